"""Weight-only int4/int8 layers (modeling_pacer/cpu/quantization.py): the GGUF's Q4_K grid is repacked unchanged
(against gguf-py's own dequantization), each output row is computed the same way whatever the number of
rows in the call, a target built from a GGUF file keeps that file's 4-bit codes, and PACER over int4
targets and drafts returns the target's own greedy output token for token."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize
from transformers import Qwen2Config, Qwen2ForCausalLM

from modeling_pacer import FixedLength, enable_pacer
from modeling_pacer.cpu import kernels
from modeling_pacer.exact import make_exact
from modeling_pacer.pairs import PairArguments, load_pair
from modeling_pacer.pairs.loading import quantize_dynamic_int8
from modeling_pacer.cpu.quantization import (
    Int4Linear, Int8Linear, int4_kernel_available, kernel_rows_only, place_on_huge_pages, q4_k_grid, quantize_from_gguf,
    quantize_linears,
)

from conftest import VOCAB, make_model
from test_exact_attention import _block_and_steps

pytestmark = pytest.mark.skipif(not int4_kernel_available(), reason="this torch has no CPU int4 kernel")


def _random_q4_k(rows: int, cols: int, seed: int) -> np.ndarray:
    """Valid Q4_K bytes for a (rows, cols) tensor: float16 d/dmin of weight-like size, random 6-bit scales
    and minimums, random 4-bit codes (144 bytes per 256 weights)."""
    rng = np.random.default_rng(seed)
    n = rows * cols // 256
    blocks = rng.integers(0, 256, size=(n, 144), dtype=np.uint8)
    blocks[:, 0:2] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    blocks[:, 2:4] = rng.uniform(1e-4, 2e-3, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    return blocks.reshape(rows, cols // 256 * 144)


def _grid_weight(codes, scales, zeros):
    return (codes.float() - 8) * scales.repeat_interleave(32, 1) + zeros.repeat_interleave(32, 1)


def test_q4_k_grid_is_gguf_dequantization():
    raw = _random_q4_k(48, 512, seed=0)
    codes, scales, zeros = q4_k_grid(raw, 48, 512)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(48, 512)
    torch.testing.assert_close(_grid_weight(codes, scales, zeros), expected, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="weights"):
        q4_k_grid(raw, 48, 256)


PACER_KERNEL = pytest.param("pacer", marks=pytest.mark.skipif(not kernels.available(),
                                                              reason=f"pacer's kernels: {kernels.unavailable_reason()}"))


@pytest.mark.parametrize("kernel", ["torch", PACER_KERNEL])
def test_int4_linear_computes_its_grid(kernel):
    torch.manual_seed(0)
    codes = torch.randint(0, 16, (64, 96))
    scales, zeros = torch.rand(64, 3) * 0.01 + 1e-3, torch.randn(64, 3) * 0.01
    bias = torch.randn(64)
    layer = Int4Linear(codes, scales, zeros, bias, kernel=kernel)
    x = torch.randn(5, 96)
    # the bf16-rounded scales and zeros both kernels use
    weight = _grid_weight(codes, scales.to(torch.bfloat16).float(), zeros.to(torch.bfloat16).float())
    expected = x.to(torch.bfloat16).float() @ weight.t() + bias.to(torch.bfloat16).float()
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (5, 64)
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="divisible"):
        Int4Linear(codes[:50], scales[:50], zeros[:50])
    with pytest.raises(ValueError, match="0..15"):
        Int4Linear(codes + 1, scales, zeros, kernel=kernel)
    with pytest.raises(ValueError, match="kernel must be one of"):
        Int4Linear(codes, scales, zeros, kernel="cuda")
    with pytest.raises(ValueError, match="int4_kernel is an option of kind='int4' only"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(96, 64)), "int8", int4_kernel="pacer")
    if kernel == "pacer":
        with pytest.raises(ValueError, match="group_size=32"):
            Int4Linear(codes, scales[:, :1].repeat(1, 3)[:, :1], zeros[:, :1], group_size=96, kernel="pacer")


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_from_linear_error_is_bounded(kind):
    torch.manual_seed(1)
    linear = torch.nn.Linear(128, 48)
    layer = Int4Linear.from_linear(linear) if kind == "int4" else Int8Linear.from_linear(linear)
    eye = torch.eye(128)
    recovered = (layer(eye) - layer(torch.zeros(1, 128))).t()  # W, through the kernel (bias removed)
    w = linear.weight.detach()
    # int4: half a step of 15 per group span; int8: half a step of 127 per row max; plus bf16 rounding
    step = (w.reshape(48, 4, 32).amax(-1) - w.reshape(48, 4, 32).amin(-1)).repeat_interleave(32, 1) / 15 \
        if kind == "int4" else w.abs().amax(-1, keepdim=True) / 127
    assert bool(((recovered - w).abs() <= 0.5 * step + 0.02 * w.abs() + 1e-3).all())


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_rows_do_not_depend_on_the_row_count(kind, threads):
    """Row i of an n-row call is bitwise the 1-row call on row i, for n up to 20: what exactness needs."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(2)
        linear = torch.nn.Linear(256, 320)
        layer = Int4Linear.from_linear(linear) if kind == "int4" else Int8Linear.from_linear(linear)
        x = torch.randn(20, 256, dtype=torch.bfloat16)
        singles = torch.cat([layer(x[i:i + 1]) for i in range(20)])
        for n in range(2, 21):
            assert torch.equal(layer(x[:n]), singles[:n]), n
    finally:
        torch.set_num_threads(before)


