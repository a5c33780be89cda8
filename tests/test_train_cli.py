"""`pacer-train` end to end on tiny models: traces, training, tuning, a Hub-ready folder with a card,
resuming, and `--push-to-hub` through huggingface_hub against a fake HfApi whose uploaded files load
back from an offline Hub cache with trust_remote_code and give identical outputs. Its arguments: the
committed head's command and recipe parse to the same settings, and every bad one stops the command
before a model is loaded; a run that trained nothing or cannot be evaluated writes no card; resuming
never unpickles what lies where a trace should be."""

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from modeling_pacer import PacerHead
from modeling_pacer.training import cli, pipeline
from modeling_pacer.training.arguments import PacerTrainScriptArguments, PairArguments
from modeling_pacer.training.training_args import PacerTrainingArguments

from conftest import VOCAB, make_pair
from test_head import OFFLINE_LOADER, OUTPUTS, _offline_hub_snapshot


class FakeHfApi:
    """Records what would be uploaded: create_repo and upload_folder, as huggingface_hub.HfApi takes them."""

    def __init__(self, store: Path):
        self.store, self.calls = store, []

    def create_repo(self, repo_id, repo_type=None, private=False, exist_ok=False):
        self.calls.append(("create_repo", repo_id, private))

    def upload_folder(self, repo_id, folder_path, repo_type=None, commit_message=None):
        self.calls.append(("upload_folder", repo_id))
        dest = self.store / repo_id
        dest.mkdir(parents=True, exist_ok=True)
        for f in Path(folder_path).iterdir():
            (dest / f.name).write_bytes(f.read_bytes())
        return SimpleNamespace(commit_url=f"https://hub.invalid/{repo_id}/commit/0")


TINY = ["--max-new-tokens", "24", "--max-draft", "6", "--epochs", "3", "--batch-size", "64", "--max-tokens-per-row", "64",
        "--head-hidden-size", "16", "--head-heads", "2", "--head-intermediate-size", "32", "--eval-fraction", "0.34"]


def _args(tmp_path, *extra):
    return cli.parse_run_args(["--out", str(tmp_path / "run"), *TINY, *extra])


def _pair_and_prompts(draft_kind="noisy"):
    target, draft = make_pair("llama", "llama", draft_kind)
    pair = SimpleNamespace(target=target, draft=draft, tokenizer=None, name="tiny", target_source="tiny-target",
                           draft_source="tiny-draft")
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(0, VOCAB, (1, 4 + i), generator=g)) for i in range(6)]
    return pair, prompts


def test_train_end_to_end_and_push(tmp_path):
    pair, prompts = _pair_and_prompts()
    args = _args(tmp_path, "--push-to-hub", "pacer-org/pacer-head-tiny")
    api = FakeHfApi(tmp_path / "hub-store")
    summary = pipeline.train(args, pair, prompts, "Tiny random prompts.", hub_api=api)
    assert summary["pushed"] == "https://hub.invalid/pacer-org/pacer-head-tiny/commit/0"

    folder = tmp_path / "run" / "head"
    assert {"config.json", "model.safetensors", "configuration_pacer.py", "modeling_pacer.py", "README.md"} <= set(os.listdir(folder))
    head = PacerHead.from_pretrained(folder)
    tuned = summary["tuned"]
    assert (head.config.block_size, head.config.threshold, head.config.growth) == (
        tuned["block_size"], tuned["threshold"], tuned["growth"])
    assert summary["prompts"] == {"train": 4, "eval": 2}
    assert 0.0 <= summary["metrics"]["eval_auc"] <= 1.0
    assert 0.0 <= summary["metrics"]["eval_auc_first_token"] <= 1.0
    assert summary["ablations"]["oracle"] >= summary["ablations"]["tuned"] - 1e-9
    # the head's default rule is whichever replayed fastest: the paper's tuned blocks, or the cost-aware rule with
    # the head's estimate as it is or refitted online (alone or with the draft's probability)
    ablations = summary["ablations"]
    rules = {("blocks", "head", None): ablations["tuned"],
             ("throughput", "head", None): ablations["cost-aware rule (expected tokens/s), head estimate, block size 1"]}
    for estimate, what in (("head", "head estimate"), ("both", "head and draft estimates combined"),
                           ("draft", "draft probability")):
        for calibration in (4.0, 16.0, 64.0):
            rules[("throughput", estimate, calibration)] = ablations[
                f"cost-aware rule, {what} fitted online (calibration {calibration:g})"]
    # or the draft's own probabilities, where they replay faster than every rule that reads the head
    rules[("throughput", "draft", None)] = ablations["cost-aware rule, draft probability estimate (no head)"]
    chosen = (head.config.stopping_rule, head.config.throughput_estimate, head.config.calibration)
    assert rules[chosen] == max(rules.values())
    assert head.config.draft_nothing == (head.config.calibration is not None)  # the rule as it was replayed
    assert "cost-aware rule, draft probability fitted online (calibration 16)" in ablations
    fixed = [v for k, v in summary["ablations"].items() if k.startswith("best fixed draft length, no head")]
    assert len(fixed) == 1 and fixed[0] <= summary["ablations"]["oracle"] + 1e-9
    assert len(list((tmp_path / "run" / "traces").glob("*.seconds"))) == 6  # each trace's recording time is kept
    assert sorted(p.name for p in (tmp_path / "run" / "traces").glob("*.safetensors")) == [f"p{i}.safetensors" for i in range(6)]

    card = (folder / "README.md").read_text()
    meta = yaml.safe_load(card.split("---")[1])
    assert meta["library_name"] == "transformers" and meta["license"] == "apache-2.0" and "pacer" in meta["tags"]
    assert f"b = {tuned['block_size']}" in card and "pacer-train" in card
    assert "block size 3" in card and "no growth" in card

    assert api.calls == [("create_repo", "pacer-org/pacer-head-tiny", False), ("upload_folder", "pacer-org/pacer-head-tiny")]
    uploaded = tmp_path / "hub-store" / "pacer-org" / "pacer-head-tiny"
    assert sorted(os.listdir(uploaded)) == sorted(os.listdir(folder))

    # what was uploaded loads back from an offline Hub cache with trust_remote_code, identically
    _offline_hub_snapshot(uploaded, tmp_path / "hf_home", "pacer-org/pacer-head-test")
    x = torch.randn(1, 5, head.config.draft_hidden_size)
    torch.save(x, tmp_path / "x.pt")
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", OFFLINE_LOADER, str(tmp_path / "x.pt"), str(tmp_path / "out.pt")],
                   env=env, check=True, cwd=tmp_path)
    loaded = torch.load(tmp_path / "out.pt")
    for name, tensor in head.state_dict().items():
        assert torch.equal(loaded["remote_weights"][name], tensor), name
    torch.testing.assert_close(loaded["remote"], head.eval()(x).logits, **OUTPUTS)


