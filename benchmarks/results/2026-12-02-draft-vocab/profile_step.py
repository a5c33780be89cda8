"""Where the int4 draft's one-token step goes: time inside torch's operators (torch.profiler's self CPU time,
summed per operator) against the step's wall-clock time, the rest being Python and dispatch between operators.
Full LM head and 32768 kept tokens. Run: python benchmarks/results/2026-12-02-draft-vocab/profile_step.py > benchmarks/results/2026-12-02-draft-vocab/profile_step.md

The draft's attention runs on pacer's C++ kernel through ctypes, which the profiler does not see: its time lands
in "outside operators"; attention without that kernel (sdpa) is profiled in a third row to size it.
"""

import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import DynamicCache

from modeling_pacer.costs import fixed_prefix
from modeling_pacer.custom_generate.generate import crop_cache, model_forward
from modeling_pacer.pairs import DEFAULT_PAIR, get_pair
from modeling_pacer.pairs.loading import load_draft, load_tokenizer

STEPS = 20
torch.set_num_threads(2)


def profile_step(draft):
    prefix = fixed_prefix(draft, 128)
    cache = DynamicCache(config=draft.config)
    model_forward(draft, prefix, cache, 1)

    def step():
        model_forward(draft, prefix[:, -1:], cache, 1)
        crop_cache(cache, 128)

    for _ in range(3):
        step()
    walls = []
    for _ in range(STEPS):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(STEPS):
            step()
    ops = {e.key: e.self_cpu_time_total / 1e3 / STEPS for e in prof.key_averages()}  # ms per step
    return statistics.median(walls) * 1e3, ops


def main():
    spec = get_pair(DEFAULT_PAIR)
    tokenizer = load_tokenizer(spec.target)
    rows = []
    for label, kwargs in (("full LM head, pacer attention", {}),
                          ("32768 kept tokens, pacer attention", dict(draft_vocab=32768, tokenizer=tokenizer)),
                          ("full LM head, sdpa attention", dict(attn_implementation="sdpa"))):
        draft = load_draft(spec.draft, torch.bfloat16, "int4", **kwargs)
        with torch.inference_mode():
            wall, ops = profile_step(draft)
        int4 = ops.get("aten::_weight_int4pack_mm_for_cpu", 0.0)
        inside = sum(ops.values())
        rows.append((label, wall, int4, inside - int4, wall - inside, sorted(ops.items(), key=lambda kv: -kv[1])[:6]))
        del draft
    print(f"ms per one-token step of the int4 draft after a 128-token prefix ({STEPS} steps; wall: median "
          "without the profiler; operators: torch.profiler's self CPU time per step)\n")
    print("| draft | wall | int4 matmuls | other operators | outside operators (Python, dispatch, ctypes kernels) |")
    print("|---|---|---|---|---|")
    for label, wall, int4, other, outside, _ in rows:
        print(f"| {label} | {wall:.1f} | {int4:.1f} | {other:.1f} | {outside:.1f} |")
    for label, *_, top in rows:
        print(f"\n{label}, largest operators (ms per step): " + ", ".join(f"{k} {v:.2f}" for k, v in top))


if __name__ == "__main__":
    main()
