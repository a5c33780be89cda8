"""Decoder layers in two kernel calls each (modeling_pacer/cpu/fused_layers.py). A draft's: one-token steps follow
the eager layer's numbers to bf16 rounding, anything else runs the eager layer itself, the layers it cannot take
are left alone (PACER's greedy identity with such a draft: tests/test_quantization.py, draft_kind "int4-fused").
A W4A8 target's: every call of one sequence on the kernels, each row bitwise alone (a prefill whole or in chunks, a
verification block, steps), close to the eager layer's numbers; PACER over it is token for token its own greedy
output, and its sampling the fused target's distribution."""

import copy

import pytest
import torch
from transformers import DynamicCache

from modeling_pacer.cpu import kernels
from modeling_pacer.costs import describe_model
from modeling_pacer import FixedLength, enable_pacer
from modeling_pacer.cpu.fused_layers import (
    MAX_ROWS, FusedDecoderStep, FusedModelStep, eager_layers, fuse_draft_layers, fuse_target_layers, fused_layers, _untimed,
)
from modeling_pacer.cpu import fused_layers as fused_layers_module
from modeling_pacer.cpu.quantization import W4A8Linear, W8A8Linear, quantize_linears
from modeling_pacer.exact import make_exact

from conftest import make_model
from test_quantization import _tiny_qwen2
from test_sampling import _chi_square_p_value

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"pacer's kernels: {kernels.unavailable_reason()}")


def _count_qkv_calls(monkeypatch, calls: list, record=lambda hidden: 1) -> None:
    """Append `record(hidden)` to `calls` for every layer whose q/k/v a kernel computes: [`kernels.layer_qkv`] (no
    cache), [`kernels.layer_qkv_cached`] (writing into a DynamicCache's buffers), once a layer for
    [`kernels.decoder_layers`] (every layer of a model step in one call)."""
    for name in ("layer_qkv", "layer_qkv_cached"):
        monkeypatch.setattr(kernels, name, lambda *a, _f=getattr(kernels, name): calls.append(record(a[0])) or _f(*a))
    monkeypatch.setattr(kernels, "decoder_layers",
                        lambda *a, _f=kernels.decoder_layers, **k: calls.extend([record(a[0])] * len(a[-3])) or _f(*a, **k))