def _tiny_loaders(monkeypatch, pair, prompts):
    """`pacer-train run`'s ways to the prompts and the pair, giving the tiny ones."""
    monkeypatch.setattr(pipeline, "sharegpt_rows", lambda script: ([(pid, pid) for pid, _ in prompts], "Tiny."))
    monkeypatch.setattr("modeling_pacer.prompts.apply_chat_template", lambda tokenizer, text: dict(prompts)[text])
    monkeypatch.setattr("modeling_pacer.pairs.pair_from_args", lambda *args, **kwargs: pair)


def test_card_command_adds_benchmark_figures(tmp_path, monkeypatch):
    pair, prompts = _pair_and_prompts()
    _tiny_loaders(monkeypatch, pair, prompts[:4])
    assert cli.main(["--out", str(tmp_path / "run"), "--n", "4", *TINY]) == 0  # `run`, as commands were written before
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["prompts"] == {"train": 3, "eval": 1}
    assert summary["card"]["base_model"] == pipeline.DEFAULT_DRAFT_HUB_ID  # no model named: the default pair's draft
    bench = dict(meta=dict(command="pacer-bench --n 1", max_new_tokens=24), summary=[
        dict(dataset="all", method="target", prompts=3, speedup=1.0, tau=1.0, mismatches=0),
        dict(dataset="all", method="pacer", prompts=3, speedup=1.5, tau=2.5, mismatches=1),
        dict(dataset="all", method="svip", prompts=3, speedup=1.25, speedup_ci=[1.1, 1.4], tau=2.0, mismatches=0),
        dict(dataset="toy", method="pacer", prompts=3, speedup=9.9, tau=2.5, mismatches=0),
    ])
    (tmp_path / "results.json").write_text(json.dumps(bench))
    before = (tmp_path / "run" / "head" / "README.md").read_text()
    assert "No live benchmark" in before
    assert cli.main(["card", "--out", str(tmp_path / "run"), "--bench-results", str(tmp_path / "results.json")]) == 0
    card = (tmp_path / "run" / "head" / "README.md").read_text()
    assert "| pacer | 1.50x | – | 2.50 | MISMATCH 1/3 |" in card and "9.9" not in card
    assert "| svip | 1.25x (1.10-1.40) | – | 2.00 | yes |" in card
    assert "**target float32 (verification not exact), draft**" in card  # a run that did not record its dtype ran the target in float32
    assert "pacer-bench --n 1\n" in card
    assert card.split("## Speed")[0] == before.split("## Speed")[0]  # nothing else changed

    # several runs (one per dtype), each labelled with how it ran the target; a head folder that carries its
    # run's training_summary.json (as the committed heads do) is re-rendered in place
    bf16 = dict(meta=dict(parts=[dict(command="pacer-bench --datasets a", dtype="bfloat16", exact=True, quantize_draft=True),
                                 dict(command="pacer-bench --datasets b", dtype="bfloat16", exact=True, quantize_draft=True)],
                          command="pacer-bench merge", max_new_tokens=96),
                summary=[dict(dataset="all", method="target", prompts=2, speedup=1.0, tokens_per_s=4.2, tau=1.0,
                              mismatches=0),
                         dict(dataset="all", method="llama.cpp", prompts=2, speedup=3.0, tokens_per_s=12.6, tau=None,
                              mismatches=0, own_numerics=True)])
    (tmp_path / "bf16.json").write_text(json.dumps(bf16))
    head_folder = tmp_path / "head-folder"
    shutil.copytree(tmp_path / "run" / "head", head_folder)
    shutil.copy(tmp_path / "run" / "summary.json", head_folder / "training_summary.json")
    assert cli.main(["card", "--out", str(head_folder), "--bench-results", str(tmp_path / "bf16.json"),
                     str(tmp_path / "results.json")]) == 0
    card = (head_folder / "README.md").read_text()
    assert card.index("**target bfloat16 exact, dynamic-int8 draft**") < card.index("**target float32 (verification not exact), draft**")
    assert "| target | 1.00x | 4.20 | 1.00 | yes |" in card and "| llama.cpp | 3.00x | 12.60 | – | own numerics (n/a) |" in card
    assert "pacer-bench --datasets a\npacer-bench --datasets b\npacer-bench merge\n" in card


