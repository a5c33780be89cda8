"""The prefill's arithmetic rate: each model reads a 256-token prompt (logits for the last row only), 3 times after a
warm-up; multiply-accumulates = tokens x the decoder layers' linear weights (the LM head counts one row)."""
import statistics
import time

import torch
from transformers import DynamicCache

from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.pairs.loading import load_pair

torch.set_num_threads(2)
pair = load_pair(quantize_target="w4a8")
prompt = torch.randint(100, 20000, (1, 256), generator=torch.Generator().manual_seed(0))
print("| model | prompt tokens | seconds (median of 3) | ms per token | GMAC/s |")
print("|---|---|---|---|---|")
with torch.no_grad():
    for name, model in (("target (w4a8)", pair.target), ("draft (int4)", pair.draft)):
        per_token = sum(m.in_features * m.out_features for n, m in model.model.named_modules()
                        if hasattr(m, "in_features") and hasattr(m, "out_features"))
        times = []
        for i in range(4):
            cache = DynamicCache(config=model.config)
            start = time.perf_counter()
            model(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
            if i:
                times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        print(f"| {name} | {prompt.shape[1]} | {seconds:.2f} | {1e3 * seconds / prompt.shape[1]:.1f} | "
              f"{prompt.shape[1] * per_token / seconds / 1e9:.0f} |")
