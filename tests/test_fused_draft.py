"""A draft's decoder layers in two kernel calls per token (modeling_pacer/cpu/fused_draft.py): one-token steps follow
the eager layer's numbers to bf16 rounding, anything else runs the eager layer itself, the layers it cannot take
are left alone (PACER's greedy identity with such a draft: tests/test_quantization.py, draft_kind "int4-fused")."""

import copy

import pytest
import torch
from transformers import DynamicCache

from modeling_pacer.cpu import kernels
from modeling_pacer.costs import describe_model
from modeling_pacer.cpu.fused_draft import MAX_ROWS, FusedDecoderStep, FusedDraftStep, fuse_draft_layers, fused_layers
from modeling_pacer.cpu.quantization import quantize_linears

from conftest import make_model
from test_quantization import _tiny_qwen2

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"pacer's kernels: {kernels.unavailable_reason()}")


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
    monkeypatch.setattr(kernels, "draft_qkv", lambda *a, _f=kernels.draft_qkv: calls.append(1) or _f(*a))
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
    monkeypatch.setattr(kernels, "draft_qkv", lambda *a, _f=kernels.draft_qkv: calls.append(1) or _f(*a))

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
    """With every layer routed, the model's own forward is routed too (FusedDraftStep): a decoding step of 1 to
    MAX_ROWS tokens without hidden states asked for gives bitwise the logits and cache of the same step through the
    model's forward over the routed layers; a prompt (empty cache), hidden states, a padded mask, position ids and
    gradients go through the model's forward."""
    fused = _int4_draft(seed=5)
    before = describe_model(fused)
    fuse_draft_layers(fused)
    assert isinstance(fused.forward, FusedDraftStep)
    # a cost curve of the routed model is its own
    assert describe_model(fused) == dict(before, fused_layers=2, fused_model_step=True)
    step = fused.forward
    taken = []
    monkeypatch.setattr(FusedDraftStep, "_takes", lambda self, *a, _f=FusedDraftStep._takes: taken.append(_f(self, *a))
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
        fused(ids[:, 8:9], past_key_values=cache, position_ids=torch.tensor([[8]]))
        assert taken[-1] is False
    fused(ids[:, 9:10], past_key_values=cache)
    assert taken[-1] is False  # gradients on


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
