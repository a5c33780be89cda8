"""pacer's CPU kernels (`vnni_matmul.cpp`), registered as torch operators (`ops.cpp`: `torch.ops.pacer.*`, with
fake kernels for torch.compile), compiled for this CPU and this torch on first use and cached.

torch's CPU int4 and int8 weight-only kernels compute in float, one multiply-add per weight and row, so their
cost grows with the rows of a call (a verification block of 8 tokens costs about 3.5 single steps over the
4-bit target). The W4A8/W8A8 kernels quantize the activations to int8 and multiply with VNNI's integer dot
products, unpacking each weight tile once for all the rows of a call: a few rows cost about one weight read,
until the dot products bound the call (from about 4 to 8 rows, by host: `pacer-bench kernel-rows`). Integer sums
are exact and each row runs the same instructions whatever the call's size or thread count, so their results are
row-invariant by construction (still probed where they run, like every exact layer).

On a CPU with AMX-INT8 (Sapphire Rapids and later; probed at build and at run time: Linux must grant the process the
tile state), Q4_K and int8 calls of [`AMX_ROWS`] rows or more take their integer sums from AMX tiles instead: the
same sums, so every row keeps its bits whatever path its call takes; `amx_rows` sets the threshold (0: VNNI alone).

[`int4_matmul`] is a draft's: torch's int4 grid (groups of 32) times activations quantized to int8 per row in blocks
of 32, on the same VNNI dot products; at one row on a 0.5B draft's shapes it runs at two to three times the speed of
torch's int4 kernel, which converts every weight to float.

`ops.cpp` (which includes the kernels' file) is compiled with the host's C++ compiler (`$CXX`, else `c++`),
`-march=native` and torch's own headers and libraries (`torch.utils.cpp_extension.include_paths()` /
`library_paths()`, its C++ ABI) into `~/.cache/pacer/kernels/`, keyed by the sources, the compiler, torch's version
and the CPU, once per machine under a cross-process lock, and loaded with `torch.ops.load_library`; a host without
AVX512-VNNI or without a compiler gets `available() == False` and a reason, and the callers keep torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ...host import build_once, cache_root, cpuinfo_field, private_folder, trusted

SOURCE = Path(__file__).with_name("vnni_matmul.cpp")  # the kernels (raw pointers)
OPS = Path(__file__).with_name("ops.cpp")  # their torch operators; includes SOURCE
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
ABI = 16  # pacer_kernel_abi() of the source this module calls


def _torch_flags() -> list[str]:
    """What compiling against torch takes, as torch's extension machinery gives it: its headers, libraries and C++ ABI."""
    from torch.utils.cpp_extension import include_paths, library_paths

    flags = [f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    flags += [f for path in include_paths() for f in ("-isystem", path)]
    for path in library_paths():
        flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    return flags + ["-lc10", "-ltorch_cpu", "-ltorch"]


def _cache_dir() -> Path:
    return cache_root() / "kernels"


def _build(compiler: str, target: Path) -> str:
    """Compile the source into `target` once, under the entry's cross-process lock (a second process waits, then
    finds it built). Returns "" or why it failed."""
    with build_once(target, f"pacer's kernels for this CPU ({SOURCE.name})"):
        if target.exists():
            return ""
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            done = subprocess.run([compiler, *FLAGS, "-o", str(built), str(OPS), *_torch_flags()], capture_output=True,
                                  text=True)
            if done.returncode:
                return f"compiling {OPS.name} failed: {done.stderr.strip()[-2000:]}"
            os.replace(built, target)
    return ""


def _load_library(path: Path) -> None:
    """Load a built library into this process: its `TORCH_LIBRARY` registers the `pacer` operators."""
    torch.ops.load_library(str(path))


def _open(compiler: str, name: str) -> tuple[object | None, str]:
    """The library `name`, built if needed and loaded: from the cache where this user alone can have put it there,
    else (a cache another user can write to, a read-only or noexec one) from a private folder, with a warning. Loading
    a library runs its code: a file planted in a shared cache is never loaded."""
    reasons = []
    for folder, root in ((_cache_dir(), cache_root()), (None, None)):
        try:
            if folder is None:
                folder = private_folder("kernels")
                root = folder
            target = folder / name
            why = _build(compiler, target)
            if why:
                return None, why
            if not trusted(target, root):
                reasons.append(f"{target} is not trusted (owned by another user, or a folder others can write to)")
                continue
            _load_library(target)
            library = torch.ops.pacer
        except OSError as error:  # a read-only cache, a noexec mount
            reasons.append(f"{folder}: {error}")
            continue
        if reasons:
            warnings.warn(f"pacer's kernels: {'; '.join(reasons)}; built in {folder} instead", stacklevel=4)
        return library, ""
    return None, "; ".join(reasons)


@functools.lru_cache(maxsize=1)
def _load() -> tuple[object | None, str]:
    """`(library, "")`, or `(None, why not)`."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the VNNI kernels are built for x86-64 Linux, not {platform.system()} {platform.machine()}"
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not compiler:
        return None, "no C++ compiler found (set $CXX or install g++)"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as error:
        return None, f"{compiler} --version failed: {error}"
    cpu_flags = cpuinfo_field("flags") or platform.processor()
    key = hashlib.sha256("\0".join([SOURCE.read_text(), OPS.read_text(), compiler, version, " ".join(FLAGS), cpu_flags,
                                    torch.__version__]).encode())
    name = f"vnni_matmul-{key.hexdigest()[:20]}.so"
    library, why = _open(compiler, name)
    if library is None:
        return None, why
    if library.kernel_abi() != ABI:
        return None, f"{name} is built from another version of {SOURCE.name}"
    if not library.vnni_available():
        return None, "this CPU has no AVX512-VNNI (avx512_vnni, avx512bw): torch's kernels are used"
    _register_fakes()
    return library, ""


def _register_fakes() -> None:
    """Shapes and dtypes of each operator's outputs, for FakeTensor tracing (torch.compile, torch.export): the
    operators then stand in a compiled graph as one node each instead of breaking it."""
    fake = torch.library.register_fake

    @fake("pacer::quantize_rows")
    def _(x, block):
        rows, k = x.shape
        return (x.new_empty((rows, k), dtype=torch.int8), x.new_empty((rows, k // block), dtype=torch.float32),
                x.new_empty((rows, k // 32), dtype=torch.int16))

    def matmul(q, n, bf16):
        return q.new_empty((q.shape[0], n), dtype=torch.bfloat16 if bf16 else torch.float32)

    fake("pacer::q4k_matmul")(lambda packed, sc, mn, dd, n, q, scale, sums, bias, bf16: matmul(q, n, bf16))
    fake("pacer::q8_matmul")(lambda packed, wscale, n, q, scale, sums, bias, bf16: matmul(q, n, bf16))
    fake("pacer::int4_matmul")(lambda packed, sz, n, q, scale, sums, bias, bf16: matmul(q, n, bf16))
    fake("pacer::int4_matmul_bf16")(lambda packed, sz, n, x, bias, bf16: matmul(x, n, bf16))

    @fake("pacer::exact_attention")
    def _(query, key, value, lo, hi, scaling):
        batch, heads, rows, dim = query.shape
        return query.new_empty((batch, rows, heads, dim), dtype=torch.float32)

    @fake("pacer::layer_qkv")
    def _(hidden, norm, eps, kinds, packed, a, mn, dd, bias, n, cos, sin, head_dim):
        rows = hidden.shape[0]
        return tuple(hidden.new_empty((1, size // head_dim, rows, head_dim), dtype=torch.bfloat16) for size in n)

    @fake("pacer::layer_qkv_cached")
    def _(hidden, norm, eps, kinds, packed, a, mn, dd, bias, n, cos, sin, head_dim, keys, values, at, slots=None):
        return hidden.new_empty((1, n[0] // head_dim, hidden.shape[0], head_dim), dtype=torch.bfloat16)

    fake("pacer::decoder_layers")(
        lambda hidden, cos, sin, head_dim, scaling, norms, eps, kinds, packed, a, mn, dd, bias, n, keys, values, held,
        slots=None, lo=None, hi=None: torch.empty_like(hidden))
    fake("pacer::layer_rest")(
        lambda q, keys, values, scaling, hidden, norm, eps, kinds, packed, a, mn, dd, bias, n, lo=None, hi=None:
        torch.empty_like(hidden))


def available() -> bool:
    """True when the kernels are built (or can be) and this CPU runs them."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why `available()` is False ("" when it is True)."""
    return _load()[1]


def amx_available() -> bool:
    """True where the kernels can use AMX tiles (this CPU has AMX-INT8, the compiler built them, and Linux granted this
    process the tile state). The tiles give every row bitwise what the VNNI loops give it."""
    return available() and bool(_library().amx_available())


def vnni_peak(threads: int | None = None, iterations: int = 2_000_000) -> float:
    """Multiply-adds a ns that `threads` threads (default: torch's) reach running VNNI's `vpdpbusd` alone, 12
    independent chains each, all at once: the bound no call of the kernels can pass (each does at least one such
    instruction per 64 multiply-adds). A measurement, as noisy as the host; run it with nothing else computing."""
    threads = threads or torch.get_num_threads()
    if threads < 1 or iterations < 1:
        raise ValueError(f"vnni_peak: threads and iterations must be positive, got {threads} and {iterations}")
    _library().vnni_peak(iterations // 10, threads)  # warm-up: clocks and the vector units' power-up
    return float(_library().vnni_peak(iterations, threads))


def bf16_tiles_available() -> bool:
    """True where [`int4_matmul_bf16`] runs: AMX-BF16 tiles and AVX512-BF16 (the compiler built them, Linux granted
    the tile state)."""
    return available() and bool(_library().bf16_tiles_available())


# the kernels' default: calls of this many rows or more go to the tiles. Fewer stay on VNNI, which is as fast up to
# its 8-row block (`pacer-bench kernel-rows --paths vnni amx`: the tiles' fixed cost a group of 32 inputs, their
# sums stored and scaled row by row, outweighs VNNI's dot products until VNNI needs a second pass over the weights)
AMX_ROWS = 9


def amx_setting() -> int:
    """The row count from which calls use the AMX tiles now (0: never, or no tiles here)."""
    return int(_library().set_amx_rows(-1)) if available() else 0


@contextlib.contextmanager
def amx_rows(rows: int):
    """Within the block, Q4_K and int8 calls of at least `rows` rows use the AMX tiles (0: none, VNNI alone); the
    setting is the process's (the kernels read one global). No effect where `amx_available()` is False. Results do
    not change: the tiles compute the same integer sums. For measuring each path (`pacer-bench kernel-rows --amx`)."""
    if rows < 0:
        raise ValueError(f"amx_rows: rows must be >= 0, got {rows}")
    if not available():
        yield
        return
    previous = _library().set_amx_rows(rows)
    try:
        yield
    finally:
        if _library().amx_available():
            _library().set_amx_rows(previous)


CPU_ONLY = (
    "pacer's quantized layers and fused draft steps run on the CPU only (their weights are packed for CPU kernels). "
    "For a GPU, load the model without pacer's CPU quantization (load_pair(..., quantize_draft=False), no "
    "quantize_target), or with bitsandbytes, and move it there before generating"
)


def require_cpu(*tensors: torch.Tensor | None) -> None:
    """Refuse tensors that are not in host memory, before any raw pointer to them reaches the kernels (which would
    read a GPU address as host memory): a model quantized or fused by pacer, then moved with `.to("cuda")`."""
    for t in tensors:
        if t is not None and t.device.type != "cpu":
            raise RuntimeError(f"{CPU_ONLY}: this call was handed a tensor on {t.device}.")


_OPS = None  # torch.ops.pacer once loaded: a plain global, which torch.compile reads as a constant


def _library():
    """`torch.ops.pacer`, built and loaded (a RuntimeError naming why where it cannot be)."""
    global _OPS
    if _OPS is None:
        library, why = _load()
        if library is None:
            raise RuntimeError(f"pacer's VNNI kernels are not available: {why}")
        _OPS = library
    return _OPS


class QuantizedRows:
    """A call's activations as the kernels read them: int8 rows in blocks of `block` inputs (256 for
    [`q4k_matmul`], 32 for [`q8_matmul`] and [`int4_matmul`]) with one scale per block, and the sum of each 32
    codes."""

    def __init__(self, x: torch.Tensor, block: int = 256):
        if block not in (32, 256):
            raise ValueError(f"QuantizedRows: block must be 32 or 256, got {block}")
        if x.dim() != 2 or x.shape[1] % block:
            raise ValueError(f"QuantizedRows: needs (rows, k) with k divisible by {block}, got {tuple(x.shape)}")
        require_cpu(x)
        x = x.to(torch.bfloat16).contiguous()
        self.rows, self.k = x.shape
        self.block = block
        self.q, self.scale, self.group_sums = _library().quantize_rows(x, block)


def _check_output(n: int, bias, dtype) -> bool:
    """Whether the kernels write bfloat16 (else float32); a bias they cannot read is refused."""
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"the kernels write float32 or bfloat16, not {dtype}")
    if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"bias must be a contiguous float32 tensor of shape ({n},)")
    return dtype == torch.bfloat16


