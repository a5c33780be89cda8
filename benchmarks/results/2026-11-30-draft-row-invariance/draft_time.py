"""Is the draft the same function in one long forward as in decoding steps, and what does a draft step cost?

For each way to run the default pair's draft (dynamic int8 in fp32, as `--quantize-draft int8`; int4 weights
with bf16 activations, as `--quantize-draft int4`; plain bf16; int8 weights with bf16 activations): the largest
logit difference at the last position between one forward over a fixed 128-token sequence and a one-token
step after the other 127 cached, then the median time of a one-token step after a cached 128-token prefix
(7 interleaved rounds, 2 threads).

    python benchmarks/results/2026-11-30-draft-row-invariance/draft_time.py
"""
import torch
from transformers import DynamicCache
from modeling_pacer.pairs.loading import load_draft
from modeling_pacer.pairs.registry import get_pair, DEFAULT_PAIR
from modeling_pacer.costs import fixed_prefix, interleaved_medians
from modeling_pacer.custom_generate.generate import model_forward, crop_cache
from modeling_pacer.quantization import quantize_linears

torch.set_num_threads(2)
spec = get_pair(DEFAULT_PAIR)
drafts = {
  "dyn-int8 fp32": load_draft(spec.draft, torch.float32, "int8"),
  "int4 bf16": load_draft(spec.draft, torch.bfloat16, "int4"),
  "bf16 plain": load_draft(spec.draft, torch.bfloat16, None),
}
drafts["w-int8 bf16"] = quantize_linears(load_draft(spec.draft, torch.bfloat16, None), "int8")
prefix = fixed_prefix(drafts["bf16 plain"], 128)
fns = []
for name, d in drafts.items():
    cache = DynamicCache(config=d.config)
    with torch.no_grad():
        model_forward(d, prefix, cache, 1)
    def step(d=d, cache=cache):
        with torch.no_grad():
            model_forward(d, prefix[:, -1:], cache, 1)
        crop_cache(cache, 128)
    fns.append(step)
    # row invariance: last row's logits, whole sequence at once vs. one token after a cached prefix
    with torch.no_grad():
        full = d(input_ids=prefix).logits[0, -1].float()
        c2 = DynamicCache(config=d.config); model_forward(d, prefix[:, :-1], c2, 1)
        one, _ = model_forward(d, prefix[:, -1:], c2, 1)
    print(name, "max |logit diff| full vs incremental:", float((full - one[0, 0]).abs().max()))
ms = interleaved_medians(fns, 7)
for name, t in zip(drafts, ms):
    print(f"{name}: {t*1000:.1f} ms")
