"""pacer's VNNI kernels (modeling_pacer/cpu/kernels) and their layers (W4A8Linear, W8A8Linear, Int4Linear with
kernel="pacer"): they compute their formula (integer sums exactly, the int4 grid to float32 rounding), each output row is bitwise the same whatever the rows and threads of the call, a
GGUF's Q4_K tensors are kept exactly, and PACER over a W4A8 target returns that target's own greedy output."""

import os

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from modeling_pacer import FixedLength, enable_pacer
from modeling_pacer.cpu import kernels
from modeling_pacer.cpu.exact_attention import kernel_attention
from modeling_pacer.exact import make_exact
from modeling_pacer.host import cpuinfo_field
from modeling_pacer.cpu.exact_linear import row_runs
from modeling_pacer.pairs import load_pair
from modeling_pacer.cpu.quantization import (
    Int4Linear, W4A8Linear, W8A8Linear, int4_grid, q4_k_parts, quantize_from_gguf, quantize_linears,
)

from test_quantization import _random_q4_k, _tiny_qwen2, _write_gguf

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"VNNI kernels: {kernels.unavailable_reason()}")


def _quantized_activations(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """The kernels' int8 activations, dequantized (float64): rint(x * 127 / amax) * amax / 127 per block."""
    rows = kernels.QuantizedRows(x, block)
    return (rows.q.double().reshape(x.shape[0], -1, block) * rows.scale.double()[..., None]).reshape(x.shape)


def test_activations_are_quantized_row_by_row():
    x = torch.randn(3, 512, dtype=torch.bfloat16) * torch.tensor([[1.0], [100.0], [0.01]], dtype=torch.bfloat16)
    x[2, 256:] = 0  # an all-zero block: scale 0, codes 0
    rows = kernels.QuantizedRows(x)
    block = x.float().reshape(3, 2, 256)
    amax = block.abs().amax(-1)
    assert torch.equal(rows.scale, amax / 127)
    assert int(rows.q.abs().max()) <= 127 and torch.equal(rows.q[2, 256:], torch.zeros(256, dtype=torch.int8))
    assert torch.equal(rows.group_sums, rows.q.reshape(3, 16, 32).sum(-1, dtype=torch.int16))
    # within one code of x * 127 / amax, and row 1 unaffected by the other rows' magnitudes
    assert bool(((rows.q.float().reshape(3, 2, 256) - block * 127 / amax.clamp_min(1e-30)[..., None]).abs() <= 0.5001).all())
    assert torch.equal(kernels.QuantizedRows(x[1:2]).q[0], rows.q[1])
    fine = kernels.QuantizedRows(x, block=32)  # the int8 weights' blocks: one scale per 32 inputs
    assert torch.equal(fine.scale, x.float().reshape(3, 16, 32).abs().amax(-1) / 127)
    assert torch.equal(fine.group_sums, fine.q.reshape(3, 16, 32).sum(-1, dtype=torch.int16))
    with pytest.raises(ValueError, match="divisible by 256"):
        kernels.QuantizedRows(torch.randn(2, 200))
    with pytest.raises(ValueError, match="32 or 256"):
        kernels.QuantizedRows(x, block=64)
    with pytest.raises(ValueError, match="blocks of 32"):
        kernels.q8_matmul(rows, *kernels.pack_q8(torch.zeros(16, 512), torch.ones(16)), 16)
    with pytest.raises(ValueError, match="blocks of 256"):
        kernels.q4k_matmul(fine, *kernels.pack_q4k(*(torch.zeros(16, n, dtype=torch.int64) for n in (512, 16, 16, 2, 2))), 16)


def test_w4a8_computes_the_q4_k_grid():
    """From a GGUF Q4_K tensor's bytes: the layer is the file's weight (gguf-py's dequantization) times the
    int8 activations, to float32 rounding."""
    raw = _random_q4_k(48, 768, seed=3)
    parts = q4_k_parts(raw, 48, 768)
    bias = torch.randn(48)
    layer = W4A8Linear(*parts, bias)
    weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(48, 768).double()
    x = torch.randn(5, 768, dtype=torch.bfloat16)
    out = layer(x.float())
    assert out.dtype == torch.float32 and out.shape == (5, 48)
    expected = _quantized_activations(x) @ weight.t() + bias.double()
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    with pytest.raises(ValueError, match="divisible by 256"):
        W4A8Linear(*(t[:, :16] if t.shape[1] == 768 else t[:, :2] if t.shape[1] == 3 else t[:, :1] for t in parts))
    with pytest.raises(ValueError, match="0..15"):
        W4A8Linear(parts[0] + 16, *parts[1:])


def test_w8a8_computes_its_codes():
    torch.manual_seed(4)
    codes, scales, bias = torch.randint(-127, 128, (32, 512)), torch.rand(32) / 100, torch.randn(32)
    layer = W8A8Linear(codes, scales, bias)
    x = torch.randn(7, 512, dtype=torch.bfloat16)
    expected = _quantized_activations(x, 32) @ (codes.double() * scales.double()[:, None]).t() + bias.double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-2, atol=1e-5 * float(expected.abs().max()))
    assert layer(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="divisible by 256"):
        W8A8Linear(codes[:, :300], scales)