def _tiny_qwen2(seed: int = 0, vocab: int = 96) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=None, eos_token_id=None, pad_token_id=None)
    return Qwen2ForCausalLM(config).eval()


def _write_gguf(model, path, q4k=("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")):
    """A GGUF holding Q4_K tensors for some of `model`'s linear layers (random grids), and the model's weights
    set to them, as transformers' loader would dequantize them. Returns the names written."""
    writer = GGUFWriter(str(path), "qwen2")
    written = []
    for layer in range(model.config.num_hidden_layers):
        block = model.model.layers[layer]
        modules = dict(attn_q=block.self_attn.q_proj, attn_k=block.self_attn.k_proj, attn_output=block.self_attn.o_proj,
                       ffn_gate=block.mlp.gate_proj, ffn_up=block.mlp.up_proj)
        for name in q4k:
            linear = modules[name]
            raw = _random_q4_k(linear.out_features, linear.in_features, seed=len(written))
            writer.add_tensor(f"blk.{layer}.{name}.weight", raw, raw_dtype=GGMLQuantizationType.Q4_K)
            weight = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q4_K)).reshape(linear.weight.shape)
            with torch.no_grad():
                linear.weight.copy_(weight)
            written.append(f"blk.{layer}.{name}.weight")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.mark.parametrize("other", ["int4", "int8", "bfloat16"])
def test_quantize_from_gguf_keeps_the_files_codes(tmp_path, other):
    model = _tiny_qwen2()
    _write_gguf(model, tmp_path / "tiny.gguf")
    reference = _tiny_qwen2()
    reference.load_state_dict(model.state_dict())
    model.to(torch.bfloat16)
    counts = quantize_from_gguf(model, tmp_path / "tiny.gguf", other=other)
    assert counts["int4 (gguf Q4_K)"] == 10  # 5 per layer
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, Int4Linear)
    # the Q4_K layers compute the file's weights (bf16 scales aside)
    x = torch.randn(3, 256)
    torch.testing.assert_close(q(x), reference.model.layers[0].self_attn.q_proj(x), rtol=3e-2, atol=3e-2)
    v, lm = model.model.layers[0].self_attn.v_proj, model.lm_head  # not Q4_K in the file
    kind = {"int4": Int4Linear, "int8": Int8Linear, "bfloat16": torch.nn.Linear}[other]
    assert type(v) is kind and type(lm) is kind
    ids = torch.randint(0, 96, (1, 12))
    with torch.no_grad():
        agree = (model(ids).logits.argmax(-1) == reference(ids).logits.argmax(-1)).float().mean()
    assert agree > 0.7


def test_quantize_from_gguf_refuses_another_models_file(tmp_path):
    model = _tiny_qwen2()
    _write_gguf(model, tmp_path / "tiny.gguf")
    other = _tiny_qwen2(seed=5)  # same shapes, other weights: not the model this file holds
    with pytest.raises(ValueError, match="does not match"):
        quantize_from_gguf(other, tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="other must be"):
        quantize_from_gguf(model, tmp_path / "tiny.gguf", other="int2")


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_int4_target_block_bitwise_equals_steps(arch):
    """A bf16 target with int4 linear layers (and pacer_exact): a k-token block's logits are bitwise the
    logits of k single steps, for k up to 8 (the vocabulary 97 leaves the LM head a padded bf16 Linear)."""
    model = make_exact(quantize_linears(make_model(arch, seed=1, hidden=64).to(torch.bfloat16), "int4"))
    assert sum(isinstance(m, Int4Linear) for m in model.modules()) >= 7
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    blocks, steps = _block_and_steps(model, ids, 30, 8)
    assert all(torch.equal(logits, steps[:, :k]) for k, logits in blocks.items())


