"""Replay stopping rules on recorded traces, per dataset: the raw and the online-calibrated cost-aware rule
against fixed lengths, SVIP, SpecDec++, the paper's block rule and the oracle.

    python benchmarks/results/2026-11-30-calibration-replay/replay_rules.py TRACES_DIR HEAD COSTS.json [FIRST LAST]

TRACES_DIR: one trace file per prompt (record.py beside this file, or a pacer-train run's traces/; the dataset is
the prompt id's prefix, before its last '-'); FIRST/LAST: prompt index range kept per dataset (default all).
COSTS.json: a cost file from ~/.cache/pacer/costs (this machine's measured curve). Prints a Markdown table
of replayed speedups over the target alone (time from the cost model) and writes it beside the traces.
"""

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

from modeling_pacer import PacerHead
from modeling_pacer.costs import CostModel
from modeling_pacer.custom_generate.policies import SVIP, ExpectedThroughput, FixedLength, Pacer, SpecDecPP
from modeling_pacer.replay import head_acceptance, load_traces, oracle, replay


def rules(costs, head, longest):
    return {
        "fixed-2": lambda: FixedLength(2),
        "fixed-3": lambda: FixedLength(3),
        "fixed-4": lambda: FixedLength(4),
        "svip": lambda: SVIP(max_draft_length=longest),
        "specdec++": lambda: SpecDecPP(max_draft_length=longest),
        "pacer-blocks": lambda: Pacer.from_config(head.config),
        "throughput (draft)": lambda: ExpectedThroughput(costs, "draft", longest),
        "throughput (head)": lambda: ExpectedThroughput(costs, "head", longest),
        **{f"calibrated draft, s={s}": (lambda s=s: ExpectedThroughput(costs, "draft", longest, calibration=s)) for s in (1.0, 4.0, 16.0)},
        **{f"calibrated head, s={s}": (lambda s=s: ExpectedThroughput(costs, "head", longest, calibration=s)) for s in (1.0, 4.0, 16.0)},
        **{f"calibrated both, s={s}": (lambda s=s: ExpectedThroughput(costs, "both", longest, calibration=s)) for s in (1.0, 4.0, 16.0)},
        "calibrated both, s=4, draft nothing": lambda: ExpectedThroughput(costs, "both", longest, calibration=4.0, draft_nothing=True),
    }


def main(trace_dir, head_path, costs_path, first=0, last=10**9):
    torch.set_num_threads(1)
    costs = CostModel.from_dict(json.loads(Path(costs_path).read_text())["costs"])
    head = PacerHead.from_pretrained(head_path).eval()
    longest = min(head.config.max_draft_length, 12)
    by_dataset = defaultdict(list)
    for path in sorted(Path(trace_dir).glob("*.safetensors")):
        dataset, _, index = path.stem.rpartition("-")
        if int(first) <= int(index) < int(last):
            by_dataset[dataset] += load_traces(path).traces
    table = {}
    for dataset, traces in sorted(by_dataset.items()):
        acceptance = [head_acceptance(head, t) for t in traces]
        alone = sum(t.length * costs.target(1) for t in traces)
        row = {}
        for name, make in rules(costs, head, longest).items():
            seconds = sum(replay(make(), t, costs, acceptance=a).seconds for t, a in zip(traces, acceptance))
            row[name] = alone / seconds
        row["oracle"] = alone / sum(oracle(t, costs, longest).seconds for t in traces)
        table[f"{dataset} ({len(traces)})"] = row
    names = list(next(iter(table.values())))
    lines = ["| rule | " + " | ".join(table) + " |", "|---|" + "---|" * len(table)]
    lines += [f"| {n} | " + " | ".join(f"{table[d][n]:.3f}" for d in table) + " |" for n in names]
    print("\n".join(lines))
    return table


if __name__ == "__main__":
    main(*sys.argv[1:])
