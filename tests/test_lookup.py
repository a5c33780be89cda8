"""Free drafts (`pacer_lookup`): tokens looked up in the sequence so far open each draft, under the rule's control.
The lookup itself; losslessness like every path (greedy: token for token the target's own output, on several pairs,
prompts, lengths, dtypes, rules and logits processors; sampling: a chi-square test against the target's exact
distribution, with the power to fail); the cost-aware rule counting looked-up tokens as free; refusals before work."""

import itertools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

import modeling_pacer.costs as costs_module
from modeling_pacer import SVIP, CostModel, DraftView, ExpectedThroughput, FixedLength, NgramLookup, make_exact

from conftest import VOCAB, make_head, make_pair
from test_sampling import _chi_square_p_value

COSTS = CostModel({n: 1.0 + 0.01 * n for n in range(1, 20)}, 0.3)  # verification nearly flat, a draft forward dear


def test_the_longest_most_recent_match_is_copied_on():
    lookup = NgramLookup(max_ngram=3, min_ngram=2, max_tokens=5)
    # "7 8" occurred twice; its most recent occurrence was followed by 1, 2; "6 7 8" (longer) once, followed by 9
    assert lookup.continuation([6, 7, 8, 9, 5, 7, 8, 1, 2, 6, 7, 8]) == ([9, 5, 7, 8, 1], 3)
    assert lookup.continuation([6, 7, 8, 9, 5, 7, 8, 1, 2, 4, 7, 8]) == ([1, 2, 4, 7, 8], 2)
    assert lookup.continuation([1, 2, 3, 4, 5]) == ([], 0)  # nothing repeats
    assert lookup.continuation([3, 9, 3]) == ([], 0)  # a single token is below min_ngram
    # a period shorter than the continuation goes on as it went
    assert NgramLookup(min_ngram=2, max_tokens=7).continuation([5, 1, 2, 1, 2]) == ([1, 2, 1, 2, 1, 2, 1], 2)
    # the index grows with the sequence, and another sequence is indexed afresh
    grown = NgramLookup(min_ngram=2, max_tokens=3)
    assert grown.continuation([4, 5, 6]) == ([], 0)
    assert grown.continuation([4, 5, 6, 9, 4, 5]) == ([6, 9, 4], 2)
    assert grown.continuation([1, 2, 1]) == ([], 0)
    with pytest.raises(ValueError, match="min_ngram"):
        NgramLookup(min_ngram=3, max_ngram=2)


def test_estimates_follow_the_outcomes():
    lookup = NgramLookup(min_ngram=2, max_ngram=4, decay=1.0)
    assert lookup.estimate(2) == lookup.draft_rate() == 0.75  # the prior
    lookup.update(match=2, looked_up=4, drafted=6, num_accepted=2)  # 2 of 3 looked-up tokens decided, none drafted
    assert lookup.estimate(2) == pytest.approx((2 + 3) / (3 + 4)) and lookup.draft_rate() == 0.75
    lookup.update(match=2, looked_up=2, drafted=5, num_accepted=3)  # both looked up accepted, 1 of 2 drafted
    assert lookup.estimate(2) == pytest.approx((4 + 3) / (5 + 4))
    assert lookup.draft_rate() == pytest.approx((1 + 3) / (2 + 4))
    assert lookup.estimate(4) == 0.75  # another match length: its own estimate
    assert lookup.worth_trying(4)  # not measured yet: tried
    lookup.update(match=4, looked_up=3, drafted=3, num_accepted=0)
    lookup.update(match=4, looked_up=3, drafted=3, num_accepted=0)
    assert not lookup.worth_trying(4)  # measured, and below the draft's rate


def test_the_cost_aware_rule_counts_looked_up_tokens_as_free():
    """After two looked-up tokens with more on offer, drafting on costs no draft forward: the rule goes on; with none
    left it would pay a draft forward for the next token and stops; drafted tokens it would stop on anyway."""
    rule = ExpectedThroughput(COSTS)
    probs, zeros = torch.full((2,), 0.75), torch.zeros(2)
    assert rule.stop_reason(DraftView(probs, zeros, None, free=2, free_ahead=8)) is None
    assert rule.stop_reason(DraftView(probs, zeros, None, free=2, free_ahead=0)) == "throughput"
    assert rule.stop_reason(DraftView(probs, zeros, None, free=0)) == "throughput"
    assert COSTS.step(4, 0, 3) == pytest.approx(COSTS.draft_forward + COSTS.target(5))