def q4k_matmul(x: QuantizedRows, packed, sc, mn, dd, n: int, bias: torch.Tensor | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`(rows, n)`: the rows of `x` (blocks of 256) times a Q4_K weight packed by `pack_q4k`, plus `bias` (float32),
    computed in float32 and written as `dtype` (float32, or bfloat16 rounded to nearest even)."""
    if x.block != 256:
        raise ValueError("q4k_matmul reads activations quantized in blocks of 256")
    require_cpu(packed, sc, mn, dd, bias)
    bf16 = _check_output(n, bias, dtype)
    return _library().q4k_matmul(packed, sc, mn, dd, n, x.q, x.scale, x.group_sums, bias, bf16)


def q8_matmul(x: QuantizedRows, packed, scale, n: int, bias: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`(rows, n)`: the rows of `x` (blocks of 32) times an int8 weight packed by `pack_q8`, plus `bias`, as
    [`q4k_matmul`] writes them."""
    if x.block != 32:
        raise ValueError("q8_matmul reads activations quantized in blocks of 32")
    require_cpu(packed, scale, bias)
    bf16 = _check_output(n, bias, dtype)
    return _library().q8_matmul(packed, scale, n, x.q, x.scale, x.group_sums, bias, bf16)


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales_zeros: torch.Tensor, n: int,
                bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """`(rows, n)`: the rows of `x` ((rows, k), taken as bf16, quantized to int8 in blocks of 32: [`QuantizedRows`])
    times an int4 weight packed by [`pack_int4`], plus `bias` (float32), in float32, written as `dtype`. Each weight
    tile is unpacked once for up to 8 rows; each row's result depends on that row alone."""
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"int4_matmul: needs (rows, k) with k divisible by 32, got {tuple(x.shape)}")
    require_cpu(packed, scales_zeros, bias)
    rows = QuantizedRows(x, block=32)
    bf16 = _check_output(n, bias, dtype)
    return _library().int4_matmul(packed, scales_zeros, n, rows.q, rows.scale, rows.group_sums, bias, bf16)


