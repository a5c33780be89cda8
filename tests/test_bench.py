"""The benchmark harness on tiny random models: live runs, mismatch detection, replay agreeing with a
live run, the oracle's optimality, and the report files."""

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch

from modeling_pacer.benchmarks import runner
from modeling_pacer.benchmarks.cli import build_parser
from modeling_pacer.benchmarks.methods import all_methods, run_method, select_methods
from modeling_pacer.benchmarks.report import markdown_table, speedup_interval, summarize, write_report
from modeling_pacer.replay import (
    CostModel,
    load_traces,
    oracle,
    record_match,
    record_trace,
    record_trace_by_decoding,
    replay,
    save_traces,
)

from conftest import VOCAB, make_head, make_pair

NEW = 24


@pytest.fixture(scope="module")
def setup():
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=12, block_size=2, threshold=0.4)
    g = torch.Generator().manual_seed(0)
    prompts = [("toy", str(i), torch.randint(0, VOCAB, (1, 5 + 3 * i), generator=g)) for i in range(3)]
    return SimpleNamespace(pair=SimpleNamespace(target=target, draft=draft), head=head, prompts=prompts)


def test_pacer_method_is_the_heads_own_rule():
    from modeling_pacer import ExpectedThroughput, PacerConfig
    from modeling_pacer.custom_generate.policies import Pacer

    costs = CostModel({n: 1.0 for n in range(1, 20)}, 0.1, 0.01)
    blocks = all_methods(head_config=PacerConfig(draft_hidden_size=8, max_draft_length=8), costs=costs)
    assert isinstance(blocks["pacer"].make_policy(), Pacer) and isinstance(blocks["pacer-blocks"].make_policy(), Pacer)
    cost_aware = all_methods(head_config=PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput"),
                             costs=costs)
    policy = cost_aware["pacer"].make_policy()
    assert isinstance(policy, ExpectedThroughput) and policy.costs is costs and policy.estimate == "head"
    assert isinstance(cost_aware["pacer-blocks"].make_policy(), Pacer)


def test_select_methods_globs():
    available = all_methods()
    names = [m.name for m in select_methods(["target", "fixed-*"], available)]
    assert names == ["target"] + [f"fixed-{g}" for g in (1, 2, 3, 4, 5, 6)]
    with pytest.raises(ValueError, match="Unknown methods"):
        select_methods(["nope"], available)


def test_live_run_counts_and_checks_every_method(setup):
    methods = select_methods(["target", "hf-assisted", "hf-constant-2", "fixed-2", "svip", "pacer"],
                             all_methods(head_config=setup.head.config))
    records, traces = runner.run_live(setup.pair, setup.head, methods, setup.prompts, NEW)
    assert len(records) == len(methods) * len(setup.prompts) and len(traces) == len(setup.prompts)
    for r in records:
        assert r.matches_target, r.method
        assert r.new_tokens == NEW and r.seconds > 0
        assert r.target_forwards >= 1
        # the forwards' own time is measured by hooks and fits inside the run's wall time
        assert r.target_seconds > 0 and r.target_seconds + r.draft_seconds + r.head_seconds < r.seconds
        if r.method == "target":
            assert r.target_forwards == NEW and r.draft_forwards == 0 and r.draft_seconds == 0
        else:
            assert r.draft_forwards > 0 and r.target_forwards < NEW + 1 and r.draft_seconds > 0
    pacer = [r for r in records if r.method == "pacer"]
    assert all(r.head_seconds > 0 and sum(r.accepted) + len(r.accepted) == NEW for r in pacer)
    # each run's first forward of each model is timed (the prompt's prefill); a model a method never calls has none
    for r in records:
        assert 0 < r.target_prefill_seconds <= r.target_seconds
        if r.method == "target":
            assert r.draft_prefill_seconds is None
        else:
            assert 0 < r.draft_prefill_seconds <= r.draft_seconds
    # the oracle's end-to-end pricing swaps its one-token prefill for the measured ones
    costs = CostModel({n: 0.01 * n for n in range(1, 10)}, 0.004, 0.001)
    for row in runner.oracle_records(traces, costs, 8, records):
        target = next(r for r in records if r.method == "target" and r.prompt_id == row["prompt_id"])
        assert row["target_prefill_seconds"] == target.target_prefill_seconds
        assert row["end_to_end_target_alone_seconds"] == pytest.approx(
            row["target_alone_seconds"] - 0.01 + target.target_prefill_seconds)
        drafted = any(row["draft_lengths"])
        assert row["end_to_end_seconds"] == pytest.approx(
            row["seconds"] - 0.01 + target.target_prefill_seconds
            + (row["draft_prefill_seconds"] - 0.004 if drafted else 0.0))
    assert all("end_to_end_seconds" not in row for row in runner.oracle_records(traces, costs, 8))