PAIRS = [("llama", "llama", "noisy"), ("llama", "llama", "random"), ("qwen2", "qwen2", "noisy")]
RULES = {
    "throughput": lambda: ExpectedThroughput(COSTS),
    "fixed3": lambda: FixedLength(3),
    "svip": lambda: SVIP(threshold=0.55),
}


def _prompts():
    g = torch.Generator().manual_seed(3)
    line = torch.randint(0, VOCAB, (1, 9), generator=g)
    return [torch.cat([line, line, line[:, :4]], dim=1),  # a repeated line: long matches
            torch.randint(0, VOCAB, (1, 12), generator=g),  # nothing to look up but what the output repeats
            torch.tensor([[5, 6, 5, 6, 5]])]  # a period of two


@pytest.mark.parametrize("pair", PAIRS, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_greedy_with_lookup_is_the_targets_output(pair, dtype):
    target, draft = make_pair(*pair)
    target, draft = make_exact(target.to(dtype)), draft.to(dtype)  # verification bitwise the steps, as load_pair makes it
    with torch.no_grad():  # confident models: outputs that repeat, so lookups are found and both accepted and rejected
        for model in (target, draft):
            model.lm_head.weight.mul_(8)
    free = accepted_free = 0
    for ids in _prompts():
        for new in (5, 40):
            plain = target.generate(ids, max_new_tokens=new, do_sample=False)
            for name, rule in RULES.items():
                out = target.generate(ids, assistant_model=draft, stopping_policy=rule(), pacer_lookup=True,
                                      max_new_tokens=new, return_dict_in_generate=True)
                assert torch.equal(out.sequences, plain), (name, new)
                free += sum(s.free for s in out.pacer_stats.steps)
                accepted_free += sum(min(s.free, s.accepted) for s in out.pacer_stats.steps)
    assert 0 < accepted_free < free  # looked-up tokens were proposed, accepted and rejected


def test_greedy_with_lookup_under_logits_processors_and_eos():
    target, draft = make_pair("llama", "llama", "noisy", eos=7)
    ids = _prompts()[0]
    for kwargs in (dict(repetition_penalty=1.3), dict(no_repeat_ngram_size=3), dict(min_new_tokens=10)):
        plain = target.generate(ids, max_new_tokens=30, do_sample=False, **kwargs)
        out = target.generate(ids, assistant_model=draft, stopping_policy=FixedLength(4), pacer_lookup=True,
                              max_new_tokens=30, **kwargs)
        assert torch.equal(out, plain), kwargs


def test_lookup_saves_draft_forwards_on_repeated_text(monkeypatch):
    """On a prompt that repeats, the default (no head, no rule named: the cost-aware rule, costs measured for the
    caller) drafts mostly by lookup: fewer draft forwards and target forwards than without it, the same output."""
    monkeypatch.setattr(costs_module, "host_costs", lambda *a, **k: COSTS)
    target, draft = make_pair("llama", "llama", "noisy")
    with torch.no_grad():
        for model in (target, draft):
            model.lm_head.weight.mul_(20)
    line = torch.arange(3, 18)[None]
    ids = torch.cat([line, line, line], dim=1)
    runs = {name: target.generate(ids, assistant_model=draft, max_new_tokens=60, return_dict_in_generate=True, **kw)
            for name, kw in (("lookup", dict(pacer_lookup=True)), ("draft", dict(stopping_policy="throughput")))}
    assert torch.equal(runs["lookup"].sequences, runs["draft"].sequences)
    stats = {name: out.pacer_stats for name, out in runs.items()}
    assert stats["lookup"].draft_forwards < stats["draft"].draft_forwards
    assert stats["lookup"].target_forwards < stats["draft"].target_forwards
    assert sum(s.free for s in stats["lookup"].steps) > 0 and sum(s.free for s in stats["draft"].steps) == 0


def test_lookup_refusals_come_before_any_work(monkeypatch):
    monkeypatch.setattr(costs_module, "host_costs", lambda *a, **k: pytest.fail("costs measured"))
    target, draft = make_pair("llama", "llama", "noisy")
    ids = torch.tensor([[1, 2, 3, 1, 2]])
    head = make_head(draft)
    for kwargs, message in [(dict(pacer_head=head, stopping_policy="pacer"), "reads the head"),
                            (dict(pacer_lookup={"max_ngram": 0}), "min_ngram"),
                            (dict(pacer_lookup="yes"), "pacer_lookup must be")]:
        kwargs = dict(dict(pacer_lookup=True, stopping_policy="fixed"), **kwargs)
        with pytest.raises(ValueError, match=message):
            target.generate(ids, assistant_model=draft, max_new_tokens=5, **kwargs)


V = 6
NEW = 3
RUNS = 2000
PROMPT = torch.tensor([[1, 4, 2, 5, 1, 4, 2, 5, 1, 4]])  # repeats: lookups are found at once
SETTINGS = dict(do_sample=True, temperature=0.8, top_k=4, max_new_tokens=NEW)


def _exact_distribution(model) -> dict[tuple[int, ...], float]:
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(4)])
    probs = {}
    with torch.no_grad():
        for seq in itertools.product(range(V), repeat=NEW):
            p = 1.0
            for i in range(NEW):
                ids = torch.cat([PROMPT, torch.tensor([seq[:i]], dtype=torch.long)], dim=1)
                p *= float(processors(ids, model(ids).logits[:, -1, :].float()).softmax(-1)[0, seq[i]])
            probs[seq] = p
    return probs