@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_from_linear_error_is_bounded(kind):
    torch.manual_seed(5)
    linear = torch.nn.Linear(512, 64)
    layer = (W4A8Linear if kind == "w4a8" else W8A8Linear).from_linear(linear)
    x = torch.randn(16, 512)
    exact = x @ linear.weight.detach().t() + linear.bias.detach()
    error = (layer(x) - exact).abs().max() / exact.abs().max()
    assert error < (0.08 if kind == "w4a8" else 0.02), float(error)


def test_int4_kernel_computes_the_int4_grid():
    """pacer's int4 kernel (a draft's layers): the grid (q - 8) * s + z, with s and z rounded to bf16 as torch's
    kernel stores them, times the activations as quantized to int8 in blocks of 32 (QuantizedRows) plus the float32
    bias, to float32 rounding; its bf16 output is that result rounded once; shapes it cannot take are refused by
    name."""
    torch.manual_seed(7)
    n, k = 48, 160
    codes = torch.randint(0, 16, (n, k))
    scales, zeros, bias = torch.rand(n, k // 32) / 100 + 1e-3, torch.randn(n, k // 32) / 100, torch.randn(n)
    packed, scales_zeros = kernels.pack_int4(codes, scales, zeros)
    assert packed.numel() == n * k // 2 and scales_zeros.numel() == 2 * n * k // 32  # torch's bytes
    x = torch.randn(7, k, dtype=torch.bfloat16)
    rows = kernels.QuantizedRows(x, block=32)
    quantized_x = (rows.q.double().reshape(7, -1, 32) * rows.scale.double()[..., None]).reshape(7, k)
    weight = int4_grid(codes, scales.to(torch.bfloat16), zeros.to(torch.bfloat16)).double()
    expected = quantized_x @ weight.t() + bias.double()
    out = kernels.int4_matmul(x, packed, scales_zeros, n, bias, torch.float32)
    assert out.dtype == torch.float32 and out.shape == (7, n)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    # the activations' int8 costs about 1% against the bf16 product
    exact = x.double() @ weight.t() + bias.double()
    assert float((out.double() - exact).abs().max() / exact.abs().max()) < 0.02
    assert torch.equal(kernels.int4_matmul(x, packed, scales_zeros, n, bias), out.to(torch.bfloat16))
    layer = Int4Linear(codes, scales, zeros, bias, kernel="pacer")  # keeps its bias in bf16, as torch's kernel does
    expected_layer = kernels.int4_matmul(x, packed, scales_zeros, n, bias.to(torch.bfloat16).float())
    assert torch.equal(layer(x), expected_layer) and "kernel=pacer" in repr(layer)
    with pytest.raises(ValueError, match="divisible by 16"):
        kernels.pack_int4(codes[:40], scales[:40], zeros[:40])
    with pytest.raises(ValueError, match="divisible by 32"):
        kernels.int4_matmul(torch.randn(2, 100), packed, scales_zeros, n)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cls", [W4A8Linear, W8A8Linear, Int4Linear])
def test_rows_do_not_depend_on_the_row_count_or_threads(cls, threads):
    """Row i of an n-row call is bitwise the 1-row call on row i, for n up to 20 (across the kernels' blocks of
    8 rows), under 1 and 2 threads, and the same under both."""
    before = torch.get_num_threads()
    torch.manual_seed(6)
    extra = {"kernel": "pacer"} if cls is Int4Linear else {}
    layer = cls.from_linear(torch.nn.Linear(512, 336), **extra)
    x = torch.randn(20, 512, dtype=torch.bfloat16)
    try:
        torch.set_num_threads(1)
        reference = torch.cat([layer(x[i:i + 1]) for i in range(20)])
        torch.set_num_threads(threads)
        for n in range(1, 21):
            assert torch.equal(layer(x[:n]), reference[:n]), n
    finally:
        torch.set_num_threads(before)
    # and the host probe finds one run over every row count
    assert [(r.lo, r.hi) for r in row_runs(layer, 24)] == [(1, 24)]


@pytest.mark.parametrize("kind", ["w4a8", "w8a8", "int4"])
def test_amx_tiles_give_the_vnni_loops_bits(kind):
    """On a CPU with AMX, calls of several rows go to the tiles (Q4_K and int8 from the threshold on, the draft's int4
    for a prompt): every row of every call size (1..40: one tile of 16 rows, several, a remainder padded with zeros)
    is bitwise what the VNNI loops give it alone, in both output dtypes and with a bias. Elsewhere the tiles are
    absent and the test says so."""
    if not kernels.amx_available():
        pytest.skip("no AMX tiles here (CPU, compiler or kernel)")
    torch.manual_seed(5)
    linear = torch.nn.Linear(768, 48, bias=True)
    layer = (Int4Linear.from_linear(linear, kernel="pacer") if kind == "int4"
             else {"w4a8": W4A8Linear, "w8a8": W8A8Linear}[kind].from_linear(linear))
    x = torch.randn(1, 40, 768, dtype=torch.bfloat16) * 4
    x[0, 7] = 0  # a zero row: scale 0
    for dtype in (torch.bfloat16, torch.float32):
        xd = x.to(dtype)
        with kernels.amx_rows(0):
            alone = torch.cat([layer(xd[:, i:i + 1]) for i in range(40)], 1)
        for rows in (1, 2, 3, 15, 16, 17, 33, 40):
            with kernels.amx_rows(1):
                assert torch.equal(layer(xd[:, :rows]), alone[:, :rows]), (dtype, rows)


@pytest.mark.parametrize("kind", ["w4a8", "w8a8"])
def test_a_long_prompt_on_the_tiles_goes_over_its_inputs_in_chunks_with_the_rows_bits(kind):
    """A prompt whose activations would not stay in a core's cache (240 rows x 2304 inputs: past the kernels' 512 KB)
    is computed over chunks of its inputs (`prompt_chunk`: 8 of Q4_K's 9 super-blocks, then 1; 17 of int8's 18 blocks
    of 128, then 1), each tile's running sums kept between them: every row still bitwise what the VNNI loops give it
    alone."""
    if not kernels.amx_available():
        pytest.skip("no AMX tiles here (CPU, compiler or kernel)")
    torch.manual_seed(6)
    layer = {"w4a8": W4A8Linear, "w8a8": W8A8Linear}[kind].from_linear(torch.nn.Linear(2304, 32, bias=True))
    x = torch.randn(1, 240, 2304, dtype=torch.bfloat16) * 4
    with kernels.amx_rows(0):
        alone = torch.cat([layer(x[:, i:i + 1]) for i in range(240)], 1)
    with kernels.amx_rows(1):
        for rows in (240, 200):  # over chunks; 200 rows (208 padded) in one chunk of all 9 / 18 blocks
            assert torch.equal(layer(x[:, :rows]), alone[:, :rows]), rows


def test_a_prompt_on_the_bf16_tiles_is_each_rows_own_and_the_grids_product():
    """kernels.int4_matmul_bf16 (a draft's prompt on AMX-BF16 tiles): each row's result is its own (the same bits in
    calls of 32, 33, 47 and 64 rows, one thread or two), in float32 it is x times the layer's bf16 grid (the values
    Int4Linear's dense copy holds) to float rounding, plus the bias, and in bf16 that result rounded as torch rounds
    it. An Int4Linear with `prompt_tiles` sends calls of BF16_TILE_ROWS rows or more there, and shorter ones to the
    int8 path, bitwise."""
    if not kernels.bf16_tiles_available():
        pytest.skip("no AMX-BF16 tiles here (CPU, compiler or kernel)")
    from modeling_pacer.cpu.quantization import int4_grid

    torch.manual_seed(7)
    layer = Int4Linear.from_linear(torch.nn.Linear(320, 48, bias=True), kernel="pacer")
    codes, scales, zeros = kernels.unpack_int4(layer.packed_weight, layer.scales_and_zeros)
    grid = int4_grid(codes, scales.to(torch.bfloat16), zeros.to(torch.bfloat16), 32).to(torch.bfloat16).float()
    x = torch.randn(64, 320, dtype=torch.bfloat16) * 3
    x[5] = 0
    matmul = lambda rows, dtype=torch.float32: kernels.int4_matmul_bf16(  # noqa: E731
        rows, layer.packed_weight, layer.scales_and_zeros, 48, layer.bias_float, dtype=dtype)
    full = matmul(x)
    exact = x.float() @ grid.t() + layer.bias_float
    assert torch.allclose(full, exact, rtol=0, atol=1e-5 * float(exact.abs().max()))
    assert torch.equal(matmul(x, torch.bfloat16), full.to(torch.bfloat16))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            for rows in (32, 33, 47, 64):
                assert torch.equal(matmul(x[:rows]), full[:rows]), (n, rows)
            assert torch.equal(matmul(torch.cat([x[9:10]] * 40))[17], full[9])  # a row among copies of itself
    finally:
        torch.set_num_threads(threads)
    layer.prompt_tiles = True
    with torch.no_grad():
        assert torch.equal(layer(x[:kernels.BF16_TILE_ROWS]).float(),
                           matmul(x[:kernels.BF16_TILE_ROWS], torch.bfloat16).float())
        short = x[:kernels.BF16_TILE_ROWS - 1]
        assert torch.equal(layer(short), kernels.int4_matmul(short, layer.packed_weight, layer.scales_and_zeros, 48,
                                                             layer.bias_float))
    assert layer.select_outputs(torch.arange(16)).prompt_tiles


EXP_CHECK = r"""
#include "vnni_matmul.cpp"
#include <cstdio>
int main() {  // every finite bf16 value as a gate: the vector SiLU, rounded to bf16 as the layer rounds it, against expf
    long differ = 0, worst = 0, n = 0;
    for (uint32_t h = 0; h < 65536; ++h) {
        float g;
        const uint32_t u = h << 16;
        std::memcpy(&g, &u, 4);
        if (!std::isfinite(g)) continue;
        alignas(64) float e[16], silu[16];
        const __m512 v = _mm512_set1_ps(g);
        _mm512_store_ps(e, exp_ps(v));
        _mm512_store_ps(silu, _mm512_div_ps(v, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), v)))));
        const float ref = std::exp(g);
        int32_t a, b;
        std::memcpy(&a, &e[0], 4);
        std::memcpy(&b, &ref, 4);
        if (std::isfinite(ref) && ref >= 1.2e-38f && std::labs(long(a) - long(b)) > worst) worst = std::labs(long(a) - long(b));
        if (f2bf(silu[0]) != f2bf(g / (1.0f + std::exp(-g)))) ++differ;
        ++n;
    }
    std::printf("%ld %ld %ld\n", n, worst, differ);
}
"""


def test_the_vector_silu_rounds_as_the_scalar_one_on_every_bf16(tmp_path):
    """The fused layers' SiLU takes e^x from a vector polynomial (`exp_ps`) where it took libm's expf a unit: within
    1 ulp of expf on every bf16 input (normal results), and the SiLU rounded to bf16, as the layer keeps it, equal on
    every finite bf16 input: the layers' numbers did not move."""
    import shutil
    import subprocess

    from modeling_pacer.cpu.kernels import FLAGS, SOURCE

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "check.cpp").write_text(EXP_CHECK)
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")]
    subprocess.run([compiler, *flags, "-I", str(SOURCE.parent), "-o", str(tmp_path / "check"),
                    str(tmp_path / "check.cpp")], check=True, capture_output=True)
    n, worst, differ = map(int, subprocess.run([str(tmp_path / "check")], check=True, capture_output=True,
                                               text=True).stdout.split())
    assert n == 65536 - 256 and worst <= 1 and differ == 0  # 256 codes are infinities and NaNs