def test_sampled_run_times_equal_lengths_and_repeats(setup, tmp_path):
    """--do-sample: every method samples exactly NEW tokens (end of sequence suppressed, so times cover equal
    work), outputs are not compared with the target's draws (nor replayed by the greedy oracle), the table says
    so, and the same seed gives the same draws again."""
    from modeling_pacer.benchmarks.methods import sampling_settings

    methods = select_methods(["target", "hf-assisted", "fixed-2", "pacer"], all_methods(head_config=setup.head.config))
    sampling = sampling_settings(1.0)
    records, traces = runner.run_live(setup.pair, setup.head, methods, setup.prompts, NEW, sampling=sampling, seed=7)
    assert traces == [] and len(records) == len(methods) * len(setup.prompts)
    assert all(r.sampled and r.matches_target is None and r.agree_prefix is None and r.new_tokens == NEW for r in records)
    report = write_report(tmp_path, [r.to_dict() for r in records], [], dict(command="test"))
    assert "sampled (in distribution: tests)" in report["table"] and "MISMATCH" not in report["table"]
    rows = [r for r in report["summary"] if r["method"] == "pacer"]
    assert rows and all(r["sampled"] and not r["own_numerics"] and r["of_oracle"] is None and r["tau"] > 1 for r in rows)

    ids = setup.prompts[0][2]
    draws = []
    for _ in range(2):
        torch.manual_seed(7)
        draws.append(run_method(methods[-1], setup.pair.target, setup.pair.draft, setup.head, ids, NEW, None, sampling)[0])
    torch.manual_seed(8)
    other = run_method(methods[-1], setup.pair.target, setup.pair.draft, setup.head, ids, NEW, None, sampling)[0]
    assert torch.equal(draws[0], draws[1]) and not torch.equal(draws[0], other)
    with pytest.raises(ValueError, match="temperature > 0"):
        sampling_settings(0.0)
    assert sampling_settings(0.7, 0.9)["top_p"] == 0.9 and sampling_settings(0.7)["top_p"] == 1.0


def test_mismatch_is_reported_loudly(setup, monkeypatch, tmp_path):
    methods = select_methods(["target", "fixed-2"], all_methods())

    def corrupt(method, *args):
        sequences, stats = run_method(method, *args)
        if method.name == "fixed-2":
            sequences = sequences.clone()
            sequences[0, -1] = (sequences[0, -1] + 1) % VOCAB
        return sequences, stats

    monkeypatch.setattr(runner, "run_method", corrupt)
    records, traces = runner.run_live(setup.pair, None, methods, setup.prompts, NEW)
    costs = CostModel({n: 1.0 + 0.1 * n for n in range(1, 10)}, 0.2)
    report = write_report(tmp_path, [r.to_dict() for r in records], runner.oracle_records(traces, costs, 8),
                          dict(command="test"))
    row = next(r for r in report["summary"] if r["method"] == "fixed-2" and r["dataset"] == "toy")
    assert row["mismatches"] == len(setup.prompts)
    assert f"**MISMATCH {len(setup.prompts)}/{len(setup.prompts)}**" in report["table"]
    assert {p.name for p in tmp_path.iterdir()} == {"results.json", "results.md", "speedup.png", "draft_lengths.png"}


def _live_steps(setup, policy, ids):
    out = setup.pair.target.generate(ids, assistant_model=setup.pair.draft, pacer_head=setup.head,
                                     stopping_policy=policy, max_new_tokens=NEW, return_dict_in_generate=True)
    return out, [(s.drafted, s.accepted) for s in out.pacer_stats.steps]


@pytest.mark.parametrize("name", ["fixed-3", "heuristic", "confidence", "svip", "specdec++", "pacer"])
def test_replay_agrees_with_live_run(setup, name):
    method = all_methods(head_config=setup.head.config)[name]
    costs = CostModel({n: 1.0 for n in range(1, 20)}, 0.1, 0.01)
    for _, _, ids in setup.prompts:
        out, live = _live_steps(setup, method.policy(), ids)
        trace = record_trace_by_decoding(setup.pair.draft, ids, out.sequences[0, ids.shape[1]:], 12, True)
        replayed = replay(method.policy(), trace, costs, setup.head)
        assert [(s.drafted, s.accepted) for s in replayed.steps] == live