def _int4_draft(seed: int = 0, arch: str = "qwen2"):
    model = _tiny_qwen2(seed=seed) if arch == "qwen2" else make_model("llama", seed=seed, hidden=128)
    return quantize_linears(model.to(torch.bfloat16), "int4", int4_kernel="pacer")


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_one_token_steps_follow_the_eager_layer(arch):
    """After a prompt read by the eager layers, 12 one-token steps: the fused model's logits and last hidden
    states stay within bf16 rounding of the eager model's, step after step (each on its own cache), and the
    caches they build agree the same way."""
    eager = _int4_draft(arch=arch)
    fused = copy.deepcopy(eager)
    assert fuse_draft_layers(fused) == eager.config.num_hidden_layers == fused_layers(fused)
    assert fused_layers(eager) == 0
    assert fuse_draft_layers(fused) == 0  # already routed: nothing more to do
    ids = torch.randint(0, eager.config.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    caches = {name: DynamicCache(config=eager.config) for name in ("eager", "fused")}
    with torch.no_grad():
        prompts = {name: model(ids[:, :8], past_key_values=caches[name]).logits
                   for name, model in (("eager", eager), ("fused", fused))}
        assert torch.equal(prompts["eager"], prompts["fused"])  # 8 rows: the eager layers on both sides
        for i in range(8, 20):
            out = {name: model(ids[:, i:i + 1], past_key_values=caches[name], output_hidden_states=True)
                   for name, model in (("eager", eager), ("fused", fused))}
            a, b = out["eager"], out["fused"]
            scale = float(a.logits.abs().max())
            assert float((a.logits - b.logits).abs().max()) <= 0.02 * scale, i
            h_a, h_b = a.hidden_states[-1].float(), b.hidden_states[-1].float()
            assert float((h_a - h_b).abs().max()) <= 0.02 * float(h_a.abs().max()), i
    for layer in range(eager.config.num_hidden_layers):
        k_a, k_b = caches["eager"].layers[layer].keys.float(), caches["fused"].layers[layer].keys.float()
        assert k_a.shape == k_b.shape and k_a.shape[:3] == (1, eager.config.num_key_value_heads, 20)
        assert float((k_a - k_b).abs().max()) <= 0.02 * float(k_a.abs().max())


def test_a_few_tokens_at_once_are_the_one_token_steps():
    """A call of 2 to MAX_ROWS new tokens (a draft's catch-up after a verification) goes through the kernels and
    gives, row for row, bitwise the logits, last hidden states and cache of one-token steps over the same tokens."""
    fused = _int4_draft(seed=3)
    fuse_draft_layers(fused)
    ids = torch.randint(0, fused.config.vocab_size, (1, 6 + MAX_ROWS), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for rows in (2, 3, MAX_ROWS):
            caches = [DynamicCache(config=fused.config) for _ in range(2)]
            for cache in caches:
                fused(ids[:, :6], past_key_values=cache)
            block = fused(ids[:, 6:6 + rows], past_key_values=caches[0], output_hidden_states=True)
            steps = [fused(ids[:, i:i + 1], past_key_values=caches[1], output_hidden_states=True)
                     for i in range(6, 6 + rows)]
            assert torch.equal(block.logits, torch.cat([s.logits for s in steps], dim=1)), rows
            assert torch.equal(block.hidden_states[-1], torch.cat([s.hidden_states[-1] for s in steps], dim=1)), rows
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_other_calls_run_the_eager_layer(monkeypatch):
    """More than MAX_ROWS tokens, a batch of two, gradients, a cache with a masked (padded) key: the eager forward,
    bitwise; only calls of 1 to MAX_ROWS tokens of one sequence without gradients reach the kernels."""
    eager = _int4_draft()
    fused = copy.deepcopy(eager)
    fuse_draft_layers(fused)
    calls = []
    _count_qkv_calls(monkeypatch, calls)
    ids = torch.randint(0, eager.config.vocab_size, (2, 6), generator=torch.Generator().manual_seed(2))
    prompt = torch.randint(0, eager.config.vocab_size, (1, MAX_ROWS + 1), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, eager(ids).logits)  # a batch of 6-token rows
        assert torch.equal(fused(prompt).logits, eager(prompt).logits)  # MAX_ROWS + 1 tokens
        mask = torch.ones(1, 6, dtype=torch.long)
        mask[0, 0] = 0  # left padding
        cache_a, cache_b = DynamicCache(config=eager.config), DynamicCache(config=eager.config)
        eager(ids[:1, :5], attention_mask=mask[:, :5], past_key_values=cache_a)
        fused(ids[:1, :5], attention_mask=mask[:, :5], past_key_values=cache_b)
        step_a = eager(ids[:1, 5:], attention_mask=mask, past_key_values=cache_a).logits
        step_b = fused(ids[:1, 5:], attention_mask=mask, past_key_values=cache_b).logits
        assert torch.equal(step_a, step_b)
    assert calls == []
    assert torch.equal(fused(ids[:1, :1]).logits, eager(ids[:1, :1]).logits)  # gradients on: the eager layer
    assert calls == []
    with torch.no_grad():
        fused(ids[:1, :1])
    assert len(calls) == fused.config.num_hidden_layers


def test_steps_read_the_projections_current_buffers(monkeypatch):
    """The step reads the projections' buffers at each call: a buffer replaced after fusing (another layer's
    weights) is what the next step reads; a norm whose dtype changed sends its layer to the eager forward."""
    fused = _int4_draft(seed=5)
    fuse_draft_layers(fused)
    ids = torch.randint(0, fused.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(6))
    calls = []
    _count_qkv_calls(monkeypatch, calls)

    def step_logits(model):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(ids[:, :6], past_key_values=cache)
            return model(ids[:, 6:], past_key_values=cache).logits

    def swap_weights(model):  # layer 0's up projection gets layer 1's weights
        mlp, other = model.model.layers[0].mlp, model.model.layers[1].mlp
        mlp.up_proj.packed_weight = other.up_proj.packed_weight.clone()
        mlp.up_proj.scales_and_zeros = other.up_proj.scales_and_zeros.clone()

    before = step_logits(fused)
    swap_weights(fused)
    routed = step_logits(fused)
    reference = _int4_draft(seed=5)  # the same swap before fusing
    swap_weights(reference)
    fuse_draft_layers(reference)
    assert not torch.equal(routed, before) and torch.equal(routed, step_logits(reference))
    assert len(calls) == 3 * fused.config.num_hidden_layers  # every step on the kernels
    norm = fused.model.layers[1].post_attention_layernorm
    norm.weight.data = norm.weight.data.float()
    step_logits(fused)
    # layer 1's norm in float32: the step takes the model's forward, where layer 0 alone still runs on the kernels
    assert len(calls) == 3 * fused.config.num_hidden_layers + 1


def test_only_int4_kernel_layers_of_known_architectures_are_routed():
    assert fuse_draft_layers(_tiny_qwen2().to(torch.bfloat16)) == 0  # bf16 weights
    assert fuse_draft_layers(quantize_linears(_tiny_qwen2().to(torch.bfloat16), "int4")) == 0  # torch's int4 kernel
    gpt2 = quantize_linears(make_model("gpt2", seed=0, hidden=128).to(torch.bfloat16), "int4", int4_kernel="pacer")
    assert fuse_draft_layers(gpt2) == 0
    mixed = _int4_draft()
    mixed.model.layers[1].mlp.down_proj = torch.nn.Linear(512, 256).to(torch.bfloat16)
    assert fuse_draft_layers(mixed) == 1 and isinstance(mixed.model.layers[0].forward, FusedDecoderStep)


def test_the_model_step_is_the_layers_step(monkeypatch):
    """With every layer routed, the model's own forward is routed too (FusedModelStep): a decoding step of 1 to
    MAX_ROWS tokens without hidden states asked for (position ids only those after the cache, as plain generate hands
    them) gives bitwise the logits and cache of the same step through the model's forward over the routed layers; a
    prompt (empty cache), hidden states, a padded mask, other position ids and gradients go through the model's
    forward."""
    fused = _int4_draft(seed=5)
    before = describe_model(fused)
    fuse_draft_layers(fused)
    assert isinstance(fused.forward, FusedModelStep)
    # a cost curve of the routed model is its own
    assert describe_model(fused) == dict(before, fused_layers=2, fused_model_step=True)
    step = fused.forward
    taken = []
    monkeypatch.setattr(FusedModelStep, "_takes", lambda self, *a, _f=FusedModelStep._takes: taken.append(_f(self, *a))
                        or taken[-1])
    ids = torch.randint(0, fused.config.vocab_size, (1, 6 + MAX_ROWS), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for rows in (1, 2, MAX_ROWS):
            caches = [DynamicCache(config=fused.config) for _ in range(2)]
            fused(ids[:, :6], past_key_values=caches[0])
            step.original(input_ids=ids[:, :6], past_key_values=caches[1])
            assert taken[-1] is False  # the prompt: the model's forward
            a = fused(ids[:, 6:6 + rows], past_key_values=caches[0], logits_to_keep=1)
            assert taken[-1] is True
            b = step.original(input_ids=ids[:, 6:6 + rows], past_key_values=caches[1], logits_to_keep=1)
            assert a.logits.shape == (1, 1, fused.config.vocab_size) and torch.equal(a.logits, b.logits), rows
            for x, y in zip(caches[0].layers, caches[1].layers):
                assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
            assert torch.equal(fused(ids[:, :1], past_key_values=caches[0]).logits,
                               step.original(input_ids=ids[:, :1], past_key_values=caches[1]).logits)
        cache = DynamicCache(config=fused.config)
        fused(ids[:, :6], past_key_values=cache)
        fused(ids[:, 6:7], past_key_values=cache, output_hidden_states=True)
        assert taken[-1] is False
        padded = torch.ones(1, 8, dtype=torch.long)
        padded[0, 0] = 0
        fused(ids[:, 7:8], past_key_values=cache, attention_mask=padded)
        assert taken[-1] is False
        fused(ids[:, 8:9], past_key_values=cache, position_ids=torch.tensor([[20]]))  # not the positions after the cache
        assert taken[-1] is False
        cache.crop(-1)
        fused(ids[:, 8:9], past_key_values=cache, position_ids=torch.tensor([[8]]), return_dict=True)  # plain generate's
        assert taken[-1] is True
    fused(ids[:, 9:10], past_key_values=cache)
    assert taken[-1] is False  # gradients on


@pytest.mark.parametrize("kind", ["int4-draft", "w4a8-target"])
def test_one_kernel_call_for_all_layers_is_the_layers_calls(monkeypatch, kind):
    """A model step runs every decoder layer in one kernel call (kernels.decoder_layers), each layer's new keys and
    values written in place into its cache buffers: bitwise the logits and caches of the same steps layer by layer,
    over steps of several sizes, a crop (a rejected draft) and buffers outgrown (their room made small here)."""
    monkeypatch.setattr(fused_layers_module, "ROOM", 3)
    model = _int4_draft(seed=3) if kind == "int4-draft" else _w4a8_target(seed=3)
    (fuse_draft_layers if kind == "int4-draft" else fuse_target_layers)(model)
    step = model.forward
    assert isinstance(step, FusedModelStep) and step._one_call
    calls = []
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a, _f=kernels.decoder_layers, **k: calls.append(1) or _f(*a, **k))
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(4))
    caches = [DynamicCache(config=model.config) for _ in range(2)]
    with torch.no_grad():
        for cache in caches:
            model(ids[:, :6], past_key_values=cache)
        position = 6
        for rows, drop in ((1, 0), (2, 1), (MAX_ROWS, 3), (1, 0), (3, 2), (1, 0), (MAX_ROWS, 0)):
            logits = []
            for one_call, cache in zip((True, False), caches):
                step._one_call = one_call
                logits.append(model(ids[:, position:position + rows], past_key_values=cache).logits)
                cache.crop(-drop)
            assert torch.equal(*logits), (rows, drop)
            position += rows - drop
            for a, b in zip(caches[0].layers, caches[1].layers):
                assert a.keys.shape[2] == position and torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    assert len(calls) == 7  # once a step, with the one call on
    # the keys a step wrote are the first positions of the layer's buffers, not a copy of them
    layer = caches[0].layers[0]
    assert layer.keys.data_ptr() == layer._pacer_room[0].data_ptr()


def test_a_cache_room_is_the_layers_buffers_kept_while_they_hold_it():
    """cache_room hands back a layer's buffers while its keys and values are their first positions (after a step, after
    a crop) and room is left; a fresh layer, one that transformers' update concatenated since, or one whose buffers are
    full gets new ones holding what it held."""
    from transformers.cache_utils import DynamicLayer

    from modeling_pacer.cpu.fused_layers import cache_room

    layer = DynamicLayer()
    keys, values, held = cache_room(layer, 2, kv_heads=2, head_dim=16)
    assert held == 0 and keys.shape == values.shape == (1, 2, 2 + fused_layers_module.ROOM, 16)
    new = torch.randn(1, 2, 2, 16, generator=torch.Generator().manual_seed(0)).bfloat16()
    keys[:, :, :2], values[:, :, :2] = new, -new
    layer.keys, layer.values = keys[:, :, :2], values[:, :, :2]
    same = cache_room(layer, 1, 2, 16)
    assert same[0] is keys and same[1] is values and same[2] == 2
    layer.crop(-1)
    again = cache_room(layer, 1, 2, 16)
    assert again[0] is keys and again[1] is values and again[2] == 1
    layer.update(new, new)  # transformers' own update: a concatenated tensor, no longer the buffers
    moved = cache_room(layer, 1, 2, 16)
    assert moved[0] is not keys and moved[2] == 3
    assert torch.equal(moved[0][:, :, :3], torch.cat([new[:, :, :1], new], dim=2))
    full = DynamicLayer()
    keys, values, _ = cache_room(full, 1, 2, 16)
    keys.copy_(torch.randn(keys.shape, generator=torch.Generator().manual_seed(1)))
    full.keys, full.values = keys, values  # every position held: no room for another
    grown = cache_room(full, 1, 2, 16)
    assert grown[2] == keys.shape[2] and grown[0].shape[2] > keys.shape[2] and torch.equal(grown[0][:, :, :grown[2]], keys)


def test_the_kernels_are_torch_operators_a_draft_step_compiles_through():
    """pacer's kernels are operators of torch's dispatcher (`torch.ops.pacer`, fake kernels registered): a fused
    draft step (the model's forward over a DynamicCache, two kernel calls a layer) traces into one graph with no break,
    and the compiled step gives the eager step's logits bitwise; torch's operator checks pass on each kernel."""
    import torch._dynamo

    model = _int4_draft(seed=5)
    assert fuse_draft_layers(model) == model.config.num_hidden_layers
    assert kernels._library() is torch.ops.pacer
    ids = torch.randint(0, model.config.vocab_size, (1, 10), generator=torch.Generator().manual_seed(2))
    caches = [DynamicCache(config=model.config) for _ in range(2)]

    def step(tokens, cache):
        return model(tokens, past_key_values=cache).logits

    with torch.no_grad():
        for cache in caches:
            model(ids[:, :8], past_key_values=cache)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(step)(ids[:, 8:9], DynamicCache(config=model.config))
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        for i in (8, 9):
            assert torch.equal(compiled(ids[:, i:i + 1], caches[0]), step(ids[:, i:i + 1], caches[1]))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).bfloat16()
    q, scale, sums = torch.ops.pacer.quantize_rows(x, 32)
    layer = model.model.layers[0].mlp.up_proj  # 256 inputs
    packed, sz = layer.packed_weight, layer.scales_and_zeros
    query, key = torch.randn(1, 4, 3, 16, generator=g).bfloat16(), torch.randn(1, 2, 5, 16, generator=g).bfloat16()
    bounds = torch.tensor([[0, 3, 0], [3, 4, 5]]).t().reshape(1, 3, 2)
    checks = [(torch.ops.pacer.quantize_rows.default, (x, 32)),
              (torch.ops.pacer.exact_attention.default, (query, key, key.clone(), bounds[..., 0].contiguous(),
                                                         bounds[..., 1].contiguous(), 0.25))]
    checks.append((torch.ops.pacer.int4_matmul.default, (packed, sz, layer.out_features, q, scale, sums, None, True)))
    for op, args in checks:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def _w4a8_target(seed: int = 0, vocab: int = 96):
    """A tiny Qwen2 target as load_pair(quantize_target="w4a8") makes one: W4A8 layers (v and down on W8A8, as a
    Q4_K_M file's Q6_K tensors), pacer_exact attention."""
    model = quantize_linears(_tiny_qwen2(seed=seed, vocab=vocab).to(torch.bfloat16), "w4a8")
    for layer in model.model.layers:
        for parent, name in ((layer.self_attn, "v_proj"), (layer.mlp, "down_proj")):
            setattr(parent, name, W8A8Linear.from_linear(_dense(getattr(parent, name))))
    return make_exact(model)