def test_amx_rows_is_a_setting_not_a_result():
    """amx_rows(n) restores the previous threshold on leaving, refuses a negative one, and is harmless without
    tiles."""
    with pytest.raises(ValueError, match=">= 0"):
        with kernels.amx_rows(-1):
            pass
    if kernels.amx_available():
        ops = torch.ops.pacer
        before = ops.set_amx_rows(kernels.AMX_ROWS)
        assert before == kernels.AMX_ROWS
        with kernels.amx_rows(5):
            assert ops.set_amx_rows(5) == 5
        assert ops.set_amx_rows(kernels.AMX_ROWS) == kernels.AMX_ROWS
    else:
        with kernels.amx_rows(3):
            pass


def test_layers_fed_one_tensor_quantize_it_once(monkeypatch):
    """q and k (gate and up) read the same input: the second layer reuses its int8 rows, bitwise what quantizing
    again gives; an input edited in place since, another tensor, another block size (an int8 layer) or an
    inference-mode input (no version counter) is quantized afresh."""
    torch.manual_seed(8)
    first, second = (W4A8Linear.from_linear(torch.nn.Linear(512, 64)) for _ in range(2))
    int8 = W8A8Linear.from_linear(torch.nn.Linear(512, 32))
    made = []
    monkeypatch.setattr(kernels, "QuantizedRows", lambda *a, _cls=kernels.QuantizedRows, **k: made.append(1) or _cls(*a, **k))
    x = torch.randn(3, 512, dtype=torch.bfloat16)

    def fresh(layer, x):  # what the layer gives on a tensor it has not seen (a copy: another object)
        return layer(x.clone())

    with torch.no_grad():
        out = first(x), second(x)
        assert len(made) == 1
        assert torch.equal(out[1], fresh(second, x)) and len(made) == 2
        x.mul_(2)  # in place: the version changes
        assert torch.equal(second(x), fresh(second, x))
        int8(x)
        assert len(made) == 5
    with torch.inference_mode():
        y = torch.randn(3, 512, dtype=torch.bfloat16)
        first(y), second(y)
    assert len(made) == 7