def test_cheap_match_trace_equals_full_trace(setup):
    _, _, ids = setup.prompts[1]
    output = setup.pair.target.generate(ids, max_new_tokens=NEW)[0, ids.shape[1]:]
    full = record_trace_by_decoding(setup.pair.draft, ids, output, 6, False)
    cheap = record_match(setup.pair.draft, ids, output, 6)
    assert cheap.match.tolist() == full.match.tolist()
    assert cheap.match.max() > 0  # the draft does agree sometimes: the comparison means something


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_teacher_forced_trace_equals_decoded_trace(arch):
    """record_trace (teacher forcing, every draft's continuation past its miss run together under a tree
    mask) records what the draft drafts from every position when it really decodes: the same matches, the
    same features up to float rounding, for every draft token the budget allows."""
    target, draft = make_pair(arch, arch, "noisy")
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    output = target.generate(ids, max_new_tokens=40, do_sample=False)[0, 7:]
    decoded = record_trace_by_decoding(draft, ids, output, 6, True)
    for fast in (record_trace(draft, target, ids, output, 6), record_trace(draft, target, ids, output, 6, target_choice=output)):
        assert fast.match.tolist() == decoded.match.tolist()
        assert 0 < int((fast.match == 0).sum()) < len(output)  # misses and hits: continuations were needed
        budget = torch.arange(6)[None, :] < (len(output) - torch.arange(len(output)))[:, None]  # j < n - i
        torch.testing.assert_close(fast.token_probs[budget], decoded.token_probs[budget], atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(fast.entropies[budget], decoded.entropies[budget], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fast.hidden[budget].float(), decoded.hidden[budget].float(), atol=2e-3, rtol=1e-3)


def test_oracle_beats_every_replayed_policy(setup):
    # a staircase cost curve like this CPU's: 1-3 tokens one forward, 4-6 two, 7-9 almost three
    costs = CostModel({n: [1.0, 1.0, 1.1, 2.0, 2.0, 2.1, 2.7, 2.7, 2.8][n - 1] for n in range(1, 10)}, 0.3, 0.01)
    methods = all_methods(gammas=(1, 2, 3, 4), head_config=setup.head.config)
    for _, _, ids in setup.prompts:
        output = setup.pair.target.generate(ids, max_new_tokens=NEW)[0, ids.shape[1]:]
        trace = record_trace_by_decoding(setup.pair.draft, ids, output, 12, True)
        best = oracle(trace, costs, 8)
        assert sum(s.emitted for s in best.steps) == NEW
        for name in ["fixed-1", "fixed-2", "fixed-4", "heuristic", "svip", "pacer"]:
            replayed = replay(methods[name].policy(), trace, costs, setup.head)
            assert best.seconds <= replayed.seconds + 1e-9, name


def test_summary_ratios():
    records = [
        dict(dataset="d", prompt_id="0", method="target", seconds=4.0, new_tokens=8, target_forwards=8,
             draft_forwards=0, matches_target=True, head_seconds=0.0, draft_lengths=[], accepted=[]),
        dict(dataset="d", prompt_id="0", method="fixed-2", seconds=2.0, new_tokens=8, target_forwards=4,
             draft_forwards=6, matches_target=True, head_seconds=0.0, draft_lengths=[2, 2, 2], accepted=[2, 2, 1]),
    ]
    oracle_rows = [dict(dataset="d", prompt_id="0", method="oracle", seconds=1.0, target_alone_seconds=4.0,
                        draft_lengths=[3, 3], accepted=[3, 3], new_tokens=8)]
    rows = {(r["dataset"], r["method"]): r for r in summarize(records, oracle_rows)}
    assert rows[("d", "fixed-2")]["speedup"] == 2.0
    assert rows[("d", "fixed-2")]["tau"] == 2.0 and rows[("d", "fixed-2")]["draft_forwards_per_token"] == 0.75
    assert rows[("d", "oracle (replay)")]["speedup"] == 4.0
    assert rows[("d", "fixed-2")]["of_oracle"] == 0.5
    assert ("d", "oracle + measured prefills") not in rows  # no measured prefills: no end-to-end row
    priced = [dict(oracle_rows[0], end_to_end_target_alone_seconds=5.0, end_to_end_seconds=2.5)]
    rows_e2e = {(r["dataset"], r["method"]): r for r in summarize(records, priced)}
    assert rows_e2e[("d", "oracle + measured prefills")]["speedup"] == 2.0
    # a live speedup includes its prefills: its share is of the end-to-end oracle where the run measured them
    assert rows_e2e[("d", "fixed-2")]["of_oracle"] == 1.0
    assert rows_e2e[("d", "oracle + measured prefills")]["of_oracle"] == 1.0
    assert rows_e2e[("d", "oracle (replay)")]["of_oracle"] is None
    assert rows[("all", "target")]["speedup"] == 1.0
    # records from before forwards were timed: no breakdown (never a made-up 0%), the head's share alone
    assert rows[("d", "fixed-2")]["target_share"] is None and rows[("d", "fixed-2")]["other_share"] is None
    table = markdown_table(list(rows.values()))
    assert "| head time |" in table and "target / draft" not in table and "| 0.0% |" in table
    timed = [dict(r, target_seconds=s, draft_seconds=d, head_seconds=h)
             for r, (s, d, h) in zip(records, [(3.0, 0.0, 0.0), (1.0, 0.5, 0.1)])]
    rows = {(r["dataset"], r["method"]): r for r in summarize(timed, oracle_rows)}
    fixed = rows[("d", "fixed-2")]
    assert (fixed["target_share"], fixed["draft_share"], fixed["head_share"]) == (0.5, 0.25, 0.05)
    assert fixed["other_share"] == pytest.approx(0.2)
    table = markdown_table(list(rows.values()))
    assert "| 50% / 25% / 5.0% / 20% |" in table and "| – / – / 0.0% / – |" in table  # the oracle's row


def test_speedup_interval_over_prompts():
    # two prompts, 2x and 3x: resamples can only give 2, 2.5 or 3
    low, high = speedup_interval([(4.0, 2.0), (6.0, 2.0)])
    assert 2.0 <= low <= 2.5 <= high <= 3.0 and low < high
    assert speedup_interval([(4.0, 2.0), (6.0, 2.0)]) == (low, high)  # seeded: reports are reproducible
    assert speedup_interval([(4.0, 2.0)]) is None
    # each prompt's pair stays together: equal ratios on every prompt give no spread at all
    assert speedup_interval([(4.0, 2.0), (40.0, 20.0), (1.0, 0.5)]) == (2.0, 2.0)
    records = [
        dict(dataset="d", prompt_id=str(i), method=method, seconds=seconds, new_tokens=8, target_forwards=8,
             draft_forwards=0, matches_target=True, head_seconds=0.0, draft_lengths=[], accepted=[])
        for i, (alone, fast) in enumerate([(4.0, 2.0), (6.0, 2.0)]) for method, seconds in [("target", alone), ("m", fast)]
    ]
    rows = {(r["dataset"], r["method"]): r for r in summarize(records, [])}
    assert rows[("d", "m")]["speedup_ci"] == (low, high) and rows[("d", "m")]["speedup"] == 2.5
    assert f"| 2.50x ({low:.2f}-{high:.2f}) |" in markdown_table(list(rows.values()))


def test_cli_help():
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["--help"])
    assert exit_info.value.code == 0


def test_costs_measures_the_quantized_setting_alone_by_default():
    from modeling_pacer.benchmarks.cli import parse_args

    assert parse_args(["costs"]).dtypes == ["bfloat16", "float32"]
    assert parse_args(["costs", "--quantize-target", "w4a8"]).dtypes == ["w4a8"]
    assert parse_args(["costs", "--dtypes", "bfloat16", "int4"]).dtypes == ["bfloat16", "int4"]


