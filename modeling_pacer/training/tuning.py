"""Choosing PACER's stopping rule (block size b, threshold t0, growth rho, first block m) on held-out traces.

Every candidate is replayed (`benchmarks.traces.replay`) on greedy traces of prompts the head was not
trained on, with the pair's measured cost model; the fastest becomes the head's default.
"""

import itertools
from dataclasses import dataclass

from ..replay import CostModel, Trace, head_acceptance, oracle, replay
from ..custom_generate.policies import ExpectedThroughput, FixedLength, Pacer

BLOCK_SIZES = (1, 2, 3, 4, 5)
# t0 = 1.0 stops at the first check unless the head is certain (p = 1.0 in float32): with the block and
# first-block sizes below, the grid holds the fixed draft lengths 1-5, so the tuned rule is not worse
# than those on the tuning traces, but for the head's own calls (one per step)
THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)
GROWTHS = (1.0, 1.05, 1.1, 1.2, 1.35, 1.5)
FIRST_BLOCK_SIZES = (0, 1, 2, 3, 4)  # 0: equal to the block size (the paper's rule)


@dataclass
class Candidate:
    block_size: int
    threshold: float
    growth: float
    first_block_size: int
    speedup: float  # replayed, over the target alone, on all traces together


def replayed_speedup(policy_factory, traces: list[Trace], costs: CostModel, acceptance) -> float:
    seconds = alone = 0.0
    for trace, accept in zip(traces, acceptance):
        result = replay(policy_factory(), trace, costs, acceptance=accept)
        seconds += result.seconds
        alone += result.target_alone_seconds
    return alone / seconds


def tune_pacer(head, traces: list[Trace], costs: CostModel, max_draft_length: int, block_sizes=BLOCK_SIZES,
               thresholds=THRESHOLDS, growths=GROWTHS, first_block_sizes=FIRST_BLOCK_SIZES) -> list[Candidate]:
    """Every (b, t0, rho, m) of the grid, fastest first (ties: the earlier in grid order)."""
    acceptance = [head_acceptance(head, t) for t in traces]  # the head's predictions do not depend on the rule
    candidates = []
    for m, b, t0, rho in itertools.product(first_block_sizes, block_sizes, thresholds, growths):
        if b > max_draft_length or m > max_draft_length or m == b:  # m == b is the same rule as m = 0
            continue
        speedup = replayed_speedup(lambda: Pacer(b, t0, rho, max_draft_length, m), traces, costs, acceptance)
        candidates.append(Candidate(b, t0, rho, m, speedup))
    return sorted(candidates, key=lambda c: -c.speedup)


def best_fixed_length(traces: list[Trace], costs: CostModel, max_draft_length: int, longest: int = 8) -> tuple[int, float]:
    """The reference without a head: the fastest fixed draft length (1..`longest`) on the same traces."""
    runs = {g: replayed_speedup(lambda: FixedLength(g), traces, costs, [None] * len(traces))
            for g in range(1, min(longest, max_draft_length) + 1)}
    g = max(runs, key=runs.get)
    return g, runs[g]


def oracle_speedup(traces: list[Trace], costs: CostModel, max_draft: int) -> float:
    results = [oracle(t, costs, max_draft) for t in traces]
    return sum(r.target_alone_seconds for r in results) / sum(r.seconds for r in results)


def rule_ablations(candidates: list[Candidate]) -> dict[str, float]:
    """The paper's ablations of the stopping rule, read off the tuned grid: the best rule, the best
    without growth (rho = 1) at the best block sizes, the best at block sizes 1, 3 and 5; and ours: the
    best with a first block like the others (m = 0, the paper's rule)."""
    best = candidates[0]
    out = {"tuned": best.speedup}
    no_growth = [c.speedup for c in candidates if c.growth == 1.0 and c.block_size == best.block_size
                 and c.first_block_size == best.first_block_size]
    if no_growth:
        out["no growth (rho = 1)"] = max(no_growth)
    paper_rule = [c.speedup for c in candidates if c.first_block_size == 0]
    if paper_rule:
        out["no separate first block (the paper's rule)"] = max(paper_rule)
    for b in (1, 3, 5):
        at_b = [c.speedup for c in candidates if c.block_size == b]
        if at_b:
            out[f"block size {b}"] = max(at_b)
    return out


def cost_aware_speedup(head, traces: list[Trace], costs: CostModel, max_draft_length: int, block_size: int = 1,
                       acceptance=None) -> float:
    """The cost-aware rule ([`ExpectedThroughput`]) with `head`'s cumulative predictions as the estimate
    (checked every `block_size` tokens), replayed; with `head=None`, the draft's own token probabilities.
    `acceptance`: the head's predictions per trace, when already computed."""
    if head is None:
        return replayed_speedup(lambda: ExpectedThroughput(costs, "draft", max_draft_length), traces, costs,
                                [None] * len(traces))
    if acceptance is None:
        acceptance = [head_acceptance(head, t) for t in traces]
    return replayed_speedup(lambda: ExpectedThroughput(costs, "head", max_draft_length, block_size), traces, costs,
                            acceptance)


def calibrated_speedup(head, traces: list[Trace], costs: CostModel, max_draft_length: int, estimate: str,
                       calibration: float, acceptance=None) -> float:
    """The cost-aware rule with its per-token estimates refitted online ([`OnlineCalibration`]), replayed:
    `estimate` "draft", "head" or "both"; `acceptance`: the head's predictions per trace, when already computed."""
    if estimate != "draft" and acceptance is None:
        acceptance = [head_acceptance(head, t) for t in traces]
    return replayed_speedup(lambda: ExpectedThroughput(costs, estimate, max_draft_length, calibration=calibration,
                                                       draft_nothing=True),
                            traces, costs, acceptance if estimate != "draft" else [None] * len(traces))


COST_AWARE_BLOCKS = (1, 2, 3)  # how often the cost-aware rule reads the head
CALIBRATIONS = (4.0, 16.0, 64.0)  # prior strengths of the online fit tried (outcomes' worth; one prompt gives ~100)


def calibrated_label(estimate: str, calibration: float) -> str:
    what = {"head": "head estimate", "both": "head and draft estimates combined", "draft": "draft probability"}[estimate]
    return f"cost-aware rule, {what} fitted online (calibration {calibration:g})"


DRAFT_ESTIMATE_LABEL = "cost-aware rule, draft probability estimate (no head)"


def cost_aware_label(block_size: int) -> str:
    return f"cost-aware rule (expected tokens/s), head estimate, block size {block_size}"


def cost_aware_ablations(head, traces: list[Trace], costs: CostModel, max_draft_length: int) -> dict[str, float]:
    """The cost-aware rule beside the paper's: with the head's estimate at block sizes 1-3, and with the
    draft's own probabilities (no head)."""
    acceptance = [head_acceptance(head, t) for t in traces]  # the head's predictions do not depend on the rule
    out = {cost_aware_label(b): cost_aware_speedup(head, traces, costs, max_draft_length, b, acceptance)
           for b in COST_AWARE_BLOCKS if b <= max_draft_length}
    out[DRAFT_ESTIMATE_LABEL] = cost_aware_speedup(None, traces, costs, max_draft_length)
    for estimate in ("head", "both", "draft"):
        for calibration in CALIBRATIONS:
            out[calibrated_label(estimate, calibration)] = calibrated_speedup(
                head, traces, costs, max_draft_length, estimate, calibration, acceptance)
    return out