def test_resume_reuses_traces(tmp_path, monkeypatch):
    pair, prompts = _pair_and_prompts()
    first = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "traces", resume=False)
    calls = []
    monkeypatch.setattr("modeling_pacer.replay.record_trace", lambda *a, **k: calls.append(a))
    again = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "traces", resume=True)
    assert calls == []
    assert [t.match.tolist() for t in again] == [t.match.tolist() for t in first]
    for old, new in zip(first, again):
        assert torch.equal(old.hidden, new.hidden) and torch.equal(old.output, new.output)
    # a resumed run still reports what recording took, or says it cannot
    assert pipeline.recording_time(tmp_path / "traces", ["p0", "p1"]).startswith("traces ")
    (tmp_path / "traces" / "p1.seconds").unlink()
    assert "1 more recorded without timing" in pipeline.recording_time(tmp_path / "traces", ["p0", "p1"])
    # traces recorded with other settings are not mixed into this run's
    with pytest.raises(pipeline.TrainingError, match="'max_draft': 6.*'max_draft': 4"):
        pipeline.record_traces(pair, prompts[:2], 16, 4, tmp_path / "traces", resume=True)


def test_resumed_training_reports_the_time_of_every_run(tmp_path):
    """A run resumed from the finished checkpoint trains no more, and reports the training time of the runs before
    it plus its own (it reported its own, near 0 s, in the card)."""
    pair, prompts = _pair_and_prompts()
    traces = pipeline.record_traces(pair, prompts, 16, 6, tmp_path / "traces", resume=False)
    hidden = pair.draft.config.get_text_config().hidden_size
    first = pipeline.fit_head(traces[:4], traces[4:], hidden, _args(tmp_path), tmp_path / "trainer")[2]
    assert float((tmp_path / "trainer" / "training.seconds").read_text()) == pytest.approx(first)
    (tmp_path / "trainer" / "training.seconds").write_text("1000.0\n")  # as if the first run had taken 1,000 s
    again = pipeline.fit_head(traces[:4], traces[4:], hidden, _args(tmp_path, "--resume"), tmp_path / "trainer")[2]
    assert 1000.0 <= again < 1000.0 + 60.0


def test_train_with_soft_labels(tmp_path, monkeypatch):
    """--soft-labels records the target's probabilities, trains on prod(min(1, p/q)) (what the trainer's
    collator packs as labels) and says so in the card."""
    from modeling_pacer.training.data import PackedDraftCollator

    pair, prompts = _pair_and_prompts("random")  # near-uniform tiny models: a noisy copy's p/q is all close to 1
    packed = []
    original = PackedDraftCollator.__call__

    def collate(self, features):
        batch = original(self, features)
        packed.append(batch["labels"][batch["labels"] >= 0])
        return batch

    monkeypatch.setattr(PackedDraftCollator, "__call__", collate)
    summary = pipeline.train(_args(tmp_path, "--soft-labels"), pair, prompts, "Tiny random prompts.")
    labels = torch.cat(packed)
    assert ((labels > 0) & (labels < 1)).float().mean() > 0.5  # the trainer saw soft labels, not 0/1
    assert "trained on soft labels" in (tmp_path / "run" / "head" / "README.md").read_text()
    assert summary["prompts"] == {"train": 4, "eval": 2}


