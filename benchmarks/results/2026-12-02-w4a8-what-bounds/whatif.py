"""What bounds speculative decoding over the w4a8 target: the stopping rule or the draft's cost?

Replays the traces a `pacer-bench run --record-traces` recorded (the target's greedy output on the 30 benchmark
prompts, the draft's own drafts from every position) under the cost model that run measured, and under the same
model with the draft's step scaled down (what a cheaper draft would give, the target's curve unchanged). For each:
the default rule (the cost-aware rule on the draft's probability, `pacer`), fixed lengths, and the oracle (the
fastest schedule knowing every acceptance). Speedups are over the target alone on the same costs.

Run: python benchmarks/results/2026-12-02-w4a8-what-bounds/whatif.py TRACES.safetensors > .../whatif.md
"""

import sys

from modeling_pacer.costs import CostModel
from modeling_pacer.custom_generate.policies import ExpectedThroughput, FixedLength
from modeling_pacer.replay import load_traces, oracle, replay

SCALES = (1.0, 0.75, 0.5, 0.33, 0.25)


def speedup(rule, traces, costs) -> tuple[float, float]:
    """(speedup over the target alone, tau) of a rule (None: the oracle) summed over the traces."""
    seconds = alone = tokens = steps = 0.0
    for trace in traces:
        result = oracle(trace, costs, 16) if rule is None else replay(rule(costs), trace, costs)
        seconds += result.seconds
        alone += result.target_alone_seconds
        tokens += sum(s.emitted for s in result.steps)
        steps += len(result.steps)
    return alone / seconds, tokens / steps


def main(path):
    saved = load_traces(path)
    measured = saved.costs
    rules = {"pacer (cost-aware, draft's probability)": lambda c: ExpectedThroughput(c, "draft", 12),
             **{f"fixed-{k}": (lambda c, k=k: FixedLength(k)) for k in (1, 2, 3, 4, 6)},
             "oracle": None}
    print(f"{len(saved.traces)} traces from `{path.rsplit('/', 1)[-1]}`; the run's costs: target "
          + ", ".join(f"{n}: {1e3 * t:.0f}" for n, t in sorted(measured.target_forward.items()) if n in (1, 2, 4, 8, 12))
          + f" ms for that many tokens; draft {1e3 * measured.draft_forward:.1f} ms a token.\n")
    print("| rule | " + " | ".join(f"draft x{s} ({1e3 * measured.draft_forward * s:.1f} ms)" for s in SCALES) + " |")
    print("|---|" + "---|" * len(SCALES))
    for name, rule in rules.items():
        cells = []
        for s in SCALES:
            costs = CostModel(measured.target_forward, measured.draft_forward * s, measured.head_call)
            x, tau = speedup(rule, saved.traces, costs)
            cells.append(f"{x:.2f}x (τ {tau:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1])
