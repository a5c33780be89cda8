"""`pacer-train` end to end on tiny models: traces, training, tuning, a Hub-ready folder with a card,
resuming, and `--push-to-hub` through huggingface_hub against a fake HfApi whose uploaded files load
back from an offline Hub cache with trust_remote_code and give identical outputs."""

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import yaml

from modeling_pacer import PacerHead
from modeling_pacer.training import cli

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


def _args(tmp_path, *extra):
    return cli.build_parser().parse_args([
        "--out", str(tmp_path / "run"), "--max-new-tokens", "24", "--max-draft", "6", "--epochs", "3",
        "--batch-size", "64", "--max-tokens-per-row", "64", "--head-hidden-size", "16", "--head-heads", "2",
        "--head-intermediate-size", "32", "--eval-fraction", "0.34", *extra,
    ])


def _pair_and_prompts():
    target, draft = make_pair("llama", "llama", "noisy")
    pair = SimpleNamespace(target=target, draft=draft, name="tiny", target_source="tiny-target", draft_source="tiny-draft")
    g = torch.Generator().manual_seed(0)
    prompts = [(f"p{i}", torch.randint(0, VOCAB, (1, 4 + i), generator=g)) for i in range(6)]
    return pair, prompts


def test_train_end_to_end_and_push(tmp_path):
    pair, prompts = _pair_and_prompts()
    args = _args(tmp_path, "--push-to-hub", "pacer-org/pacer-head-tiny")
    api = FakeHfApi(tmp_path / "hub-store")
    summary = cli.train(args, pair, prompts, "Tiny random prompts.", hub_api=api)
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
    fixed = [v for k, v in summary["ablations"].items() if k.startswith("best fixed draft length, no head")]
    assert len(fixed) == 1 and fixed[0] <= summary["ablations"]["oracle"] + 1e-9
    assert len(list((tmp_path / "run" / "traces").glob("*.seconds"))) == 6  # each trace's recording time is kept

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


def test_card_only_adds_benchmark_figures(tmp_path):
    pair, prompts = _pair_and_prompts()
    cli.train(_args(tmp_path), pair, prompts[:4], "Tiny random prompts.")
    bench = dict(meta=dict(command="pacer-bench --n 1", max_new_tokens=24), summary=[
        dict(dataset="all", method="target", prompts=3, speedup=1.0, tau=1.0, mismatches=0),
        dict(dataset="all", method="pacer", prompts=3, speedup=1.5, tau=2.5, mismatches=1),
        dict(dataset="all", method="svip", prompts=3, speedup=1.25, speedup_ci=[1.1, 1.4], tau=2.0, mismatches=0),
        dict(dataset="toy", method="pacer", prompts=3, speedup=9.9, tau=2.5, mismatches=0),
    ])
    (tmp_path / "results.json").write_text(json.dumps(bench))
    before = (tmp_path / "run" / "head" / "README.md").read_text()
    assert "No live benchmark" in before
    cli.main(["--card-only", "--out", str(tmp_path / "run"), "--bench-results", str(tmp_path / "results.json")])
    card = (tmp_path / "run" / "head" / "README.md").read_text()
    assert "| pacer | 1.50x | 2.50 | MISMATCH 1/3 |" in card and "9.9" not in card
    assert "| svip | 1.25x (1.10-1.40) | 2.00 | yes |" in card
    assert "pacer-bench --n 1\n" in card
    assert card.split("## Speed")[0] == before.split("## Speed")[0]  # nothing else changed


def test_resume_reuses_traces(tmp_path, monkeypatch):
    pair, prompts = _pair_and_prompts()
    first = cli.record_traces(pair, prompts[:2], 16, 6, tmp_path / "traces", resume=False)
    calls = []
    monkeypatch.setattr("modeling_pacer.benchmarks.traces.record_trace_fast", lambda *a, **k: calls.append(a))
    again = cli.record_traces(pair, prompts[:2], 16, 6, tmp_path / "traces", resume=True)
    assert calls == []
    assert [t.match.tolist() for t in again] == [t.match.tolist() for t in first]
    # a resumed run still reports what recording took, or says it cannot
    assert cli.recording_time(tmp_path / "traces", ["p0", "p1"]).startswith("traces ")
    (tmp_path / "traces" / "p1.seconds").unlink()
    assert "1 more recorded without timing" in cli.recording_time(tmp_path / "traces", ["p0", "p1"])


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
