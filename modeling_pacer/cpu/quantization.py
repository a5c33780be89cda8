"""Weight-only quantized linear layers for CPU decoding, and a GGUF target whose 4-bit weights stay 4-bit.

Decoding on a CPU is bound by the bytes of weights read per token. transformers dequantizes a GGUF file
(Q4_K_M: 4.5 bits a weight) to bf16 or float32, 3.5x to 7x the bytes. PyTorch ships CPU kernels that
multiply bf16 activations by packed 4-bit weights (`aten._weight_int4pack_mm_for_cpu`, groups of 32
input weights sharing a scale and an offset) and by int8 weights with one scale per output row
(`aten._weight_int8pack_mm`). Both compute each output row the same way whatever the number of rows
in the call (tests/test_quantization.py checks it), so a verification block gives bitwise the rows
of single-token steps, as speculative decoding needs.

Q4_K keeps its weights exactly on the kernel's grid. A Q4_K super-block of 256 weights holds eight
sub-blocks of 32, each with a 6-bit scale `sc` and 6-bit minimum `m` under the block's float16 `d`
and `dmin`:

    w = d * sc * q - dmin * m                       q in 0..15          (llama.cpp, dequantize_row_q4_K)
      = (q - 8) * s + z    with  s = d * sc,  z = 8 * s - dmin * m      (the int4 kernel's convention)

so the GGUF's own 4-bit codes are repacked unchanged; only `s` and `z` are rounded to bf16, as the
kernel stores them. Tensors of other GGUF types (Q6_K, Q5_0, Q8_0) have no exact 4-bit form: they are
requantized from the loaded weights with one int8 scale per output row ([`Int8Linear`]) or, with
`other="int4"`, to min-max int4 in groups of 32 ([`Int4Linear.from_linear`]).
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import nn

from . import kernels
from .last_call import LastCall

GROUP_SIZE = 32  # Q4_K's sub-block: 32 input weights share a scale and a minimum
SUPER_BLOCK = 256  # Q4_K's super-block (one float16 d and dmin), and the W4A8/W8A8 activations' scale block
OUT_MULTIPLE = 16  # the int4 kernel's packing takes output sizes divisible by 16
# the kernel's choices for the leftover tensors; "bfloat16" keeps them as loaded
OTHER_CHOICES = ("int8", "int4", "bfloat16")


def int4_kernel_available() -> bool:
    """True when this torch build has the CPU int4 weight-only kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


