"""Do replays now describe live decoding? Mean draft tokens per step and new tokens per step of the
live run in this folder, beside a replay of the same rules on traces of the same prompts recorded with the same
(int4) draft, with the cost curve the live run measured (its results.json meta).

    python benchmarks/results/2026-11-30-head-int4-n10/replay_vs_live.py runs/bench-traces-int4

The traces: ../2026-11-30-calibration-replay/record.py runs/bench-traces-int4 int4 runs/bench-traces
(128 tokens each, where the live run generated 96: the replay stops at 96 too).
"""

import json
import sys
from pathlib import Path

import torch

from modeling_pacer import PacerHead
from modeling_pacer.costs import CostModel
from modeling_pacer.custom_generate.policies import SVIP, ExpectedThroughput, SpecDecPP, make_policy
from modeling_pacer.replay import Trace, load_traces, replay

HERE = Path(__file__).parent


def main(trace_dir: str) -> None:
    torch.set_num_threads(1)
    results = json.loads((HERE / "results.json").read_text())
    costs = CostModel.from_dict(results["meta"]["costs"])
    head = PacerHead.from_pretrained(results["meta"]["head"]).eval()
    longest = head.config.max_draft_length
    rules = {"pacer": lambda: make_policy(None, head.config, costs), "specdec++": lambda: SpecDecPP(max_draft_length=longest),
             "svip": lambda: SVIP(max_draft_length=longest), "throughput": lambda: ExpectedThroughput(costs, "draft", longest)}
    print("| dataset | method | draft tokens / step, replay / live | new tokens / step, replay / live |")
    print("|---|---|---|---|")
    for dataset in ("humaneval", "gsm8k", "mtbench"):
        traces = []
        for i in range(10):
            t = load_traces(Path(trace_dir) / f"{dataset}-{i}.safetensors").traces[0]
            n = min(96, t.length)  # what the live run generated; drafts near the end see the same budget
            traces.append(Trace(t.dataset, t.prompt_id, t.match[:n], t.output[:n],
                                t.token_probs[:n], t.entropies[:n], t.hidden[:n]))
        for name, make in rules.items():
            steps = [s for t in traces for s in replay(make(), t, costs, head=head).steps]
            live = [r for r in results["records"] if r["dataset"] == dataset and r["method"] == name]
            live_drafted = sum(sum(r["draft_lengths"]) for r in live) / sum(len(r["draft_lengths"]) for r in live)
            live_tau = sum(r["new_tokens"] for r in live) / sum(len(r["draft_lengths"]) for r in live)
            print(f"| {dataset} | {name} | {sum(s.drafted for s in steps) / len(steps):.2f} / {live_drafted:.2f} | "
                  f"{sum(s.emitted for s in steps) / len(steps):.2f} / {live_tau:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1])