def test_quantize_from_gguf_with_int8_activations(tmp_path):
    model = _tiny_qwen2()
    _write_gguf(model, tmp_path / "tiny.gguf")
    reference = _tiny_qwen2()
    reference.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    counts = quantize_from_gguf(model, tmp_path / "tiny.gguf", activations="int8")
    assert counts["w4a8 (gguf Q4_K)"] == 10 and counts["w8a8"] == 2 * 2 + 1  # v, down per layer; the LM head
    assert type(model.model.layers[0].self_attn.q_proj) is W4A8Linear
    assert type(model.model.layers[0].self_attn.v_proj) is W8A8Linear and type(model.lm_head) is W8A8Linear
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        agree = (model(ids).logits.argmax(-1) == reference(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.7
    with pytest.raises(ValueError, match="activations must be"):
        quantize_from_gguf(_tiny_qwen2(), tmp_path / "tiny.gguf", activations="int4")


def test_pacer_greedy_equals_w4a8_target():
    """PACER over a W4A8 target (every linear layer on the VNNI kernels, exact attention) with an int4 draft:
    token for token the W4A8 target's own greedy `generate`, several prompts, lengths and policies."""
    target = enable_pacer(make_exact(quantize_linears(_tiny_qwen2(seed=0).to(torch.bfloat16), "w4a8")))
    assert type(target.lm_head) is W4A8Linear
    draft = _tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * p.std() * torch.randn_like(p))
    draft = quantize_linears(draft.to(torch.bfloat16), "int4")
    g = torch.Generator().manual_seed(1)
    drafted = 0
    for n in (1, 9, 30):
        ids = torch.randint(0, 96, (1, n), generator=g)
        for new in (5, 24):
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            for policy in (FixedLength(2), FixedLength(8), "svip"):
                out = target.generate(ids, assistant_model=draft, stopping_policy=policy, do_sample=False,
                                      max_new_tokens=new, return_dict_in_generate=True)
                assert out.sequences.tolist() == expected.tolist(), (n, new, policy)
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0


def test_a_kernel_attention_draft_keeps_pacer_lossless():
    """`kernel_attention` (what load_draft does to a bf16 draft) puts a bf16 CPU model on pacer's attention kernel,
    leaves a float32 one alone, and PACER with such a draft is token for token the exact target's greedy output,
    under `torch.inference_mode()` as under transformers' own `no_grad`."""
    assert not kernel_attention(_tiny_qwen2(seed=1))  # float32: sdpa stays
    draft = _tiny_qwen2(seed=1).to(torch.bfloat16)
    assert kernel_attention(draft) and draft.config._attn_implementation == "pacer_kernel"
    target = enable_pacer(make_exact(_tiny_qwen2(seed=0).to(torch.bfloat16)))
    g = torch.Generator().manual_seed(2)
    for n in (1, 12):
        ids = torch.randint(0, 96, (1, n), generator=g)
        expected = target.generate(ids, do_sample=False, max_new_tokens=20)
        for mode in (torch.no_grad, torch.inference_mode):
            with mode():
                out = target.generate(ids, assistant_model=draft, stopping_policy=FixedLength(4), do_sample=False,
                                      max_new_tokens=20)
            assert out.tolist() == expected.tolist(), (n, mode)


def test_a_kernel_attention_draft_takes_a_mask_with_padding_where_the_exact_target_refuses_it():
    """transformers' generate infers a mask from the padding id when given none, so a sequence holding that id (a
    sampled token, under transformers' assisted generation) reaches the draft with a hole in its mask: a draft on the
    kernel computes it as sdpa does, where an exact target refuses it (its rows could not be exact)."""
    draft = _tiny_qwen2(seed=1).to(torch.bfloat16)
    assert kernel_attention(draft)
    ids = torch.tensor([[5, 9, 7, 11, 12, 13]])  # 7: the padding id below
    mask = (ids != 7).long()
    with torch.no_grad():
        ours = draft(ids, attention_mask=mask).logits
        draft.set_attn_implementation("sdpa")
        theirs = draft(ids, attention_mask=mask).logits
    assert torch.equal(ours, theirs)
    draft.set_attn_implementation("pacer_kernel")
    draft.generation_config.pad_token_id, draft.generation_config.eos_token_id = 7, 95
    assert draft.generate(ids, do_sample=False, max_new_tokens=3).shape == (1, 9)
    target = make_exact(_tiny_qwen2(seed=0).to(torch.bfloat16))
    with torch.no_grad(), pytest.raises(ValueError, match="not a plain causal pattern"):
        target(ids, attention_mask=mask)


def test_a_kernel_attention_draft_records_traces():
    """record_trace runs every draft's continuation past its miss in one forward under a tree mask, which pacer's
    causal attention kernel refuses: a draft on the kernel (every bf16 CPU draft load_draft makes, hence
    `pacer-bench run --record-traces` and pacer-train's recording) runs those forwards on sdpa and comes back
    on the kernel."""
    from modeling_pacer.replay import record_trace

    draft = _tiny_qwen2(seed=1).to(torch.bfloat16)
    assert kernel_attention(draft)
    target = make_exact(_tiny_qwen2(seed=0).to(torch.bfloat16))
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(3))
    output = target.generate(ids, do_sample=False, max_new_tokens=24)[0, 9:]
    trace = record_trace(draft, target, ids, output, 5, target_choice=output)
    assert draft.config._attn_implementation == "pacer_kernel"
    assert int((trace.match == 0).sum()) > 0  # misses: continuations were drafted under the tree mask
    budget = torch.arange(5)[None, :] < (len(output) - torch.arange(len(output)))[:, None]
    assert bool(((trace.token_probs[budget] > 0) & (trace.token_probs[budget] <= 1)).all())


