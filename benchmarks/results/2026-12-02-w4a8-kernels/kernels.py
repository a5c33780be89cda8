"""The candidate kernels for the 4-bit target's linear layers, side by side, on this host: milliseconds for one pass
over the linear layers of Qwen2.5-1.5B (28 decoder layers' worth of distinct random weights, so that they stream
from memory as in the model, plus the 151936 x 1536 LM head) for calls of 1..16 rows, rounds interleaved, median.

    python benchmarks/results/2026-12-02-w4a8-kernels/kernels.py [--rows 1,2,4,8,16] [--repeats 5]

Candidates: torch's int4 weight-only kernel with bf16 activations (`aten._weight_int4pack_mm_for_cpu`, the
`int4` target; its LM head int8 as in `int4+int8`), torch's int8 weight-only kernel (`aten._weight_int8pack_mm`),
bf16 (`F.linear`, the plain target), int8 x int8 (`torch._int_mm`, activations quantized per row), and pacer's
VNNI kernels (`w4a8`: Q4_K weights, the LM head W8A8). Weights are random: time does not depend on their values.
"""

import argparse
import statistics
import time

import torch

from modeling_pacer import kernels

LAYERS = 28
SHAPES = [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536), (1536, 8960)]
LM_HEAD = (151936, 1536)


def int4(n, k):
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = torch.rand(k // 32, n, 2).bfloat16()
    return lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)


def int8(n, k):
    w, s = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, w, s)


def bf16(n, k):
    w = torch.randn(n, k).bfloat16()
    return lambda x: torch.nn.functional.linear(x, w)


def int_mm(n, k):
    w, s = torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n)

    def forward(x):
        xf = x.float()
        sx = xf.abs().amax(-1, keepdim=True).clamp_min(1e-8) / 127
        return (torch._int_mm(torch.round(xf / sx).to(torch.int8), w.t()).float() * (sx * s)).bfloat16()
    return forward


def w4a8(n, k):
    parts = kernels.pack_q4k(torch.randint(0, 16, (n, k)), torch.randint(0, 64, (n, k // 32)),
                             torch.randint(0, 64, (n, k // 32)), torch.rand(n, k // 256), torch.rand(n, k // 256))
    return lambda x: kernels.q4k_matmul(kernels.QuantizedRows(x), *parts, n)


def w8a8(n, k):
    parts = kernels.pack_q8(torch.randint(-127, 128, (n, k)), torch.rand(n))
    return lambda x: kernels.q8_matmul(kernels.QuantizedRows(x, 32), *parts, n)


# candidate: (decoder layers' kernel, LM head's kernel)
CANDIDATES = {"int4 (torch)": (int4, int8), "int8 (torch)": (int8, int8), "bf16 (torch)": (bf16, bf16),
              "int8 x int8 (torch._int_mm)": (int_mm, int_mm), "w4a8 (pacer)": (w4a8, w8a8)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,3,4,5,8,9,12,16")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    names = [n for n in CANDIDATES if n != "w4a8 (pacer)" or kernels.available()]
    built = {}
    for name in names:
        layer, head = CANDIDATES[name]
        built[name] = ([[layer(n, k) for n, k in SHAPES] for _ in range(LAYERS)], head(*LM_HEAD))

    def one_pass(name, m):
        x, wide = torch.randn(m, 1536).bfloat16(), torch.randn(m, 8960).bfloat16()

        def run():
            layers, head = built[name]
            for layer in layers:
                for j, fn in enumerate(layer):
                    fn(wide if j == 6 else x)
            head(x)
        return run

    calls = [(name, m, one_pass(name, m)) for m in rows for name in names]
    times = {(name, m): [] for name, m, _ in calls}
    with torch.no_grad():
        for round_ in range(args.repeats + 1):  # round 0 warms up
            for name, m, run in calls:
                start = time.perf_counter()
                run()
                if round_:
                    times[(name, m)].append(time.perf_counter() - start)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; ms per pass (the ratio to 1 row)\n")
    print("| kernel | " + " | ".join(f"{m} row{'s' if m > 1 else ''}" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        one = statistics.median(times[(name, rows[0])])
        print(f"| {name} | " + " | ".join(
            f"{1000 * statistics.median(times[(name, m)]):.0f} ({statistics.median(times[(name, m)]) / one:.2f}x)"
            for m in rows) + " |")


if __name__ == "__main__":
    main()