def test_int4_dense_rows_runs_long_calls_on_the_dequantized_weight():
    """`dense_rows`: calls below it are the int4 kernel's bitwise, calls from it on are a bf16 matmul by the
    layer's own grid (close to the kernel's rows, not equal); the copy is no saved state and no bytes a step
    reads; a layer with it is refused by exact_linears (its rows depend on the call's size)."""
    from modeling_pacer.costs import weight_bytes
    from modeling_pacer.cpu.exact_linear import exact_linears

    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 64)
    plain, dense = Int4Linear.from_linear(linear), Int4Linear.from_linear(linear, dense_rows=4)
    x = torch.randn(9, 96, dtype=torch.bfloat16)
    for n in (1, 2, 3):
        assert torch.equal(dense(x[:n]), plain(x[:n]))
    for n in (4, 9):
        expected = torch.nn.functional.linear(x[:n], dense.dense_weight, dense.bias)
        assert torch.equal(dense(x[:n]), expected)
        torch.testing.assert_close(dense(x[:n]).float(), plain(x[:n]).float(), rtol=3e-2, atol=3e-2)
    # the copy is the kernel's grid: multiplying the identity through the kernel gives it back
    recovered = (plain(torch.eye(96)) - plain(torch.zeros(1, 96))).t().to(torch.bfloat16)
    torch.testing.assert_close(dense.dense_weight.float(), recovered.float(), rtol=1e-2, atol=1e-3)
    with kernel_rows_only(torch.nn.Sequential(dense)):  # how record_trace runs a draft's long forwards
        assert torch.equal(dense(x), plain(x))
    assert torch.equal(dense(x), torch.nn.functional.linear(x, dense.dense_weight, dense.bias))
    assert "dense_weight" not in dense.state_dict() and weight_bytes(dense) == weight_bytes(plain)
    assert "dense_rows=4" in repr(dense)
    with pytest.raises(ValueError, match="at least 2"):
        Int4Linear.from_linear(linear, dense_rows=1)
    with pytest.raises(ValueError, match="kind='int4' only"):
        quantize_linears(torch.nn.Sequential(torch.nn.Linear(96, 64)), "int8", dense_rows=8)
    with pytest.raises(ValueError, match="dense_rows"):
        exact_linears(torch.nn.Sequential(dense))


def test_load_draft_keeps_a_dense_copy_only_for_torchs_int4_kernel(tmp_path, monkeypatch):
    """load_draft's int4 draft: on pacer's int4 kernel its prompt stays int4 (no dense copy held); on torch's, whose
    cost grows with the rows, calls of DRAFT_DENSE_ROWS rows or more run on the dense copy; an explicit
    `dense_rows` is kept either way and a bad one is a clear error."""
    from modeling_pacer.pairs.loading import DRAFT_DENSE_ROWS, load_draft

    _tiny_qwen2().save_pretrained(tmp_path / "draft")

    def int4_layers(**kwargs):
        draft = load_draft(str(tmp_path / "draft"), torch.bfloat16, "int4", **kwargs)
        return [m for m in draft.modules() if isinstance(m, Int4Linear)]

    if kernels.available():
        layers = int4_layers()
        assert layers and all(m.kernel == "pacer" and m.dense_rows is None and m.dense_weight is None for m in layers)
        # its prompt on AMX-BF16 tiles where the CPU has them (Int4Linear.prompt_tiles; the int8 path elsewhere)
        assert all(m.prompt_tiles for m in layers)
        assert all(m.dense_rows == 64 for m in int4_layers(dense_rows=64))
    monkeypatch.setattr(kernels, "available", lambda: False)
    layers = int4_layers()
    assert layers and all(m.kernel == "torch" and m.dense_rows == DRAFT_DENSE_ROWS and not m.prompt_tiles
                          for m in layers)
    assert all(m.dense_rows is None for m in int4_layers(dense_rows=None))
    for bad in (1, "dense", 2.5):
        with pytest.raises(ValueError, match="dense_rows must be"):
            load_draft(str(tmp_path / "draft"), torch.bfloat16, "int4", dense_rows=bad)


@pytest.mark.parametrize("draft_kind", ["int4", "int4-dense", "int8"] + [pytest.param(
    kind, marks=pytest.mark.skipif(not kernels.available(), reason="pacer's kernels are not available"))
    for kind in ("int4-pacer", "int4-fused")] + [pytest.param(
        "int4-tiles", marks=pytest.mark.skipif(not kernels.bf16_tiles_available(), reason="no AMX-BF16 tiles here"))])