def test_missing_kernels_are_a_clear_error(tmp_path, monkeypatch):
    """Without the kernels (no compiler, no VNNI), asking for them names why and what runs instead."""
    monkeypatch.setattr(kernels, "_load", lambda: (None, "no C++ compiler found (set $CXX or install g++)"))
    monkeypatch.setattr(kernels, "_OPS", None)  # as in a process that never loaded them
    assert not kernels.available() and "compiler" in kernels.unavailable_reason()
    with pytest.raises(RuntimeError, match="no C\\+\\+ compiler"):
        W8A8Linear.from_linear(torch.nn.Linear(256, 16))(torch.randn(1, 256))
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"")
    folder = tmp_path / "tiny"
    _tiny_qwen2().save_pretrained(folder)
    with pytest.raises(ValueError, match="w4a8.*no C\\+\\+ compiler.*'int4' runs on torch's kernels"):
        load_pair(str(gguf), draft=str(folder), quantize_target="w4a8")


def test_a_failing_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("PACER_CACHE", str(tmp_path / "cache"))
    library, why = kernels._load.__wrapped__()
    assert library is None and "no-such-compiler" in why


def test_exact_attention_kernel_is_the_torch_rows_computed_alone(monkeypatch):
    """The C++ attention (bf16, one call per layer) against pacer_exact's torch ops, on Qwen2-1.5B's attention
    shape with GQA, a sliding window and a padding row: the same attention to float rounding, and each row of
    a block bitwise its single-query call."""
    from modeling_pacer.cpu import exact_attention

    class Attention(torch.nn.Module):
        is_causal = True

    g = torch.Generator().manual_seed(0)
    past, k = 40, 8
    q = torch.randn(1, 12, k, 128, generator=g).bfloat16()
    key, value = (torch.randn(1, 2, past + k, 128, generator=g).bfloat16() for _ in range(2))
    fn = exact_attention.exact_attention_forward
    for window in (None, 16):
        fast, _ = fn(Attention(), q, key, value, None, scaling=128**-0.5, sliding_window=window)
        for i in range(k):
            step, _ = fn(Attention(), q[:, :, i:i + 1], key[:, :, :past + i + 1], value[:, :, :past + i + 1], None,
                         scaling=128**-0.5, sliding_window=window)
            assert torch.equal(fast[:, i], step[:, 0]), (window, i)
        with monkeypatch.context() as patched:
            patched.setattr(exact_attention, "_kernel_applies", lambda *a: False)
            slow, _ = fn(Attention(), q, key, value, None, scaling=128**-0.5, sliding_window=window)
        assert fast.dtype == slow.dtype == torch.bfloat16
        torch.testing.assert_close(fast.float(), slow.float(), rtol=2e-2, atol=2e-2)
    lo, hi = torch.tensor([[0, 3]]), torch.tensor([[0, 9]])  # row 0: a padding query that sees nothing
    out = kernels.exact_attention(q[:, :, :2], key[:, :, :9], value[:, :, :9], lo, hi, 0.1)
    assert torch.equal(out[0, 0], torch.zeros(12, 128)) and bool(out[0, 1].abs().sum() > 0)
    with pytest.raises(ValueError, match="bf16"):
        kernels.exact_attention(q.float(), key, value, lo, hi, 0.1)


