"""The default rule's two switches on recorded traces: does refitting the draft's probability online
(`calibration`) or letting a step draft nothing on low-acceptance text (`draft_nothing`) bring the cost-aware rule
closer to the oracle over the w4a8 target, per dataset?

Replays the traces a `pacer-bench run --record-traces` recorded (the target's greedy output on the 30 benchmark
prompts, the draft's own drafts from every position) under the cost model that run measured. Speedups are over the
target alone on the same costs, pricing no prefill (as the benchmark's "oracle (replay)" row).

Run: python benchmarks/results/2026-12-03-w4a8-rule-variants/variants.py TRACES.safetensors > .../variants.md
"""

import sys
from collections import defaultdict

from modeling_pacer.custom_generate.policies import ExpectedThroughput
from modeling_pacer.replay import load_traces, oracle, replay

LONGEST = 12  # the default head's max_draft_length, the live rule's cap


def rules():
    return {
        "the default (draft's probability)": lambda c: ExpectedThroughput(c, "draft", LONGEST),
        "calibration=4": lambda c: ExpectedThroughput(c, "draft", LONGEST, calibration=4.0),
        "calibration=16": lambda c: ExpectedThroughput(c, "draft", LONGEST, calibration=16.0),
        "the default, drafts capped at 8": lambda c: ExpectedThroughput(c, "draft", 8),
        "draft_nothing": lambda c: ExpectedThroughput(c, "draft", LONGEST, draft_nothing=True),
        "calibration=4 + draft_nothing": lambda c: ExpectedThroughput(c, "draft", LONGEST, calibration=4.0,
                                                                       draft_nothing=True),
        "oracle": None,
    }


def main(path):
    saved = load_traces(path)
    costs = saved.costs
    datasets = sorted({t.dataset for t in saved.traces})
    print(f"{len(saved.traces)} traces from `{path.rsplit('/', 1)[-1]}`; the run's costs: target "
          + ", ".join(f"{n}: {1e3 * t:.0f}" for n, t in sorted(costs.target_forward.items()) if n in (1, 2, 4, 8, 12))
          + f" ms for that many tokens; draft {1e3 * costs.draft_forward:.1f} ms a token.\n")
    print("| rule | " + " | ".join(datasets) + " | all | τ, all |")
    print("|---|" + "---|" * (len(datasets) + 2))
    for name, rule in rules().items():
        seconds, alone, tokens, steps = (defaultdict(float) for _ in range(4))
        for trace in saved.traces:
            result = oracle(trace, costs, LONGEST) if rule is None else replay(rule(costs), trace, costs)
            for key in (trace.dataset, "all"):
                seconds[key] += result.seconds
                alone[key] += result.target_alone_seconds
                tokens[key] += sum(s.emitted for s in result.steps)
                steps[key] += len(result.steps)
        cells = [f"{alone[d] / seconds[d]:.3f}x" for d in (*datasets, "all")]
        print(f"| {name} | " + " | ".join(cells) + f" | {tokens['all'] / steps['all']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