def test_soft_label_traces_hold_target_probabilities_and_are_kept_apart(tmp_path):
    """`target_probs=True` (pacer-train --soft-labels) records the target's probability of every draft token
    (the soft labels of test_training's check) and says so in the file: a soft-label run does not resume from
    greedy files, which lack them, while a greedy run reuses soft-label files (the same traces, and more)."""
    pair, prompts = _pair_and_prompts()
    soft = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "soft", resume=False, target_probs=True)
    greedy = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "greedy", resume=False)
    for s, g in zip(soft, greedy):
        assert g.target_probs is None and s.target_probs.shape == s.token_probs.shape
        assert torch.equal(s.match, g.match) and torch.equal(s.token_probs, g.token_probs)
        assert ((s.target_probs > 0) & (s.target_probs <= 1)).any()
    again = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "soft", resume=True, target_probs=True)
    assert all(torch.equal(a.target_probs, s.target_probs) for a, s in zip(again, soft))
    reused = pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "soft", resume=True)
    assert [t.match.tolist() for t in reused] == [t.match.tolist() for t in greedy]
    with pytest.raises(pipeline.TrainingError, match="'target_probs': None"):
        pipeline.record_traces(pair, prompts[:2], 16, 6, tmp_path / "greedy", resume=True, target_probs=True)


def test_ablation_heads_and_first_token_predictors(tmp_path):
    """--ablate-draft-features and --ablate-training-sizes train the extra heads on the same held-out prompts;
    the card compares the head's first-token predictions with the draft's probability and entropy, and
    the paper's rule with the cost-aware one."""
    pair, prompts = _pair_and_prompts()
    args = _args(tmp_path, "--head-draft-features", "--ablate-draft-features", "--ablate-training-sizes", "1", "2", "9")
    summary = pipeline.train(args, pair, prompts, "Tiny random prompts.")
    head = PacerHead.from_pretrained(tmp_path / "run" / "head")
    assert head.config.use_draft_features
    ablations = summary["ablations"]
    for name in ("without draft features", "trained on 1 prompts", "trained on 2 prompts"):
        rows = [k for k in ablations if k.startswith(f"{name} (first-token AUC ")]
        assert len(rows) == 1 and all(0 < ablations[k] <= ablations["oracle"] + 1e-9 for k in rows), name
    assert not any(k.startswith("trained on 9 prompts") for k in ablations)  # not fewer than the 4 it has
    for b in (1, 2, 3):
        assert 0 < ablations[f"cost-aware rule (expected tokens/s), head estimate, block size {b}"] <= ablations["oracle"] + 1e-9
    assert 0 < ablations["cost-aware rule, draft probability estimate (no head)"] <= ablations["oracle"] + 1e-9
    predictors = summary["first_token_predictors"]
    assert set(predictors) == {"head", "draft probability", "draft entropy (lower ranks higher)"}
    assert all(0 <= p["auc"] <= 1 for p in predictors.values())
    assert predictors["head"]["auc"] == pytest.approx(summary["metrics"]["eval_auc_first_token"])
    card = (tmp_path / "run" / "head" / "README.md").read_text()
    assert f"| draft probability | {predictors['draft probability']['auc']:.3f} |" in card
    assert "| draft entropy (lower ranks higher) |" in card and "| – |" in card  # entropy is no probability


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batched_recording_equals_one_prompt_at_a_time(tmp_path, dtype):
    """An exact target records several prompts in one left-padded batch: every output is that prompt's own
    greedy output and every trace is the one recorded alone (the loop's path, for non-exact targets)."""
    from modeling_pacer import make_exact

    pair, prompts = _pair_and_prompts()
    pair.target = make_exact(pair.target.to(dtype))
    alone = pipeline.record_traces(pair, prompts, 20, 6, tmp_path / "alone", resume=False)
    pair.exact = True
    batched = pipeline.record_traces(pair, prompts, 20, 6, tmp_path / "batched", resume=False, batch_size=4)
    assert [t.prompt_id for t in batched] == [pid for pid, _ in prompts]
    for (pid, ids), one, many in zip(prompts, alone, batched):
        expected = pair.target.generate(ids, do_sample=False, max_new_tokens=20)[0, ids.shape[1]:]
        assert many.output.tolist() == one.output.tolist() == expected.tolist(), pid
        assert many.match.tolist() == one.match.tolist(), pid
        torch.testing.assert_close(many.token_probs, one.token_probs)
    assert pipeline.recording_time(tmp_path / "batched", [pid for pid, _ in prompts]).startswith("traces ")


def test_two_processes(tmp_path):
    """Two CPU processes (torchrun, as `accelerate launch --multi_gpu` starts them; gloo instead of NCCL):
    each records its share of the traces, the Trainer trains data-parallel, the main process alone tunes
    and writes the head folder."""
    script = Path(__file__).parent / "accelerate_train.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script), str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in (0, 1)]
    assert [r["num_processes"] for r in reports] == [2, 2]
    assert "tuned" in reports[0]["summary_keys"] and reports[1]["summary_keys"] == []
    # every prompt's trace was recorded once, by one of the two processes
    assert sorted(reports[0]["recorded"] + reports[1]["recorded"]) == [f"p{i}" for i in range(6)]
    assert len(reports[0]["recorded"]) == len(reports[1]["recorded"]) == 3
    head = PacerHead.from_pretrained(tmp_path / "run" / "head")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["prompts"] == {"train": 4, "eval": 2}
    assert head.config.block_size == summary["tuned"]["block_size"]


