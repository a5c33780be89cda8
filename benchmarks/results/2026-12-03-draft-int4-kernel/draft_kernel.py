"""torch's int4 kernel against pacer's (`kernels.int4_matmul`) for the default draft (Qwen2.5-Coder-0.5B, int4):
one row on each of the draft's layer shapes (random weights, in cache), then the draft's whole decoding step
(one token after a 128-token prompt, the cache cropped back after each step) for three drafts: torch's int4
kernel in transformers' eager layers; pacer's kernel in the eager layers; pacer's kernel with the layers fused
(modeling_pacer.fused_draft, as load_draft makes it now), interleaved in 10 rounds of 8 steps. Medians (ms), with
quartiles for the step; and how often the three drafts' greedy choices agree along a random prompt."""
import statistics, time

import torch
from transformers import DynamicCache

from modeling_pacer import fused_draft, kernels
from modeling_pacer.custom_generate.generate import cache_kwargs
from modeling_pacer.pairs.loading import load_draft, resolve_pair
from modeling_pacer.pairs.registry import DEFAULT_PAIR
from modeling_pacer.quantization import Int4Linear

torch.set_num_threads(2)
torch.manual_seed(0)


def timed(f, n):
    for _ in range(10):
        f()
    out = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        out.append(time.perf_counter() - t)
    return statistics.median(out) * 1e3


print("| one row, shape (out x in) | torch's kernel | pacer's kernel | pacer's GB/s |")
print("|---|---|---|---|")
for out_f, in_f in [(896, 896), (128, 896), (4864, 896), (896, 4864), (151936, 896)]:
    linear = torch.nn.Linear(in_f, out_f, bias=False)
    ours, theirs = Int4Linear.from_linear(linear, kernel="pacer"), Int4Linear.from_linear(linear)
    x = torch.randn(1, in_f, dtype=torch.bfloat16)
    n = 30 if out_f > 100_000 else 300
    a, b = timed(lambda: theirs(x), n), timed(lambda: ours(x), n)
    size = ours.packed_weight.numel() + 2 * ours.scales_and_zeros.numel()
    print(f"| {out_f} x {in_f} | {a:.3f} | {b:.3f} | {size / b / 1e6:.1f} |")

source = resolve_pair(DEFAULT_PAIR).draft
drafts = {"pacer's kernel, fused layers": load_draft(source, torch.bfloat16, "int4")}
fuse = fused_draft.fuse_draft_layers
fused_draft.fuse_draft_layers = lambda model: 0  # load_draft without the fusion
drafts["pacer's kernel, eager layers"] = load_draft(source, torch.bfloat16, "int4")
available = kernels.available
kernels.available = lambda: False  # load_draft falls back to torch's kernel
drafts["torch's kernel, eager layers"] = load_draft(source, torch.bfloat16, "int4")
kernels.available, fused_draft.fuse_draft_layers = available, fuse
assert [(d.lm_head.kernel, fused_draft.fused_layers(d)) for d in drafts.values()] == [("pacer", 24), ("pacer", 0),
                                                                                      ("torch", 0)]

prompt = torch.randint(0, drafts["torch's kernel, eager layers"].config.vocab_size, (1, 128))
token = torch.tensor([[5]])
steps = {name: [] for name in drafts}
with torch.no_grad():
    caches = {}
    for name, draft in drafts.items():
        caches[name] = DynamicCache(config=draft.config)
        draft(input_ids=prompt, use_cache=True, logits_to_keep=1, **cache_kwargs(draft, caches[name]))
    for _ in range(10):
        for name, draft in drafts.items():
            for _ in range(8):
                t = time.perf_counter()
                draft(input_ids=token, use_cache=True, **cache_kwargs(draft, caches[name]))
                steps[name].append(time.perf_counter() - t)
                caches[name].crop(-1)
    # the two drafts' greedy choices along the prompt (one-row steps on their own caches)
    for name, draft in drafts.items():
        caches[name] = DynamicCache(config=draft.config)
    picks = {name: [] for name in drafts}
    for i in range(64):
        for name, draft in drafts.items():
            logits = draft(input_ids=prompt[:, i:i + 1], use_cache=True, **cache_kwargs(draft, caches[name])).logits
            picks[name].append(int(logits[0, -1].argmax()))
print()
print("| draft step (int4 draft, one token after 128) | median ms | quartiles |")
print("|---|---|---|")
for name, v in steps.items():
    q = statistics.quantiles(v, n=4)
    print(f"| {name} | {statistics.median(v) * 1e3:.1f} | {q[0] * 1e3:.1f}-{q[2] * 1e3:.1f} |")
names = list(drafts)
for a, b in ((names[1], names[2]), (names[0], names[1])):
    same = sum(x == y for x, y in zip(picks[a], picks[b]))
    print(f"\ngreedy choices of '{a}' and '{b}' agree at {same}/64 positions of a random prompt")