def test_oracle_is_optimal_under_a_non_monotone_cost_curve():
    """Measured costs can dip (verifying 4 tokens cheaper than 3): the oracle must still beat any schedule."""
    from modeling_pacer.replay import Trace

    # (position 0 is the prefill's token: nothing is drafted for it)
    trace = Trace("d", "0", match=torch.tensor([0, 2, 1, 0, 3, 2, 1, 0, 0, 1, 0]))
    costs = CostModel({1: 1.0, 2: 1.0, 3: 1.5, 4: 1.0, 5: 2.0}, 0.01)
    best = oracle(trace, costs, 4)
    for gamma in range(0, 5):  # every fixed schedule, simulated by hand (token 0 from the prefill, one target token)
        pos, seconds = 1, costs.step(0)
        while pos < trace.length:
            k = min(gamma, trace.length - pos - 1)
            seconds += costs.step(k)
            pos += min(k, int(trace.match[pos])) + 1
        assert best.seconds <= seconds + 1e-12
    assert any(s.drafted > s.accepted for s in best.steps)  # it used the dip: drafted past a miss


def _part(tmp_path, name, dataset, target_seconds, fixed_seconds):
    records = [
        dict(dataset=dataset, prompt_id="0", method="target", seconds=target_seconds, new_tokens=8, target_forwards=8,
             draft_forwards=0, matches_target=True, head_seconds=0.0, draft_lengths=[], accepted=[]),
        dict(dataset=dataset, prompt_id="0", method="fixed-2", seconds=fixed_seconds, new_tokens=8, target_forwards=4,
             draft_forwards=6, matches_target=dataset != "b", head_seconds=0.0, draft_lengths=[2, 2, 2], accepted=[2, 2, 1]),
    ]
    oracle_rows = [dict(dataset=dataset, prompt_id="0", method="oracle", seconds=1.0, target_alone_seconds=target_seconds,
                        draft_lengths=[3, 3], accepted=[3, 3], new_tokens=8)]
    write_report(tmp_path / name, records, oracle_rows, dict(command=f"pacer-bench --datasets {dataset}", max_new_tokens=8))
    return str(tmp_path / name / "results.json")


def test_merge_runs_split_by_dataset(tmp_path):
    import json
    from pathlib import Path

    from modeling_pacer.benchmarks.cli import main

    a, b = _part(tmp_path, "a", "a", 4.0, 2.0), _part(tmp_path, "b", "b", 6.0, 2.0)
    assert main(["merge", a, b, "--out", str(tmp_path / "all")]) == 1  # written, but a mismatch fails the run
    merged = json.loads((tmp_path / "all" / "results.json").read_text())
    rows = {(r["dataset"], r["method"]): r for r in merged["summary"]}
    assert rows[("a", "fixed-2")]["speedup"] == 2.0 and rows[("b", "fixed-2")]["speedup"] == 3.0
    assert rows[("all", "fixed-2")]["speedup"] == 10.0 / 4.0  # ratio of sums over both runs
    assert rows[("all", "fixed-2")]["mismatches"] == 1  # a mismatch in one part stays loud in the merge
    assert "MISMATCH" in (tmp_path / "all" / "results.md").read_text()
    assert [p["command"] for p in merged["meta"]["parts"]] == ["pacer-bench --datasets a", "pacer-bench --datasets b"]
    with pytest.raises(ValueError, match="share prompts"):
        main(["merge", a, a, "--out", str(tmp_path / "twice")])
    # runs that measured different methods merge only on the common ones, named
    c = tmp_path / "c" / "results.json"
    part = json.loads(Path(b).read_text())
    part["records"] = [dict(r, method="svip") if r["method"] == "fixed-2" else r for r in part["records"]]
    part["oracle"] = [dict(r, prompt_id="1") for r in part["oracle"]]
    part["records"] = [dict(r, prompt_id="1") for r in part["records"]]
    c.parent.mkdir()
    c.write_text(json.dumps(part))
    with pytest.raises(ValueError, match="different methods"):
        main(["merge", a, str(c), "--out", str(tmp_path / "mixed")])
    main(["merge", a, str(c), "--methods", "target", "--out", str(tmp_path / "common")])
    common = json.loads((tmp_path / "common" / "results.json").read_text())
    assert {r["method"] for r in common["records"]} == {"target"}