ATTENTION_CHECK = r"""
#include "vnni_matmul.cpp"
#include <cstdio>
#include <random>
// rows computed together against each row alone, bitwise; and against a double reference
int main() {
    std::mt19937 g(1); std::normal_distribution<float> nd;
    int bad = 0; double worst = 0;
    for (int64_t D : {16, 48, 64, 80, 128, 256}) for (int64_t KV : {1, 2}) for (int64_t G : {1, 3, 7, 9}) {
        const int64_t H = KV * G, M = 21, L = 57;
        auto mk = [&](int64_t n) { std::vector<uint16_t> v(n); for (auto& x : v) x = f2bf(nd(g)); return v; };
        auto q = mk(H * M * D), k = mk(KV * L * D), v = mk(KV * L * D);
        std::vector<int64_t> lo(M), hi(M);
        for (int64_t i = 0; i < M; ++i) { hi[i] = L - M + i + 1; lo[i] = i % 5 == 0 ? 0 : hi[i] > 19 ? hi[i] - 19 : 0; }
        lo[3] = hi[3];  // a padding row
        std::vector<float> out(M * H * D), one(H * D);
        pacer_exact_attention(q.data(), k.data(), v.data(), 1, H, KV, M, L, D, L * D, lo.data(), hi.data(), 0.3f, out.data());
        for (int64_t i = 0; i < M; ++i) {
            std::vector<uint16_t> qi(H * D);
            for (int64_t h = 0; h < H; ++h) for (int64_t d = 0; d < D; ++d) qi[h * D + d] = q[(h * M + i) * D + d];
            // the row alone, its keys as the first hi positions of a buffer of capacity L
            pacer_exact_attention(qi.data(), k.data(), v.data(), 1, H, KV, 1, hi[i], D, L * D, &lo[i], &hi[i], 0.3f, one.data());
            if (std::memcmp(one.data(), out.data() + i * H * D, H * D * 4)) ++bad;
            for (int64_t h = 0; h < H; ++h) {
                const int64_t kh = h / G;
                std::vector<double> s; double top = -1e300;
                for (int64_t j = lo[i]; j < hi[i]; ++j) { double x = 0; for (int64_t d = 0; d < D; ++d) x += (double)bf2f(qi[h*D+d]) * bf2f(k[(kh*L+j)*D+d]); s.push_back(x*0.3); top = std::max(top, x*0.3); }
                double tot = 0; for (auto& x : s) { x = std::exp(x - top); tot += x; }
                for (int64_t d = 0; d < D; ++d) { double r = 0; for (size_t j = 0; j < s.size(); ++j) r += s[j] * bf2f(v[(kh*L+lo[i]+j)*D+d]); r = s.empty() ? 0 : r / tot;
                    worst = std::max(worst, std::fabs(r - out[(i*H+h)*D+d])); }
            }
        }
    }
    std::printf("%d %.3e\n", bad, worst);
}
"""


