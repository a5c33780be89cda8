"""The heads of 560 and 1,000 prompts side by side, replayed on the live benchmark's 30 prompts: traces of those
prompts recorded with the int4 draft (which replay as they run live: ../2026-11-30-head-int4-n10/replay_vs_live.md),
the cost curve that live run measured, 96 tokens as it generated. Speedup over the target alone, per dataset.

    python benchmarks/results/2026-11-30-head-1000/replay_heads.py runs/bench-traces-int4 \
        heads/qwen2.5-coder-1.5b-0.5b-int4 runs/head-int4-1000/head

The traces: ../2026-11-30-calibration-replay/record.py runs/bench-traces-int4 int4 runs/bench-traces.
"""

import json
import sys
from pathlib import Path

import torch

from modeling_pacer import PacerHead
from modeling_pacer.costs import CostModel
from modeling_pacer.custom_generate.policies import SVIP, ExpectedThroughput, FixedLength, SpecDecPP, make_policy
from modeling_pacer.replay import Trace, head_acceptance, load_traces, oracle, replay

LIVE = Path(__file__).parent.parent / "2026-11-30-head-int4-n10" / "results.json"
DATASETS = ("humaneval", "gsm8k", "mtbench")


def load(trace_dir: str) -> dict:
    out = {}
    for dataset in DATASETS:
        for i in range(10):
            t = load_traces(Path(trace_dir) / f"{dataset}-{i}.safetensors").traces[0]
            n = min(96, t.length)  # what the live run generated
            out.setdefault(dataset, []).append(Trace(t.dataset, t.prompt_id, t.match[:n], t.output[:n],
                                                     t.token_probs[:n], t.entropies[:n], t.hidden[:n]))
    return out


def main(trace_dir: str, *head_paths: str) -> None:
    torch.set_num_threads(1)
    costs = CostModel.from_dict(json.loads(LIVE.read_text())["meta"]["costs"])
    traces = load(trace_dir)
    heads = {Path(p).parent.name if Path(p).name == "head" else Path(p).name: PacerHead.from_pretrained(p).eval()
             for p in head_paths}
    longest = 12
    rules = {"fixed-4": (lambda: FixedLength(4), None), "svip": (lambda: SVIP(max_draft_length=longest), None),
             "throughput (draft probability)": (lambda: ExpectedThroughput(costs, "draft", longest), None)}
    for name, head in heads.items():
        rules[f"pacer, {name} (its default: {head.config.stopping_rule})"] = (lambda h=head: make_policy(None, h.config, costs), head)
        rules[f"specdec++, {name}"] = (lambda: SpecDecPP(max_draft_length=longest), head)
        rules[f"cost-aware, {name} estimate"] = (lambda: ExpectedThroughput(costs, "head", longest), head)
    print("| rule | " + " | ".join(DATASETS) + " | all |")
    print("|---" * (len(DATASETS) + 2) + "|")
    acceptance = {(id(h), t.dataset, t.prompt_id): head_acceptance(h, t) for h in heads.values()
                  for ts in traces.values() for t in ts}
    for name, (make, head) in list(rules.items()) + [("oracle", (None, None))]:
        cells, total = [], [0.0, 0.0]
        for dataset in DATASETS:
            alone = seconds = 0.0
            for t in traces[dataset]:
                if make is None:
                    r = oracle(t, costs, longest)
                else:
                    r = replay(make(), t, costs, acceptance=None if head is None else acceptance[(id(head), t.dataset, t.prompt_id)])
                alone, seconds = alone + r.target_alone_seconds, seconds + r.seconds
            cells.append(f"{alone / seconds:.2f}x")
            total = [total[0] + alone, total[1] + seconds]
        print(f"| {name} | " + " | ".join(cells) + f" | {total[0] / total[1]:.2f}x |")


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
