"""Mean draft length per step of the bf16 head's rules, replayed on the traces of the live run's prompts
(HumanEval, GSM8K, MT-Bench: the first 3 each, dynamic-int8 draft, as 2026-11-30-head-bf16-n3 ran them live),
to set beside that run's live figures (its results.json: draft_lengths per record).

    python benchmarks/results/2026-11-30-draft-row-invariance/replay_draft_lengths.py COSTS.json runs/bench-traces

COSTS.json: a cost file of ~/.cache/pacer/costs for the pair and head (this run used bef2d04c82d9a825dbb9.json,
the curve host_costs had cached for that head at 07:11 that day); runs/bench-traces: the traces that
../2026-11-30-calibration-replay/record.py wrote (dynamic-int8 draft).
"""
import json, sys, torch
from collections import defaultdict
from pathlib import Path
from modeling_pacer import PacerHead
from modeling_pacer.costs import CostModel
from modeling_pacer.custom_generate.policies import ExpectedThroughput, Pacer, SVIP
from modeling_pacer.replay import head_acceptance, load_traces, replay
torch.set_num_threads(1)
costs = CostModel.from_dict(json.load(open(sys.argv[1]))["costs"])
head = PacerHead.from_pretrained("heads/qwen2.5-coder-1.5b-0.5b-bf16").eval()
for ds in ("humaneval", "gsm8k", "mtbench"):
    traces = [load_traces(f"{sys.argv[2]}/{ds}-{i}.safetensors").traces[0] for i in range(3)]
    for name, make in [("pacer", lambda: Pacer.from_config(head.config)), ("pacer-throughput", lambda: ExpectedThroughput(costs, "head", 12)), ("throughput", lambda: ExpectedThroughput(costs, "draft", 12)), ("svip", lambda: SVIP(max_draft_length=12))]:
        d = steps = new = 0
        for t in traces:
            r = replay(make(), t, costs, head=head)
            d += sum(s.drafted for s in r.steps); steps += len(r.steps); new += sum(s.emitted for s in r.steps)
        print(ds, name, "mean draft", round(d/steps,2), "tau", round(new/steps,2))