def test_the_attention_kernel_is_row_invariant_and_accurate_with_and_without_bf16_dot_products(tmp_path):
    """pacer_exact_attention over head sizes that are and are not multiples of 32 (masked chunks), 1 to 9 query heads
    a key head (more than one batch of 8), sliding windows and a padding row: every row of a 21-row call bitwise its
    single-row call, and within 1e-4 of the attention in double precision; built as the host builds it and, where
    the CPU has AVX512-BF16 (its scores by vdpbf16ps), again without it (the other CPUs' fused multiply-adds)."""
    import shutil
    import subprocess

    from modeling_pacer.cpu.kernels import FLAGS, SOURCE

    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    (tmp_path / "check.cpp").write_text(ATTENTION_CHECK)
    flags = [f for f in FLAGS if f not in ("-shared", "-fPIC")]
    builds = [[]] + ([["-mno-avx512bf16"]] if "avx512_bf16" in (cpuinfo_field("flags") or "").split() else [])
    for extra in builds:
        binary = tmp_path / f"check{len(extra)}"
        subprocess.run([compiler, *flags, *extra, "-I", str(SOURCE.parent), "-o", str(binary), str(tmp_path / "check.cpp")],
                       check=True, capture_output=True)
        bad, worst = subprocess.run([str(binary)], check=True, capture_output=True, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "2"}).stdout.split()
        assert int(bad) == 0 and float(worst) < 1e-4, (extra, bad, worst)


