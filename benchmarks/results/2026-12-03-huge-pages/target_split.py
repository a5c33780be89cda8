"""Where the w4a8 target's forward goes: its wall time against the time inside pacer's C++ kernels (activation
quantization, the W4A8/W8A8 matmuls, attention), timed by wrapping the kernels' ctypes calls, after a 150-token
prompt, 1 / 4 / 8 new tokens, 8 forwards each, twice."""
import collections
import time

import torch
from transformers import DynamicCache

from modeling_pacer import kernels
from modeling_pacer.pairs.loading import load_pair

torch.set_num_threads(2)
target = load_pair(quantize_target="w4a8").target
spent = collections.defaultdict(float)
library = kernels._library()
timed = ["pacer_quantize_rows", "pacer_q4k_matmul", "pacer_q8_matmul", "pacer_exact_attention"]


class Timed:
    def __getattr__(self, name):
        fn = getattr(library, name)
        if name not in timed:
            return fn

        def call(*args):
            t = time.perf_counter()
            fn(*args)
            spent[name] += time.perf_counter() - t
        return call


kernels._library = lambda: Timed()
ids = torch.randint(100, 20000, (1, 200), generator=torch.Generator().manual_seed(0))
cache = DynamicCache(config=target.config)
print("| new tokens | forward (ms) | in the kernels (ms) | quantize | q4k | q8 | attention |")
print("|---|---|---|---|---|---|---|")
with torch.no_grad():
    target(ids[:, :150], past_key_values=cache, use_cache=True)
    for rows in (1, 4, 8, 1, 4, 8):
        spent.clear()
        total = 0.0
        for _ in range(8):
            t = time.perf_counter()
            target(ids[:, 150:150 + rows], past_key_values=cache, use_cache=True)
            total += time.perf_counter() - t
            cache.crop(-rows)
        parts = [spent[name] / 8 * 1e3 for name in timed]
        print(f"| {rows} | {total / 8 * 1e3:.1f} | {sum(parts):.1f} | " + " | ".join(f"{p:.1f}" for p in parts) + " |")