def test_sampling_with_lookup_is_the_targets_distribution():
    """Looked-up tokens are point-mass proposals: speculative sampling keeps the target's distribution exactly. The
    runs really used lookups (accepted and rejected); the same samples fail against the draft's distribution."""
    target, draft = make_pair("llama", "llama", "random", vocab=V)
    counts, free, accepted_free = {}, 0, 0
    for seed in range(RUNS):
        torch.manual_seed(seed)
        out = target.generate(PROMPT, assistant_model=draft, stopping_policy=FixedLength(3),
                              pacer_lookup={"min_ngram": 1, "max_tokens": 4}, return_dict_in_generate=True, **SETTINGS)
        outcome = tuple(out.sequences[0, PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        free += sum(s.free for s in out.pacer_stats.steps)
        accepted_free += sum(min(s.free, s.accepted) for s in out.pacer_stats.steps)
    assert 0 < accepted_free < free
    assert _chi_square_p_value(counts, _exact_distribution(target), RUNS) > 1e-3
    assert _chi_square_p_value(counts, _exact_distribution(draft), RUNS) < 1e-6


def test_lookup_agreement_counts_what_a_lookup_would_have_had_accepted():
    """`pacer-bench draft-agreement --lookup`'s count, by hand: prompt 1 2 3 4, output 1 2 3 9 1 2: after "1" (a
    match of 1) the lookup proposes 2 3 4 1 ... (2 and 3 right, then 9 against 4); after "1 2" it proposes 3 (right);
    after "1 2 3" 4 (wrong); at "9" nothing is found; after "9 1" the match is "1" again."""
    from modeling_pacer.benchmarks.agreement import lookup_agreement, summarize_lookups

    counts = lookup_agreement(torch.tensor([[1, 2, 3, 4]]), torch.tensor([1, 2, 3, 9, 1, 2]), cap=4)
    assert counts["positions"] == 6
    # positions: after 1 2 3 4 (no match: "4" is new), after ..4 1 (match "1": proposes 2 3 4 1; output 2 3 9: 2
    # right), after ..1 2 (match "1 2": 3 4 1 2; 3 right then 9), after ..1 2 3 (match 3: proposes 4: wrong), after
    # ..3 9 (no match), after ..9 1 (match "1": the most recent 1 is at position 4, followed by 2: right)
    assert counts["by_match"] == {"1": dict(lookups=2, first=2, tokens=3), "2": dict(lookups=1, first=1, tokens=1),
                                  "3": dict(lookups=1, first=0, tokens=0)}
    rows = summarize_lookups([dict(dataset="d", prompt_id="0", **counts)])
    first = {r["match"]: r for r in rows if r["dataset"] == "all"}
    assert first[1]["found"] == pytest.approx(2 / 6) and first[1]["run"] == 1.5 and first[3]["first"] == 0.0
