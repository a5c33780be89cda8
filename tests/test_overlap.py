"""`pacer-bench overlap` (issue 64's deciding measurement): the bound it computes from its timings, the two processes
run end to end on tiny models (structure and signs only: timings are never asserted), and its refusals before any
model loads."""

import os
import types

import pytest

from modeling_pacer.benchmarks.overlap import measure_overlap, overlap_table, summarize_overlap

from conftest import make_pair

TWO_CORES = len(os.sched_getaffinity(0)) >= 2


def tiny_pair():
    """The pair each child loads: built there, from the same seed (a module-level function, so it pickles)."""
    target, draft = make_pair("llama", "llama", "noisy")
    return types.SimpleNamespace(target=target, draft=draft)


def _medians(t_every=0.030, d_every=0.010, t_one=0.050, d_one=0.015, t_both=0.060, d_both=0.020):
    return {
        "target alone, 1 core": {"target": t_one}, "draft alone, 1 core": {"draft": d_one},
        "both at once, 1 core each": {"target": t_both, "draft": d_both},
        "target alone, every core": {"target": t_every}, "draft alone, every core": {"draft": d_every},
        "bandwidth alone, 1 core": {"target": 0.1}, "bandwidth, 2 at once, 1 core each": {"target": 0.15, "draft": 0.15},
        "bandwidth alone, every core": {"target": 0.08},
    }


def test_the_bound_is_the_serial_step_over_the_overlapped_one():
    result = summarize_overlap(_medians(), draft_tokens=3, nbytes=10**9, cores=2)
    assert result["serial_step_ms"] == pytest.approx(3 * 10 + 30)  # k draft steps, then the verification
    assert result["overlapped_step_ms"] == pytest.approx(max(3 * 20, 60))  # the longer, both at once
    assert result["bound"] == pytest.approx(60 / 60)
    assert result["slowdown_together"] == pytest.approx(dict(target=60 / 50, draft=20 / 15))
    assert result["bandwidth_gbps"] == pytest.approx(dict(alone_1_core=10.0, two_at_once_1_core_each=2 / 0.15,
                                                          alone_every_core=12.5))
    # a draft that is slow beside the target: the overlapped step is its k steps
    slow = summarize_overlap(_medians(d_both=0.030), draft_tokens=3, nbytes=10**9, cores=2)
    assert slow["overlapped_step_ms"] == pytest.approx(90) and slow["bound"] == pytest.approx(60 / 90)
    # 1 -> 2 cores: the target 50 -> 30 ms, the draft 15 -> 10 ms; on 4 cores 18 and 6.67 ms, each half (2 cores) as
    # on 2 cores slowed together by 60/50 and 20/15: serial 3 * 6.67 + 18 = 38, overlapped max(3 * 10 * 4/3, 30 * 1.2)
    assert result["projected"][4] == pytest.approx((3 * 10 / 1.5 + 30 / (5 / 3)) / max(3 * 10 * 20 / 15, 30 * 60 / 50))
    assert set(result["projected"]) == {4, 8}
    table = overlap_table(result)
    assert "| both at once, 1 core each | 60.0 | 20.0 |" in table and "| target alone, 1 core | 50.0 | – |" in table
    assert "at most 1.00x" in table and "Projection (not measured" in table


@pytest.mark.skipif(not TWO_CORES, reason="overlap splits two cores between the models")
def test_two_processes_end_to_end_on_tiny_models():
    result = measure_overlap(tiny_pair, draft_tokens=2, prefix_tokens=16, seconds=0.05, rounds=1, gib=0.01)
    assert set(result["ms"]) == {"target alone, 1 core", "draft alone, 1 core", "both at once, 1 core each",
                                 "target alone, every core", "draft alone, every core"}
    assert all(v > 0 for by_role in result["ms"].values() for v in by_role.values())
    assert all(v > 0 for v in result["bandwidth_gbps"].values()) and result["bound"] > 0
    assert result["draft_tokens"] == 2 and result["cores"] == len(os.sched_getaffinity(0))


def test_refusals_before_any_model_loads(monkeypatch, capsys, tmp_path):
    from modeling_pacer.benchmarks import cli

    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["overlap", "--seconds", "0", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--seconds must be positive" in capsys.readouterr().err
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["overlap", "--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "splits two cores" in capsys.readouterr().err
