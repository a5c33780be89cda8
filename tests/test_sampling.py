"""Losslessness under sampling: the distribution of PACER's output is exactly the target's.

On a 6-token vocabulary the exact target distribution of the first three new tokens (216 outcomes)
is enumerated from the target itself; many seeded PACER runs are then compared with it by a
chi-square test. The same samples compared with the *draft's* distribution must fail the test, which
shows the test has the power to see a wrong sampler.
"""

import itertools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from modeling_pacer import ExpectedThroughput, FixedLength, Pacer
from modeling_pacer.costs import CostModel

from conftest import make_head, make_pair

V = 6
NEW = 3
RUNS = 2000
PROMPT = torch.tensor([[1, 4, 2, 5]])
SETTINGS = dict(do_sample=True, temperature=0.8, top_k=4, max_new_tokens=NEW)


def _exact_distribution(model, top_p: float | None = None) -> dict[tuple[int, ...], float]:
    """P(t1, t2, t3 | PROMPT) under `model` with the same temperature and top-k as SETTINGS (then `top_p`, as
    generate orders them)."""
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(4)])
    if top_p is not None:
        processors.append(TopPLogitsWarper(top_p))
    probs: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=NEW):
            p = 1.0
            for i in range(NEW):
                ids = torch.cat([PROMPT, torch.tensor([seq[:i]], dtype=torch.long)], dim=1)
                scores = processors(ids, model(ids).logits[:, -1, :].float())
                p *= float(scores.softmax(-1)[0, seq[i]])
            probs[seq] = p
    return probs


def _chi_square_p_value(counts: dict, expected_probs: dict, n: int) -> float:
    """Pearson's chi-square goodness of fit; outcomes expected fewer than 5 times are pooled."""
    observed, expected, pool_o, pool_e = [], [], 0.0, 0.0
    for outcome, p in expected_probs.items():
        o = counts.get(outcome, 0)
        if p * n >= 5:
            observed.append(o)
            expected.append(p * n)
        else:
            pool_o += o
            pool_e += p * n
    if pool_e > 0:
        observed.append(pool_o)
        expected.append(max(pool_e, 1e-9))
    # samples outside the expected support count fully against the fit
    outside = n - sum(counts.get(k, 0) for k in expected_probs)
    observed[-1] += outside
    o, e = torch.tensor(observed, dtype=torch.float64), torch.tensor(expected, dtype=torch.float64)
    statistic = float(((o - e) ** 2 / e).sum())
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2)))


@pytest.fixture(scope="module")
def models():
    target, draft = make_pair("llama", "llama", "random", vocab=V)
    return target, draft, _exact_distribution(target), _exact_distribution(draft)


POLICIES = {
    "pacer": lambda: Pacer(block_size=1, threshold=0.3, growth=1.2, max_draft_length=4),
    "fixed3": lambda: FixedLength(3),
    # the cost-aware rule fitted online to the outcomes it sees (head and draft combined), drafting nothing
    # where drafting does not pay: its choices depend on earlier accepts/rejects, never on what is next
    "throughput-calibrated": lambda: ExpectedThroughput(CostModel({n: 1.0 + 0.1 * n for n in range(1, 9)}, 0.2, 0.01),
                                                        estimate="both", calibration=1.0, draft_nothing=True,
                                                        probe_every=2, max_draft_length=4),
}