# --------------------------------------------------------------------------------------------------
# arguments
# --------------------------------------------------------------------------------------------------
HEAD = Path(__file__).parent.parent / "heads" / "qwen2.5-coder-1.5b-0.5b-int4"
RECIPE = Path(__file__).parent.parent / "training" / "qwen2.5-coder-1.5b-0.5b-int4.yaml"
README = Path(__file__).parent.parent / "README.md"


def _readme_train_command() -> str:
    """The README's `pacer-train run` command (its "Train a head for your own pair" block), continuation lines joined."""
    text = README.read_text().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if line.startswith("pacer-train run "))
    return line.split("#")[0].strip()


def _settings(args) -> dict:
    """Everything a run's arguments decide, as plain values (`to_dict` turns the enums into strings)."""
    return dict(script=dataclasses.asdict(args.script), pair=dataclasses.asdict(args.pair), training=args.training.to_dict())


def test_defaults_are_the_commands_of_old():
    """The defaults pacer-train has always trained with, now PacerTrainingArguments' fields."""
    args = cli.parse_run_args(["--out", "runs/x"])
    t = args.training
    assert (t.learning_rate, t.num_train_epochs, t.lr_scheduler_type.value, t.warmup_steps, t.weight_decay) == (
        1e-3, 4.0, "cosine", 0.05, 0.01)
    assert (t.per_device_train_batch_size, t.per_device_eval_batch_size, t.max_tokens_per_row) == (256, 256, 256)
    assert (t.save_strategy.value, t.save_total_limit, t.eval_strategy.value, t.logging_steps, t.seed) == (
        "epoch", 1, "no", 10, 0)
    assert t.use_cpu == (not torch.cuda.is_available()) and t.report_to == [] and t.dataloader_num_workers == 0
    assert not t.push_to_hub
    s = args.script
    assert (s.n, s.skip, s.prompt_filter, s.eval_fraction, s.max_new_tokens, s.max_draft) == (200, 0, None, 0.15, 128, 16)
    assert (s.head_hidden_size, s.head_heads, s.head_intermediate_size, s.head_dropout) == (256, 4, 512, 0.0)
    assert not (s.ablate_position_embedding or s.head_draft_features or s.resume or s.private)
    assert s.push_to_hub_repo is None
    assert not pipeline.head_config(s, 32).use_draft_features
    features = cli.parse_run_args(["--out", "runs/x", "--head-draft-features"]).script
    assert pipeline.head_config(features, 32).use_draft_features
    assert args.pair == PairArguments()
    # the old flag names are aliases of the TrainingArguments fields, and the run parser keeps every field's flag;
    # TrainingArguments' boolean --push-to-hub alone gives way to ours (a repo id for the head folder)
    aliased = cli.parse_run_args(["--out", "x", "--lr", "0.5", "--epochs", "2", "--batch-size", "8", "--push-to-hub", "me/h"])
    assert (aliased.training.learning_rate, aliased.training.num_train_epochs) == (0.5, 2.0)
    assert (aliased.training.per_device_train_batch_size, aliased.training.per_device_eval_batch_size) == (8, 8)
    assert aliased.script.push_to_hub_repo == "me/h" and not aliased.training.push_to_hub
    options = {o: a.dest for a in cli.build_run_parser()._actions for o in a.option_strings}
    for dtype in (PacerTrainingArguments, PairArguments, PacerTrainScriptArguments):
        for f in dataclasses.fields(dtype):
            if f.init and f.name != "push_to_hub":
                assert options.get(f"--{f.name}") == f.name, f.name
    assert options["--push-to-hub"] == options["--push_to_hub"] == "push_to_hub_repo"


def test_training_arguments_are_those_built_by_hand_before(tmp_path):
    """What fit_head passed to TrainingArguments one by one (`--lr` -> learning_rate, ...) is now what the
    flags parse to, field for field."""
    args = _args(tmp_path, "--lr", "0.002")
    by_hand = PacerTrainingArguments(
        output_dir=str(tmp_path / "run" / "trainer"), num_train_epochs=3, learning_rate=0.002, lr_scheduler_type="cosine",
        warmup_steps=0.05, weight_decay=0.01, per_device_train_batch_size=64, per_device_eval_batch_size=64,
        max_tokens_per_row=64, logging_steps=10, save_strategy="epoch", save_total_limit=1, eval_strategy="no",
        use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0, seed=0,
    )
    assert dataclasses.replace(args.training, output_dir=by_hand.output_dir).to_dict() == by_hand.to_dict()