def test_replay_cli_over_several_trace_files(setup, tmp_path):
    """`replay a.safetensors b.safetensors` replays every file's traces with its own cost model; the figures equal replaying
    by hand, and the oracle bounds every policy."""
    import json

    from modeling_pacer.benchmarks.cli import main

    setup.head.save_pretrained(tmp_path / "head")
    files, by_hand = [], {"fixed-2": [0.0, 0.0], "pacer": [0.0, 0.0]}
    for i, (dataset, prompt_id, ids) in enumerate(setup.prompts[:2]):
        costs = CostModel({n: 1.0 + i + 0.2 * (n > 3) for n in range(1, 14)}, 0.1 * (i + 1), 0.01)
        output = setup.pair.target.generate(ids, max_new_tokens=NEW)[0, ids.shape[1]:]
        trace = record_trace_by_decoding(setup.pair.draft, ids, output, 12, True, dataset, prompt_id)
        save_traces(tmp_path / f"{i}.safetensors", [trace], costs, pair="toy")
        files.append(str(tmp_path / f"{i}.safetensors"))
        for name in by_hand:
            result = replay(all_methods(head_config=setup.head.config)[name].policy(), trace, costs, setup.head)
            by_hand[name][0] += result.target_alone_seconds
            by_hand[name][1] += result.seconds
    main(["replay", *files, "--head", str(tmp_path / "head"), "--methods", "fixed-2", "pacer", "--out", str(tmp_path / "r"),
          "--rules", '{"name": "fixed", "gamma": 2}', '{"name": "throughput", "calibration": 4.0, "max_draft_length": 8}'])
    rows = {r["method"]: r["replayed_speedup"] for r in json.loads((tmp_path / "r" / "replay.json").read_text())["rows"]}
    for name, (alone, seconds) in by_hand.items():
        assert rows[name] == pytest.approx(alone / seconds)
    assert rows["fixed(gamma=2)"] == rows["fixed-2"]  # a rule given by its settings replays as the named method
    assert "throughput(calibration=4.0, max_draft_length=8)" in rows
    with pytest.raises(SystemExit):  # a setting the rule does not have: refused by the parser, naming it
        main(["replay", *files, "--rules", '{"name": "fixed", "gama": 2}', "--out", str(tmp_path / "bad")])
    assert rows["oracle"] >= max(rows["fixed-2"], rows["pacer"])
    assert (tmp_path / "r" / "replay.md").exists()

    # --costs: every trace priced at another machine's cost model (a GPU's, from `pacer-bench device`); --alone-ms
    # (or the file's alone_ms) the target alone's step where it is not the model's target(1)
    gpu = CostModel({n: 0.01 + 0.0001 * n for n in range(1, 14)}, 0.004, 0.0)
    (tmp_path / "gpu.json").write_text(json.dumps(dict(gpu.to_dict(), alone_ms=8.0)))
    main(["replay", *files, "--head", str(tmp_path / "head"), "--methods", "fixed-2", "--costs", str(tmp_path / "gpu.json"),
          "--out", str(tmp_path / "g")])
    projected = json.loads((tmp_path / "g" / "replay.json").read_text())
    alone = seconds = 0.0
    for path in files:
        trace = load_traces(path).traces[0]
        result = replay(all_methods(head_config=setup.head.config)["fixed-2"].policy(), trace, gpu, setup.head)
        alone += result.target_alone_seconds * 0.008 / gpu.target(1)
        seconds += result.seconds
    assert projected["rows"][0]["replayed_speedup"] == pytest.approx(alone / seconds)
    assert projected["meta"]["alone_ms"] == 8.0 and projected["meta"]["costs"] == [json.loads(json.dumps(gpu.to_dict()))]
    (tmp_path / "bad.json").write_text(json.dumps({"draft_forward": 0.1}))
    with pytest.raises(ValueError, match="not a cost model"):
        main(["replay", *files, "--costs", str(tmp_path / "bad.json"), "--out", str(tmp_path / "b")])


def test_trace_files_round_trip_and_a_pickle_runs_nothing(setup, tmp_path):
    """Trace files are safetensors + JSON: what was saved comes back, and a crafted pickle in their place
    (the format of earlier versions) is refused without executing anything."""
    import os

    from modeling_pacer.benchmarks.cli import main

    dataset, prompt_id, ids = setup.prompts[0]
    output = setup.pair.target.generate(ids, max_new_tokens=NEW)[0, ids.shape[1]:]
    trace = record_trace_by_decoding(setup.pair.draft, ids, output, 6, True, dataset, prompt_id)
    costs = CostModel({1: 1.0, 2: 1.5}, 0.1, 0.01)
    save_traces(tmp_path / "t.safetensors", [trace], costs, pair="toy")
    back = load_traces(tmp_path / "t.safetensors")
    assert back.costs == costs and back.meta == {"pair": "toy"}
    (loaded,) = back.traces
    assert (loaded.dataset, loaded.prompt_id) == (dataset, prompt_id)
    for name in ("match", "output", "token_probs", "entropies", "hidden"):
        assert torch.equal(getattr(loaded, name), getattr(trace, name)), name

    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"traces": [], "costs": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="not a pacer trace file"):
        load_traces(tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="not a pacer trace file"):
        main(["replay", str(tmp_path / "evil.pt"), "--out", str(tmp_path / "r")])
    assert not marker.exists()


@pytest.mark.parametrize("argv, message", [
    (["--n", "0"], "--n: .*at least 1"),
    (["--n", "-1"], "--n: .*at least 1"),
    (["--max-new-tokens", "0"], "--max-new-tokens: .*at least 1"),
    (["--datasets", "nosuch"], "--datasets: invalid choice"),
    (["--methods", "target", "nosuch"], "Unknown methods"),
    (["--methods", "fixed-2"], "must include 'target'"),
    (["--pair", "no/such-pair"], "--pair"),
    (["--target", "org/big"], "--target org/big needs --draft"),
    (["--gammas", "0"], "--gammas: .*at least 1"),
    (["--head", "no/such/folder/x"], "--head"),
    (["--out", "/proc/no-such-folder/out"], "not a writable folder"),
    (["replay", "missing.safetensors"], "no such file"),
    (["merge", "missing.json"], "no such file"),
    (["--replay", "t.safetensors"], "pacer-bench replay"),
    (["--merge", "a.json"], "pacer-bench merge"),
    (["agreement"], "pass --quantize-target"),
    (["agreement", "--quantize-target", "int3"], "invalid choice"),
    (["costs", "--dtypes", "int3"], "--dtypes"),
    (["costs", "--quantize-target", "w4a8", "--dtypes", "bfloat16", "float32"], "cannot also measure float32"),
    (["--temperature", "0.7"], "without --do-sample"),
    (["--do-sample", "--temperature", "0"], "temperature > 0"),
    (["--top-p", "0.9"], "--top-p 0.9 without --do-sample"),
    (["--do-sample", "--top-p", "1.5"], r"top-p must be in \(0, 1\]"),
    (["--do-sample", "--methods", "target", "llama.cpp"], "greedy decoding only"),
    (["--do-sample", "--record-traces", "t.safetensors"], "without --do-sample"),
    (["batch", "--batch-sizes", "0"], "must be at least 1"),
    (["batch", "--methods", "pacer", "pacer"], "a method named twice"),
    (["batch", "--methods", "vllm"], "invalid choice"),
])
def test_bad_arguments_fail_before_any_model_loads(argv, message, monkeypatch, capsys):
    """Every argument is checked first: a clear usage error (exit 2), and the pair is never loaded."""
    from modeling_pacer.benchmarks import cli

    monkeypatch.setattr("modeling_pacer.pairs.loading.load_pair", lambda *a, **k: pytest.fail("a model was loaded"))
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert re.search(message, capsys.readouterr().err), message


