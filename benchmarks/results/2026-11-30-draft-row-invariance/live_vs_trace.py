"""What the head sees live against what it saw in training: decode HumanEval's first prompt with the bf16 head
(dynamic-int8 draft, as the head was recorded and trained) and print, per step, the draft's token probabilities
and the head's predictions live beside the trace's at the same output position.

    python benchmarks/results/2026-11-30-draft-row-invariance/live_vs_trace.py runs/bench-traces/humaneval-0.safetensors
"""
import sys

import torch, json
from modeling_pacer import PacerHead
from modeling_pacer.pairs import load_pair
from modeling_pacer.prompts import apply_chat_template, load_prompts
from modeling_pacer.replay import head_acceptance, load_traces
torch.set_num_threads(2)
pair = load_pair(quantize_draft=True)
head = PacerHead.from_pretrained("heads/qwen2.5-coder-1.5b-0.5b-bf16").eval()
prompt = load_prompts("humaneval", 1)[0]
ids = apply_chat_template(pair.tokenizer, prompt)
trace = load_traces(sys.argv[1]).traces[0]
acc = head_acceptance(head, trace)
seen = []
def cb(ids_, proposal, target_scores, num_accepted):
    seen.append((ids_.shape[1], proposal.view, proposal.hidden, num_accepted))
from modeling_pacer.custom_generate.generate import generate
out = generate(pair.target, ids, assistant_model=pair.draft, pacer_head=head, do_sample=False, max_new_tokens=40,
                           return_dict_in_generate=True, pacer_step_callback=cb)
L = ids.shape[1]
print("output equal to trace:", out.sequences[0, L:].tolist() == trace.output[:out.sequences.shape[1]-L].tolist())
for pos_len, view, hidden, na in seen[:8]:
    i = pos_len - L
    k = view.length
    live_acc = view.acceptance() if view.acceptance else None
    print(f"pos {i} k {k} acc {na} | live probs {[round(float(x),3) for x in view.token_probs]} | trace probs {[round(float(x),3) for x in trace.token_probs[i,:k]]}")
    feats = torch.stack([view.token_probs, view.entropies], -1)[None].float()
    live = head.acceptance_probabilities(hidden.float(), draft_features=feats)[0]
    print("   live head", [round(float(x),3) for x in live], " trace head", [round(float(x),3) for x in acc[i,:k]])
    print("   hidden diff", float((hidden[0].float() - trace.hidden[i,:k].float()).abs().max()), "norms", float(hidden[0].float().norm(dim=-1).mean()), float(trace.hidden[i,:k].float().norm(dim=-1).mean()))