def test_committed_commands_parse_to_their_settings():
    """The commands that committed cards and the README quote still mean what they meant."""
    card_command = json.loads((HEAD / "training_summary.json").read_text())["command"]
    assert f"\n{card_command}\n" in (HEAD / "README.md").read_text()
    command, arguments = cli.split_command(shlex.split(card_command)[1:])
    assert command == "run"
    at = arguments.index("--target-outputs-from")  # another run's folder (see the recipe's comment), not here
    del arguments[at : at + 2]
    args = cli.parse_run_args(arguments)
    assert args.pair.quantize_draft == "int4" and args.pair.is_default
    s, t = args.script, args.training
    assert (s.n, s.prompt_filter, s.eval_fraction, s.max_new_tokens, s.max_draft, s.out) == (
        1000, None, 0.15, 128, 12, "runs/head-int4-1000")
    assert s.head_draft_features and s.head_draft_prior and s.resume and t.num_train_epochs == 3.0
    assert cli.split_command(["run", *arguments]) == ("run", arguments)
    assert cli.split_command(arguments) == ("run", arguments)
    command, arguments = cli.split_command(shlex.split(_readme_train_command())[1:])
    readme = cli.parse_run_args(arguments)
    assert command == "run" and (readme.script.n, readme.script.out, readme.pair.quantize_draft) == (100, "runs/my-head", "int4")
    assert readme.training.soft_labels and readme.script.head_draft_features and readme.script.head_draft_prior
    assert (readme.pair.target, readme.pair.draft) == ("org/big", "org/small")


@pytest.mark.parametrize("name", ["qwen2.5-coder-1.5b-0.5b-int4", "qwen2.5-coder-1.5b-0.5b-int4-soft"])
def test_recipe_is_the_committed_heads_command(tmp_path, name):
    """training/NAME.yaml trains what the committed head heads/NAME's card says it was trained with (but for
    where that run kept its files, and another run's traces it took the target's outputs from); a JSON recipe
    is read the same way."""
    head, recipe = HEAD.parent / name, RECIPE.parent / f"{name}.yaml"
    card_command = json.loads((head / "training_summary.json").read_text())["command"]
    assert f"\n{card_command}\n" in (head / "README.md").read_text()
    command, arguments = cli.split_command(shlex.split(card_command)[1:])
    assert command == "run"
    if "--target-outputs-from" in arguments:  # another run's folder (see the recipe's comment), not on this machine
        at = arguments.index("--target-outputs-from")
        assert not Path(arguments[at + 1]).is_absolute(), arguments[at + 1]
        del arguments[at : at + 2]
    from_card = _settings(cli.parse_run_args(arguments))
    from_recipe = _settings(cli.parse_run_args([str(recipe)]))
    assert from_recipe["script"].pop("out") == f"runs/{name}" and not from_recipe["script"].pop("resume")
    assert from_recipe["script"].pop("target_outputs_from") is None
    from_card["script"].pop("out"), from_card["script"].pop("resume"), from_card["script"].pop("target_outputs_from")
    assert from_recipe == from_card
    (tmp_path / "recipe.json").write_text(json.dumps(yaml.safe_load(recipe.read_text())))
    assert _settings(cli.parse_run_args([str(tmp_path / "recipe.json")])) == _settings(cli.parse_run_args([str(recipe)]))


class _Loaded(Exception):
    """Raised by the patched loaders: the command got as far as loading."""


@pytest.fixture
def no_loading(monkeypatch):
    """Every way to a model or a prompt set fails the test (or, for `allow`, raises `_Loaded`)."""
    def forbidden(*args, **kwargs):
        pytest.fail("a model or the prompts were loaded")

    for target in ("modeling_pacer.pairs.pair_from_args", "modeling_pacer.pairs.load_pair",
                   "modeling_pacer.pairs.loading.load_pair", "modeling_pacer.training.data.load_sharegpt_prompts",
                   "modeling_pacer.training.pipeline.record_traces"):
        monkeypatch.setattr(target, forbidden)
    return monkeypatch


BAD_ARGUMENTS = [
    (["--max-draft", "0"], "--max-draft"),
    (["--max-draft", "-3"], "--max-draft"),
    (["--max-draft", "65"], "--max-draft 65 does not fit --max-tokens-per-row 64"),
    (["--lr", "0"], "--lr"),
    (["--learning-rate", "-0.001"], "--lr"),
    (["--eval-fraction", "0"], "--eval-fraction"),
    (["--eval-fraction", "1"], "--eval-fraction"),
    (["--eval-fraction", "1.5"], "--eval-fraction"),
    (["--n", "0"], "--n"),
    (["--n", "-4"], "--n"),
    (["--n", "1"], "--n 1 leaves no training prompt"),
    (["--n", "4", "--eval-fraction", "0.9"], "--n 4 leaves no training prompt"),
    (["--max-new-tokens", "1"], "--max-new-tokens"),
    (["--prompt-filter", "("], "--prompt-filter '(' is not a valid regular expression"),
    (["--epochs", "0"], "--epochs"),
    (["--num_train_epochs", "-1"], "--epochs"),
    (["--head-hidden-size", "0"], "--head-hidden-size"),
    (["--head-heads", "0"], "--head-heads"),
    (["--head-intermediate-size", "-1"], "--head-intermediate-size"),
    (["--head-heads", "3"], "--head-hidden-size 16 is not divisible by --head-heads 3"),
    (["--batch-size", "0"], "--batch-size"),
    (["--skip", "-1"], "--skip"),
    (["--threads", "0"], "--threads"),
    (["--private"], "--private"),
    (["--push-to-hub", "not a repo"], "--push-to-hub"),
    (["--target", "org/big"], "--target org/big needs --draft"),
    (["--pair", "no-such-pair"], "--pair"),
    (["--card-only"], "pacer-train card"),
    (["--no-such-flag"], "--no-such-flag"),
]