def sample_outcomes(target, draft, head, make_policy, **settings) -> tuple[dict[tuple[int, ...], int], int, int]:
    """RUNS seeded PACER runs under SETTINGS (updated by `settings`): `(count of each 3-token outcome, tokens drafted,
    tokens accepted)`."""
    counts: dict[tuple[int, ...], int] = {}
    drafted = accepted = 0
    for seed in range(RUNS):
        torch.manual_seed(seed)
        out = target.generate(PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=make_policy(),
                              return_dict_in_generate=True, **{**SETTINGS, **settings})
        outcome = tuple(out.sequences[0, PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        drafted += sum(s.drafted for s in out.pacer_stats.steps)
        accepted += sum(s.accepted for s in out.pacer_stats.steps)
    return counts, drafted, accepted


@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_sampling_distribution_is_the_targets(models, policy_name):
    target, draft, target_probs, draft_probs = models
    counts, drafted, accepted = sample_outcomes(target, draft, make_head(draft, max_draft_length=8), POLICIES[policy_name])
    # the runs really exercised speculative sampling: drafts were both accepted and rejected
    assert 0 < accepted < drafted
    assert _chi_square_p_value(counts, target_probs, RUNS) > 1e-3
    # power: the same samples are clearly not from the draft's distribution
    assert _chi_square_p_value(counts, draft_probs, RUNS) < 1e-6


def test_sampling_with_top_p_is_the_targets(models):
    """top-p goes through pacer's shortcut of transformers' warper (processing.py) on every drafted and verified row;
    the outcomes still follow the target's distribution with top-p, and clearly not the one without it."""
    target, draft, without_top_p, _ = models
    counts, drafted, accepted = sample_outcomes(target, draft, make_head(draft, max_draft_length=8), POLICIES["pacer"],
                                                top_p=0.6)
    assert 0 < accepted < drafted
    assert _chi_square_p_value(counts, _exact_distribution(target, top_p=0.6), RUNS) > 1e-3
    assert _chi_square_p_value(counts, without_top_p, RUNS) < 1e-6


def test_sampling_without_draft_help_matches_plain_sampling(models):
    """Sanity of the oracle itself: transformers' own sampling passes the same test."""
    target, _, target_probs, _ = models
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(RUNS):
        torch.manual_seed(seed)
        outcome = tuple(target.generate(PROMPT, **SETTINGS)[0, PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert _chi_square_p_value(counts, target_probs, RUNS) > 1e-3


def test_head_default_rule_for_sampling_is_the_one_its_config_names(models):
    """A head whose greedy default reads the draft alone (cost-aware) and whose sampling default is its block rule:
    `generate(do_sample=True)` runs the block rule (no cost curve needed), greedy runs the cost-aware rule."""
    from modeling_pacer.costs import CostModel

    target, draft, _, _ = models
    head = make_head(draft, max_draft_length=8, block_size=2, threshold=0.3, stopping_rule="throughput",
                     throughput_estimate="draft", sampling_stopping_rule="blocks")
    torch.manual_seed(0)
    sampled = target.generate(PROMPT, assistant_model=draft, pacer_head=head, return_dict_in_generate=True, **SETTINGS)
    assert sampled.pacer_stats.policy.startswith("Pacer(") and sampled.pacer_policy.block_size == 2
    costs = CostModel({n: 1.0 + 0.1 * n for n in range(1, 10)}, 0.2, 0.01)
    greedy = target.generate(PROMPT, assistant_model=draft, pacer_head=head, pacer_costs=costs, max_new_tokens=NEW,
                             return_dict_in_generate=True)
    assert greedy.pacer_stats.policy.startswith("ExpectedThroughput(estimate='draft'")


def test_the_sampler_draws_each_token_at_its_probability_and_never_one_of_probability_zero():
    """pacer's one-sample draw (the inverse of the cumulative sum at one uniform number): counts fit the
    probabilities (unnormalised, as a row of processed scores' softmax may be to rounding), tokens of probability
    0 are never drawn, and the same counts do not fit another distribution (the test's power)."""
    from modeling_pacer.custom_generate.generate import sample

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.2, 0.3, 0.0]]) * 3.0
    torch.manual_seed(0)
    draws = [int(sample(probs)) for _ in range(RUNS)]
    counts = {(t,): draws.count(t) for t in set(draws)}
    assert set(draws) <= {1, 3, 4}
    assert _chi_square_p_value(counts, {(1,): 0.5, (3,): 0.2, (4,): 0.3}, RUNS) > 1e-3
    assert _chi_square_p_value(counts, {(1,): 0.4, (3,): 0.3, (4,): 0.3}, RUNS) < 1e-6


def test_the_sampler_draws_again_where_the_uniform_number_reaches_the_total(monkeypatch):
    """u = r x total can round up to the total (r < 1 by a hair): past every interval, where the last token (here of
    probability 0) would be drawn; the sampler draws again instead."""
    from modeling_pacer.custom_generate.generate import sample

    real_rand, calls = torch.rand, []

    def rand(*args, **kwargs):
        calls.append(1)
        return real_rand(*args, **kwargs) * 0 + 1.0 if len(calls) == 1 else real_rand(*args, **kwargs)

    monkeypatch.setattr(torch, "rand", rand)
    token = sample(torch.tensor([[0.25, 0.75, 0.0]]))
    assert len(calls) == 2 and int(token) in (0, 1)


def test_the_sampler_refuses_probabilities_that_sum_to_zero():
    """Nothing to draw from: a clear error, not an endless search past the last token."""
    from modeling_pacer.custom_generate.generate import sample

    with pytest.raises(ValueError, match="sum to 0"):
        sample(torch.zeros(1, 4))
