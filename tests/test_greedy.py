"""Losslessness under greedy decoding: every policy, token for token equal to the target's own greedy
`generate`, on several architectures, prompts, lengths, block sizes and thresholds."""

import pytest
import torch

from modeling_pacer import SVIP, Confidence, ExpectedThroughput, FixedLength, Heuristic, Pacer, SpecDecPP
from modeling_pacer.costs import CostModel

from conftest import VOCAB, make_head, make_pair

PAIRS = [
    ("llama", "llama", "noisy"),
    ("llama", "llama", "same"),
    ("llama", "llama", "random"),
    ("qwen2", "qwen2", "noisy"),
    ("qwen2", "llama", "random"),
    ("gpt2", "gpt2", "noisy"),
]

POLICIES = {
    "fixed1": lambda: FixedLength(1),
    "fixed4": lambda: FixedLength(4),
    "heuristic": lambda: Heuristic(initial_gamma=3),
    "confidence": lambda: Confidence(threshold=0.3),
    "svip": lambda: SVIP(threshold=0.55),
    "specdec++": lambda: SpecDecPP(threshold=0.5, max_draft_length=8),
    "pacer-b1": lambda: Pacer(block_size=1, threshold=0.4, growth=1.05, max_draft_length=8),
    "pacer-b3": lambda: Pacer(block_size=3, threshold=0.5, growth=1.1, max_draft_length=12),
    "pacer-b5-lenient": lambda: Pacer(block_size=5, threshold=0.1, growth=1.0, max_draft_length=15),
    "pacer-strict": lambda: Pacer(block_size=2, threshold=0.95, growth=1.5, max_draft_length=16),
    "pacer-first-block": lambda: Pacer(block_size=3, threshold=0.6, growth=1.2, max_draft_length=8, first_block_size=2),
    # a flat verification curve: long drafts pay, so the rule really drafts
    "throughput-draft": lambda: ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 20)}, 0.05), max_draft_length=8),
    "throughput-head": lambda: ExpectedThroughput(CostModel({n: 1.0 + 0.05 * n for n in range(1, 20)}, 0.05, 0.01),
                                                  estimate="head", block_size=2, max_draft_length=12),
    # fitted to the accept/reject outcomes while decoding; the draft's and the head's estimates combined
    "throughput-calibrated": lambda: ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 20)}, 0.05),
                                                        calibration=1.0, max_draft_length=8),
    "throughput-both": lambda: ExpectedThroughput(CostModel({n: 1.0 + 0.05 * n for n in range(1, 20)}, 0.05, 0.01),
                                                  estimate="both", calibration=1.0, max_draft_length=12),
    # a target step costs little beside a draft forward: some steps draft nothing (a plain target step)
    "throughput-draft-nothing": lambda: ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 20)}, 0.6),
                                                           calibration=1.0, draft_nothing=True, probe_every=3,
                                                           max_draft_length=8),
}

PROMPT_LENGTHS = [1, 6, 19]
NEW_TOKENS = [1, 7, 33]


def _prompts(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (1, n), generator=g) for n in PROMPT_LENGTHS]


def _assert_greedy_identical(target, draft, head, policy_name):
    drafted = 0
    for ids in _prompts():
        for new in NEW_TOKENS:
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            out = target.generate(
                ids, assistant_model=draft, pacer_head=head, stopping_policy=POLICIES[policy_name](),
                do_sample=False, max_new_tokens=new, return_dict_in_generate=True,
            )
            assert out.sequences.tolist() == expected.tolist(), (policy_name, ids.shape, new)
            drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0  # the policy really drafted: this compared speculative decoding, not a plain loop


@pytest.mark.parametrize("pair", PAIRS, ids=["-".join(p) for p in PAIRS])
@pytest.mark.parametrize("policy_name", list(POLICIES))
def test_greedy_identical_to_target(pair, policy_name):
    target, draft = make_pair(*pair)
    _assert_greedy_identical(target, draft, make_head(draft, max_draft_length=16), policy_name)


@pytest.mark.parametrize("pair", [PAIRS[0], PAIRS[4]], ids=["-".join(p) for p in (PAIRS[0], PAIRS[4])])
@pytest.mark.parametrize("policy_name", ["pacer-b1", "pacer-b3", "throughput-head"])
def test_greedy_identical_with_draft_features_head(pair, policy_name):
    """A head that also reads the draft's token probabilities and entropies changes where drafting stops, never
    the output."""
    target, draft = make_pair(*pair)
    _assert_greedy_identical(target, draft, make_head(draft, max_draft_length=16, use_draft_features=True), policy_name)