@pytest.mark.parametrize("command", [[], ["run"]], ids=["old-style", "run"])
@pytest.mark.parametrize("bad, message", BAD_ARGUMENTS, ids=[" ".join(b) for b, _ in BAD_ARGUMENTS])
def test_bad_arguments_stop_before_any_model(tmp_path, no_loading, capsys, command, bad, message):
    with pytest.raises(SystemExit) as stopped:
        cli.main([*command, "--out", str(tmp_path / "run"), *TINY, *bad])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert err.count("\n") <= 3  # argparse's short usage line and the message, not hundreds of flags


def test_unwritable_out_and_bad_recipes_stop_before_any_model(tmp_path, no_loading, capsys):
    (tmp_path / "a-file").write_text("")
    recipe = yaml.safe_load(RECIPE.read_text())
    cases = [(["--out", str(tmp_path / "a-file" / "run")], "--out"),
             (["run", str(tmp_path / "no-such-recipe.yaml")], "no-such-recipe.yaml"),
             (["run", str(RECIPE), "--n", "3"], "sole argument")]
    for name, change, message in [("zero", dict(max_draft=0), "--max-draft"), ("nan", dict(learning_rate=0.0), "--lr"),
                                  ("unknown", dict(epochs=8), "epochs"), ("no-out", dict(out=None), "out"),
                                  ("string", dict(learning_rate="1e-3"), "write 0.001"),
                                  ("unchecked-string", dict(weight_decay="1e-2"), "recipe key weight_decay"),
                                  ("fraction", dict(n=20.5), "recipe key n"), ("switch", dict(quantize_draft="yes"), "quantize-draft must be one of")]:
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({k: v for k, v in {**recipe, **change}.items() if v is not None}))
        cases.append((["run", str(path)], message))
    for argv, message in cases:
        with pytest.raises(SystemExit) as stopped:
            cli.main(argv)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and message in err, (argv, err)


def test_card_command_checks_its_arguments(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["card", "--out", str(tmp_path)])
    assert stopped.value.code == 2 and "holds no finished run" in capsys.readouterr().err
    (tmp_path / "head").mkdir()
    (tmp_path / "summary.json").write_text("{}")
    with pytest.raises(SystemExit) as stopped:
        cli.main(["card", "--out", str(tmp_path), "--bench-results", str(tmp_path / "results.json")])
    assert stopped.value.code == 2 and "--bench-results" in capsys.readouterr().err


def test_good_arguments_reach_the_loader(tmp_path, no_loading):
    """The other side of the tests above: with nothing wrong, the command does go on to load the pair, after
    reading the prompts."""
    def loaded(*args, **kwargs):
        raise _Loaded

    no_loading.setattr("modeling_pacer.pairs.pair_from_args", loaded)
    no_loading.setattr("modeling_pacer.training.data.load_sharegpt_prompts",
                       lambda n, skip, pattern: [dict(id=str(i), text="hello") for i in range(n)])
    with pytest.raises(_Loaded):
        cli.main(["--out", str(tmp_path / "run"), "--n", "4", *TINY])
    assert (tmp_path / "run").is_dir()


# --------------------------------------------------------------------------------------------------
# runs that must not claim a head
# --------------------------------------------------------------------------------------------------
def test_a_run_that_made_no_optimisation_step_writes_no_head(tmp_path, monkeypatch):
    """Whatever the cause (`--epochs 0` once was one; the flag is now refused), a head that no step trained is
    not saved, carded or pushed: here the Trainer's training loop is skipped."""
    from modeling_pacer.training.trainer import PacerTrainer

    pair, prompts = _pair_and_prompts()
    monkeypatch.setattr(PacerTrainer, "train", lambda self, **kwargs: None)
    with pytest.raises(pipeline.TrainingError, match="no optimisation step"):
        pipeline.train(_args(tmp_path, "--push-to-hub", "me/head"), pair, prompts[:4], "Tiny random prompts.",
                       hub_api=SimpleNamespace())  # an HfApi that fails if used
    assert not (tmp_path / "run" / "head").exists() and not (tmp_path / "run" / "summary.json").exists()


def test_a_run_whose_held_out_auc_is_nan_writes_no_head(tmp_path):
    """A draft equal to the target: every held-out draft token is accepted, so no AUC can be measured."""
    pair, prompts = _pair_and_prompts("same")
    with pytest.raises(pipeline.TrainingError, match="held-out AUC is nan"):
        pipeline.train(_args(tmp_path, "--epochs", "1"), pair, prompts[:4], "Tiny random prompts.")
    assert not (tmp_path / "run" / "head").exists() and not (tmp_path / "run" / "summary.json").exists()


