"""The int4 draft's decoding step through FusedDraftStep (the model's forward routed: one function over the fused
layers) against the same draft's own forward over the same fused layers (`draft.forward.original`), after a 128-token
prompt, interleaved with one w4a8 target forward per round (so the draft starts each round with the target's weights
in the caches, as in the loop), 15 rounds of 3 steps each; and whether the two give the same logits."""
import statistics
import time

import torch
from transformers import DynamicCache

from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.fused_draft import FusedDraftStep
from modeling_pacer.pairs.loading import load_pair

torch.set_num_threads(2)
pair = load_pair(quantize_target="w4a8")
target, draft = pair.target, pair.draft
assert isinstance(draft.forward, FusedDraftStep)
ways = {"the model's forward over the fused layers": draft.forward.original, "FusedDraftStep (load_draft now)": draft}
prompt = torch.randint(100, 20000, (1, 128), generator=torch.Generator().manual_seed(0))
with torch.no_grad():
    target_cache = DynamicCache(config=target.config)
    target(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(target, target_cache))
    caches = {name: DynamicCache(config=draft.config) for name in ways}
    for name, forward in ways.items():
        forward(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(draft, caches[name]))
    logits = [forward(input_ids=prompt[:, :1], use_cache=True, logits_to_keep=1,
                      **cache_kwargs(draft, caches[name])).logits for name, forward in ways.items()]
    for cache in caches.values():
        cache.crop(-1)
    times = {name: [] for name in ways}
    for _ in range(15):
        target(input_ids=prompt[:, :1], use_cache=True, **cache_kwargs(target, target_cache))
        target_cache.crop(-1)
        for name, forward in ways.items():
            for _ in range(3):
                t = time.perf_counter()
                forward(input_ids=prompt[:, :1], use_cache=True, logits_to_keep=1, **cache_kwargs(draft, caches[name]))
                times[name].append(time.perf_counter() - t)
                caches[name].crop(-1)
print("| the draft's step | median ms | quartiles |")
print("|---|---|---|")
for name, values in times.items():
    q = statistics.quantiles(values, n=4)
    print(f"| {name} | {statistics.median(values) * 1e3:.1f} | {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} |")
print()
print("same logits:", torch.equal(*logits))