def _dense(layer):
    """A W4A8 layer's weights as an nn.Linear (the values a W8A8 layer is then made of)."""
    x = torch.eye(layer.in_features, dtype=torch.bfloat16)
    with torch.no_grad():
        weight = layer(x).float().t()
    linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    with torch.no_grad():
        linear.weight.copy_(weight if layer.bias is None else weight - layer.bias[:, None])
        if layer.bias is not None:
            linear.bias.copy_(layer.bias)
    return linear


def _noisy_draft(noise: float = 0.2, target_seed: int = 0):
    """An int4 draft on pacer's kernel, fused, made of the target's weights plus noise: drafts partly accepted."""
    draft = _tiny_qwen2(seed=target_seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(noise * p.std() * torch.randn_like(p))
    draft = quantize_linears(draft.to(torch.bfloat16), "int4", int4_kernel="pacer")
    assert fuse_draft_layers(draft) == draft.config.num_hidden_layers
    return draft


def test_a_target_runs_every_call_on_the_kernels_each_row_alone(monkeypatch):
    """fuse_target_layers: every layer and the model's step routed; a prompt whole, in chunks, without a cache, and
    blocks of 1 to 17 tokens after it give bitwise the rows (logits, cache) of one-token steps; every one of those
    calls ran on the kernels; the numbers stay within bf16 rounding of the eager layers'."""
    eager = _w4a8_target()
    assert isinstance(eager.model.layers[0].self_attn.v_proj, W8A8Linear)
    assert isinstance(eager.model.layers[0].self_attn.q_proj, W4A8Linear)
    fused = copy.deepcopy(eager)
    assert fuse_target_layers(fused) == 2 == fused_layers(fused)
    assert isinstance(fused.forward, FusedModelStep) and fused._pacer_exact == "rows-alone"
    calls = []
    _count_qkv_calls(monkeypatch, calls, lambda hidden: hidden.shape[0])
    ids = torch.randint(0, 96, (1, 48), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        steps_cache = DynamicCache(config=fused.config)
        steps = torch.cat([fused(ids[:, i:i + 1], past_key_values=steps_cache).logits for i in range(48)], dim=1)
        assert calls == [1] * 2 * 48
        whole = fused(ids).logits  # no cache handed in: the model makes one
        assert torch.equal(whole, steps)
        calls.clear()
        assert torch.equal(fused(ids, use_cache=False).logits, steps)  # no cache at all
        assert calls == [48, 48]
        chunked_cache = DynamicCache(config=fused.config)
        chunks = [fused(ids[:, a:b], past_key_values=chunked_cache).logits for a, b in ((0, 13), (13, 20), (20, 30))]
        assert torch.equal(torch.cat(chunks, dim=1), steps[:, :30])
        for rows in (1, 2, 5, 8, 9, 17):
            block = fused(ids[:, 30:30 + rows], past_key_values=chunked_cache).logits
            assert torch.equal(block, steps[:, 30:30 + rows]), rows
            chunked_cache.crop(30 - chunked_cache.get_seq_length())
        fused(ids[:, 30:], past_key_values=chunked_cache)
        for a, b in zip(chunked_cache.layers, steps_cache.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        reference = eager(ids).logits.float()
        with eager_layers(fused):  # the eager layers for a while (pacer-bench's target-unfused), then routed again
            assert torch.equal(fused(ids).logits, eager(ids).logits)
        assert torch.equal(fused(ids).logits, whole) and isinstance(fused.forward, FusedModelStep)
    assert not torch.equal(reference, whole.float())  # the fused target is a model of its own ...
    assert float((reference - whole.float()).abs().max()) <= 0.03 * float(reference.abs().max())  # ... close
    assert (reference.argmax(-1) == whole.argmax(-1)).float().mean() > 0.9


def test_a_fused_target_leaves_what_it_cannot_take_to_the_eager_layer(monkeypatch):
    """A batch of two and a call with gradients run the eager layers (bitwise the unfused model's); a model with a
    projection of another kind is not routed there; fuse_target=True without a W4A8 target is refused before loading."""
    from modeling_pacer.pairs import load_pair

    eager = _w4a8_target(seed=2)
    fused = copy.deepcopy(eager)
    fuse_target_layers(fused)
    calls = []
    _count_qkv_calls(monkeypatch, calls)
    ids = torch.randint(0, 96, (2, 6), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(fused(ids).logits, eager(ids).logits)
    assert torch.equal(fused(ids[:1]).logits, eager(ids[:1]).logits)  # gradients on
    assert calls == []
    mixed = _w4a8_target(seed=2)
    mixed.model.layers[1].mlp.up_proj = torch.nn.Linear(256, 512).to(torch.bfloat16)
    assert fuse_target_layers(mixed) == 1 and not isinstance(mixed.forward, FusedModelStep)
    assert getattr(mixed, "_pacer_exact", None) == "rows-alone"  # make_exact's: its layers' rows are alone either way
    with pytest.raises(ValueError, match="fuse_target=True .* needs quantize_target='w4a8'"):
        load_pair(fuse_target=True)
    with pytest.raises(ValueError, match="fuse_target=True .* needs quantize_target='w4a8'"):
        load_pair(quantize_target="int4", fuse_target=True)


def test_pacer_greedy_equals_the_fused_w4a8_target():
    """PACER over a fused W4A8 target with a fused int4 draft: token for token the fused target's own greedy
    `generate`, several prompts, lengths and policies (verifications of up to 17 tokens among them)."""
    target = _w4a8_target()
    fuse_target_layers(target)
    enable_pacer(target)
    draft = _noisy_draft()
    g = torch.Generator().manual_seed(1)
    drafted = 0
    for n in (1, 9, 30):
        ids = torch.randint(0, 96, (1, n), generator=g)
        for new in (5, 24):
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            for policy in (FixedLength(2), FixedLength(16), "svip"):
                out = target.generate(ids, assistant_model=draft, stopping_policy=policy, do_sample=False,
                                      max_new_tokens=new, return_dict_in_generate=True)
                assert out.sequences.tolist() == expected.tolist(), (n, new, policy)
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0


def test_the_layerwise_methods_are_their_methods_with_each_layer_called(monkeypatch):
    """pacer-bench's target-layerwise and pacer-layerwise (fused_layers.layer_by_layer): the same tokens as target
    and pacer, no one-call kernel inside the block, the one call back after it (and after an error in it)."""
    from modeling_pacer.benchmarks.methods import all_methods, run_method
    from modeling_pacer.cpu.fused_layers import layer_by_layer

    target = _w4a8_target(seed=1)
    fuse_target_layers(target)
    draft = _noisy_draft(target_seed=1)
    calls = []
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a, _f=kernels.decoder_layers, **k: calls.append(1) or _f(*a, **k))
    methods = all_methods()
    methods["pacer"].policy = methods["pacer-layerwise"].policy = lambda *c: FixedLength(3)  # no head here
    methods["pacer"].needs_head = methods["pacer-layerwise"].needs_head = False
    ids = torch.randint(0, 96, (1, 9), generator=torch.Generator().manual_seed(5))
    for name in ("target", "pacer"):
        calls.clear()
        expected, _ = run_method(methods[name], target, draft, None, ids, 20)
        assert calls, name  # the one call
        calls.clear()
        layerwise, _ = run_method(methods[f"{name}-layerwise"], target, draft, None, ids, 20)
        assert calls == [] and layerwise.tolist() == expected.tolist(), name
    assert target.forward._one_call and draft.forward._one_call
    with pytest.raises(RuntimeError):
        with layer_by_layer(target, draft, None):
            assert not target.forward._one_call and not draft.forward._one_call
            raise RuntimeError
    assert target.forward._one_call and draft.forward._one_call


RUNS = 1500
NOISE = 0.05  # the sampling test's draft: close enough to the target that some drafts pass, far enough to tell apart
PROMPT = torch.tensor([[3, 17, 42, 5, 60]])
SAMPLING = dict(do_sample=True, temperature=0.9, top_k=4, max_new_tokens=3)


def _distribution(model) -> dict[tuple[int, ...], float]:
    """The probability of every 3-token continuation of PROMPT under `model` with SAMPLING's warpers (the top 4 at
    each position: 64 outcomes)."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper

    processors = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopKLogitsWarper(4)])

    def probs(ids):
        with torch.no_grad():
            return processors(ids, model(ids).logits[:, -1, :].float()).softmax(-1)[0]

    out = {}

    def expand(prefix: tuple, p: float):
        if len(prefix) == SAMPLING["max_new_tokens"]:
            out[prefix] = p
            return
        q = probs(torch.cat([PROMPT, torch.tensor([prefix], dtype=torch.long)], dim=1))
        for token in torch.nonzero(q).flatten().tolist():
            expand((*prefix, token), p * float(q[token]))

    expand((), 1.0)
    return out


def test_sampling_over_a_fused_target_is_its_distribution():
    """Speculative sampling over a fused W4A8 target keeps the fused target's distribution (chi-square over the 64
    outcomes of 3 tokens), drafts partly rejected; the same samples fail against the draft's distribution."""
    target = _w4a8_target()
    fuse_target_layers(target)
    enable_pacer(target)
    torch.manual_seed(0)
    draft = _noisy_draft(NOISE)
    counts, drafted, accepted = {}, 0, 0
    for seed in range(RUNS):
        torch.manual_seed(seed)
        out = target.generate(PROMPT, assistant_model=draft, stopping_policy=FixedLength(2),
                              return_dict_in_generate=True, **SAMPLING)
        outcome = tuple(out.sequences[0, PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        drafted += sum(s.drafted for s in out.pacer_stats.steps)
        accepted += sum(s.accepted for s in out.pacer_stats.steps)
    assert 0 < accepted < drafted
    assert _chi_square_p_value(counts, _distribution(target), RUNS) > 1e-3
    assert _chi_square_p_value(counts, _distribution(draft), RUNS) < 1e-6


def test_the_flag_keeps_the_eager_layers(monkeypatch):
    """`--no-fuse-target` reaches load_pair as fuse_target=False; without it the default (None: with w4a8)."""
    import argparse

    from modeling_pacer.pairs import loading

    parser = argparse.ArgumentParser()
    loading.add_pair_arguments(parser)
    seen = []
    monkeypatch.setattr(loading, "load_pair", lambda *a, **kw: seen.append(kw["fuse_target"]))
    for argv, expected in (([], None), (["--no-fuse-target"], False)):
        loading.pair_from_args(parser.parse_args(["--quantize-target", "w4a8", *argv]))
        assert seen[-1] is expected


def test_a_split_of_a_fused_model_times_its_kernel_calls():
    """costs.time_split times module forwards with hooks, which a fused layer's kernel calls never reach: a fused
    model's layers are split by their calls (the two kernels, the cache update), its LM head by its hook; the timing
    leaves the numbers alone and is gone after the block."""
    from modeling_pacer.costs import time_split
    from modeling_pacer.cpu.fused_layers import timed_kernels

    model = _int4_draft(seed=1)
    ids = torch.randint(0, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    plain = time_split(model, ids, repeats=1)
    assert plain["fused"] == 0.0 and plain["linear"] > 0 and plain["attention"] > 0
    assert plain["qkv_kernel"] == plain["cache_update"] == plain["rest_kernel"] == 0.0
    fuse_draft_layers(model)
    split = time_split(model, ids, repeats=1)
    assert split["fused"] == 1.0 and split["attention"] == 0.0  # no attention module is called
    assert split["qkv_kernel"] > 0 and split["cache_update"] > 0 and split["rest_kernel"] > 0 and split["linear"] > 0
    assert split["total"] >= split["qkv_kernel"] + split["cache_update"] + split["rest_kernel"] + split["linear"]
    assert isinstance(model.forward, FusedModelStep) and fused_layers(model) == model.config.num_hidden_layers
    step = model.model.layers[0].forward
    assert step._call is _untimed
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids[:, :-1], past_key_values=cache, use_cache=True)
        untimed = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
        cache.crop(-1)
        with timed_kernels(model) as spent:
            timed = model(ids[:, -1:], past_key_values=cache, use_cache=True).logits
        assert set(spent) == {"cache_room", "layer_qkv_cached", "layer_rest"}
    assert torch.equal(untimed, timed)


def test_a_packed_call_of_several_sequences_is_each_sequences_own_calls():
    """decoder_layers with each row's slot and key range (a packed call: kernels.decoder_layers(..., rows=...)): two
    sequences' prompts, then their steps, in one call each, give bitwise what each sequence's own calls give, rows and
    cache alike, with more than 16 rows (the AMX path where it runs) and a row of one sequence between the other's;
    slots or ranges outside the buffers are refused by the operator, not read."""
    from modeling_pacer.custom_generate.rows import RowCache, packed_forward
    from modeling_pacer.custom_generate.steps import cache_kwargs, model_forward

    target = _w4a8_target(seed=4)
    fuse_target_layers(target)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 96, (1, n), generator=g) for n in (13, 7)]
    steps = [torch.randint(0, 96, (1, n), generator=g) for n in (5, 3)]
    with torch.no_grad():
        alone = []
        for p, s in zip(prompts, steps):
            cache = DynamicCache(config=target.config)
            alone.append((model_forward(target, p, cache, p.shape[1])[0], model_forward(target, s, cache, 3)[0]))
    calls = []
    monkeypatch = pytest.MonkeyPatch()
    monkeypatch.setattr(kernels, "decoder_layers",
                        lambda *a, _f=kernels.decoder_layers, **k: calls.append(k.get("rows") is not None) or _f(*a, **k))
    try:
        with torch.no_grad():
            packed = RowCache(2, 24)
            first = packed_forward(target, packed, [(0, prompts[0]), (1, prompts[1])], [13, 7], cache_kwargs=cache_kwargs)
            second = packed_forward(target, packed, [(1, steps[1]), (0, steps[0])], [3, 3], cache_kwargs=cache_kwargs)
    finally:
        monkeypatch.undo()
    assert calls == [True, True]  # both calls on the one-call kernel, with the rows' slots and ranges
    assert torch.equal(first[0][0], alone[0][0]) and torch.equal(first[1][0], alone[1][0])
    assert torch.equal(second[1][0], alone[0][1]) and torch.equal(second[0][0], alone[1][1])
    layer = target.model.layers[0]
    rest = target.forward.layers[0]
    qkv, weights = rest._projections()
    hidden = torch.randn(2, 256, generator=g).bfloat16()
    cos = sin = torch.zeros(2, rest.head_dim, dtype=torch.bfloat16)
    keys, values = packed.layers[0].keys, packed.layers[0].values
    norm = layer.input_layernorm
    with pytest.raises(RuntimeError, match="outside"):
        kernels.layer_qkv_cached(hidden, norm.weight, norm.variance_epsilon, qkv, cos, sin, rest.head_dim, keys,
                                 values, 0, torch.tensor([0, 48]))
    q = kernels.layer_qkv_cached(hidden, norm.weight, norm.variance_epsilon, qkv, cos, sin, rest.head_dim, keys,
                                 values, 0, torch.tensor([20, 44]))
    post = layer.post_attention_layernorm
    for lo, hi, message in (([0, 3], [2, 3], "sees no key"), ([0, 0], [2, 49], "outside")):
        with pytest.raises(RuntimeError, match=message):
            kernels.layer_rest(q, keys, values, rest.scaling, hidden, post.weight, post.variance_epsilon, weights,
                               torch.tensor(lo), torch.tensor(hi))
