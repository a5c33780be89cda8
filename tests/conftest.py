"""Tiny random models built from a config, so the tests need no weights and run on a CPU in seconds."""

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from modeling_pacer import PacerConfig, PacerHead, enable_pacer

VOCAB = 97

# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine two threads per process
# oversubscribe the cores and slow these tests many times over. Each test compares results computed in
# this one process, so the setting is the same on both sides of every comparison.
torch.set_num_threads(1)


def _llama(seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, eos: int | None = None):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=eos, pad_token_id=None,
    )
    return LlamaForCausalLM(config).eval()


def _qwen2(seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, eos: int | None = None):
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        bos_token_id=None, eos_token_id=eos, pad_token_id=None,
    )
    return Qwen2ForCausalLM(config).eval()


def _gpt2(seed: int, layers: int = 2, hidden: int = 32, vocab: int = VOCAB, eos: int | None = None):
    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=vocab, n_embd=hidden, n_layer=layers, n_head=4, n_positions=512,
        bos_token_id=None, eos_token_id=eos, pad_token_id=None,
    )
    return GPT2LMHeadModel(config).eval()


BUILDERS = {"llama": _llama, "qwen2": _qwen2, "gpt2": _gpt2}


def make_model(arch: str, seed: int, **kwargs):
    return BUILDERS[arch](seed, **kwargs)


def make_pair(target_arch: str, draft_arch: str, draft_kind: str = "random", **kwargs):
    """A target and a draft. `draft_kind`: "random" (an unrelated model: rarely agrees), "same" (the
    target's own weights: always agrees), "noisy" (the target's weights plus noise: mostly agrees)."""
    target = enable_pacer(make_model(target_arch, seed=1, **kwargs))
    if draft_kind == "random":
        draft = make_model(draft_arch, seed=2, layers=1, **kwargs)
    else:
        draft = make_model(target_arch, seed=1, **kwargs)
        if draft_kind == "noisy":
            torch.manual_seed(3)
            with torch.no_grad():
                for p in draft.parameters():
                    p.add_(0.3 * p.std() * torch.randn_like(p))
    return target, draft


def make_head(draft, spread: float = 30.0, seed: int = 4, **config) -> PacerHead:
    """An untrained head. Its classifier is scaled by `spread` so that its predictions cover (0, 1)
    rather than sitting at 0.5: drafting then stops at varied lengths, which is what the tests need."""
    defaults = dict(hidden_size=16, num_attention_heads=2, intermediate_size=32)
    defaults.update(config)
    torch.manual_seed(seed)
    head = PacerHead(PacerConfig(draft_hidden_size=draft.config.get_text_config().hidden_size, **defaults)).eval()
    with torch.no_grad():
        head.classifier.weight.mul_(spread)
    return head


def narrow_rows(model, width: int = 4):
    """Keep every exact linear layer of `model` to `width` row counts at the bottom of its range as probed on this
    host (e.g. 2..5 where the host's run is 2..40), so that padding and chunking run on every prompt longer than
    a few tokens, on any host, and stay inside what this host's kernels compute alike. Returns the model."""
    from modeling_pacer.cpu.exact_linear import RowRange, host_row_range, is_exact_linear

    for module in model.modules():
        if is_exact_linear(module):
            probed = host_row_range(module) or RowRange(1, 1)
            module._pacer_rows = RowRange(probed.lo, min(probed.hi, probed.lo + width - 1))
    return model


@pytest.fixture(autouse=True)
def _cost_curves_in_tmp(monkeypatch, tmp_path_factory):
    """The cost curves tests measure (tiny models' keys) go to this run's tmp folder, shared by its tests, never
    to the user's ~/.cache/pacer/costs; the other caches (kernels, GGUF files) stay where they are."""
    folder = tmp_path_factory.getbasetemp() / "pacer-cache"
    monkeypatch.setattr("modeling_pacer.costs.cache_root", lambda pacer_cache=None: Path(
        pacer_cache or os.environ.get("PACER_CACHE") or folder))  # a test's own PACER_CACHE is kept


@pytest.fixture
def llama_pair():
    return make_pair("llama", "llama", "noisy")


def word_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer for the tiny models: token i reads "[i]" (the last one is "abcdef", which transformers'
    stop-string matcher needs to tokenize); words are split on whitespace; a minimal chat template."""
    vocab = {f"[{i}]": i for i in range(VOCAB - 1)} | {"abcdef": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[0]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer)
    fast.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return fast
