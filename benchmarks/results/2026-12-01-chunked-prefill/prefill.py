"""What the row-invariant linear layers' chunking costs a prefill: the default bf16 exact target reads a prompt of
N tokens in one forward, (a) as load_pair sets it up (every linear call kept inside this host's probed row range:
a 256-token prompt is cut into chunks of at most 40 rows), (b) the same attention with the linear layers fed the
whole prompt in one call (what exact_linears did before: it only padded short calls), (c) `--no-exact` (sdpa,
plain linear layers). Timings interleaved, median of 5 after a warm-up; the first token each way is printed, and
whether (a)'s last-row logits equal a single step after an (N-1)-token (a) prefill.

    python benchmarks/results/2026-12-01-chunked-prefill/prefill.py > benchmarks/results/2026-12-01-chunked-prefill/results.md
"""

import torch
from transformers import DynamicCache

from modeling_pacer.costs import describe_host, interleaved_medians
from modeling_pacer.custom_generate.generate import model_forward
from modeling_pacer.exact_linear import RowRange, host_row_range, is_exact_linear
from modeling_pacer.pairs import load_pair

torch.set_num_threads(2)
pair = load_pair(quantize_draft="int8")
target = pair.target
vocab = target.config.vocab_size
layers = [m for m in target.modules() if is_exact_linear(m)]
ranges = sorted({(m.in_features, m.out_features, host_row_range(m)) for m in layers}, key=str)
host = describe_host()
print(f"Host: {host['cpu']}, {host['threads']} threads, torch {host['torch']}; target {pair.describe()}\n")
print("Probed row ranges (in x out: lo..hi):", "; ".join(f"{i}x{o}: {r.lo}..{r.hi}" for i, o, r in ranges), "\n")


def prefill(ids):
    return model_forward(target, ids, DynamicCache(config=target.config), 1)[0]


def unchunked(fn):
    def run():
        for m in layers:
            m._pacer_rows = RowRange(1, 1 << 20)
        try:
            return fn()
        finally:
            for m in layers:
                m._pacer_rows = None
    return run


def no_exact(fn):
    def run():
        saved = [m.forward for m in layers]
        for m in layers:
            del m.forward  # the class's own forward
        target.set_attn_implementation("sdpa")
        try:
            return fn()
        finally:
            target.set_attn_implementation("pacer_exact")
            for m, f in zip(layers, saved):
                m.forward = f
    return run


print("| prompt tokens | chunked (default) s | one call per layer s | --no-exact s | chunked / one call | first token equal (chunked, one call, no-exact) | chunked last row == step |")
print("|---|---|---|---|---|---|---|")
with torch.no_grad():
    for n in (32, 128, 256):
        ids = (torch.arange(n) * 7919 % vocab).view(1, -1)
        fns = [lambda: prefill(ids), unchunked(lambda: prefill(ids)), no_exact(lambda: prefill(ids))]
        seconds = interleaved_medians(fns, repeats=5)
        firsts = [int(f()[0, -1].argmax()) for f in fns]
        cache = DynamicCache(config=target.config)
        model_forward(target, ids[:, :-1], cache, 1)
        step = model_forward(target, ids[:, -1:], cache, 1)[0]
        same = torch.equal(step, fns[0]())
        print(f"| {n} | {seconds[0]:.2f} | {seconds[1]:.2f} | {seconds[2]:.2f} | {seconds[0] / seconds[1]:.2f} | "
              f"{firsts[0] == firsts[1] == firsts[2]} | {same} |")
