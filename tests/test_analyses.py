"""`pacer-bench breakdown` and `paired`: analyses that were scripts beside the runs, now commands with tests (`costs
--repeat`: tests/test_pairs.py). Figures computed by hand from the records written here."""

import json

import pytest

from modeling_pacer.benchmarks.analyses import paired_comparison, time_breakdown
from modeling_pacer.benchmarks.cli import main


def _record(dataset, prompt, method, seconds, **timed):
    return dict(dataset=dataset, prompt_id=str(prompt), method=method, seconds=seconds, new_tokens=8, **timed)


def _run(tmp_path, records):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(dict(meta=dict(command="test"), records=records)))
    return str(path)


def test_breakdown_splits_prefills_forwards_and_rest(tmp_path):
    records = []
    for p in range(2):
        records.append(_record("d", p, "target", 10.0, target_seconds=9.0, target_prefill_seconds=2.0, target_forwards=8,
                               draft_seconds=0.0, draft_prefill_seconds=0.0, draft_forwards=0))
        records.append(_record("d", p, "pacer", 6.0, target_seconds=3.0, target_prefill_seconds=2.0, target_forwards=3,
                               draft_seconds=2.5, draft_prefill_seconds=0.5, draft_forwards=5))
        records.append(_record("d", p, "llama.cpp", 4.0))
    rows = {r["method"]: r for r in time_breakdown(records)}
    pacer = rows["pacer"]
    assert pacer["target_prefill"] == 4.0 and pacer["draft_prefill"] == 1.0
    assert pacer["target_other"] == 2.0 and pacer["target_ms_each"] == pytest.approx(1e3 * 2.0 / 4)  # 6 forwards, 2 prefills
    assert pacer["draft_other"] == 4.0 and pacer["draft_ms_each"] == pytest.approx(1e3 * 4.0 / 8)
    assert pacer["rest"] == pytest.approx(12.0 - 6.0 - 5.0)
    # decoding alone: the target alone without its prefills (20 - 4) over pacer without both prefills (12 - 5)
    assert pacer["decoding_speedup"] == pytest.approx(16.0 / 7.0)
    assert "target_other" not in rows["llama.cpp"]  # another runtime: no forwards timed, said as such

    path = _run(tmp_path, records)
    assert main(["breakdown", path, "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "breakdown.json").read_text())
    assert written["meta"]["command"].startswith("pacer-bench breakdown") and "versions" in written["meta"]
    assert "| pacer | 12.0 | 4.0 | 1.0 | 2.0 (500.0) | 4.0 (500.0) | 1.0 | 2.29x |" in (tmp_path / "out" / "breakdown.md").read_text()


def test_paired_ratio_interval_and_wins(tmp_path):
    records = []
    for p, (a, b) in enumerate([(1.0, 2.0), (2.0, 2.0), (1.0, 3.0), (4.0, 2.0)]):
        records += [_record("d", p, "pacer", a), _record("d", p, "svip", b)]
    row = paired_comparison(records, "pacer", "svip")
    assert row["ratio"] == pytest.approx(9.0 / 8.0) and row["faster_on"] == 2 and row["prompts"] == 4
    low, high = row["interval"]
    assert low <= row["ratio"] <= high and low < high

    path = _run(tmp_path, records)
    assert main(["paired", path, "--method", "pacer", "--against", "svip", "--out", str(tmp_path / "out")]) == 0
    written = json.loads((tmp_path / "out" / "paired.json").read_text())
    assert written["rows"][0]["ratio"] == pytest.approx(1.125) and written["meta"]["source"] is not None
    with pytest.raises(SystemExit):  # a method the file does not have: refused before anything is written
        main(["paired", path, "--against", "fixed-4", "--out", str(tmp_path / "no")])
    assert not (tmp_path / "no").exists()
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(SystemExit):
        main(["breakdown", str(tmp_path / "bad.json"), "--out", str(tmp_path / "no")])


def test_every_results_file_records_commit_versions_and_host():
    """`run_meta`, the `meta` of every pacer-bench results file: the command as typed, the commit pacer runs from (and
    whether the tree was dirty), the installed versions that decide a result, the host."""
    import subprocess
    from importlib import metadata
    from pathlib import Path

    from modeling_pacer.benchmarks.provenance import run_meta

    meta = run_meta(["run", "--n", "3", "--out", "a b"], pair="toy")
    assert meta["command"] == "pacer-bench run --n 3 --out 'a b'" and meta["pair"] == "toy"
    assert meta["versions"]["torch"] == metadata.version("torch")
    assert meta["versions"]["transformers"] == metadata.version("transformers")
    assert meta["host"]["threads"] >= 1 and meta["host"]["cpu"]
    checkout = Path(__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True)
    import modeling_pacer

    if head.returncode == 0 and Path(modeling_pacer.__file__).resolve().is_relative_to(checkout):
        assert meta["source"]["commit"] == head.stdout.strip() and isinstance(meta["source"]["dirty"], bool)