def test_pacer_greedy_equals_int4_target(draft_kind, monkeypatch):
    """PACER over an int4 target (every linear layer, LM head included) with an int4 or int8 draft (int4 on
    torch's kernel, with a dense prefill copy, or on pacer's kernel with it, as load_draft makes it): token for
    token the int4 target's own greedy `generate`, several prompts and lengths; "int4-fused": pacer's kernel with
    the decoder layers fused (modeling_pacer/cpu/fused_layers.py), as load_draft makes it; "int4-tiles": that, and
    prompts of 40 tokens read on the AMX-BF16 tiles (`prompt_tiles`, as load_draft sets it)."""
    target = enable_pacer(make_exact(quantize_linears(_tiny_qwen2(seed=0).to(torch.bfloat16), "int4")))
    assert isinstance(target.lm_head, Int4Linear)
    draft = _tiny_qwen2(seed=0)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.2 * p.std() * torch.randn_like(p))
    if draft_kind == "int8":
        draft = quantize_dynamic_int8(draft)
    else:  # "int4-dense", "int4-pacer": prompts of 4 tokens or more are read with the dense copy (load_draft's prefill)
        draft = quantize_linears(draft.to(torch.bfloat16), "int4",
                                 dense_rows=None if draft_kind in ("int4", "int4-tiles") else 4,
                                 int4_kernel="pacer" if draft_kind in ("int4-pacer", "int4-fused", "int4-tiles") else "torch")
        if draft_kind == "int4-fused":
            from modeling_pacer.cpu.fused_layers import fuse_draft_layers

            assert fuse_draft_layers(draft) == 2
        if draft_kind == "int4-tiles":
            from modeling_pacer.cpu.fused_layers import fuse_draft_layers
            from modeling_pacer.cpu.quantization import tile_prompts

            assert fuse_draft_layers(draft) == 2 and tile_prompts(draft) == 15
    tiled = []
    bf16_matmul = kernels.int4_matmul_bf16
    monkeypatch.setattr(kernels, "int4_matmul_bf16", lambda x, *a, **k: tiled.append(x.shape[0]) or bf16_matmul(x, *a, **k))
    g = torch.Generator().manual_seed(1)
    drafted = 0
    for n in (1, 9) + ((40,) if draft_kind == "int4-tiles" else ()):
        ids = torch.randint(0, 96, (1, n), generator=g)
        for new in (5, 24):
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            for policy in (FixedLength(2), FixedLength(6), "svip"):
                out = target.generate(ids, assistant_model=draft, stopping_policy=policy, do_sample=False,
                                      max_new_tokens=new, return_dict_in_generate=True)
                assert out.sequences.tolist() == expected.tolist(), (n, new, policy)
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0
    # the draft's first calls after the 40-token prompts (the prompt and the target's first token) went to the tiles,
    # none of the shorter ones
    assert (tiled and min(tiled) >= 40) if draft_kind == "int4-tiles" else not tiled


def test_load_pair_refuses_what_cannot_be_4_bit(tmp_path):
    """Clear errors before anything loads: a target that is no GGUF file, a dtype other than bf16, two target
    quantizations at once, an unknown name; and the flags say the same."""
    folder = tmp_path / "tiny"
    _tiny_qwen2().save_pretrained(folder)
    with pytest.raises(ValueError, match="not a GGUF file"):
        load_pair(str(folder), draft=str(folder), quantize_target="int4")
    gguf = tmp_path / "t.gguf"
    gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="bfloat16"):
        load_pair(str(gguf), draft=str(folder), quantize_target="int4", dtype="float32")
    with pytest.raises(ValueError, match="choose one"):
        load_pair(str(gguf), draft=str(folder), quantize_target="int4", exact=False, load_in_8bit_target=True)
    with pytest.raises(ValueError, match="quantize_target must be"):
        load_pair(str(gguf), draft=str(folder), quantize_target="int3")
    with pytest.raises(ValueError, match="quantize_draft must be"):
        load_pair(str(folder), draft=str(folder), quantize_draft="int2")
    with pytest.raises(ValueError, match="--quantize-target: .*not a GGUF file"):
        PairArguments(target=str(folder), draft=str(folder), quantize_target="int4")
    assert PairArguments(quantize_draft=True).quantize_draft == "int8"