class _RunsCode:
    """Pickled, it runs `command` when unpickled (as any pickle can)."""

    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_resume_never_unpickles_a_trace_file(tmp_path, monkeypatch, capsys):
    pair, prompts = _pair_and_prompts()
    out, marker = tmp_path / "run", tmp_path / "MARKER"
    (out / "traces").mkdir(parents=True)
    planted = out / "traces" / "p0.safetensors"
    torch.save({"x": _RunsCode(f"touch {shlex.quote(str(marker))}")}, planted)
    _tiny_loaders(monkeypatch, pair, prompts)
    assert cli.main(["run", "--out", str(out), "--n", "6", "--resume", *TINY]) == 1
    err = capsys.readouterr().err
    assert f"cannot resume from {planted}" in err and "not a pacer trace file" in err and "Traceback" not in err
    assert not marker.exists()
    assert not (out / "head").exists()
    # what the earlier pacer-train did with its trace files (ID.pt) on --resume: the file was a real threat
    old_name = planted.with_suffix(".pt")
    old_name.write_bytes(planted.read_bytes())
    torch.load(old_name, weights_only=False)
    assert marker.exists()


def test_card_speed_table_of_a_sampled_benchmark():
    """A `pacer-bench --do-sample` run in a card: its rows say sampled (not 'yes'), and the setting says how it sampled."""
    from modeling_pacer.training.card import speed_section

    row = dict(dataset="all", prompts=3, speedup=1.5, speedup_ci=(1.2, 1.8), tokens_per_s=6.0, tau=3.0, mismatches=0,
               own_numerics=False, sampled=True)
    bench = dict(meta=dict(command="pacer-bench run --do-sample", dtype="bfloat16", exact=True, quantize_draft="int4",
                           max_new_tokens=64, sampling=dict(temperature=1.0, seed=0)),
                 summary=[dict(row, method="target", speedup=1.0, speedup_ci=(1.0, 1.0)), dict(row, method="pacer"),
                          dict(row, dataset="gsm8k", method="pacer")])
    text = speed_section([bench])
    assert "64 new tokens, sampled at temperature 1, seed 0" in text
    assert "| pacer | 1.50x (1.20-1.80) | 6.00 | 3.00 | sampled (in distribution: tests) |" in text
    assert "| yes |" not in text


@pytest.mark.parametrize("estimate", ["draft", "head"])
def test_card_says_when_the_default_rule_does_not_read_the_head(estimate):
    """A head whose default rule reads the draft's probabilities alone says so first; one whose rule reads the
    head does not. Both say that the draft's probability ranks the first token better, where it does."""
    from modeling_pacer.hub_cards import render_head_card

    fields = json.loads((HEAD.parent / "qwen2.5-coder-1.5b-0.5b-int4" / "training_summary.json").read_text())["card"]
    fields.update(stopping_rule="throughput", throughput_estimate=estimate, calibration=None,
                  predictors={"head": dict(auc="0.870", ece="0.010"), "draft probability": dict(auc="0.880", ece="0.050")})
    card = str(render_head_card(speed="", **fields))
    assert ("does not read the head" in card) == (estimate == "draft")
    assert "**The head does not beat the draft alone here**: draft probability ranks" in card
    assert ("it\nreplayed faster, so it is the default rule" in card) == (estimate == "draft")
    assert ("the head's rule replayed faster, so it stays the default" in card) == (estimate == "head")


def test_card_measures_pacer_against_the_others_per_dataset():
    """The card's Speed section says, per dataset, PACER's speedup over the best fixed length's and the best other
    method's (PACER's own variants and the oracle are not others), and its share of the oracle."""
    from modeling_pacer.training.card import speed_section

    def row(dataset, method, speedup, of_oracle=None):
        return dict(dataset=dataset, method=method, prompts=2, speedup=speedup, tau=2.0, mismatches=0,
                    of_oracle=of_oracle)

    summary = [row("a", "target", 1.0), row("a", "fixed-2", 1.6), row("a", "fixed-4", 2.0), row("a", "svip", 1.9),
               row("a", "pacer-blocks", 2.9), row("a", "pacer", 2.2, 0.55), row("a", "oracle (replay)", 4.0, 1.0),
               row("b", "target", 1.0), row("b", "fixed-4", 1.5), row("b", "hf-assisted", 2.0), row("b", "pacer", 1.8)]
    text = speed_section(dict(meta=dict(command="pacer-bench run", max_new_tokens=8), summary=summary))
    assert "| a | 2.20x | 1.100 (fixed-4 2.00x) | 1.100 (fixed-4 2.00x) | 55% | no: oracle |" in text
    assert "| b | 1.80x | 1.200 (fixed-4 1.50x) | 0.900 (hf-assisted 2.00x) | – | no: other methods |" in text
    no_pacer = speed_section(dict(meta=dict(command="pacer-bench run", max_new_tokens=8), summary=summary[:4]))
    assert "PACER against the others" not in no_pacer