def test_greedy_agreement_scores_a_models_text_by_another():
    """The quantized model's greedy text, read by the reference in one forward: a model against itself
    agrees everywhere; against another model the prefix ends where the two greedy outputs first differ."""
    from modeling_pacer.benchmarks.agreement import greedy_agreement, summarize
    from conftest import make_model

    a, b = make_model("qwen2", seed=1), make_model("qwen2", seed=2)
    ids = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(0))
    same = greedy_agreement(a, a, ids, 12)
    assert same["tokens"] == 12 and same["agree_prefix"] == 12 and same["agreement"] == 1.0
    other = greedy_agreement(b, a, ids, 12)
    own_a = a.generate(ids, do_sample=False, max_new_tokens=12)[0, 6:]
    own_b = b.generate(ids, do_sample=False, max_new_tokens=12)[0, 6:]
    first_difference = next((i for i in range(12) if own_a[i] != own_b[i]), 12)
    assert other["agree_prefix"] == first_difference < 12 and other["agreement"] < 1.0
    assert other["reference_nll"] > 0
    rows = [dict(dataset="x", **same), dict(dataset="y", **other)]
    table = {r["dataset"]: r for r in summarize(rows)}
    assert table["all"]["tokens"] == 24 and table["all"]["agreement"] == pytest.approx((1 + other["agreement"]) / 2)


