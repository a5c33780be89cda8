"""This machine's cost curve: measured once per host, models and dtype, cached, read back; and the
cost-aware stopping rule that uses it."""

import json

import pytest
import torch

from modeling_pacer import costs as costs_module
from modeling_pacer.costs import CostModel, describe_model, host_costs, interleaved_medians
from modeling_pacer.custom_generate.policies import DraftView, ExpectedThroughput, OnlineCalibration, make_policy

from conftest import make_head, make_model, make_pair


def _counting(monkeypatch):
    calls = []
    real = costs_module.measure_costs

    def measure(*args, **kwargs):
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(costs_module, "measure_costs", measure)
    return calls


def test_host_costs_are_measured_once_then_read_from_the_cache(tmp_path, monkeypatch):
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=2, block_size=1)  # shorter than the curve: its call is timed on its longest draft
    calls = _counting(monkeypatch)
    first = host_costs(target, draft, head, max_tokens=4, prefix_tokens=16, repeats=1, folder=tmp_path)
    assert len(calls) == 1 and sorted(first.target_forward) == [1, 2, 3, 4]
    assert first.draft_forward > 0 and first.head_call > 0
    (saved,) = tmp_path.glob("*.json")
    record = json.loads(saved.read_text())
    assert record["target"]["dtype"] == "torch.float32" and record["host"]["threads"] == torch.get_num_threads()
    again = host_costs(target, draft, head, max_tokens=4, prefix_tokens=16, repeats=1, folder=tmp_path)
    assert len(calls) == 1 and again.to_dict() == CostModel.from_dict(first.to_dict()).to_dict()
    host_costs(target, draft, head, max_tokens=4, prefix_tokens=16, repeats=1, folder=tmp_path, refresh=True)
    assert len(calls) == 2


def test_host_costs_key_changes_with_dtype_threads_and_age(tmp_path, monkeypatch):
    target, draft = make_pair("llama", "llama", "noisy")
    calls = _counting(monkeypatch)
    kwargs = dict(max_tokens=2, prefix_tokens=8, repeats=1, folder=tmp_path)
    host_costs(target, draft, **kwargs)
    host_costs(target.to(torch.bfloat16), draft, **kwargs)  # another dtype: another curve
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        host_costs(target, draft, **kwargs)  # another thread count: another curve
    finally:
        torch.set_num_threads(threads)
    assert len(calls) == 3
    host_costs(target, draft, **kwargs, max_age_days=0)  # too old: measured again
    assert len(calls) == 4
    for path in tmp_path.glob("*.json"):
        path.write_text("not json")
    host_costs(target, draft, **kwargs)  # unreadable: measured again, not a crash
    assert len(calls) == 5


def test_host_costs_key_changes_with_the_kernels_amx_setting(tmp_path, monkeypatch):
    """A curve measured with the AMX tiles (the w4a8 kernels' path past a row count) is not read for VNNI alone."""
    from modeling_pacer.cpu import kernels

    target, draft = make_pair("llama", "llama", "noisy")
    calls = _counting(monkeypatch)
    kwargs = dict(max_tokens=2, prefix_tokens=8, repeats=1, folder=tmp_path)
    settings = iter([9, 0, 9])
    monkeypatch.setattr(kernels, "amx_setting", lambda: next(settings))
    host_costs(target, draft, **kwargs)
    host_costs(target, draft, **kwargs)  # VNNI alone: another curve
    host_costs(target, draft, **kwargs)  # the tiles again: the first curve, from the cache
    assert len(calls) == 2 and len(list(tmp_path.glob("*.json"))) == 2


def test_describe_model_sees_exactness_and_quantization():
    from modeling_pacer import make_exact
    from modeling_pacer.pairs import quantize_dynamic_int8

    target, draft = make_pair("llama", "llama", "noisy")
    plain = describe_model(target)
    assert describe_model(make_exact(target)) != plain
    assert describe_model(quantize_dynamic_int8(draft))["linears"] != plain["linears"]


# --------------------------------------------------------------------------------------------------
# the cost-aware rule
# --------------------------------------------------------------------------------------------------
def _view(probs, acceptance=None):
    probs = torch.tensor(probs)
    return DraftView(probs, torch.zeros_like(probs), (lambda: torch.tensor(acceptance)) if acceptance else None)


