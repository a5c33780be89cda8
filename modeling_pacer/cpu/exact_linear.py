"""Linear layers whose every output row is computed the same way whatever the number of rows in the call,
on the CPU that runs them.

CPU GEMM kernels pick their code path by the row count M: a single row (a decoding step) may go through
a matrix-vector path, a few rows through one micro-kernel, more rows through another blocking (or AMX
tiles), each summing in another order. A row's result is then a function of the row *and of the call's
size*, and a verification block, a prefill and a decoding step compute different numbers for the same
token, enough to flip a near-tie. Which sizes share a path is a property of the host's kernels, not of
the model: on one AMD EPYC host bf16 rows agree for M = 2..40 at every Qwen2.5 shape; on an Intel Xeon with
AMX, for M = 1..32 at some shapes and not beyond.

So the range is measured where it runs. [`row_runs`] calls a layer of the same class, shape and dtype on
M = 1..`PROBE_ROWS` rows (rows of one pool in a random order, so a row lands at other positions from call
to call; weights and inputs built so that any change in the order of the sums shows in the result) and
finds the runs of consecutive M whose rows agree bitwise with the previous M's; [`choose_range`]
takes one run `[lo, hi]`. [`exact_linears`] then makes every call of the layer fall inside it:

    rows < lo          -> zero rows appended up to lo, their results dropped   (a decoding step)
    lo <= rows <= hi   -> one call                                             (a verification block)
    rows > hi          -> chunks of hi rows, the last one padded up to lo      (a prefill)

so a row's result depends on the row alone, whether it comes as a step, a block or a 300-token prompt.
The probe runs once per host (CPU model and flags, torch version, thread count) and layer kind (class,
shape, dtype) and is cached in `~/.cache/pacer/rows/`; a layer called under another thread count probes
again (threads change how the work is split). Where no run of two or more sizes exists, the layer falls
back to one row per call, invariant by construction, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import platform
import time
import types
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from ..host import cache_root, private_folder, trusted
from ..resources import write_json

ROWS_FORMAT = "pacer-rows/1"  # bump when the probe changes: older results are probed again
PROBE_ROWS = 40  # the largest call probed, so the largest chunk: holds a 20-token draft's verification (21 rows)
PROBE_VALUES = 1 << 18  # outputs compared per row count: a changed summation order shows in a few rounded values
PROBE_POOL = 512  # at most this many rows (the pool of a layer with few outputs: its calls are cheap, not free)
LARGE = 2.0**12  # the probe's cancelling inputs: partial sums this large leave their mark on the low bits
MIN_SPAN = 8  # a run this long is preferred to a shorter one that starts lower (fewer chunks, one call per block)


@dataclass(frozen=True)
class RowRange:
    """Row counts `lo..hi` (inclusive) for which a layer computes each row the same way."""

    lo: int
    hi: int

    def __post_init__(self):
        if not 1 <= self.lo <= self.hi:
            raise ValueError(f"a row range needs 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    def chunks(self, rows: int) -> list[tuple[int, int, int]]:
        """`(start, rows, padded rows)` of each call that computes `rows` rows inside the range."""
        out = []
        for start in range(0, rows, self.hi):
            n = min(self.hi, rows - start)
            out.append((start, n, max(n, self.lo)))
        return out


def _probe_inputs(size: int, in_features: int, dtype: torch.dtype, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rows (size, in), pairs (2, n))`: random rows in which the inputs at each pair of columns are one large
    value, so that a probe weight whose columns in each pair are opposite cancels them exactly. The sum stays
    small while its partial sums are large: any change in the order of the float32 additions changes the low
    bits of the result and so, most of the time, its rounding (with plain random inputs, rarely)."""
    pairs = torch.randperm(in_features, generator=generator)[: 2 * (in_features // 8)].view(2, -1)
    rows = torch.randn(size, in_features, generator=generator)
    big = LARGE * torch.where(torch.rand(size, pairs.shape[1], generator=generator) < 0.5, -1.0, 1.0)
    rows[:, pairs[0]] = big
    rows[:, pairs[1]] = big
    return rows.to(dtype), pairs


def probe_layer(module: torch.nn.Module, pairs: torch.Tensor, generator) -> torch.nn.Module:
    """A layer of `module`'s class, shape and dtype, with random weights whose columns `pairs[1]` are the
    negatives of columns `pairs[0]` (exactly, in the layer's own number format)."""
    from .quantization import Int4Linear, Int8Linear, W4A8Linear, W8A8Linear

    out_features, in_features = module.out_features, module.in_features
    has_bias = getattr(module, "bias", None) is not None
    if type(module) is Int4Linear:
        codes = torch.randint(1, 16, (out_features, in_features), generator=generator)
        codes[:, pairs[1]] = 16 - codes[:, pairs[0]]  # (c - 8) opposite; zeros 0: the weights are opposite
        groups = in_features // module.group_size
        scales = torch.rand(out_features, groups, generator=generator) / 8 + 1 / 64
        return Int4Linear(codes, scales, torch.zeros_like(scales), torch.zeros(out_features) if has_bias else None,
                          module.group_size)
    if type(module) is Int8Linear:
        codes = torch.randint(-127, 128, (out_features, in_features), generator=generator)
        codes[:, pairs[1]] = -codes[:, pairs[0]]
        scales = torch.rand(out_features, generator=generator) / 64 + 1 / 1024
        return Int8Linear(codes, scales, torch.zeros(out_features) if has_bias else None)
    if type(module) in (W4A8Linear, W8A8Linear):  # from a random float layer, in the layer's own format
        dense = torch.nn.Linear(in_features, out_features, bias=has_bias)
        with torch.no_grad():
            weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
            weight[:, pairs[1]] = -weight[:, pairs[0]]
            dense.weight.copy_(weight)
            if has_bias:
                dense.bias.zero_()
        return type(module).from_linear(dense)
    layer = type(module)(in_features, out_features, bias=has_bias, dtype=module.weight.dtype)  # nn.Linear or a subclass
    with torch.no_grad():
        weight = (torch.randn(out_features, in_features, generator=generator) / in_features**0.5).to(layer.weight.dtype)
        weight[:, pairs[1]] = -weight[:, pairs[0]]
        layer.weight.copy_(weight)
        if has_bias:
            layer.bias.zero_()
    return layer


def row_runs(module: torch.nn.Module, max_rows: int = PROBE_ROWS, seed: int = 0) -> list[RowRange]:
    """The row counts 1..max_rows split into maximal runs whose calls agree: within a run, every row computed
    in calls of M rows is bitwise that row computed in calls of M - 1 rows (so, by the chain, in calls of any
    size of the run). Measured on a [`probe_layer`] of `module`'s kind (the kernel's path depends on the class,
    shape and dtype, not on the weights' values) with [`_probe_inputs`], which make any change of summation
    order show.

    For each M, a pool of rows is fed through calls of exactly M rows, in a new random order (so every row lands
    at other positions of a call), wrapping around to fill the last call; the pool holds about `PROBE_VALUES`
    outputs (at least `max_rows` rows, at most `PROBE_POOL`)."""
    g = torch.Generator().manual_seed(seed)
    size = max(max_rows, min(PROBE_POOL, -(-PROBE_VALUES // module.out_features)))
    pool, pairs = _probe_inputs(size, module.in_features, _input_dtype(module), g)
    if getattr(module, "int8_activations", False):
        # a call's rows are quantized to int8 block by block: large cancelling inputs would round every other
        # input to 0 and the integer sums are exact anyway; plain random rows show any change in how the
        # blocks' float terms are combined
        pool = torch.randn(size, module.in_features, generator=g).to(torch.bfloat16)
    forward = _plain_forward(probe_layer(module, pairs, g))
    runs, start, previous = [], 1, None
    with torch.no_grad():
        for m in range(1, max_rows + 1):
            order = torch.randperm(size, generator=g)
            calls = -(-size // m)
            order = torch.cat([order, order[: calls * m - size]])
            rows = None
            for c in range(calls):
                picked = order[c * m : (c + 1) * m]
                result = forward(pool[picked].clone())
                if rows is None:
                    rows = result.new_empty(size, result.shape[-1])
                rows[picked] = result  # back in pool order
            if previous is not None and not torch.equal(rows, previous):
                runs.append(RowRange(start, m - 1))
                start = m
            previous = rows
    runs.append(RowRange(start, max_rows))
    return runs


def choose_range(runs: list[RowRange]) -> RowRange | None:
    """The run a layer's calls are kept in: the lowest-starting run at least `MIN_SPAN` long (or, if none is,
    as long as the longest); None where every run is a single size (no position independence was seen)."""
    longest = max(r.hi - r.lo + 1 for r in runs)
    if longest < 2:
        return None
    want = min(MIN_SPAN, longest)
    return next(r for r in runs if r.hi - r.lo + 1 >= want)


# --------------------------------------------------------------------------------------------------
# measured once per host and layer kind
# --------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _cpu() -> tuple:
    from ..host import cpuinfo_field

    flags = cpuinfo_field("flags") or ""
    return (cpuinfo_field("model name") or platform.processor() or platform.machine(),
            hashlib.sha256(" ".join(sorted(flags.split())).encode()).hexdigest()[:16])


def describe_cpu() -> dict:
    """The CPU and runtime a kernel's row behaviour belongs to: model name, a digest of its flags (amx_bf16,
    avx512_bf16, ... decide the kernels), torch's CPU capability and version, and the thread count."""
    cpu, flags = _cpu()
    return dict(cpu=cpu, flags=flags, capability=torch.backends.cpu.get_cpu_capability(), torch=torch.__version__,
                threads=torch.get_num_threads())


def describe_layer(module: torch.nn.Module) -> dict:
    """What decides a layer's kernel: its class, shape, weight dtype and, for packed kernels, group size."""
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = next(iter(module.buffers()))
    return dict(cls=f"{type(module).__module__}.{type(module).__qualname__}", in_features=module.in_features,
                out_features=module.out_features, dtype=str(weight.dtype), bias=getattr(module, "bias", None) is not None,
                group_size=getattr(module, "group_size", None))


_SEEN: dict[str, RowRange | None] = {}  # this process's probes, by cache key


def _rows_file(folder, name: str) -> Path:
    """Where a layer kind's probe is kept: `folder` (default the cache's `rows/`) where this user alone can have
    written it, else a private folder. A row range decides what "exact" verification computes: a file planted in a
    shared cache would silently make it inexact, so it is never read."""
    root = Path(folder) if folder is not None else cache_root()
    path = (Path(folder) if folder is not None else cache_root() / "rows") / name
    if not path.exists() or trusted(path, root):
        return path
    if name not in _UNTRUSTED:
        _UNTRUSTED.add(name)
        warnings.warn(f"{path} is not trusted (another user owns it, or others can write its folder): probing again, "
                      f"kept in {private_folder('rows')}", stacklevel=4)
    return private_folder("rows") / name


_UNTRUSTED: set[str] = set()


def host_row_range(module: torch.nn.Module, *, folder=None, refresh: bool = False, max_rows: int = PROBE_ROWS):
    """`module`'s [`RowRange`] on this host under the current thread count (None: no range, one row per call),
    read from the cache or probed (seconds for the largest layers) and cached."""
    fields = dict(format=ROWS_FORMAT, host=describe_cpu(), layer=describe_layer(module), max_rows=max_rows)
    key = hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:20]
    if not refresh and key in _SEEN:
        return _SEEN[key]
    path = _rows_file(folder, f"{key}.json")
    runs = None
    if not refresh and path.is_file() and trusted(path, path.parent):
        try:
            saved = json.loads(path.read_text())
            runs = [RowRange(*r) for r in saved["runs"]]
        except (ValueError, KeyError, TypeError):
            runs = None  # unreadable or from another version: probe again
    if runs is None:
        started = time.perf_counter()
        runs = row_runs(module, max_rows)
        record = dict(fields, runs=[[r.lo, r.hi] for r in runs], seconds=time.perf_counter() - started,
                      measured_at=time.time())
        try:
            write_json(path, record)
        except OSError:
            pass  # a read-only cache: the probe stands for this process
    chosen = choose_range(runs)
    if chosen is None and key not in _SEEN:  # once per process and layer kind
        warnings.warn(
            f"{describe_layer(module)}: no two row counts up to {max_rows} compute a row alike on this CPU; "
            "exact verification falls back to one row per call (exact, slow)", stacklevel=3)
    _SEEN[key] = chosen
    return chosen


def _input_dtype(module) -> torch.dtype:
    # the packed kernels take bf16 activations whatever they are handed; a float layer takes its weight's dtype
    weight = getattr(module, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) and weight.is_floating_point() else torch.bfloat16


def _plain_forward(module):
    """The layer's own forward on a 2-D input, bypassing the row-invariant wrapper."""
    return types.MethodType(type(module).forward, module)


# --------------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------------
def _row_invariant_forward(self, x: torch.Tensor) -> torch.Tensor:
    """The layer's forward, with every call cut into calls whose row counts lie in the layer's range."""
    rows = x.numel() // self.in_features
    flat = x.reshape(rows, self.in_features)
    span = self._pacer_rows
    if span is None:  # measured on this host, once per thread count
        threads = torch.get_num_threads()
        span = self._pacer_probed.get(threads)
        if span is None:
            span = self._pacer_probed[threads] = host_row_range(self) or RowRange(1, 1)
    forward = self._pacer_plain_forward
    if span.lo <= rows <= span.hi:
        out = forward(flat.contiguous())
    else:
        parts = []
        for start, n, padded in span.chunks(rows):
            chunk = flat[start : start + n]
            if padded > n:
                chunk = torch.cat([chunk, chunk.new_zeros(padded - n, self.in_features)])
            parts.append(forward(chunk.contiguous())[:n])
        out = torch.cat(parts) if len(parts) > 1 else parts[0]
    return out.reshape(*x.shape[:-1], self.out_features)


def exact_kind(module: torch.nn.Module) -> bool:
    """A layer `exact_linears` handles: torch's `nn.Linear` and pacer's packed int4/int8/W4A8/W8A8 layers, whose
    rows are independent of each other (torch's dynamic-int8 Linear is not: it scales a call's activations by
    the call's own range; pacer's W4A8 scales each row by its own)."""
    from .quantization import Int4Linear, Int8Linear, W4A8Linear, W8A8Linear

    return type(module) in (torch.nn.Linear, Int4Linear, Int8Linear, W4A8Linear, W8A8Linear)


def exact_linears(model: torch.nn.Module, rows: RowRange | tuple[int, int] | None = None) -> torch.nn.Module:
    """Make every linear layer of `model` (this instance only; see [`exact_kind`]) compute a row the same way
    whatever the number of rows it is fed. Returns the model.

    `rows`: force one range `(lo, hi)` for every layer (tests use a narrow one, e.g. (4, 8), so that
    padding and chunking run on any host); default: each layer's range as measured on this host
    ([`host_row_range`]), probed on its first call under each thread count.
    """
    forced = None if rows is None else rows if isinstance(rows, RowRange) else RowRange(*rows)
    dense = [name for name, m in model.named_modules() if getattr(m, "dense_rows", None) is not None]
    if dense:
        raise ValueError(
            f"exact_linears: {dense[0]} (and {len(dense) - 1} more) runs long calls on a dense copy of its int4 weight "
            "(dense_rows), so its rows depend on the call's size: a draft's option, never an exact model's"
        )
    for module in model.modules():
        if exact_kind(module):
            module._pacer_rows = forced
            module._pacer_probed = {}
            module._pacer_plain_forward = _plain_forward(module)
            module.forward = types.MethodType(_row_invariant_forward, module)
    return model


def is_exact_linear(module: torch.nn.Module) -> bool:
    """True for a layer [`exact_linears`] has wrapped."""
    return hasattr(module, "_pacer_rows")