def test_recording_with_a_row_variant_draft_warns():
    """A dynamic-int8 draft quantizes each call's input with one scale, so a trace's one long forward computes
    other features than decoding steps: recording with it says so; a plain draft records silently."""
    import warnings

    from modeling_pacer.pairs import quantize_dynamic_int8
    from modeling_pacer.pairs.loading import row_variant_linears

    target, draft = make_pair("llama", "llama", "noisy")
    ids = torch.randint(0, VOCAB, (1, 5), generator=torch.Generator().manual_seed(2))
    output = target.generate(ids, max_new_tokens=12, do_sample=False)[0, 5:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        record_trace(draft, target, ids, output, 4)
    assert row_variant_linears(draft) == 0
    quantize_dynamic_int8(draft)
    assert row_variant_linears(draft) > 0
    with pytest.warns(UserWarning, match="--quantize-draft int4"):
        record_trace(draft, target, ids, output, 4)


def test_pacer_method_follows_the_mode():
    """A head whose config names another rule for sampling: `pacer` is the cost-aware draft-probability rule in a
    greedy run and the head's block rule in a sampled one."""
    from modeling_pacer import ExpectedThroughput, PacerConfig
    from modeling_pacer.custom_generate.policies import Pacer

    costs = CostModel({n: 1.0 for n in range(1, 20)}, 0.1, 0.01)
    config = PacerConfig(draft_hidden_size=8, max_draft_length=8, stopping_rule="throughput", throughput_estimate="draft",
                         sampling_stopping_rule="blocks")
    greedy = all_methods(head_config=config, costs=costs)["pacer"]
    assert greedy.needs_costs and isinstance(greedy.make_policy(), ExpectedThroughput)
    assert greedy.make_policy().estimate == "draft"
    sampled = all_methods(head_config=config, costs=costs, do_sample=True)["pacer"]
    assert not sampled.needs_costs and isinstance(sampled.make_policy(), Pacer)


def test_replay_skips_methods_longer_than_the_traces(setup, tmp_path, capsys):
    """Traces with 6-token drafts: methods that may draft longer (heuristic 64, svip 20) are skipped with one line
    naming them; the others are replayed."""
    import json

    from modeling_pacer.benchmarks.cli import main

    dataset, prompt_id, ids = setup.prompts[0]
    costs = CostModel({n: 1.0 + 0.2 * (n > 3) for n in range(1, 14)}, 0.1, 0.01)
    output = setup.pair.target.generate(ids, max_new_tokens=NEW)[0, ids.shape[1]:]
    trace = record_trace_by_decoding(setup.pair.draft, ids, output, 6, False, dataset, prompt_id)
    save_traces(tmp_path / "t.safetensors", [trace], costs, pair="toy")
    main(["replay", str(tmp_path / "t.safetensors"), "--methods", "fixed-2", "heuristic", "svip", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert "skipping heuristic (up to 64), svip (up to 20)" in err and "(6)" in err
    rows = [r["method"] for r in json.loads((tmp_path / "r" / "replay.json").read_text())["rows"]]
    assert rows == ["fixed-2", "oracle"]


def test_verdict_names_pacer_the_best_other_and_losslessness(tmp_path):
    from modeling_pacer.benchmarks.report import verdict

    def row(method, speedup, mismatches=0):
        return dict(dataset="all", method=method, prompts=3, speedup=speedup, tokens_per_s=2.0 * speedup,
                    mismatches=mismatches, own_numerics=False, sampled=False)

    summary = [row("target", 1.0), row("svip", 1.6), row("pacer", 1.8), row("fixed-2", 1.4),
               dict(row("oracle (replay)", 3.0))]
    line = verdict(summary, tmp_path / "out")
    assert line.startswith("PACER 1.80x the target alone (3.6 tokens/s, the target alone 2.0)")
    assert "best other: svip 1.60x (PACER ahead)" in line and "every method lossless" in line
    assert line.endswith(f"files in {tmp_path / 'out'}/") and "\n" not in line
    summary[1]["speedup"], summary[3]["mismatches"] = 1.9, 1
    line = verdict(summary, tmp_path / "out")
    assert "best other: svip 1.90x (ahead of PACER)" in line and "NOT LOSSLESS: fixed-2 (1/3)" in line
    # the end-to-end oracle bounds PACER's figure and is never "the best other method"
    summary.append(row("oracle + measured prefills", 2.2))
    line = verdict(summary, tmp_path / "out")
    assert "the oracle with the measured prefills 2.20x" in line and "best other: svip" in line


def test_lookup_methods_give_the_targets_output_and_are_not_replayed(tmp_path):
    """pacer-lookup (free drafts under the cost-aware rule) and transformers' prompt lookup: the target's greedy
    output on prompts that repeat; llama.cpp's lookup is opt-in like llama.cpp."""
    from modeling_pacer.benchmarks.methods import LOOKUP_TOKENS

    target, draft = make_pair("llama", "llama", "noisy")
    costs = CostModel({n: 1.0 + 0.01 * n for n in range(1, 20)}, 0.3)
    methods = all_methods(costs=costs)
    assert methods["pacer-lookup"].lookup == LOOKUP_TOKENS["pacer"] and not methods["pacer-lookup"].needs_head
    assert methods["hf-prompt-lookup"].family == "hf" and methods["llama.cpp-lookup"].opt_in
    assert "llama.cpp-lookup" not in [m.name for m in select_methods(None, methods)]
    line = torch.tensor([[5, 17, 33, 2, 61, 8, 40]])
    for ids in (torch.cat([line, line, line[:, :3]], dim=1), torch.tensor([[4, 9, 4, 9, 4]])):
        plain = target.generate(ids, max_new_tokens=30, do_sample=False)
        for name in ("pacer-lookup", "hf-prompt-lookup"):
            sequences, stats = run_method(methods[name], target, draft, None, ids, 30)
            assert torch.equal(sequences, plain), name
    _, stats = run_method(methods["pacer-lookup"], target, draft, None, torch.cat([line, line, line[:, :3]], dim=1), 30)
    assert sum(s.free for s in stats.steps) > 0


def test_draft_window_methods_give_the_targets_output_and_are_not_replayed(setup, tmp_path, capsys):
    """pacer-window-K: the head's default rule with the draft reading the prompt's last K tokens; the target's greedy
    output; not replayed (its drafts are not the traces' draft's)."""
    import json

    from modeling_pacer.benchmarks.cli import main
    from modeling_pacer.benchmarks.methods import DRAFT_WINDOWS

    costs = CostModel({n: 1.0 + 0.01 * n for n in range(1, 20)}, 0.3)
    methods = all_methods(head_config=setup.head.config, costs=costs)
    for k in DRAFT_WINDOWS:
        method = methods[f"pacer-window-{k}"]
        assert method.draft_window == k and method.needs_head == methods["pacer"].needs_head
    dataset, prompt_id, ids = setup.prompts[0]
    plain = setup.pair.target.generate(ids, max_new_tokens=NEW, do_sample=False)
    window = dataclasses.replace(methods[f"pacer-window-{DRAFT_WINDOWS[0]}"], draft_window=2)
    sequences, stats = run_method(window, setup.pair.target, setup.pair.draft, setup.head, ids, NEW)
    assert torch.equal(sequences, plain) and sum(s.drafted for s in stats.steps) > 0
    setup.head.save_pretrained(tmp_path / "head")
    output = plain[0, ids.shape[1]:]
    save_traces(tmp_path / "t.safetensors", [record_trace_by_decoding(setup.pair.draft, ids, output, 12, True, dataset,
                                                                      prompt_id)], costs)
    main(["replay", str(tmp_path / "t.safetensors"), "--head", str(tmp_path / "head"), "--methods", "pacer*",
          "--out", str(tmp_path / "r")])
    replayed = {r["method"] for r in json.loads((tmp_path / "r" / "replay.json").read_text())["rows"]}
    assert "pacer" in replayed and not any(name.startswith("pacer-window") or "vocab" in name for name in replayed)


def test_draft_vocab_methods_swap_in_their_head_and_give_the_targets_output(setup, capsys):
    """pacer-vocab-N (and with a window of 128): opt-in, the head's default rule with the draft's LM head over N
    tokens, built by the run (`reduced_head`) and swapped in for the call only; the target's greedy output. Asked
    with --draft-vocab (a draft already reduced), refused before anything loads."""
    from modeling_pacer.benchmarks.cli import main
    from modeling_pacer.benchmarks.methods import DRAFT_VOCABS
    from modeling_pacer.draft_vocab import kept_tokens, reduced_head

    costs = CostModel({n: 1.0 + 0.01 * n for n in range(1, 20)}, 0.3)
    methods = all_methods(head_config=setup.head.config, costs=costs)
    chosen = [methods[f"pacer-vocab-{n}"] for n in DRAFT_VOCABS] + [methods[f"pacer-window-128-vocab-{n}"] for n in DRAFT_VOCABS]
    assert all(m.draft_vocab in DRAFT_VOCABS and m.opt_in for m in chosen)
    assert chosen[-1].draft_window == 128 and chosen[0].draft_window == 0
    assert not any(m.draft_vocab for m in select_methods(None, methods))
    dataset, prompt_id, ids = setup.prompts[1]
    draft = setup.pair.draft
    with pytest.raises(ValueError, match="reduced LM head"):
        run_method(chosen[0], setup.pair.target, draft, setup.head, ids, NEW)
    plain = setup.pair.target.generate(ids, max_new_tokens=NEW, do_sample=False)
    own = draft.get_output_embeddings()
    method = dataclasses.replace(chosen[0], draft_head=reduced_head(draft, token_ids=torch.arange(0, VOCAB, 2)[:48]))
    seen = []
    hook = draft.register_forward_hook(lambda module, args, out: seen.append(kept_tokens(module)))
    try:
        sequences, stats = run_method(method, setup.pair.target, draft, setup.head, ids, NEW)
    finally:
        hook.remove()
    assert torch.equal(sequences, plain) and sum(s.drafted for s in stats.steps) > 0
    assert seen and set(seen) == {48}  # every draft forward ran the reduced head
    assert draft.get_output_embeddings() is own
    with pytest.raises(SystemExit):
        main(["run", "--draft-vocab", "64", "--methods", "target", "pacer-vocab-*", "--out", "unused"])
    assert "leave out --draft-vocab 64" in capsys.readouterr().err


def test_the_run_builds_each_reduced_head_once_with_its_own_costs(setup, tmp_path, monkeypatch):
    """`pacer-bench run` gives each pacer-*vocab-N method the draft's head over N tokens and this machine's costs
    measured with that head (what results.json's meta.method_costs records); the draft keeps its own head."""
    from modeling_pacer.benchmarks.cli import _reduced_vocab_heads
    from modeling_pacer.draft_vocab import ReducedVocabHead

    from conftest import word_tokenizer

    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "cache"))
    methods = all_methods(head_config=setup.head.config, costs=CostModel({n: 1.0 for n in range(1, 20)}, 0.3))
    chosen = [dataclasses.replace(methods[name], draft_vocab=48) for name in ("pacer-vocab-65536", "pacer-window-128-vocab-65536")]
    draft = setup.pair.draft
    own = draft.get_output_embeddings()
    pair = SimpleNamespace(target=setup.pair.target, draft=draft, tokenizer=word_tokenizer())
    _reduced_vocab_heads([methods["pacer"], *chosen], pair, setup.head, 4)
    assert isinstance(chosen[0].draft_head, ReducedVocabHead) and chosen[0].draft_head.token_ids.numel() == 48
    assert chosen[1].draft_head is chosen[0].draft_head and chosen[1].costs is chosen[0].costs  # built once
    assert chosen[0].costs is not methods["pacer"].costs and sorted(chosen[0].costs.target_forward) == [1, 2, 3, 4]
    assert draft.get_output_embeddings() is own and methods["pacer"].draft_head is None


def test_batch_throughput_runs_every_method_on_each_batch_and_checks_every_row(tmp_path):
    """pacer-bench batch's runner on tiny models (an exact target): every prompt alone first (the rows' reference),
    then at each batch size every method on each left-padded group, interleaved; pacer's methods give every row the
    target alone's output, the summary counts rows, tokens and seconds per batch size and pairs each method with
    target-packed per group."""
    from modeling_pacer import make_exact
    from modeling_pacer.benchmarks.batch import (DEFAULT_BATCH_METHODS, batch_table, left_padded, run_batches,
                                                 summarize_batches)
    from conftest import word_tokenizer

    target, draft = make_pair("llama", "llama", "noisy")
    make_exact(target)
    head = make_head(draft, max_draft_length=8, stopping_rule="throughput", throughput_estimate="draft")
    tokenizer = word_tokenizer()
    tokenizer.pad_token = "[0]"
    g = torch.Generator().manual_seed(3)
    prompts = [("toy", str(i), torch.randint(1, VOCAB, (1, 3 + 2 * i), generator=g)) for i in range(5)]
    ids, mask = left_padded([p for _, _, p in prompts[:2]], 0)
    assert ids.shape == (2, 5) and mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    pair = SimpleNamespace(target=target, draft=draft, tokenizer=tokenizer)
    records, references = run_batches(pair, head, prompts, [1, 2, 4], list(DEFAULT_BATCH_METHODS), 12)
    assert len(references) == 5 and all(len(r) == 12 for r in references.values())
    # groups: 5 of one, 3 of two (the last one row), 2 of four (the last one row); every method on each
    assert len(records) == (5 + 3 + 2) * 3
    for r in records:
        assert len(r.prompts) == len(r.new_tokens) == len(r.matches_target)
        if r.method != "target":
            assert all(r.matches_target), (r.method, r.batch_size, r.group)
    rows = summarize_batches([r.to_dict() for r in records])
    assert [(r["batch_size"], r["method"]) for r in rows] == [(b, m) for b in (1, 2, 4) for m in DEFAULT_BATCH_METHODS]
    for row in rows:
        assert row["sequences"] == 5 and row["new_tokens"] == 60 and row["tokens_per_second"] > 0
        assert ("vs_packed" in row) == (row["method"] != "target-packed")
    assert "| 4 | pacer | 5 |" in batch_table(rows)
    with pytest.raises(ValueError, match="unknown batch methods"):
        run_batches(pair, head, prompts, [2], ["vllm"], 4)