def test_throughput_rule_drafts_on_while_longer_drafts_pay():
    flat = CostModel({n: 1.0 for n in range(1, 20)}, 0.05)
    steep = CostModel({n: float(n) for n in range(1, 20)}, 0.05)
    rule = ExpectedThroughput(flat, max_draft_length=8)
    assert rule.stop_reason(_view([0.9])) is None  # verification is free: a likely token is worth drafting
    assert rule.stop_reason(_view([0.9, 0.9, 0.05])) == "throughput"  # a likely miss: nothing after it pays
    # every verified token costs a whole forward: no draft ever pays
    assert ExpectedThroughput(steep, max_draft_length=8).stop_reason(_view([0.99])) == "throughput"
    # at the length cap nothing longer is reachable
    assert ExpectedThroughput(flat, max_draft_length=2).stop_reason(_view([0.99, 0.99])) == "throughput"


def test_throughput_rule_looks_past_a_stair_of_the_cost_curve():
    # 1-3 tokens cost one forward, 4-9 two: after 3 drafts (4 tokens to verify) the next stair has been paid
    stairs = CostModel({n: 1.0 if n <= 3 else 2.0 for n in range(1, 20)}, 0.01)
    rule = ExpectedThroughput(stairs, max_draft_length=8)
    assert rule.stop_reason(_view([0.97, 0.97])) is None  # 3 tokens: the stair ahead pays off further on
    assert rule.stop_reason(_view([0.6, 0.6])) == "throughput"  # unlikely: stop before the stair


def test_throughput_rule_with_the_head_reads_its_cumulative_predictions_blockwise():
    flat = CostModel({n: 1.0 for n in range(1, 20)}, 0.05, 0.001)
    rule = ExpectedThroughput(flat, estimate="head", block_size=2, max_draft_length=8)
    assert rule.needs_head
    assert rule.stop_reason(_view([0.99], [0.9])) is None  # not a block boundary: the head is not read
    assert rule.stop_reason(_view([0.99, 0.99], [0.9, 0.85])) is None
    assert rule.stop_reason(_view([0.99, 0.99], [0.9, 0.02])) == "throughput"  # the draft's own probability is ignored


def test_throughput_rule_refuses_bad_settings():
    with pytest.raises(ValueError, match="calibration"):
        ExpectedThroughput(CostModel({1: 1.0}, 0.1), estimate="both")
    with pytest.raises(ValueError, match="probe_every"):
        ExpectedThroughput(CostModel({1: 1.0}, 0.1), probe_every=0)
    with pytest.raises(ValueError, match="strength"):
        ExpectedThroughput(CostModel({1: 1.0}, 0.1), calibration=0.0)
    with pytest.raises(ValueError, match="host_costs"):
        ExpectedThroughput()
    with pytest.raises(ValueError, match="host_costs"):
        make_policy("throughput")
    flat = CostModel({1: 1.0}, 0.1)
    with pytest.raises(ValueError, match="estimate"):
        ExpectedThroughput(flat, estimate="oracle")
    with pytest.raises(ValueError, match="block_size"):
        ExpectedThroughput(flat, block_size=0)


def test_calibration_learns_how_far_off_an_estimate_is():
    """Outcomes drawn from sigmoid(2 x - 1) for estimate logits x: the online fit finds (bias, slope) = (-1, 2)."""
    g = torch.Generator().manual_seed(0)
    fit = OnlineCalibration(1, strength=4.0)
    assert fit.probability(torch.tensor([[0.0]])).item() == pytest.approx(0.5)  # the prior: the estimate as is
    for _ in range(1500):
        x = torch.randn(4, 1, generator=g) * 2
        accept = torch.rand(4, generator=g) < torch.sigmoid(2 * x[:, 0] - 1)
        fit.observe(x, int(accept.int().cumprod(0).sum()))  # accepted up to the first rejection, as in decoding
    assert fit.w.tolist() == pytest.approx([-1.0, 2.0], abs=0.15)
    fit.reset()
    assert fit.w.tolist() == [0.0, 1.0] and fit.observed == 0


