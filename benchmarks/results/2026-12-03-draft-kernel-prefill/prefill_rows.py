"""The default int4 draft's forward over a prompt of N tokens (fresh cache, last row's logits only) on pacer's int4
kernel for every call (`dense_rows=None`) against the dense bf16 copy for calls of 32 rows or more (`dense_rows=32`,
the default before this run), rounds interleaved, median of 7 (milliseconds). Prints a markdown table; run with
nothing else on the machine."""

import statistics
import time

import torch
from transformers import DynamicCache

from modeling_pacer import kernels
from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.pairs.loading import load_draft, resolve_pair
from modeling_pacer.pairs.registry import DEFAULT_PAIR

ROWS = (16, 32, 64, 96, 142, 192, 256, 512, 1024)
assert kernels.available(), kernels.unavailable_reason()
torch.manual_seed(0)
kernel = load_draft(resolve_pair(DEFAULT_PAIR).draft, torch.bfloat16, "int4", dense_rows=None)
dense = load_draft(resolve_pair(DEFAULT_PAIR).draft, torch.bfloat16, "int4", dense_rows=32)
vocab = kernel.config.vocab_size


@torch.no_grad()
def once(model, ids):
    cache = DynamicCache(config=model.config)
    start = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    return (time.perf_counter() - start) * 1e3


times = {(name, n): [] for name in ("kernel", "dense") for n in ROWS}
prompts = {n: torch.randint(0, vocab, (1, n)) for n in ROWS}
for model in (kernel, dense):  # warm-up
    for n in ROWS:
        once(model, prompts[n])
for _ in range(7):
    for n in ROWS:
        for name, model in (("kernel", kernel), ("dense", dense)):
            times[name, n].append(once(model, prompts[n]))

print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
print("| prompt tokens | pacer int4 kernel (ms) | dense bf16 copy (ms) | kernel / dense | kernel ms per token | dense ms per token |")
print("|---|---|---|---|---|---|")
for n in ROWS:
    k, d = (statistics.median(times[name, n]) for name in ("kernel", "dense"))
    print(f"| {n} | {k:.1f} | {d:.1f} | {k / d:.2f} | {k / n:.2f} | {d / n:.2f} |")