# Int4Linear(prompt_tiles=True) sends calls of this many rows or more (a prompt) to int4_matmul_bf16: its weights'
# dequantization, once a call, costs about what the int8 path's work per group and row costs for 32 rows (measured
# on an Intel Xeon with AMX, the 0.5B draft's shapes: even at 33 rows, 1.5-1.8x faster at 64, 2.2x at 200)
BF16_TILE_ROWS = 32


def int4_matmul_bf16(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor, n: int,
                     bias: torch.Tensor | None = None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """As [`int4_matmul`], for a prompt on AMX-BF16 tiles ([`bf16_tiles_available`]): the weight dequantized to bf16
    once a call (its grid's values), `x`'s rows not quantized, float sums. Each row's result depends on that row alone,
    but is not [`int4_matmul`]'s: for a draft's prompt (`Int4Linear(prompt_tiles=True)`), whose numbers change which
    tokens it proposes, never the output."""
    if x.dim() != 2 or x.shape[1] % 32:
        raise ValueError(f"int4_matmul_bf16: needs (rows, k) with k divisible by 32, got {tuple(x.shape)}")
    if not bf16_tiles_available():
        raise RuntimeError("int4_matmul_bf16: this CPU, compiler or process has no AMX-BF16 tiles (bf16_tiles_available)")
    require_cpu(x, packed, scales_and_zeros, bias)
    bf16 = _check_output(n, bias, dtype)
    return _library().int4_matmul_bf16(packed, scales_and_zeros, n, x.to(torch.bfloat16).contiguous(), bias, bf16)


# the kinds of linear layer the fused layers read (vnni_matmul.cpp's Weight): int4 (an Int4Linear(kernel="pacer")),
# Q4_K (a W4A8Linear), int8 (a W8A8Linear)
LINEAR_KINDS = {"int4": 0, "q4k": 1, "int8": 2}


def layer_qkv(hidden: torch.Tensor, norm: torch.Tensor, eps: float, weights, cos: torch.Tensor,
              sin: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """New tokens' `hidden` ((m, size), bf16, contiguous) -> RMSNorm (`norm`, `eps`) -> the q, k, v projections
    (`weights`: six lists of three, as `modeling_pacer.cpu.fused_layers` reads a layer's buffers: kinds
    (`LINEAR_KINDS`), packed weights, first scales, Q4_K minima or None, Q4_K super-scales or None, float biases or
    None, and one list of output sizes) -> rotary embeddings (`cos`, `sin`: (m, `head_dim`), bf16). Returns q
    (1, heads, m, d), k and v (1, kv_heads, m, d), bf16, as transformers' attention hands them to its cache; each row
    as a one-row call gives it."""
    require_cpu(hidden, norm, cos, sin)  # the weights: the dispatcher refuses them elsewhere (a CPU kernel only)
    return _library().layer_qkv(hidden, norm, eps, *weights, cos, sin, head_dim)


def layer_qkv_cached(hidden: torch.Tensor, norm: torch.Tensor, eps: float, weights, cos: torch.Tensor,
                     sin: torch.Tensor, head_dim: int, keys: torch.Tensor, values: torch.Tensor, at: int,
                     slots: torch.Tensor | None = None) -> torch.Tensor:
    """[`layer_qkv`] writing k and v in place into a cache's buffers `keys` / `values` ((1, kv_heads, capacity,
    head_dim), bf16, contiguous) at positions `at` .. `at + m - 1`, instead of returning them; returns q. The same
    bits as [`layer_qkv`]'s k and v: only where they are stored differs. `slots` ((m,) int64): row r's position
    instead (the rows of several sequences packed into one call, each at its own sequence's place; `at` unused)."""
    require_cpu(hidden, norm, cos, sin, keys, values)
    if keys.dtype != torch.bfloat16 or values.dtype != torch.bfloat16:
        raise ValueError(f"layer_qkv_cached: the cache buffers must be bf16, got {keys.dtype} / {values.dtype}")
    return _library().layer_qkv_cached(hidden, norm, eps, *weights, cos, sin, head_dim, keys, values, at, slots)


def layer_rest(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float, hidden: torch.Tensor,
               norm: torch.Tensor, eps: float, weights, lo: torch.Tensor | None = None,
               hi: torch.Tensor | None = None) -> torch.Tensor:
    """The rest of a decoder layer for the m new tokens: `q` (1, heads, m, d) attends to `keys`/`values`
    (1, kv_heads, length, d, the new tokens last, each head's rows contiguous: a tensor of their own or the first
    positions of a cache's buffer; row r sees keys 0..length - m + r, or `lo[r]`..`hi[r] - 1` where the bounds are
    given, (m,) int64 each: a packed call's rows, each seeing its own sequence's keys), then o_proj, the residual onto
    `hidden` (m, size), RMSNorm (`norm`, `eps`), the SiLU-gated MLP and its residual. `weights`: the o, gate, up,
    down layers' as [`layer_qkv`] reads them. bf16 in and out, (m, size)."""
    require_cpu(q, keys, values, hidden, norm)
    return _library().layer_rest(q, keys, values, scaling, hidden, norm, eps, *weights, lo, hi)


def decoder_layers(hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, scaling: float,
                   norms: list, eps: list, weights, keys: list, values: list, held: list,
                   rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """A model's decoder layers in one call, each as [`layer_qkv_cached`] then [`layer_rest`] compute it (the same
    bits), layer l's keys and values written into `keys[l]` / `values[l]` ((1, kv_heads, capacity, head_dim) bf16,
    contiguous) after the `held[l]` positions they hold. `norms` / `eps`: two a layer (before attention, after it);
    `weights`: seven projections a layer (q, k, v, o, gate, up, down) as [`layer_qkv`] reads three. `hidden` (m, size)
    bf16 -> (m, size) bf16. `rows`: `(slots, lo, hi)`, (m,) int64 each, for a packed call: every layer writes row r at
    `slots[r]` and row r attends to keys `lo[r]`..`hi[r] - 1` (`held` unused; the layers' buffers of one capacity)."""
    require_cpu(hidden, cos, sin, *norms, *keys, *values)
    if any(t.dtype != torch.bfloat16 for t in (*keys, *values)):
        raise ValueError("decoder_layers: the cache buffers must be bf16")
    return _library().decoder_layers(hidden, cos, sin, head_dim, scaling, norms, eps, *weights, keys, values, held,
                                     *(rows or (None, None, None)))


ATTENTION_SHAPES = "query heads divisible by key/value heads and a head size that is a multiple of 16 up to 256"


def attention_shape_ok(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the attention kernel takes this shape ([`ATTENTION_SHAPES`])."""
    return not (heads % kv_heads or head_dim % 16 or head_dim > 256)


def exact_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                    scaling: float) -> torch.Tensor:
    """pacer_exact attention in one call: `query` (B, H, M, D), `key`/`value` (B, KV, L, D), bf16; row (b, i)
    attends to keys `lo[b, i]..hi[b, i] - 1` ((B, M) int64). Returns (B, M, H, D) float32, each row computed
    alone by the same instructions whatever M, L or the thread count."""
    require_cpu(query, key, value, lo, hi)
    batch, heads, rows, dim = query.shape
    kv_heads = key.shape[1]
    if not attention_shape_ok(heads, kv_heads, dim) or query.dtype != torch.bfloat16:
        raise ValueError(f"exact_attention: needs bf16, {ATTENTION_SHAPES}; got {query.dtype}, head_dim {dim}, "
                         f"{heads}/{kv_heads} heads")
    q, k, v = (t.to(torch.bfloat16).contiguous() for t in (query, key, value))
    lo, hi = lo.to(torch.int64).contiguous(), hi.to(torch.int64).contiguous()
    return _library().exact_attention(q, k, v, lo, hi, scaling)


def pack_q4k(codes: torch.Tensor, sc: torch.Tensor, mn: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor):
    """Q4_K's parts -> the kernel's layout. codes (n, k) in 0..15; sc, mn (n, k / 32) in 0..63; d, dmin (n, k / 256)
    float, with w = d * sc * q - dmin * mn. Returns (packed codes, sc, mn pairs, d and dmin as float16 bits), tiled
    by 16 outputs in the layout `vnni_matmul.cpp`'s q4_tile reads."""
    n, k = codes.shape
    if n % 16 or k % 256:
        raise ValueError(f"pack_q4k: needs n divisible by 16 and k by 256, got {n} x {k}")
    t, b = n // 16, k // 256
    c = codes.to(torch.uint8).reshape(t, 16, b, 8, 8, 4).permute(0, 2, 3, 4, 1, 5).reshape(t, b, 8, 8, 64)
    packed = (c[:, :, :, :4] | (c[:, :, :, 4:] << 4)).contiguous()
    tile = lambda v, per: v.reshape(t, 16, b, per).permute(0, 2, 3, 1).contiguous()  # noqa: E731
    # the minima of groups 2p, 2p + 1 side by side per output: (t, b, 4, 16, 2)
    mn_pairs = mn.to(torch.uint8).reshape(t, 16, b, 4, 2).permute(0, 2, 3, 1, 4).contiguous()
    # d and dmin as float16 (Q4_K stores them so: exact), (t, b, 2, 16)
    dd = torch.stack([d, dmin], dim=-1).to(torch.float16).reshape(t, 16, b, 2).permute(0, 2, 3, 1).contiguous()
    return packed, tile(sc.to(torch.uint8), 8), mn_pairs, dd.view(torch.int16)


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor):
    """int4 codes (n, k) in 0..15 with a scale and a zero per output and group of 32 inputs ((n, k / 32), as torch's
    int4 kernel reads them: w = (q - 8) * s + z) -> (packed codes, scales and zeros as bf16 bits) in the tiles of 16
    outputs `pacer_i4_matmul` reads: packed[t][g][p][4o + e] = q[16t + o, 32g + 4p + e] | q[16t + o, 32g + 16 + 4p + e]
    << 4 (p < 4, e < 4), scales_zeros[t][g] = (s of the 16 outputs, z of the 16 outputs)."""
    n, k = codes.shape
    if n % 16 or k % 32 or scales.shape != (n, k // 32) or zeros.shape != scales.shape:
        raise ValueError(f"pack_int4: needs n divisible by 16, k by 32 and scales/zeros of shape (n, k / 32); got "
                         f"codes {tuple(codes.shape)}, scales {tuple(scales.shape)}, zeros {tuple(zeros.shape)}")
    t, g = n // 16, k // 32
    # (t, g, step j, 16 outputs x 4 inputs): step j holds inputs 4j..4j+3 of the group
    c = codes.to(torch.uint8).reshape(t, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(t, g, 8, 64)
    packed = (c[:, :, :4] | (c[:, :, 4:] << 4)).contiguous()
    per_tile = lambda v: v.to(torch.bfloat16).reshape(t, 16, g).permute(0, 2, 1)  # noqa: E731
    return packed, torch.stack([per_tile(scales), per_tile(zeros)], dim=2).contiguous().view(torch.int16)


def unpack_int4(packed: torch.Tensor, scales_zeros: torch.Tensor):
    """[`pack_int4`]'s inverse: (packed codes, scales and zeros) -> (codes (n, k) uint8 in 0..15, scales (n, k / 32)
    bf16, zeros (n, k / 32) bf16), the same values the kernel reads."""
    t, g = packed.shape[:2]
    c = torch.cat([packed & 15, packed >> 4], dim=2)  # (t, g, 8 steps, 64 = 16 outputs x 4 inputs)
    codes = c.reshape(t, g, 8, 16, 4).permute(0, 3, 1, 2, 4).reshape(16 * t, 32 * g)
    sz = scales_zeros.view(torch.bfloat16).reshape(t, g, 2, 16)
    per_output = lambda v: v.permute(0, 2, 1).reshape(16 * t, g)  # noqa: E731
    return codes.contiguous(), per_output(sz[:, :, 0]).contiguous(), per_output(sz[:, :, 1]).contiguous()


def pack_q8(codes: torch.Tensor, scale: torch.Tensor):
    """int8 codes (n, k) in -127..127 with one float scale per output -> (packed codes + 128 as uint8, scale), tiled
    by 16 outputs: packed[t][k / 32][8][16][4]."""
    n, k = codes.shape
    if n % 16 or k % 256:
        raise ValueError(f"pack_q8: needs n divisible by 16 and k by 256, got {n} x {k}")
    t = n // 16
    c = (codes.to(torch.int16) + 128).to(torch.uint8).reshape(t, 16, k // 32, 8, 4)
    return c.permute(0, 2, 3, 1, 4).contiguous(), scale.float().reshape(t, 16).contiguous()


HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
MADV_HUGEPAGE = 14  # <sys/mman.h>


@functools.lru_cache(maxsize=1)
def _madvise():
    if platform.system() != "Linux":
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise


def move_buffers_to_huge_pages(modules) -> int:
    """Move the buffers of `modules` (the layers pacer's kernels read, e.g. a model's quantized linear layers) into
    one block of memory asked of Linux as transparent huge pages (`madvise(MADV_HUGEPAGE)`, before the block is
    first written): the kernels stream every weight once a step, and over 4 KiB pages the CPU's prefetchers stop at
    each page and its TLB misses about every 4 KiB read; llama.cpp's weights, mapped from the file, get huge pages
    from the page cache. The values are copied unchanged, and each module's buffers become views of the block (of
    their own dtype and shape, 64-byte aligned). Where the kernel gives no huge pages (THP `never`, not Linux) the
    block is plain memory. Returns the bytes moved."""
    tensors = [(module, name, tensor) for module in modules for name, tensor in module._buffers.items()
               if tensor is not None and tensor.numel() and tensor.device.type == "cpu"
               and name not in getattr(module, "not_read_per_step", ())]  # e.g. a draft's dense copy for prompts
    offsets, total = [], 0
    for _, _, tensor in tensors:
        offsets.append(total)
        total += -(-tensor.numel() * tensor.element_size() // 64) * 64
    if not total:
        return 0
    pages = -(-total // HUGE_PAGE) * HUGE_PAGE
    block = torch.empty(pages + HUGE_PAGE, dtype=torch.uint8)  # room to start on a huge page's boundary
    start = -block.data_ptr() % HUGE_PAGE
    madvise = _madvise()
    if madvise is not None:
        madvise(block.data_ptr() + start, pages, MADV_HUGEPAGE)  # refused: the block stays on plain pages
    for (module, name, tensor), offset in zip(tensors, offsets):
        size = tensor.numel() * tensor.element_size()
        view = block[start + offset:start + offset + size].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.contiguous())
        module._buffers[name] = view
    return total