def test_calibrated_rule_drafts_longer_where_the_draft_is_underconfident():
    flat = CostModel({n: 1.0 + 0.2 * n for n in range(1, 20)}, 0.05)
    raw = ExpectedThroughput(flat, max_draft_length=8)
    calibrated = ExpectedThroughput(flat, calibration=4.0, max_draft_length=8)
    view = _view([0.5, 0.5])
    assert raw.stop_reason(view) == "throughput"
    calibrated.reset()
    for _ in range(30):  # every draft of 50%-probable tokens was accepted whole
        calibrated.begin_step()
        calibrated.update(_view([0.5] * 4), 4)
    assert calibrated.stop_reason(view) is None
    assert "calibration=4.0" in repr(calibrated)


def test_throughput_rule_drafts_nothing_when_no_draft_pays():
    # a draft forward costs 60% of a target step and verification is flat: only well-accepted drafts pay
    costs = CostModel({n: 1.0 for n in range(1, 20)}, 0.6)
    rule = ExpectedThroughput(costs, draft_nothing=True, probe_every=3, max_draft_length=8)
    rule.reset()
    assert rule.begin_step() == 8  # nothing seen yet: draft
    for _ in range(5):
        rule.update(_view([0.9, 0.9]), 0)  # every first token rejected
    caps = []
    for _ in range(6):
        caps.append(rule.begin_step())
        if caps[-1]:
            rule.update(_view([0.9]), 0)
        else:
            rule.update(None, 0)
    assert caps == [0, 0, 8, 0, 0, 8]  # a probe every third step keeps measuring
    rule.reset()
    for _ in range(5):
        rule.begin_step()
        rule.update(_view([0.9, 0.9, 0.9]), 3)  # accepted: drafting pays again
    assert rule.begin_step() == 8
    assert ExpectedThroughput(costs, max_draft_length=8).begin_step() == 8  # off by default


def test_cost_rounds_interleave_so_a_burst_of_load_does_not_make_a_stair():
    """A burst of load that slows four calls in a row: timed in rounds it costs one sample of several
    functions (dropped by the median); timed one function at a time it would have taken all of one's."""
    now, calls = [0.0], [0]

    def clock():
        return now[0]

    def work(seconds):
        def run():
            calls[0] += 1
            now[0] += seconds * (10.0 if 9 <= calls[0] <= 12 else 1.0)  # calls 9-12 run under load
        return run

    medians = interleaved_medians([work(1.0), work(2.0), work(3.0), work(4.0)], repeats=5, clock=clock)
    assert medians == [1.0, 2.0, 3.0, 4.0]
    assert calls[0] == 4 * 6  # one warm-up round, excluded


def test_a_curve_the_run_contradicts_is_dropped(tmp_path):
    """curve_disagrees judges observed against predicted target seconds (1.3x either way by default);
    forget_costs removes the cached curve so the next host_costs measures it again."""
    from modeling_pacer.costs import curve_disagrees, forget_costs

    curve = CostModel({1: 0.1, 2: 0.1, 3: 0.12}, 0.03)
    assert curve_disagrees(curve, [1, 2], 0.22) is None  # predicted 0.1 + 0.12
    assert curve_disagrees(curve, [1, 2], 0.40) == pytest.approx(0.40 / 0.22)
    assert curve_disagrees(curve, [1, 2], 0.10) == pytest.approx(0.10 / 0.22)
    assert curve_disagrees(curve, [1, 2], 0.40, limit=2.0) is None
    assert curve_disagrees(curve, [], 1.0) is None
    target, draft = make_pair("llama", "llama", "noisy")
    host_costs(target, draft, max_tokens=3, repeats=1, folder=tmp_path)
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert forget_costs(target, draft, max_tokens=3, folder=tmp_path)
    assert not list(tmp_path.glob("*.json")) and not forget_costs(target, draft, max_tokens=3, folder=tmp_path)