def int4_grid(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """The float32 weight `(codes - 8) * scales + zeros` of codes `(out, in)` with one scale and zero per group of
    `group_size` inputs (`(out, in / group_size)`): the int4 kernel's convention."""
    expand = lambda t: t.float().repeat_interleave(group_size, dim=1)  # noqa: E731
    return (codes.float() - 8) * expand(scales) + expand(zeros)


INT4_KERNELS = ("torch", "pacer")


class Int4Linear(nn.Module):
    """`y = x W^T + b` with `W[n, k] = (codes[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]`, codes in
    0..15; the output is cast back to the input's dtype. `kernel`: "torch" packs the weight for
    `aten._weight_int4pack_mm_for_cpu` (bf16 activations; an exact target's layers: tests and probes know its
    rows); "pacer" for pacer's VNNI kernel ([`kernels.int4_matmul`], group size 32 only), which reads the same grid
    with the activations quantized to int8 per row in blocks of 32: two to three times torch's speed at one row on
    a 0.5B draft's shapes, rows still independent of each other, results not torch's (a draft's choice: its
    numerics change speed, never the output)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, group_size: int = GROUP_SIZE, dense_rows: int | None = None,
                 kernel: str = "torch"):
        super().__init__()
        if kernel not in INT4_KERNELS:
            raise ValueError(f"Int4Linear: kernel must be one of {INT4_KERNELS}, got {kernel!r}")
        if kernel == "pacer" and (group_size != GROUP_SIZE or not kernels.available()):
            raise ValueError(f"Int4Linear: kernel='pacer' needs group_size={GROUP_SIZE} and pacer's kernels "
                             f"(group_size={group_size}; {kernels.unavailable_reason() or 'kernels available'})")
        if kernel == "torch" and not int4_kernel_available():
            raise RuntimeError(f"torch {torch.__version__} has no CPU int4 weight-only kernel (needs torch>=2.6)")
        out_features, in_features = codes.shape
        groups = in_features // group_size
        if (in_features % group_size or out_features % OUT_MULTIPLE or scales.shape != (out_features, groups)
                or zeros.shape != scales.shape):
            raise ValueError(
                f"Int4Linear: codes {tuple(codes.shape)} need in_features divisible by group_size={group_size}, "
                f"out_features divisible by {OUT_MULTIPLE} and scales/zeros of shape {(out_features, groups)}, got "
                f"{tuple(scales.shape)}/{tuple(zeros.shape)}"
            )
        if int(codes.min()) < 0 or int(codes.max()) > 15:
            raise ValueError("Int4Linear: codes must lie in 0..15")
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.kernel = kernel
        if kernel == "torch":
            # packed (out_features, in_features / 2) uint8; the scales and zeros interleaved per group, as the kernel
            # reads them
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
            scales_and_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        else:  # tiles of 16 outputs (kernels.pack_int4), the same bytes
            packed, scales_and_zeros = kernels.pack_int4(codes, scales, zeros)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("scales_and_zeros", scales_and_zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())
        # pacer's kernel adds the bias in float32 before its one rounding to bf16
        self.register_buffer("bias_float", None if bias is None or kernel == "torch" else self.bias.float(),
                             persistent=False)
        # calls of at least `dense_rows` rows (a draft's prompt) multiply by the dequantized weight in bf16: the
        # int4 kernel costs in proportion to the rows, a dense matmul about one read of the weight. Not saved, and
        # not counted as bytes a step reads (costs.weight_bytes); None: every call runs the int4 kernel (row-invariant)
        if dense_rows is not None and dense_rows < 2:
            raise ValueError(f"Int4Linear: dense_rows must be at least 2 (or None), got {dense_rows}")
        self.dense_rows = dense_rows
        # kernel="pacer": calls of kernels.BF16_TILE_ROWS rows or more (a draft's prompt) on AMX-BF16 tiles over the
        # weights dequantized once a call ([`kernels.int4_matmul_bf16`]) where this CPU has them; a draft's setting
        # (load_draft's), never an exact target's: it makes long calls compute rows differently from short ones
        self.prompt_tiles = False
        dense = None
        if dense_rows is not None:  # the grid the kernel computes with: its scales and zeros are bf16
            dense = int4_grid(codes, scales.to(torch.bfloat16), zeros.to(torch.bfloat16), group_size).to(torch.bfloat16)
        self.register_buffer("dense_weight", dense, persistent=False)

    # buffers that a one-row step never reads (costs.weight_bytes skips them)
    not_read_per_step = ("dense_weight",)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE, dense_rows: int | None = None,
                    kernel: str = "torch") -> Int4Linear:
        """Min-max (asymmetric) int4 of a float layer's weight: each group's 16 levels span its min..max."""
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        g = w.reshape(out_features, in_features // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((g - lo[..., None]) / scales[..., None]).clamp_(0, 15)
        # w ~ codes * s + lo = (codes - 8) * s + (lo + 8 s)
        return cls(codes.reshape(out_features, in_features), scales, lo + 8 * scales, linear.bias, group_size, dense_rows,
                   kernel)

    def select_outputs(self, rows: torch.Tensor) -> Int4Linear:
        """A layer over the outputs `rows` (sorted or not, a multiple of 16 of them) of this one, each computed with
        the same codes, scales and zeros, so the same bits as here (pacer's kernel; torch's packing is not read
        back). A draft's LM head over fewer tokens ([`modeling_pacer.draft_vocab`]) is built so after quantizing."""
        if self.kernel != "pacer":
            raise ValueError(f"Int4Linear.select_outputs reads pacer's packing back; this layer runs kernel={self.kernel!r}")
        rows = torch.as_tensor(rows, dtype=torch.long)
        if rows.dim() != 1 or rows.numel() == 0 or rows.numel() % OUT_MULTIPLE or int(rows.min()) < 0 \
                or int(rows.max()) >= self.out_features:
            raise ValueError(f"Int4Linear.select_outputs: rows must be a non-empty list of output indices in "
                             f"0..{self.out_features - 1}, a multiple of {OUT_MULTIPLE} of them; got {rows.numel()}")
        codes, scales, zeros = kernels.unpack_int4(self.packed_weight, self.scales_and_zeros)
        bias = None if self.bias is None else self.bias[rows]
        layer = Int4Linear(codes[rows], scales[rows], zeros[rows], bias, self.group_size, self.dense_rows, self.kernel)
        layer.prompt_tiles = self.prompt_tiles
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels.require_cpu(x, self.packed_weight)  # torch's int4 op and pacer's kernel are both CPU-only
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        if self.dense_rows is not None and flat.shape[0] >= self.dense_rows:
            out = nn.functional.linear(flat, self.dense_weight, self.bias)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        if self.kernel == "pacer":
            if self.prompt_tiles and flat.shape[0] >= kernels.BF16_TILE_ROWS and kernels.bf16_tiles_available():
                matmul = kernels.int4_matmul_bf16
            else:
                matmul = kernels.int4_matmul
            out = matmul(flat, self.packed_weight, self.scales_and_zeros, self.out_features, self.bias_float)
            return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        dense = f", dense_rows={self.dense_rows}" if self.dense_rows is not None else ""
        dense += ", prompt_tiles=True" if self.prompt_tiles else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, " \
               f"bias={self.bias is not None}{dense}, kernel={self.kernel}"


class Int8Linear(nn.Module):
    """`y = x W^T + b` with `W[n] = codes[n] * scales[n]`, int8 codes, one scale per output row
    (`aten._weight_int8pack_mm`); bf16 activations, output in the input's dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("weight_int8", codes.to(torch.int8).contiguous())
        self.register_buffer("scales", scales.to(torch.bfloat16).contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> Int8Linear:
        """Symmetric int8 with one scale per output row: `scale = max |w| / 127`."""
        w = linear.weight.detach().float()
        scales = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        # the scale the kernel will use is the bf16 one: round against it
        scales = scales.to(torch.bfloat16).float()
        codes = torch.round(w / scales[:, None]).clamp_(-127, 127)
        return cls(codes, scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kernels.require_cpu(x, self.weight_int8)  # the CPU kernel is the one tested row-invariant
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# q and k (gate and up) read the same input: it is quantized once ([`LastCall`]); an inference-mode input, with no
# version counter to tell an in-place change, is quantized every time
_LAST_ROWS = LastCall(unversioned_by_identity=False)


def quantized_input(x: torch.Tensor, in_features: int, block: int) -> kernels.QuantizedRows:
    """`x`'s rows as the W4A8/W8A8 kernels read them, quantized in blocks of `block` inputs: once for layers fed the
    same tensor one after another (bitwise the same rows: quantization reads only the row)."""
    return _LAST_ROWS.get(x, (in_features, block), lambda: kernels.QuantizedRows(x.reshape(-1, in_features), block=block))


class W4A8Linear(nn.Module):
    """`y = x W^T + b` over a Q4_K weight kept exactly as the GGUF file stores it (`W = d * sc * q - dmin * m`,
    q in 0..15 in groups of 32, d and dmin per 256), with the activations quantized to int8 per row in blocks of
    256 (llama.cpp's Q8_K), multiplied by pacer's VNNI kernel ([`modeling_pacer.cpu.kernels`]): integer sums,
    each weight tile unpacked once for all the rows of a call, so a verification block of a few rows costs
    about one single-token step (until its dot products bound it: `pacer-bench kernel-rows`), and each row's
    result depends on that row alone."""

    int8_activations = True  # each call's rows are quantized to int8 (row by row: rows stay independent)

    def __init__(self, codes: torch.Tensor, sc: torch.Tensor, m: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__()
        out_features, in_features = codes.shape
        groups, blocks = in_features // GROUP_SIZE, in_features // SUPER_BLOCK
        if in_features % SUPER_BLOCK or out_features % 16 or sc.shape != (out_features, groups) or \
                m.shape != sc.shape or d.shape != (out_features, blocks) or dmin.shape != d.shape:
            raise ValueError(
                f"W4A8Linear: codes {tuple(codes.shape)} need in_features divisible by {SUPER_BLOCK}, out_features by "
                f"16, sc/m of shape {(out_features, groups)} and d/dmin of shape {(out_features, blocks)}; got "
                f"{tuple(sc.shape)}/{tuple(m.shape)}/{tuple(d.shape)}/{tuple(dmin.shape)}")
        if int(codes.min()) < 0 or int(codes.max()) > 15 or int(sc.max()) > 63 or int(m.max()) > 63 or \
                int(sc.min()) < 0 or int(m.min()) < 0:
            raise ValueError("W4A8Linear: codes must lie in 0..15 and sc, m in 0..63")
        self.in_features, self.out_features = in_features, out_features
        packed, sc_t, m_t, dd = kernels.pack_q4k(codes, sc, m, d, dmin)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("sub_scales", sc_t)
        self.register_buffer("sub_minimums", m_t)
        self.register_buffer("super_scales", dd)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W4A8Linear:
        """Q4_K-style 4-bit of a float layer's weight: per group of 32 a min-max scale and minimum, both as 6-bit
        multiples of the super-block's float16 d and dmin (a simpler search than llama.cpp's make_qkx2)."""
        w = linear.weight.detach().float()
        n, k = w.shape
        g = w.reshape(n, k // GROUP_SIZE, GROUP_SIZE)
        lo = g.amin(-1).clamp(max=0)  # Q4_K subtracts a non-negative minimum: w = s q - mn, mn = -lo >= 0
        scale = (g.amax(-1) - lo) / 15
        per_block = SUPER_BLOCK // GROUP_SIZE
        tiny = torch.finfo(torch.float16).tiny
        d = (scale.reshape(n, -1, per_block).amax(-1) / 63).clamp_min(tiny).half().float()
        dmin = ((-lo).reshape(n, -1, per_block).amax(-1) / 63).clamp_min(tiny).half().float()
        sc = torch.round(scale / d.repeat_interleave(per_block, 1)).clamp(1, 63)
        mn = torch.round(-lo / dmin.repeat_interleave(per_block, 1)).clamp(0, 63)
        s = (d.repeat_interleave(per_block, 1) * sc)[..., None]
        off = (dmin.repeat_interleave(per_block, 1) * mn)[..., None]
        codes = torch.round((g + off) / s).clamp(0, 15).reshape(n, k)
        return cls(codes, sc, mn, d, dmin, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = quantized_input(x, self.in_features, SUPER_BLOCK)
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32  # the bias is added in float32 either way
        out = kernels.q4k_matmul(rows, self.packed_weight, self.sub_scales, self.sub_minimums, self.super_scales,
                                 self.out_features, self.bias, dtype)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class W8A8Linear(nn.Module):
    """`y = x W^T + b` with `W[n] = codes[n] * scales[n]` (int8, one scale per output row) and int8 activations
    per row in blocks of 32, on pacer's VNNI kernel: the W4A8 target's layers that have no 4-bit grid in the
    file (Q6_K tensors, the LM head)."""

    int8_activations = True

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        if self.in_features % SUPER_BLOCK or self.out_features % 16:
            raise ValueError(f"W8A8Linear: codes {tuple(codes.shape)} need in_features divisible by {SUPER_BLOCK} "
                             "and out_features by 16")
        packed, scale = kernels.pack_q8(codes, scales)
        self.register_buffer("packed_weight", packed)
        self.register_buffer("scales", scale)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> W8A8Linear:
        """Symmetric int8 with one float32 scale per output row: `scale = max |w| / 127`."""
        w = linear.weight.detach().float()
        scales = (w.abs().amax(-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        return cls(torch.round(w / scales[:, None]).clamp_(-127, 127), scales, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = quantized_input(x, self.in_features, 32)
        dtype = torch.bfloat16 if x.dtype == torch.bfloat16 else torch.float32
        out = kernels.q8_matmul(rows, self.packed_weight, self.scales, self.out_features, self.bias, dtype)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@contextlib.contextmanager
def kernel_rows_only(model: nn.Module):
    """Within the block, `model`'s int4 layers run every call on the int4 kernel, their dense copies unused: a long
    forward then gives each row bitwise what a one-row step gives (what a trace of decoding steps records,
    [`modeling_pacer.replay.record_trace`])."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.dense_rows is not None]
    saved = [m.dense_rows for m in layers]
    for m in layers:
        m.dense_rows = None
    try:
        yield model
    finally:
        for m, rows in zip(layers, saved):
            m.dense_rows = rows


QUANTIZED_LINEARS = (Int4Linear, Int8Linear, W4A8Linear, W8A8Linear)


def place_on_huge_pages(model: nn.Module) -> int:
    """`model`'s quantized linear layers' weights moved, unchanged, into one block of transparent huge pages
    ([`kernels.move_buffers_to_huge_pages`]): a step streams them all, and 4 KiB pages cost bandwidth. Returns the
    bytes moved (0 for a model without such layers)."""
    return kernels.move_buffers_to_huge_pages([m for m in model.modules() if isinstance(m, QUANTIZED_LINEARS)])


def w4a8_shape_ok(linear: nn.Linear) -> bool:
    """The VNNI kernels take this layer's shape (in_features divisible by 256, out_features by 16)."""
    return linear.in_features % SUPER_BLOCK == 0 and linear.out_features % 16 == 0


# --------------------------------------------------------------------------------------------------
# GGUF Q4_K -> the kernel's grid
# --------------------------------------------------------------------------------------------------
def q4_k_parts(blocks, out_features: int, in_features: int) -> tuple[torch.Tensor, ...]:
    """A Q4_K tensor's raw bytes (`GGUFReader` tensor data, 144 bytes per 256 weights) -> its parts
    `(codes, sc, m, d, dmin)`: codes (out, in) in 0..15, sc and m (out, in / 32) 6-bit integers, d and dmin
    (out, in / 256) float32 (the file's float16 values), with `w = d * sc * codes - dmin * m`."""
    import numpy as np

    from ..extras import require

    require("pairs", "Reading a GGUF file's 4-bit weights", ("gguf",))
    from gguf.quants import Q4_K

    raw = np.ascontiguousarray(np.asarray(blocks, dtype=np.uint8)).reshape(-1, 144)
    n_blocks = raw.shape[0]
    if n_blocks * 256 != out_features * in_features:
        raise ValueError(f"Q4_K data holds {n_blocks * 256} weights, not {out_features} x {in_features}")
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # (n, 1)
    dmin = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(raw[:, 4:16])  # (n, 8) 6-bit each, gguf-py's unpacking
    qs = raw[:, 16:]  # (n, 128): 4 chunks of 32 bytes; low nibbles -> sub-block 2j, high -> 2j+1
    nibbles = qs.reshape(n_blocks, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = (nibbles & 0x0F).reshape(out_features, in_features)
    groups, blocks_per_row = in_features // GROUP_SIZE, in_features // 256
    return (torch.from_numpy(codes.astype(np.uint8)),
            torch.from_numpy(sc.astype(np.uint8).reshape(out_features, groups)),
            torch.from_numpy(m.astype(np.uint8).reshape(out_features, groups)),
            torch.from_numpy(d.reshape(out_features, blocks_per_row)),
            torch.from_numpy(dmin.reshape(out_features, blocks_per_row)))


def q4_k_grid(blocks, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's raw bytes -> `(codes, scales, zeros)` of shapes (out, in), (out, in / 32), (out, in / 32)
    with `w = (codes - 8) * scales + zeros`, scales and zeros in float32 (exact products of the float16 and
    6-bit factors)."""
    return _grid(*q4_k_parts(blocks, out_features, in_features))


def _grid(codes, sc, m, d, dmin):
    per_block = SUPER_BLOCK // GROUP_SIZE
    scales = d.repeat_interleave(per_block, 1) * sc.float()
    minimums = dmin.repeat_interleave(per_block, 1) * m.float()
    return codes, scales, 8 * scales - minimums


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def int4_shape_ok(linear: nn.Linear) -> bool:
    """The int4 kernel takes this layer's shape (in_features divisible by 32, out_features by 16)."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % OUT_MULTIPLE == 0


LINEAR_KINDS = {"int4": Int4Linear, "int8": Int8Linear, "w4a8": W4A8Linear, "w8a8": W8A8Linear}


def tile_prompts(model: nn.Module) -> int:
    """A draft's long calls (its prompt) on AMX-BF16 tiles: `prompt_tiles` on every Int4Linear of `model` that runs
    pacer's kernel ([`Int4Linear`]); a CPU without the tiles keeps the int8 path. Returns how many layers."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.kernel == "pacer"]
    for layer in layers:
        layer.prompt_tiles = True
    return len(layers)


@contextlib.contextmanager
def untiled_prompts(model: nn.Module):
    """Within: every Int4Linear of `model` with `prompt_tiles` reads long calls on the int8 path instead ([`tile_prompts`]
    undone), restored on leaving. For measuring what the tiles save (`pacer-bench run --methods pacer-int8-prompt`)."""
    layers = [m for m in model.modules() if isinstance(m, Int4Linear) and m.prompt_tiles]
    for layer in layers:
        layer.prompt_tiles = False
    try:
        yield
    finally:
        for layer in layers:
            layer.prompt_tiles = True


def quantize_linears(model: nn.Module, kind: str = "int4", *, dense_rows: int | None = None,
                     int4_kernel: str = "torch") -> nn.Module:
    """Every `nn.Linear` of `model` becomes a layer of `kind` (LINEAR_KINDS), in place: "int4" [`Int4Linear`]
    (min-max, groups of 32), "int8" [`Int8Linear`], "w4a8" [`W4A8Linear`] or "w8a8" [`W8A8Linear`] (the VNNI
    kernels: int8 activations). Layers of shapes the kernel does not take are left as they are. Returns the
    model. Used for the draft, whose numerics change speed, never the output, and for the layers of a GGUF
    target that have no 4-bit grid of their own. `dense_rows` ("int4" only; a draft's, never an exact target's:
    it makes long calls compute rows differently): calls of that many rows or more run on the dequantized
    weight in bf16 ([`Int4Linear`]); `int4_kernel` ("int4" only): [`Int4Linear`]'s `kernel`."""
    if kind not in LINEAR_KINDS:
        raise ValueError(f"kind must be one of {sorted(LINEAR_KINDS)}, got {kind!r}")
    if dense_rows is not None and kind != "int4":
        raise ValueError(f"dense_rows is an option of kind='int4' only, got kind={kind!r}")
    shape_ok = {"int4": int4_shape_ok, "int8": lambda _: True}.get(kind, w4a8_shape_ok)
    if int4_kernel != "torch" and kind != "int4":
        raise ValueError(f"int4_kernel is an option of kind='int4' only, got kind={kind!r}")
    extra = {"dense_rows": dense_rows} if dense_rows is not None else {}
    if int4_kernel != "torch":
        extra["kernel"] = int4_kernel
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and shape_ok(module):
            _replace(model, name, LINEAR_KINDS[kind].from_linear(module, **extra))
    return model


def quantize_from_gguf(model: nn.Module, gguf_file: str | os.PathLike, *, other: str = "int8",
                       check: bool = True, activations: str = "bfloat16") -> dict[str, int]:
    """Replace `model`'s linear layers, in place, with weight-only layers built from the GGUF it was loaded from.

    With `activations="bfloat16"` (torch's kernels): Q4_K tensors keep their 4-bit codes ([`Int4Linear`],
    scales rounded to bf16); every other linear layer (Q6_K, Q5_0, Q8_0 or float tensors, and the LM head)
    becomes `other`: "int8" ([`Int8Linear`], one scale per row), "int4" (min-max groups of 32) or "bfloat16"
    (kept as loaded). With `activations="int8"` (pacer's VNNI kernels, [`modeling_pacer.cpu.kernels`]): Q4_K
    tensors become [`W4A8Linear`] (the file's grid exactly, float16 scales included) and `other` "int8" or
    "int4" becomes [`W8A8Linear`] or W4A8Linear's own min-max form. Embeddings and norms are kept.
    With `check`, each Q4_K layer's weight is compared with the model's loaded weight (transformers'
    dequantization of the same tensor) and a mismatch (a tensor the loader permutes, another file) is an
    error, never a silently different model.

    Returns how many layers became each kind (`{"int4 (gguf Q4_K)": n, "int8": m, ...}`).
    """
    from ..extras import require

    require("pairs", "Reading a GGUF file's 4-bit weights", ("gguf",))
    from gguf import GGMLQuantizationType, GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    if other not in OTHER_CHOICES:
        raise ValueError(f"other must be one of {OTHER_CHOICES}, got {other!r}")
    if activations not in ("bfloat16", "int8"):
        raise ValueError(f"activations must be 'bfloat16' or 'int8', got {activations!r}")
    if activations == "int8":
        if not kernels.available():
            raise RuntimeError(f"int8 activations need pacer's VNNI kernels: {kernels.unavailable_reason()}")
    int8 = activations == "int8"
    reader = GGUFReader(str(gguf_file))
    gguf_to_hf = get_gguf_hf_weights_map(model, TensorProcessor())
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf.get(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_K or not hf_name or not hf_name.endswith(".weight"):
            continue
        name = hf_name.removesuffix(".weight")
        linear = model.get_submodule(name)
        if type(linear) is not nn.Linear or not (w4a8_shape_ok if int8 else int4_shape_ok)(linear):
            continue  # the token embedding (a lookup reads one row: nothing to gain), or a shape the kernel refuses
        parts = q4_k_parts(tensor.data, linear.out_features, linear.in_features)
        codes, scales, zeros = _grid(*parts)
        if check:
            # every 64th row (a permutation of rows or a wrong tensor shows on any of them; all rows cost seconds)
            rows = slice(None, None, 64)
            grid = int4_grid(codes[rows], scales[rows], zeros[rows])
            s = scales[rows].repeat_interleave(GROUP_SIZE, 1)
            loaded = linear.weight.detach()[rows].float()
            # the loaded weight is the same grid rounded to the model's dtype: allow that rounding and a little more
            tolerance = 1e-2 * loaded.abs() + 1e-6 + 4 * s * 2.0**-8
            if not bool(((grid - loaded).abs() <= tolerance).all()):
                raise ValueError(
                    f"GGUF tensor {tensor.name} does not match the model's {hf_name}: this architecture's GGUF layout "
                    "is not handled (its loader may permute it); load the target without 4-bit weights"
                )
        if int8:
            _replace(model, name, W4A8Linear(*parts, linear.bias))
        else:
            _replace(model, name, Int4Linear(codes, scales, zeros, linear.bias))
        label = "w4a8 (gguf Q4_K)" if int8 else "int4 (gguf Q4_K)"
        counts[label] = counts.get(label, 0) + 1
    if not counts:
        raise ValueError(f"{gguf_file} has no Q4_K linear weights for this model: nothing to keep in 4 bits")
    if other != "bfloat16":
        kind = {"int8": "w8a8", "int4": "w4a8"}[other] if int8 else other
        before = sum(isinstance(m, nn.Linear) for m in model.modules())
        quantize_linears(model, kind)
        counts[kind] = before - sum(isinstance(m, nn.Linear) for m in model.modules())
    left = sum(isinstance(m, nn.Linear) for m in model.modules())
    if left:
        counts["kept as loaded"] = left
    return counts
