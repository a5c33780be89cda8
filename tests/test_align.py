"""`pacer-align` on tiny models: trl's SFTTrainer trains a LoRA adapter of the draft on the target's greedy
outputs, the adapter folder is Hub-ready with its card, loads back identically, merges into the draft through
`load_pair(aligned_draft=...)` (also before int8 quantization), and decoding with the aligned draft still
gives the target's own greedy output. A head for the aligned draft records the draft's side only, reusing
the target's outputs; the draft-agreement benchmark counts what greedy verification would accept."""

from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from modeling_pacer.alignment import cli, pipeline
from modeling_pacer.benchmarks.agreement import draft_agreement
from modeling_pacer.custom_generate.generate import generate
from modeling_pacer.custom_generate.policies import FixedLength
from modeling_pacer.pairs import load_draft, load_pair
from modeling_pacer.training import pipeline as train_pipeline

from conftest import VOCAB, make_pair, word_tokenizer

TINY = ["--max-new-tokens", "20", "--max-draft", "4", "--eval-fraction", "0.34", "--lora-r", "4", "--lora-alpha", "8",
        "--epochs", "8", "--lr", "0.01", "--batch-size", "2", "--max-length", "64", "--logging-steps", "1",
        "--save-steps", "4", "--base-model", "tiny-org/tiny-draft"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny Qwen2 target (with its tokenizer) and a noisy copy as its draft, saved as folders: the general
    `load_pair(target, draft=...)` path."""
    root = tmp_path_factory.mktemp("pair")
    target, draft = make_pair("qwen2", "qwen2", "noisy")
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "[0]"  # SFTTrainer pads its batches
    target.save_pretrained(root / "target")
    tokenizer.save_pretrained(root / "target")
    draft.save_pretrained(root / "draft")
    return root


def _prompts(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"p{i}", torch.randint(1, VOCAB, (1, 4 + i), generator=g)) for i in range(n)]


def _pair(folders, **kwargs):
    return load_pair(str(folders / "target"), draft=str(folders / "draft"), dtype="float32", **kwargs)


@pytest.fixture(scope="module")
def aligned(folders, tmp_path_factory):
    """One alignment run on the tiny pair: (its summary, its out folder)."""
    out = tmp_path_factory.mktemp("align")
    args = cli.parse_args(["--out", str(out), *TINY])
    summary = pipeline.align(args, _pair(folders), _prompts(), "Tiny random prompts.")
    return summary, out


def test_alignment_trains_an_adapter_and_writes_a_hub_ready_folder(aligned):
    summary, out = aligned
    folder = out / "adapter"
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", pipeline.SUMMARY} <= {p.name for p in folder.iterdir()}
    weights = load_file(folder / "adapter_model.safetensors")
    b = [w for name, w in weights.items() if "lora_B" in name]
    assert b and any(w.abs().max() > 0 for w in b)  # LoRA's B starts at zero: training changed the adapter
    assert summary["prompts"] == {"train": 4, "eval": 2}
    for side in ("before", "after"):
        assert 0 <= summary[side]["agreement"] <= 1 and summary[side]["loss"] > 0
    # 8 epochs at a high rate on 4 prompts: the draft now writes more of what the target wrote on them
    history = [h["loss"] for h in summary["log_history"] if "loss" in h]
    assert history[-1] < history[0]

    card = (folder / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "peft" and meta["base_model"] == "tiny-org/tiny-draft" and "trl" in meta["tags"]
    assert f"| plain | {summary['before']['agreement']:.4f} |" in card
    assert f"| aligned (this adapter) | {summary['after']['agreement']:.4f} |" in card
    assert "pacer-align" in card and "r = 4, alpha = 8" in card
    import json

    assert json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-org/tiny-draft"


def test_token_level_distillation_trains_against_the_targets_distributions(folders, tmp_path):
    """--distillation token: trl's GKDTrainer (lmbda=0) with the target as teacher; the same held-out figures."""
    args = cli.parse_args(["--out", str(tmp_path), *TINY, "--distillation", "token", "--epochs", "2"])
    summary = pipeline.align(args, _pair(folders), _prompts(), "Tiny random prompts.")
    weights = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(w.abs().max() > 0 for name, w in weights.items() if "lora_B" in name)
    assert summary["before"]["tokens"] == summary["after"]["tokens"] > 0
    assert summary["before"] != summary["after"]
    assert "GKDTrainer" in (tmp_path / "adapter" / "README.md").read_text()


def test_the_adapter_loads_back_identically_and_merges(folders, aligned):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _, out = aligned
    plain = AutoModelForCausalLM.from_pretrained(folders / "draft", dtype=torch.float32).eval()
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folders / "draft"), out / "adapter").eval()
    saved = load_file(out / "adapter" / "adapter_model.safetensors")
    loaded = {k: v for k, v in peft_model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(saved)
    for name, tensor in saved.items():
        match = [v for k, v in loaded.items() if k.replace(".default", "") == name]
        assert len(match) == 1 and torch.equal(match[0], tensor), name

    merged = load_draft(str(folders / "draft"), torch.float32, None, out / "adapter")
    ids = _prompts(1, seed=5)[0][1]
    with torch.no_grad():
        torch.testing.assert_close(merged(ids).logits, peft_model(ids).logits, rtol=1e-4, atol=1e-4)
        assert not torch.allclose(merged(ids).logits, plain(ids).logits)


@pytest.mark.parametrize("quantize_draft", [None, "int8"])
def test_decoding_with_the_aligned_draft_is_the_targets_own(folders, aligned, quantize_draft):
    _, out = aligned
    pair = _pair(folders, aligned_draft=str(out / "adapter"), quantize_draft=quantize_draft)
    assert pair.aligned_draft == str(out / "adapter") and "aligned" in pair.describe()
    for seed in range(3):
        for (_, ids), new in zip(_prompts(2, seed=10 + seed), (9, 17)):
            expected = pair.target.generate(ids, do_sample=False, max_new_tokens=new)
            got = generate(pair.target, ids, assistant_model=pair.draft, stopping_policy=FixedLength(3),
                           max_new_tokens=new, do_sample=False)
            assert got.tolist() == expected.tolist()


def test_resume_continues_from_the_checkpoint(folders, aligned, monkeypatch):
    """A second run with --resume starts from the last checkpoint (nothing left to train) and reports the plain
    draft's held-out figures kept from the first run, not the adapter's."""
    summary, out = aligned
    args = cli.parse_args(["--out", str(out), *TINY, "--resume"])
    again = pipeline.align(args, _pair(folders), _prompts(), "Tiny random prompts.")
    assert again["before"] == summary["before"]
    assert again["training_seconds"] >= summary["training_seconds"]  # the first run's time is kept in the total
    assert again["after"]["loss"] == pytest.approx(summary["after"]["loss"], rel=1e-5)


def test_a_head_for_the_aligned_draft_reuses_the_targets_outputs(folders, aligned, tmp_path, monkeypatch):
    """Recording for another draft takes the target's greedy outputs from an earlier run's traces (the target
    generates nothing) and gives the traces that recording from scratch gives."""
    _, out = aligned
    pair = _pair(folders, aligned_draft=str(out / "adapter"))
    scratch = train_pipeline.record_traces(pair, _prompts(), 20, 4, tmp_path / "scratch", resume=False, batch_size=3)

    def no_generation(*args, **kwargs):
        raise AssertionError("the target generated although its outputs were recorded")

    monkeypatch.setattr(train_pipeline, "greedy_outputs", no_generation)
    reused = train_pipeline.record_traces(pair, _prompts(), 20, 4, tmp_path / "reused", resume=False, batch_size=3,
                                          outputs_from=out / "traces")
    for a, b in zip(scratch, reused):
        assert a.output.tolist() == b.output.tolist() and a.match.tolist() == b.match.tolist()
        torch.testing.assert_close(a.token_probs, b.token_probs)
    # the traces name the adapter: a head of the plain draft's traces is not resumed from them
    assert train_pipeline.trace_settings(pair, 20, 4)["aligned_draft"] == str(out / "adapter")
    with pytest.raises(train_pipeline.TrainingError, match="aligned_draft"):
        train_pipeline.record_traces(pair, _prompts(), 20, 4, out / "traces", resume=True)


def test_draft_agreement_counts_what_greedy_verification_accepts():
    target, _ = make_pair("llama", "llama", "same")
    ids = _prompts(1)[0][1]
    output = target.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:]
    same = draft_agreement(target, ids, output, cap=4)
    assert same["agreement"] == 1.0 and same["tokens"] == 12
    assert same["run"] == pytest.approx(sum(min(4, 12 - i) for i in range(12)) / 12)
    _, random_draft = make_pair("llama", "llama", "random")
    assert draft_agreement(random_draft, ids, output)["agreement"] < 1.0