def test_weight_bytes_counts_what_a_forward_reads():
    """Linear layers and norms, packed buffers included; not the embedding table, except where the LM head is
    tied to it (then it is read in full, once)."""
    from modeling_pacer.costs import weight_bytes
    from modeling_pacer.cpu.quantization import quantize_linears

    for tie in (False, True):
        model = make_model("llama", seed=0, hidden=64)
        if tie:
            model.lm_head.weight = model.get_input_embeddings().weight
        linear = sum(m.weight.numel() * 4 + (m.bias.numel() * 4 if m.bias is not None else 0)
                     for m in model.modules() if isinstance(m, torch.nn.Linear))
        norms = sum(p.numel() * 4 for n, p in model.named_parameters() if "norm" in n)
        buffers = sum(b.numel() * b.element_size() for b in model.buffers())  # rotary frequencies
        assert weight_bytes(model) == linear + norms + buffers, tie
    before = weight_bytes(model)
    quantize_linears(model.to(torch.bfloat16), "int4")  # packed 4-bit codes (bf16 scales): fewer bytes
    assert weight_bytes(model) < before / 3


def test_a_fresh_curve_measured_under_load_is_measured_again(tmp_path, monkeypatch):
    """host_costs(check=True) times the target's and the draft's steps once more after measuring a curve: when
    either is more than STALE_RATIO off (the machine was busy during the measurement), it warns and measures the
    curve again, and caches the second; when both agree, the first curve stands. measure_costs is replaced by a
    scripted sequence, so the test does not depend on the machine's load."""
    target, draft = make_pair("llama", "llama", "noisy")
    busy = CostModel({1: 0.104, 2: 0.106, 3: 0.117}, 0.083)  # what a run measured under load on 2026-12-03
    quiet = CostModel({1: 0.074, 2: 0.080, 3: 0.083}, 0.033)
    script = [busy, quiet, quiet]  # the curve, the recheck, the curve measured again
    calls = []

    def measure(*args, **kwargs):
        calls.append(args[4])  # max_tokens: the curve's, or 1 for the recheck
        return script[len(calls) - 1]

    monkeypatch.setattr(costs_module, "measure_costs", measure)
    with pytest.warns(UserWarning, match="the machine was busy"):
        got = host_costs(target, draft, max_tokens=3, repeats=1, folder=tmp_path, check=True)
    assert calls == [3, 1, 3] and got.to_dict() == quiet.to_dict()
    (saved,) = tmp_path.glob("*.json")
    assert CostModel.from_dict(json.loads(saved.read_text())["costs"]).to_dict() == quiet.to_dict()

    script[:], calls[:] = [quiet, quiet], []  # a quiet machine: the recheck agrees, the curve stands
    got = host_costs(target, draft, max_tokens=3, repeats=1, folder=tmp_path, refresh=True, check=True)
    assert calls == [3, 1] and got.to_dict() == quiet.to_dict()


def test_a_curve_reads_between_and_past_its_measured_sizes():
    """A batch's curve measures some sizes: between two it is linear, past the last proportional, and the draft's
    step of b sequences reads its own points (one sequence: draft_forward); both survive a JSON round trip."""
    costs = CostModel({1: 1.0, 2: 1.2, 4: 2.0, 8: 3.0}, 0.5, 0.0, {2: 0.6, 4: 1.0})
    assert costs.target(3) == pytest.approx(1.6) and costs.target(6) == pytest.approx(2.5)
    assert costs.target(16) == pytest.approx(6.0) and costs.target(2) == 1.2
    assert costs.draft(1) == 0.5 and costs.draft(3) == pytest.approx(0.8) and costs.draft(8) == pytest.approx(2.0)
    again = CostModel.from_dict(json.loads(json.dumps(costs.to_dict())))
    assert again == costs
    assert CostModel.from_dict(json.loads(json.dumps(CostModel({1: 1.0}, 0.5).to_dict()))).draft_rows == {}


