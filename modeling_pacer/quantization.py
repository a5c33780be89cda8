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

import os

import torch
from torch import nn

GROUP_SIZE = 32  # Q4_K's sub-block: 32 input weights share a scale and a minimum
OUT_MULTIPLE = 16  # the int4 kernel's packing takes output sizes divisible by 16
# the kernel's choices for the leftover tensors; "bfloat16" keeps them as loaded
OTHER_CHOICES = ("int8", "int4", "bfloat16")


def int4_kernel_available() -> bool:
    """True when this torch build has the CPU int4 weight-only kernels."""
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


class Int4Linear(nn.Module):
    """`y = x W^T + b` with `W[n, k] = (codes[n, k] - 8) * scales[n, k // g] + zeros[n, k // g]`, codes in
    0..15, stored packed for `aten._weight_int4pack_mm_for_cpu`. Activations run in bf16 (the kernel's fast
    path); the output is cast back to the input's dtype."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None, group_size: int = GROUP_SIZE):
        super().__init__()
        if not int4_kernel_available():
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
        # packed (out_features, in_features / 2) uint8; the scales and zeros interleaved per group, as the kernel reads them
        self.register_buffer(
            "packed_weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        )
        self.register_buffer(
            "scales_and_zeros", torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        )
        self.register_buffer("bias", None if bias is None else bias.detach().to(torch.bfloat16).clone())

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = GROUP_SIZE) -> Int4Linear:
        """Min-max (asymmetric) int4 of a float layer's weight: each group's 16 levels span its min..max."""
        w = linear.weight.detach().float()
        out_features, in_features = w.shape
        g = w.reshape(out_features, in_features // group_size, group_size)
        lo, hi = g.amin(-1), g.amax(-1)
        scales = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        codes = torch.round((g - lo[..., None]) / scales[..., None]).clamp_(0, 15)
        # w ~ codes * s + lo = (codes - 8) * s + (lo + 8 s)
        return cls(codes.reshape(out_features, in_features), scales, lo + 8 * scales, linear.bias, group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed_weight, self.group_size, self.scales_and_zeros)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}, " \
               f"bias={self.bias is not None}"


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
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        out = torch.ops.aten._weight_int8pack_mm(flat, self.weight_int8, self.scales)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# --------------------------------------------------------------------------------------------------
# GGUF Q4_K -> the kernel's grid
# --------------------------------------------------------------------------------------------------
def q4_k_grid(blocks, out_features: int, in_features: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K tensor's raw bytes (`GGUFReader` tensor data, 144 bytes per 256 weights) -> `(codes, scales,
    zeros)` of shapes (out, in), (out, in / 32), (out, in / 32) with `w = (codes - 8) * scales + zeros`,
    scales and zeros in float32 (exact products of the float16 and 6-bit factors)."""
    import numpy as np
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
    scales = (d * sc.astype(np.float32)).reshape(out_features, in_features // GROUP_SIZE)
    minimums = (dmin * m.astype(np.float32)).reshape(out_features, in_features // GROUP_SIZE)
    scales_t = torch.from_numpy(scales)
    return torch.from_numpy(codes.astype(np.uint8)), scales_t, 8 * scales_t - torch.from_numpy(minimums)


def _replace(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def int4_shape_ok(linear: nn.Linear) -> bool:
    """The int4 kernel takes this layer's shape (in_features divisible by 32, out_features by 16)."""
    return linear.in_features % GROUP_SIZE == 0 and linear.out_features % OUT_MULTIPLE == 0


def quantize_linears(model: nn.Module, kind: str = "int4") -> nn.Module:
    """Every `nn.Linear` of `model` becomes an [`Int4Linear`] (min-max, groups of 32; layers of shapes the
    kernel does not take are left as they are) or an [`Int8Linear`] (`kind="int8"`), in place. Returns the
    model. Used for the draft, whose numerics change speed, never the output, and for the layers of a GGUF
    target that have no 4-bit grid of their own."""
    if kind not in ("int4", "int8"):
        raise ValueError(f"kind must be 'int4' or 'int8', got {kind!r}")
    for name, module in list(model.named_modules()):
        if type(module) is nn.Linear and (kind == "int8" or int4_shape_ok(module)):
            new = Int4Linear.from_linear(module) if kind == "int4" else Int8Linear.from_linear(module)
            _replace(model, name, new)
    return model


def quantize_from_gguf(model: nn.Module, gguf_file: str | os.PathLike, *, other: str = "int8",
                       check: bool = True) -> dict[str, int]:
    """Replace `model`'s linear layers, in place, with weight-only layers built from the GGUF it was loaded from.

    Q4_K tensors keep their 4-bit codes ([`Int4Linear`], scales rounded to bf16); every other linear layer
    (Q6_K, Q5_0, Q8_0 or float tensors, and the LM head) becomes `other`: "int8" ([`Int8Linear`], one scale
    per row), "int4" (min-max groups of 32) or "bfloat16" (kept as loaded). Embeddings and norms are kept.
    With `check`, each Q4_K layer's weight is compared with the model's loaded weight (transformers'
    dequantization of the same tensor) and a mismatch (a tensor the loader permutes, another file) is an
    error, never a silently different model.

    Returns how many layers became each kind (`{"int4 (gguf Q4_K)": n, "int8": m, ...}`).
    """
    from gguf import GGMLQuantizationType, GGUFReader
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    if other not in OTHER_CHOICES:
        raise ValueError(f"other must be one of {OTHER_CHOICES}, got {other!r}")
    reader = GGUFReader(str(gguf_file))
    gguf_to_hf = get_gguf_hf_weights_map(model, TensorProcessor())
    counts: dict[str, int] = {}
    for tensor in reader.tensors:
        hf_name = gguf_to_hf.get(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_K or not hf_name or not hf_name.endswith(".weight"):
            continue
        name = hf_name.removesuffix(".weight")
        linear = model.get_submodule(name)
        if type(linear) is not nn.Linear or not int4_shape_ok(linear):
            continue  # the token embedding (a lookup reads one row: nothing to gain), or a shape the kernel refuses
        codes, scales, zeros = q4_k_grid(tensor.data, linear.out_features, linear.in_features)
        if check:
            # every 64th row (a permutation of rows or a wrong tensor shows on any of them; all rows cost seconds)
            rows = slice(None, None, 64)
            s, z = (t[rows].repeat_interleave(GROUP_SIZE, 1) for t in (scales, zeros))
            grid = (codes[rows].float() - 8) * s + z
            loaded = linear.weight.detach()[rows].float()
            # the loaded weight is the same grid rounded to the model's dtype: allow that rounding and a little more
            tolerance = 1e-2 * loaded.abs() + 1e-6 + 4 * s * 2.0**-8
            if not bool(((grid - loaded).abs() <= tolerance).all()):
                raise ValueError(
                    f"GGUF tensor {tensor.name} does not match the model's {hf_name}: this architecture's GGUF layout "
                    "is not handled (its loader may permute it); load the target without 4-bit weights"
                )
        _replace(model, name, Int4Linear(codes, scales, zeros, linear.bias))
        counts["int4 (gguf Q4_K)"] = counts.get("int4 (gguf Q4_K)", 0) + 1
    if not counts:
        raise ValueError(f"{gguf_file} has no Q4_K linear weights for this model: nothing to keep in 4 bits")
    if other != "bfloat16":
        before = sum(isinstance(m, nn.Linear) for m in model.modules())
        quantize_linears(model, other)
        counts[other] = before - sum(isinstance(m, nn.Linear) for m in model.modules())
    left = sum(isinstance(m, nn.Linear) for m in model.modules())
    if left:
        counts["kept as loaded"] = left
    return counts
