"""The draft's greedy agreement with the bf16-exact target's output, computed two ways: in decoding steps (one
token after a cached prefix, as the draft runs live) and teacher-forced in one forward over prompt + output (as
`record_trace` computes a trace). A draft whose two numbers differ gives traces that do not describe its
live behaviour. Nine benchmark prompts (HumanEval, GSM8K, MT-Bench: the first 3 each), 128 target tokens each,
the target's outputs read from the traces that ../2026-11-30-calibration-replay/record.py wrote:

    python benchmarks/results/2026-11-30-draft-row-invariance/draft_agreement.py runs/bench-traces
"""
import sys

import torch, time
from transformers import DynamicCache
from modeling_pacer.pairs.loading import load_draft, load_tokenizer
from modeling_pacer.pairs.gguf import source_gguf
from modeling_pacer.pairs.registry import get_pair, DEFAULT_PAIR
from modeling_pacer.custom_generate.generate import model_forward
from modeling_pacer.quantization import quantize_from_gguf
from modeling_pacer.replay import load_traces
from modeling_pacer.prompts import apply_chat_template, load_prompts
torch.set_num_threads(2)
spec = get_pair(DEFAULT_PAIR)
tokenizer = load_tokenizer(spec.target, pair_name=spec.name)
gguf = source_gguf(spec.draft, None, pair_name=spec.name)
g = load_draft(spec.draft, torch.bfloat16, None); print(quantize_from_gguf(g, gguf, other="int8"))
drafts = {"dyn-int8 fp32": load_draft(spec.draft, torch.float32, "int8"),
          "int4 bf16 (minmax)": load_draft(spec.draft, torch.bfloat16, "int4"),
          "int4 bf16 (gguf grid, int8 rest)": g}
cases = []
for ds in ("humaneval", "gsm8k", "mtbench"):
    prompts = load_prompts(ds, 3)
    for i in range(3):
        t = load_traces(f"{sys.argv[1]}/{ds}-{i}.safetensors").traces[0]
        cases.append((apply_chat_template(tokenizer, prompts[i]), t.output))
for name, d in drafts.items():
    inc = tf = n = 0
    start = time.perf_counter()
    with torch.no_grad():
        for ids, out in cases:
            full = torch.cat([ids, out[None]], 1)
            tf_pred = d(input_ids=full[:, :-1]).logits[0, ids.shape[1]-1:].argmax(-1)
            tf += int((tf_pred == out).sum())
            cache = DynamicCache(config=d.config)
            logits, _ = model_forward(d, ids, cache, 1)
            for j in range(len(out)):
                inc += int(logits[0, 0].argmax() == out[j])
                logits, _ = model_forward(d, out[None, j:j+1], cache, 1)
            n += len(out)
    print(f"{name}: incremental agreement {inc/n:.3f}, teacher-forced in one forward {tf/n:.3f} ({n} tokens, {time.perf_counter()-start:.0f} s)")