def test_bias_and_bf16_output_are_torch_rounding():
    """The kernels add the bias in float32 and round to bf16 to nearest even: bitwise what torch does with
    their float32 output, so a bf16 model's layer gives the same numbers either way."""
    torch.manual_seed(7)
    x = torch.randn(5, 512, dtype=torch.bfloat16)
    bias = torch.randn(48)
    q4 = kernels.pack_q4k(torch.randint(0, 16, (48, 512)), torch.randint(0, 64, (48, 16)), torch.randint(0, 64, (48, 16)),
                          torch.rand(48, 2) / 100, torch.rand(48, 2) / 100)
    q8 = kernels.pack_q8(torch.randint(-127, 128, (48, 512)), torch.rand(48) / 100)
    for matmul, parts, block in ((kernels.q4k_matmul, q4, 256), (kernels.q8_matmul, q8, 32)):
        rows = kernels.QuantizedRows(x, block)
        plain = matmul(rows, *parts, 48)
        assert torch.equal(matmul(rows, *parts, 48, bias), plain + bias)
        assert torch.equal(matmul(rows, *parts, 48, bias, torch.bfloat16), (plain + bias).to(torch.bfloat16))
        with pytest.raises(ValueError, match="float32 or bfloat16"):
            matmul(rows, *parts, 48, None, torch.float16)
        with pytest.raises(ValueError, match="bias must be"):
            matmul(rows, *parts, 48, bias.double())


def test_unpack_int4_reads_back_what_pack_int4_packed():
    """`kernels.unpack_int4` (a reduced draft head's rows read back from the packing) is `pack_int4`'s inverse."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (48, 96), generator=g)
    scales, zeros = torch.randn(48, 3, generator=g), torch.randn(48, 3, generator=g)
    packed, scales_zeros = kernels.pack_int4(codes, scales, zeros)
    back = kernels.unpack_int4(packed, scales_zeros)
    assert torch.equal(back[0].long(), codes)
    assert torch.equal(back[1], scales.to(torch.bfloat16)) and torch.equal(back[2], zeros.to(torch.bfloat16))
    assert all(torch.equal(a, b) for a, b in zip(kernels.pack_int4(*back), (packed, scales_zeros)))


def test_the_vnni_peak_is_a_rate_in_the_instructions_physical_range():
    """`kernels.vnni_peak`: multiply-adds a ns of vpdpbusd alone; positive, and under what any core could do (64 an
    instruction, at most 4 instructions a cycle at 6 GHz, a thread); bad arguments refused before any work."""
    for threads in (1, 2):
        rate = kernels.vnni_peak(threads=threads, iterations=20_000)
        assert 0 < rate < 64 * 4 * 6 * threads
    with pytest.raises(ValueError, match="positive"):
        kernels.vnni_peak(threads=1, iterations=0)