def test_pacer_head_alone_uses_its_config():
    """`pacer_head=head` with no policy runs PACER with the head's (b, t0, rho, max length)."""
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, block_size=2, threshold=0.45, growth=1.2, max_draft_length=10)
    ids = _prompts()[1]
    out = target.generate(ids, assistant_model=draft, pacer_head=head, max_new_tokens=40, return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(ids, max_new_tokens=40).tolist()
    stats = out.pacer_stats
    assert "block_size=2" in stats.policy and "threshold=0.45" in stats.policy
    # drafts end on a block boundary unless the length cap or the budget ended them
    for step in stats.steps:
        if step.stop_reason == "head":
            assert step.drafted % 2 == 0
        assert step.drafted <= 10


def test_cost_aware_head_alone_uses_its_rule_and_this_machines_costs(tmp_path, monkeypatch):
    """A head whose config says stopping_rule="throughput" runs the cost-aware rule with no policy given: with
    the costs passed, or measured once on this machine and cached; `stopping_policy="pacer"` still picks the
    paper's block rule. Always the target's own output."""
    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "cache"))
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=10, stopping_rule="throughput")
    ids = _prompts()[1]
    expected = target.generate(ids, max_new_tokens=40).tolist()
    flat = CostModel({n: 1.0 for n in range(1, 12)}, 0.05, 0.01)
    for costs in (flat, None):
        out = target.generate(ids, assistant_model=draft, pacer_head=head, pacer_costs=costs, max_new_tokens=40,
                              return_dict_in_generate=True)
        assert out.sequences.tolist() == expected
        assert out.pacer_stats.policy.startswith("ExpectedThroughput(estimate='head'")
    assert list((tmp_path / "cache" / "costs").glob("*.json"))  # measured here once, kept for the next call
    out = target.generate(ids, assistant_model=draft, pacer_head=head, stopping_policy="pacer", max_new_tokens=40,
                          return_dict_in_generate=True)
    assert out.sequences.tolist() == expected and out.pacer_stats.policy.startswith("Pacer(")


def test_head_whose_rule_reads_the_draft_alone_is_not_run():
    """A head whose config says throughput_estimate="draft" (pacer-train's choice where the draft's probabilities
    replay faster than every rule reading the head) runs the cost-aware rule on the draft's probabilities: the
    head is never called, and the output is the target's own on every prompt."""
    target, draft = make_pair("llama", "llama", "noisy")
    head = make_head(draft, max_draft_length=10, stopping_rule="throughput", throughput_estimate="draft")
    flat = CostModel({n: 1.0 for n in range(1, 12)}, 0.05, 0.01)
    for ids in _prompts():
        expected = target.generate(ids, max_new_tokens=30).tolist()
        out = target.generate(ids, assistant_model=draft, pacer_head=head, pacer_costs=flat, max_new_tokens=30,
                              return_dict_in_generate=True)
        assert out.sequences.tolist() == expected
        assert out.pacer_stats.policy.startswith("ExpectedThroughput(estimate='draft'")
        assert out.pacer_stats.head_forwards == 0 and out.pacer_stats.draft_forwards > 0


def test_same_weights_draft_accepts_everything():
    target, draft = make_pair("llama", "llama", "same")
    ids = _prompts()[2]
    out = target.generate(ids, assistant_model=draft, stopping_policy=FixedLength(5), max_new_tokens=36,
                          return_dict_in_generate=True)
    stats = out.pacer_stats
    assert stats.acceptance_rate == 1.0
    # the prefill (the whole prompt, the first token from its last row, as plain decoding), then 5 verifications
    # of 5 + 1 tokens and one of 4 + 1 (the budget): 1 + 30 + 5 = 36 tokens, one target forward a step
    assert [(s.drafted, s.emitted, s.stop_reason) for s in stats.steps] == (
        [(0, 1, "prefill")] + [(5, 6, "max_draft_length")] * 5 + [(4, 5, "budget")])
    assert stats.target_forwards == len(stats.steps) == 7


def test_random_draft_is_rarely_accepted_yet_lossless():
    target, draft = make_pair("llama", "llama", "random")
    ids = _prompts()[1]
    out = target.generate(ids, assistant_model=draft, stopping_policy=FixedLength(3), max_new_tokens=30,
                          return_dict_in_generate=True)
    assert out.sequences.tolist() == target.generate(ids, max_new_tokens=30).tolist()
    assert out.pacer_stats.acceptance_rate < 0.3


@pytest.mark.parametrize("policy", [FixedLength(3), Pacer(block_size=2, threshold=0.4, max_draft_length=8)], ids=["fixed3", "pacer"])
def test_int8_draft_is_still_lossless(policy):
    """A dynamic-int8 draft changes what is proposed, never what is accepted."""
    from modeling_pacer.pairs import quantize_dynamic_int8

    target, draft = make_pair("llama", "llama", "noisy")
    draft = quantize_dynamic_int8(draft)
    head = make_head(draft, max_draft_length=16)
    for ids in _prompts(seed=3):
        expected = target.generate(ids, max_new_tokens=30)
        out = target.generate(ids, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                              max_new_tokens=30, return_dict_in_generate=True)
        assert out.sequences.tolist() == expected.tolist()
        assert out.pacer_stats.acceptance_rate > 0

