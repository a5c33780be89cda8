"""`pacer-bench kernel-rows`: what one of pacer's quantized layers costs for 1..rows rows, and what bounds it.

A verification call of k tokens costs about one step only while the target's linear layers are bound by reading
their weights (once per call, whatever the rows). Each row adds its integer dot products, so past some row count
the layers are bound by this CPU's integer throughput instead. For each layer kind (`w4a8`: Q4_K weights; `w8a8`:
int8 weights, both with int8 activations on pacer's VNNI kernel) and each shape (by default the layers of the
1.5B target: attention 1536 x 1536 and 1536 x 256, MLP 1536 x 8960 and 8960 x 1536), it times a call of 1..rows
rows over enough copies of the layer that the weights stream from memory (not cache), and reports

- `ms[r]` and `ratio[r]` = ms[r] / ms[1]: the layer's own cost curve;
- `gb_per_s`: weight bytes / ms[1] (the bandwidth a one-row call reaches);
- `macs_per_ns[r]`: the multiply-adds (in_features x out_features x r) per nanosecond the call reaches. Where it
  stops growing with r, the layer is compute-bound: `peak_macs_per_ns` is the highest rate seen, and
  `bound[r]` = max(ms[1], r x macs / peak) / ms[1] is the least ratio any schedule of the same instructions could
  reach at r rows on this host (weights read once, the dot products at the best rate measured);
- once per run, `vnni_peak_macs_per_ns`: the rate of VNNI's `vpdpbusd` alone on the same threads
  ([`kernels.vnni_peak`]), the bound of the VNNI loops (a layer's best rate over it says how close they come; the AMX
  tiles' rate can pass it).

With `--attention-keys N ...`, also the exact attention kernel (`kernels.exact_attention`, one layer, the target's
heads by default) for 1..rows query rows that end a sequence of N keys, as a verification call's rows do: the part of
a call's cost that grows with the context rather than with the weights.

Timings are medians over `--repeats` rounds in which the row counts are interleaved. Writes `kernel-rows.json` and
`kernel-rows.md` to `--out`.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ..cpu import kernels
from .provenance import run_meta

# the 1.5B target's linear layers (in_features, out_features): q/o, k/v, gate/up, down
TARGET_SHAPES = ((1536, 1536), (1536, 256), (1536, 8960), (8960, 1536))
KINDS = ("w4a8", "w8a8")
# the 1.5B target's attention: query heads, key/value heads, head size; and its layer count
TARGET_ATTENTION = (12, 2, 128)
TARGET_LAYERS = 28
# the kernels' row threshold for AMX tiles per measured path (kernels.amx_rows): their default, never, from one row
PATHS = {"default": kernels.AMX_ROWS, "vnni": 0, "amx": 1}
STREAM_BYTES = 256 << 20  # copies of a layer until their weights pass this size: far beyond any last-level cache


def _layer(kind: str, in_features: int, out_features: int, seed: int) -> torch.nn.Module:
    from ..cpu.quantization import W4A8Linear, W8A8Linear

    torch.manual_seed(seed)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    return {"w4a8": W4A8Linear, "w8a8": W8A8Linear}[kind].from_linear(linear)


def _weight_bytes(layer: torch.nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in layer.buffers())


def check_shapes(kinds, shapes) -> None:
    """A clear error before any work for a shape the kernels do not take."""
    for kind in kinds:
        step = 256  # W4A8Linear's super-blocks; W8A8Linear takes the same inputs (a target's layers beside them)
        for k, n in shapes:
            if k % step or n % 16 or k <= 0 or n <= 0:
                raise ValueError(f"--shapes {k}x{n}: {kind} needs in_features divisible by {step} and out_features by 16")


def measure_rows(kind: str, in_features: int, out_features: int, rows: int, repeats: int,
                 stream_bytes: int = STREAM_BYTES, paths: tuple[str, ...] = ("default",)) -> list[dict]:
    """One layer kind and shape: the cost of a call of 1..rows rows (see the module's docstring), one entry per path
    in `paths` (`PATHS`: the kernels' own choice, VNNI alone, AMX tiles from one row), timed interleaved."""
    first = _layer(kind, in_features, out_features, seed=0)
    size = _weight_bytes(first)
    copies = max(1, min(64, -(-stream_bytes // size)))
    layers = [first] + [_layer(kind, in_features, out_features, seed=i) for i in range(1, copies)]
    inputs = {r: torch.randn(1, r, in_features, dtype=torch.bfloat16) for r in range(1, rows + 1)}
    for path in paths:
        with kernels.amx_rows(PATHS[path]):
            for r in inputs:  # warm-up: every row count once
                for layer in layers:
                    layer(inputs[r] + 0)
    times = {path: {r: [] for r in inputs} for path in paths}
    for _ in range(repeats):
        for r, x in inputs.items():  # interleaved: a slow moment of the host falls on every row count and path alike
            for path in paths:
                fresh = [x + 0 for _ in layers]  # new tensors: each layer quantizes its rows anew, as in a forward
                with kernels.amx_rows(PATHS[path]):
                    start = time.perf_counter()
                    for layer, xi in zip(layers, fresh):
                        layer(xi)
                    times[path][r].append((time.perf_counter() - start) / len(layers))
    entries = []
    for path in paths:
        ms = {r: 1e3 * statistics.median(t) for r, t in times[path].items()}
        macs = in_features * out_features
        rate = {r: macs * r / (ms[r] * 1e6) for r in ms}
        peak = max(rate.values())
        entries.append(dict(kind=kind, path=path, in_features=in_features, out_features=out_features, weight_bytes=size,
                            copies=copies, ms=ms, ratio={r: ms[r] / ms[1] for r in ms}, gb_per_s=size / (ms[1] * 1e6),
                            macs_per_ns=rate, peak_macs_per_ns=peak,
                            bound={r: max(ms[1], macs * r / (peak * 1e6)) / ms[1] for r in ms}))
    return entries


def measure_attention(keys: int, rows: int, repeats: int, heads: int, kv_heads: int, head_dim: int) -> dict:
    """The exact attention kernel, one layer: ms per call of 1..rows query rows at positions keys - r .. keys - 1 of a
    causal sequence of `keys` keys (each row sees the keys up to its own), interleaved over `repeats` rounds."""
    g = torch.Generator().manual_seed(0)
    key, value = (torch.randn(1, kv_heads, keys, head_dim, generator=g).bfloat16() for _ in range(2))
    calls = {}
    for r in range(1, min(rows, keys) + 1):
        query = torch.randn(1, heads, r, head_dim, generator=g).bfloat16()
        lo, hi = torch.zeros(1, r, dtype=torch.int64), torch.arange(keys - r + 1, keys + 1).view(1, r)
        calls[r] = (query, lo, hi)
    scaling = head_dim ** -0.5
    for query, lo, hi in calls.values():  # warm-up
        kernels.exact_attention(query, key, value, lo, hi, scaling)
    times = {r: [] for r in calls}
    for _ in range(repeats):
        for r, (query, lo, hi) in calls.items():
            start = time.perf_counter()
            kernels.exact_attention(query, key, value, lo, hi, scaling)
            times[r].append(time.perf_counter() - start)
    ms = {r: 1e3 * statistics.median(t) for r, t in times.items()}
    return dict(keys=keys, heads=heads, kv_heads=kv_heads, head_dim=head_dim, ms=ms,
                ratio={r: ms[r] / ms[1] for r in ms})


def _attention_lines(report: dict) -> list[str]:
    entries = report.get("attention") or []
    if not entries:
        return []
    rows = sorted({int(r) for e in entries for r in e["ms"]})
    shown = [r for r in rows if r in (1, 2, 4, 8, 12, 16) or r == rows[-1]]
    e0 = entries[0]
    shape = (e0["heads"], e0["kv_heads"], e0["head_dim"])
    model = (f"; times {report.get('layers_per_model', TARGET_LAYERS)} for the 1.5B target's forward"
             if shape == TARGET_ATTENTION else "")
    lines = ["", f"The exact attention kernel, one layer ({e0['heads']} query heads, {e0['kv_heads']} key/value heads, "
             f"head size {e0['head_dim']}): ms per call of r rows ending a sequence of N keys (ratio to one row){model}.",
             "",
             "| keys | " + " | ".join(f"{r} rows" for r in shown) + " |", "|---|" + "---|" * len(shown)]
    for e in entries:
        lines.append(f"| {e['keys']} | " + " | ".join(
            f"{e['ms'][r]:.3f} ({e['ratio'][r]:.2f}x)" if r in e["ms"] else "–" for r in shown) + " |")
    return lines


def markdown(report: dict) -> str:
    rows = sorted({int(r) for entry in report["layers"] for r in entry["ms"]}) or [1]
    shown = [r for r in rows if r in (1, 2, 4, 8, 12, 16) or r == rows[-1]]
    lines = [f"Command: `{report['command']}`", "",
             f"Host: {report['host'].get('cpu')}, {report['threads']} threads; AMX: {report['amx']} (tiles granted: "
             f"{report.get('amx_tiles')}), "
             f"AVX512-VNNI: {report['vnni']}. Per layer: ms per call of r rows (ratio to one row), the one-row call's "
             "bandwidth, the best multiply-add rate seen, and the least ratio at the largest r any schedule could "
             "reach at that rate.", "",
             f"VNNI's vpdpbusd alone, on the same threads: {report['vnni_peak_macs_per_ns']:.0f} multiply-adds a ns "
             "(the last column: each layer's best rate over it).", "",
             "| layer | " + " | ".join(f"{r} rows" for r in shown) + " | GB/s at 1 row | peak MACs/ns | "
             f"bound at {rows[-1]} rows | of vpdpbusd's rate |",
             "|---|" + "---|" * len(shown) + "---|---|---|---|"]
    if not report["layers"]:  # --kinds with none: the attention alone
        lines = lines[:2] + [f"Host: {report['host'].get('cpu')}, {report['threads']} threads."]
    several = len({e.get("path", "default") for e in report["layers"]}) > 1  # label each row with its path
    for e in report["layers"]:
        cells = [f"{e['ms'][r]:.3f} ({e['ratio'][r]:.2f}x)" for r in shown]
        path = f" ({e.get('path', 'default')})" if several else ""
        lines.append(f"| {e['kind']} {e['in_features']}x{e['out_features']}{path} | " + " | ".join(cells) +
                     f" | {e['gb_per_s']:.1f} | {e['peak_macs_per_ns']:.0f} | {e['bound'][rows[-1]]:.2f}x | "
                     f"{e['peak_macs_per_ns'] / report['vnni_peak_macs_per_ns']:.0%} |")
    return "\n".join(lines + _attention_lines(report)) + "\n"


def run_kernel_rows(args) -> dict:
    from ..cpu import kernels
    from ..host import cpuinfo_field

    if not kernels.available():
        raise SystemExit(f"pacer-bench kernel-rows: pacer's kernels do not run here: {kernels.unavailable_reason()}")
    if args.threads:
        torch.set_num_threads(args.threads)
    flags = (cpuinfo_field("flags") or "").split()
    shapes = [tuple(s) for s in args.shapes]
    vnni_peak = kernels.vnni_peak()  # before the layers: nothing of theirs in flight
    layers = []
    for kind in args.kinds:
        for k, n in shapes:
            print(f"kernel-rows: {kind} {k}x{n}, 1..{args.rows} rows", file=sys.stderr, flush=True)
            layers += measure_rows(kind, k, n, args.rows, args.repeats, stream_bytes=args.stream_mb << 20,
                                   paths=tuple(args.paths))
    attention = []
    for keys in args.attention_keys or ():
        print(f"kernel-rows: exact attention over {keys} keys, 1..{args.rows} rows", file=sys.stderr, flush=True)
        attention.append(measure_attention(keys, args.rows, args.repeats, *args.attention_heads))
    report = dict(layers=layers, attention=attention, layers_per_model=TARGET_LAYERS, threads=torch.get_num_threads(), vnni_peak_macs_per_ns=vnni_peak, amx="amx_int8" in flags,
                  amx_tiles=kernels.amx_available(),
                  vnni="avx512_vnni" in flags, **run_meta(getattr(args, "argv", None)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kernel-rows.json").write_text(json.dumps(report, indent=1))
    (out / "kernel-rows.md").write_text(markdown(report))
    print(markdown(report))
    print(f"pacer-bench: wrote {out / 'kernel-rows.json'}, {out / 'kernel-rows.md'}")
    return report