def test_bad_alignment_arguments_stop_with_a_message(tmp_path, capsys, folders):
    for bad, message in ((["--lora-r", "0"], "--lora-r must be at least 1"),
                         (["--eval-fraction", "1.5"], "--eval-fraction must lie strictly between 0 and 1"),
                         (["--lora-target-modules"], "expected at least one argument")):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_args(["--out", str(tmp_path), *bad])
        assert exit_info.value.code == 2 and message in capsys.readouterr().err
    args = cli.parse_args(["--out", str(tmp_path), "--aligned-draft", str(tmp_path)])
    with pytest.raises(train_pipeline.TrainingError, match="leave out --aligned-draft"):
        pipeline.run(args)
    with pytest.raises(ValueError, match="no peft adapter there"):
        _pair(folders, aligned_draft=str(tmp_path))


def test_recipe_is_the_committed_adapters_command():
    """training/qwen2.5-coder-0.5b-aligned.yaml trains what the committed adapter's card says it was trained
    with (but for where that run kept its files)."""
    import dataclasses
    import json
    import shlex

    root = Path(__file__).resolve().parent.parent
    folder = root / "adapters" / "qwen2.5-coder-0.5b-aligned"
    command = json.loads((folder / pipeline.SUMMARY).read_text())["command"]
    assert f"\n{command}\n" in (folder / "README.md").read_text()
    from_card = [dataclasses.asdict(a) for a in cli.parse_args(shlex.split(command)[1:])]
    from_recipe = [dataclasses.asdict(a) for a in cli.parse_args(["--config", str(root / "training" / "qwen2.5-coder-0.5b-aligned.yaml")])]
    for settings in (from_card[2], from_recipe[2]):
        for where in ("out", "traces", "resume"):
            settings.pop(where)
    assert from_recipe == from_card