def test_load_pair_int4_draft(tmp_path):
    """`quantize_draft="int4"`: a bf16 draft whose linear layers are Int4Linear; the target untouched."""
    folder = tmp_path / "tiny"
    _tiny_qwen2().save_pretrained(folder)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
                            ).save_pretrained(folder)
    pair = load_pair(str(folder), draft=str(folder), quantize_draft="int4", dtype="bfloat16")
    assert isinstance(pair.draft.lm_head, Int4Linear) and pair.draft.dtype == torch.bfloat16
    # pacer's int4 kernel where this CPU runs it, torch's elsewhere
    assert pair.draft.lm_head.kernel == ("pacer" if kernels.available() else "torch")
    assert type(pair.target.lm_head) is torch.nn.Linear and pair.quantize_target is None
    assert pair.setting == "bfloat16 exact"


def test_weights_on_huge_pages_are_the_same_weights():
    """place_on_huge_pages moves every quantized layer's buffers into one 64-byte-aligned block, values, dtypes and
    shapes unchanged, and the model computes bitwise what it did; the dense copy for prompts stays where it was."""
    model = quantize_linears(_tiny_qwen2().to(torch.bfloat16), "int4", dense_rows=4)
    model.model.layers[0].mlp.down_proj = Int8Linear.from_linear(torch.nn.Linear(512, 256))
    layers = [m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear))]
    before = {(id(m), name): t.clone() for m in layers for name, t in m._buffers.items() if t is not None}
    dense = [m.dense_weight.data_ptr() for m in layers if isinstance(m, Int4Linear)]
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = [model(ids).logits, model(ids[:, :2]).logits]
        moved = place_on_huge_pages(model)
        after = [model(ids).logits, model(ids[:, :2]).logits]
    assert all(torch.equal(a, b) for a, b in zip(reference, after))
    assert [m.dense_weight.data_ptr() for m in layers if isinstance(m, Int4Linear)] == dense
    blocks = set()
    for m in layers:
        for name, t in m._buffers.items():
            if t is None or name == "dense_weight":
                continue
            old = before[(id(m), name)]
            assert t.dtype == old.dtype and t.shape == old.shape and torch.equal(t, old) and t.is_contiguous()
            assert t.data_ptr() % 64 == 0
            blocks.add(t.untyped_storage().data_ptr())
    assert len(blocks) == 1
    assert moved >= sum(t.numel() * t.element_size() for (_, name), t in before.items() if name != "dense_weight")
    assert place_on_huge_pages(torch.nn.Linear(4, 4)) == 0


@pytest.mark.skipif(not kernels.bf16_tiles_available(), reason="no AMX-BF16 tiles here")
def test_the_int8_prompt_method_is_pacer_with_the_drafts_prompt_untiled(monkeypatch):
    """pacer-bench's pacer-int8-prompt (quantization.untiled_prompts): the same tokens as pacer (the target's own),
    the draft's 40-token prompt on the int8 path inside the block, on the tiles before and after it (and after an
    error in it)."""
    from modeling_pacer.benchmarks.methods import all_methods, run_method
    from modeling_pacer.cpu.quantization import tile_prompts, untiled_prompts

    target = enable_pacer(make_exact(quantize_linears(_tiny_qwen2(seed=0).to(torch.bfloat16), "int4")))
    draft = quantize_linears(_tiny_qwen2(seed=0).to(torch.bfloat16), "int4", int4_kernel="pacer")
    assert tile_prompts(draft) == 15
    tiled = []
    monkeypatch.setattr(kernels, "int4_matmul_bf16",
                        lambda x, *a, _f=kernels.int4_matmul_bf16, **k: tiled.append(x.shape[0]) or _f(x, *a, **k))
    methods = all_methods()
    for name in ("pacer", "pacer-int8-prompt"):
        methods[name].policy, methods[name].needs_head, methods[name].needs_costs = lambda *c: FixedLength(3), False, False
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(5))
    expected = target.generate(ids, do_sample=False, max_new_tokens=20)
    out, _ = run_method(methods["pacer"], target, draft, None, ids, 20)
    assert tiled and out.tolist() == expected.tolist()
    tiled.clear()
    out, _ = run_method(methods["pacer-int8-prompt"], target, draft, None, ids, 20)
    assert not tiled and out.tolist() == expected.tolist()
    assert all(m.prompt_tiles for m in draft.modules() if isinstance(m, Int4Linear))
    with pytest.raises(RuntimeError):
        with untiled_prompts(draft):
            assert not any(m.prompt_tiles for m in draft.modules() if isinstance(m, Int4Linear))
            raise RuntimeError
    assert all(m.prompt_tiles for m in draft.modules() if isinstance(m, Int4Linear))