def test_a_batch_step_is_priced_by_its_rows():
    """BatchCosts: the step as it stands costs the draft forwards of the rows at their lengths (b rows: draft(b)) and
    the verification of every active row's k + 1 rows; a row pricing a longer draft adds its verification rows and its
    share of each draft forward it adds, draft(n) / n with the n rows still drafting then; a row sees the others'
    tokens as they reported them; ended rows count for nothing."""
    from modeling_pacer.custom_generate.costs import BatchCosts

    costs = CostModel({n: float(n) for n in range(1, 40)}, 0.5, 0.1, {2: 0.7, 3: 0.9})
    batch = BatchCosts(costs, 3)
    assert batch.rows[0].step(0) == pytest.approx(3.0)  # three plain rows: 3 verification rows, no draft forward
    batch.rows[1].report(2, 1.5)
    batch.rows[2].report(1, 1.2, free=1)  # its one token looked up: no draft forward
    # now: two forwards of row 1 alone (0.5 each), 1 + 3 + 2 verification rows; row 0 at 3 adds 3 rows and its share
    # of three forwards with both others still drafting (0.9 / 3 each)
    assert batch.rows[0].step(3) == pytest.approx(1.0 + 6.0 + 3.0 + 0.9)
    assert batch.rows[0].tokens_besides == pytest.approx(2.7)
    batch.rows[2].stopped()  # row 2 drafts no more: row 0 shares with row 1 alone
    assert batch.rows[0].step(3) == pytest.approx(1.0 + 6.0 + 3.0 + 3 * 0.35)
    batch.finish(1)  # row 1 ended: row 0 drafts alone, beside row 2's two verification rows
    assert batch.rows[0].step(3) == pytest.approx(3.0 + 3.0 + 3 * 0.5) and batch.rows[0].tokens_besides == pytest.approx(1.2)
    batch.rows[0].report(3, 2.0, head_calls=2)
    assert batch.rows[2].step(1, free=1) == pytest.approx(3 * 0.5 + 6.0 + 2 * 0.1)  # no longer than it is: as it stands
    batch.begin()  # the next step: nothing drafted, every active row may draft
    assert batch.rows[0].step(0) == pytest.approx(2.0) and batch.alive == [True, False, True]


def test_the_cost_aware_rule_drafts_less_as_a_batchs_rows_grow_dear():
    """A batch of 4 with the target's own weights as the draft (every token accepted): where verification costs the
    same for any number of rows each row drafts long; where every row costs as much as a whole call, drafting loses
    and the rows draft nothing (but for the probes that keep measuring); every row stays its own output either way."""
    from modeling_pacer import make_exact

    target, draft = make_pair("llama", "llama", "same")
    target = make_exact(target)
    ids = torch.randint(1, 97, (4, 6), generator=torch.Generator().manual_seed(1))
    drafted = {}
    for name, curve in (("flat", {n: 1.0 for n in range(1, 80)}), ("steep", {n: float(n) for n in range(1, 80)})):
        costs = CostModel(curve, 0.05)
        # calibrated: the tiny draft's probabilities are low, its tokens always right; the fit learns that
        rule = ExpectedThroughput(costs, max_draft_length=8, calibration=1.0)
        out = target.generate(ids, assistant_model=draft, stopping_policy=rule,
                              max_new_tokens=30, pad_token_id=0, return_dict_in_generate=True)
        steps = [s for s in out.pacer_stats.steps if s.stop_reason != "prefill"]
        drafted[name] = sum(s.drafted for s in steps) / len(steps)
        for row in range(4):
            assert out.sequences[row].tolist() == target.generate(ids[row:row + 1], max_new_tokens=30,
                                                                  do_sample=False)[0].tolist()
    assert drafted["flat"] > 4 and drafted["steep"] < 0.5, drafted


def test_a_batchs_curve_measures_its_calls_sizes(tmp_path):
    """host_costs(rows=3): the target at every size to max_tokens and more up to 3 * max_tokens, the draft's step of
    one token for 2 and 3 sequences packed; cached apart from the one-sequence curve."""
    from modeling_pacer.custom_generate.costs import batch_sizes

    target, draft = make_pair("llama", "llama", "noisy")
    assert batch_sizes(4, 1) == [1, 2, 3, 4] and batch_sizes(4, 3) == [1, 2, 3, 4, 5, 6, 8, 10, 12]
    one = host_costs(target, draft, None, max_tokens=4, prefix_tokens=16, repeats=1, folder=tmp_path)
    three = host_costs(target, draft, None, max_tokens=4, prefix_tokens=16, repeats=1, folder=tmp_path, rows=3)
    assert sorted(one.target_forward) == [1, 2, 3, 4] and not one.draft_rows
    assert sorted(three.target_forward) == batch_sizes(4, 3) and sorted(three.draft_rows) == [2, 3]
    assert all(v > 0 for v in three.draft_rows.values()) and len(list(tmp_path.glob("*.json"))) == 2
