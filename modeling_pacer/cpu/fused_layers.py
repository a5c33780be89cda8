"""Decoder layers in two C++ calls each ([`fuse_draft_layers`], [`fuse_target_layers`]).

transformers' eager decoder layer runs some forty small torch operators per token (norms in float and back,
rotary embeddings, reshapes, the MLP's activation), each a few microseconds of dispatch and allocation: over a
0.5B draft's 24 layers that is about as much time as reading its int4 weights, and over a 1.5B target's 28 layers
a sixth of a step. A routed layer's forwards go through pacer's kernels instead ([`kernels.layer_qkv`]: RMSNorm,
the q/k/v projections, rotary embeddings, the new keys and values written in place into the cache ([`cache_room`]);
[`kernels.layer_rest`]: causal attention over the cache, o_proj, the residual, RMSNorm, the SiLU-gated MLP and its
residual), each weight read once for all the rows. Intermediates are rounded to bf16 where the eager layer rounds them, so the numbers stay close to the eager
layer's (not bitwise: the norm's float sum and the SiLU's exp run in another order); each row is computed alone,
so a call of several tokens gives bitwise what one-token calls give. Once every layer is routed, the model's own
forward is too ([`FusedModelStep`]): a decoding step then runs embedding, every layer in one kernel call
([`kernels.decoder_layers`]: the two calls a layer, looped in C++, the bits of the calls layer by layer), the norm and
the LM head in one function.

A draft ([`fuse_draft_layers`]) routes its decoding steps (1 to `MAX_ROWS` tokens): its numbers change which tokens
it proposes, never the output. A target ([`fuse_target_layers`]) routes every call of one sequence over a dynamic
cache (or none), its prompt too, so that every forward pacer's loop and plain `generate` make runs the same
row-alone functions: the fused target is a model of its own, its rows bitwise the same in a step, a verification
and a prefill, close to the eager layer's but not equal to them.
"""

from __future__ import annotations

import contextlib
import inspect
import time

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..custom_generate.rows import RowCache
from . import kernels
from .quantization import Int4Linear, W4A8Linear, W8A8Linear

FUSED_MODEL_TYPES = ("llama", "qwen2")  # RMSNorm, rotate_half rotary embeddings, GQA, a SiLU-gated MLP
_ATTENTION = ("q_proj", "k_proj", "v_proj")
_REST = (("self_attn", "o_proj"), ("mlp", "gate_proj"), ("mlp", "up_proj"), ("mlp", "down_proj"))
# the most new tokens a draft's call routes (a decoding step: 1; the catch-up after a verification: 2): the kernels
# read each weight once for up to 8 rows; longer calls (a prompt) run the eager layer, whose int4 layers may go dense
MAX_ROWS = 8
# a DynamicLayer's keys and values, once a routed layer writes them, are the first positions of buffers with room for
# this many more (or a quarter more, past a long prompt): a step writes its rows in place where transformers' update
# would concatenate the whole cache anew, two copies of it a layer a step
ROOM = 256
# a projection's kind as the kernels read it, and the names of its buffers: packed weight, first scales, Q4_K minima
# and super-scales, float bias
_BUFFERS = {
    Int4Linear: ("int4", ("packed_weight", "scales_and_zeros", None, None, "bias_float")),
    W4A8Linear: ("q4k", ("packed_weight", "sub_scales", "sub_minimums", "super_scales", "bias")),
    W8A8Linear: ("int8", ("packed_weight", "scales", None, None, "bias")),
}


def _untimed(function, *args):
    return function(*args)


def cache_room(layer: DynamicLayer, rows: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Buffers `(keys, values)`, (1, `kv_heads`, capacity, `head_dim`) bf16, whose first positions are what the cache
    layer holds, with room for `rows` more, and how many it holds. The buffers a previous call made are handed back
    while the layer's tensors are still their first positions (a step, or a crop: `crop` keeps a view); anything
    else (a first call, a layer that transformers' own update concatenated since, another dtype) gets new ones,
    the held positions copied in. The caller writes the new rows at the held position and sets the layer's
    `keys`/`values` to the buffers' first held + rows positions."""
    if not layer.is_initialized:
        layer.lazy_initialization(*(torch.empty(1, kv_heads, 0, head_dim, dtype=torch.bfloat16),) * 2)
    keys, values = layer.keys, layer.values
    held = layer.get_seq_length()
    room = getattr(layer, "_pacer_room", None)
    if room is not None:
        k_buffer, v_buffer = room
        if (held + rows <= k_buffer.shape[2] and keys.data_ptr() == k_buffer.data_ptr()
                and values.data_ptr() == v_buffer.data_ptr() and keys.stride() == k_buffer.stride()
                and values.stride() == v_buffer.stride() and keys.dtype == k_buffer.dtype
                and values.dtype == v_buffer.dtype):
            return k_buffer, v_buffer, held
    need = held + rows
    shape = (1, kv_heads, need + max(ROOM, need // 4), head_dim)
    k_buffer, v_buffer = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    if held:
        k_buffer[:, :, :held].copy_(keys)
        v_buffer[:, :, :held].copy_(values)
    layer._pacer_room = (k_buffer, v_buffer)
    return k_buffer, v_buffer, held


def row_buffers(cache: RowCache, layer_idx: int, kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A [`RowCache`] layer's buffers `(keys, values)`, (1, `kv_heads`, batch * capacity, `head_dim`) bf16, made on the
    layer's first call: a packed call's rows are written at its slots and read in its ranges."""
    layer = cache.layer(layer_idx)
    if not layer.is_initialized:
        layer.lazy_initialization(*(torch.empty(1, kv_heads, 0, head_dim, dtype=torch.bfloat16),) * 2)
    return layer.keys, layer.values


def packed_call(cache, rows: int):
    """The packed call of several sequences ([`RowCache.plan`]) whose `rows` tokens these are, or None."""
    call = getattr(cache, "call", None) if isinstance(cache, RowCache) else None
    return call if call is not None and call.slots.shape[0] == rows else None


def writes_in_place(cache) -> bool:
    """Whether routed layers write into `cache`'s buffers ([`cache_room`]): a cache, not offloaded (transformers'
    update moves its layers), outside torch.compile tracing (which cannot follow the buffers' addresses that
    cache_room compares). Elsewhere they call transformers' update."""
    return cache is not None and not getattr(cache, "offloading", False) and not torch.compiler.is_compiling()


def hold(layer: DynamicLayer, k_buffer: torch.Tensor, v_buffer: torch.Tensor, length: int):
    """Set the cache layer's keys and values to its buffers' first `length` positions; returns them."""
    layer.keys, layer.values = k_buffer[:, :, :length], v_buffer[:, :, :length]
    return layer.keys, layer.values


def rotary_tables(position_embeddings, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A rotary embedding's (cos, sin), (1, rows, head_dim) as transformers hands them to the layers, as the kernels
    read them: bf16, (rows, head_dim), contiguous."""
    return tuple(t.to(torch.bfloat16).reshape(-1, head_dim).contiguous() for t in position_embeddings)


class FusedDecoderStep:
    """A decoder layer's forward: 1 to `max_rows` (None: any number of) new tokens of one sequence through the
    kernels, anything else through the layer's own forward (`original`)."""

    def __init__(self, layer: nn.Module, config, max_rows: int | None = MAX_ROWS):
        self.layer, self.original, self.max_rows = layer, layer.forward, max_rows
        # the name the layer's forward takes its cache by (transformers 5.24 renamed past_key_values to cache)
        self.cache_name = "cache" if "cache" in inspect.signature(layer.forward).parameters else "past_key_values"
        attention = layer.self_attn
        self.layer_idx, self.scaling, self.head_dim = attention.layer_idx, float(attention.scaling), attention.head_dim
        self.hidden = config.hidden_size
        self.qkv = [getattr(attention, name) for name in _ATTENTION]
        self.kv_heads = self.qkv[1].out_features // self.head_dim
        self.rest = [getattr(getattr(layer, part), name) for part, name in _REST]
        # the projections' buffer dicts, read directly: each step checks them, and nn.Module's attribute lookup
        # over 7 projections x 24 layers cost about 1 ms a step (of ~17)
        self._buffers = [m._buffers for m in self.qkv + self.rest]
        self._kinds = [kernels.LINEAR_KINDS[_BUFFERS[type(m)][0]] for m in self.qkv + self.rest]
        self._names = [_BUFFERS[type(m)][1] for m in self.qkv + self.rest]
        self._sizes = [m.out_features for m in self.qkv + self.rest]
        # what one step hands every layer alike, converted once: the rotary tables as bf16, whether the mask hides
        # nothing
        self._rotary: tuple = (None, None)
        self._mask: tuple = (None, None, None)
        self._call = _untimed  # how step() calls its kernels and the cache: [`timed_kernels`] puts a clock around them

    def __call__(self, hidden_states, attention_mask=None, position_ids=None, cache=None, use_cache=False,
                 position_embeddings=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if kwargs.get("output_attentions") or not self._takes(hidden_states, attention_mask, cache, position_embeddings):
            return self.original(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                 use_cache=use_cache, position_embeddings=position_embeddings,
                                 **{self.cache_name: cache}, **kwargs)
        rows = hidden_states.shape[1]
        cos, sin = self._rotary_bf16(position_embeddings)
        out = self.step(hidden_states.reshape(rows, self.hidden).contiguous(), cos, sin, cache)
        return out.view(1, rows, self.hidden)

    def step(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The layer on the kernels: `hidden` (rows, size) and the rotary tables (rows, head_dim), bf16, after what
        `cache` holds (the new keys and values appended to it) -> (rows, size)."""
        layer, call = self.layer, self._call
        qkv, rest = self._projections()
        norm = layer.input_layernorm
        packed = packed_call(cache, hidden.shape[0])
        if packed is not None:  # several sequences' rows: each written at its slot, each seeing its own keys
            k_buffer, v_buffer = call(row_buffers, cache, self.layer_idx, self.kv_heads, self.head_dim)
            q = call(kernels.layer_qkv_cached, hidden, norm.weight, norm.variance_epsilon, qkv, cos, sin,
                     self.head_dim, k_buffer, v_buffer, 0, packed.slots)
            norm = layer.post_attention_layernorm
            return call(kernels.layer_rest, q, k_buffer, v_buffer, self.scaling, hidden, norm.weight,
                        norm.variance_epsilon, rest, packed.lo, packed.hi)
        if writes_in_place(cache):  # the new keys and values written into the cache's buffers by the kernel
            rows, cached = hidden.shape[0], cache.layers[self.layer_idx]
            k_buffer, v_buffer, held = call(cache_room, cached, rows, self.kv_heads, self.head_dim)
            q = call(kernels.layer_qkv_cached, hidden, norm.weight, norm.variance_epsilon, qkv, cos, sin,
                     self.head_dim, k_buffer, v_buffer, held)
            keys, values = hold(cached, k_buffer, v_buffer, held + rows)
        else:
            q, k, v = call(kernels.layer_qkv, hidden, norm.weight, norm.variance_epsilon, qkv, cos, sin, self.head_dim)
            keys, values = (k, v) if cache is None else call(cache.update, k, v, self.layer_idx)
        norm = layer.post_attention_layernorm
        return call(kernels.layer_rest, q, keys, values, self.scaling, hidden, norm.weight, norm.variance_epsilon,
                    rest)

    def _rotary_bf16(self, position_embeddings):
        if self._rotary[0] is not position_embeddings:
            self._rotary = (position_embeddings, rotary_tables(position_embeddings, self.head_dim))
        return self._rotary[1]

    def _projections(self):
        """The q/k/v and o/gate/up/down layers' buffers now, as [`kernels.layer_qkv`] / [`kernels.layer_rest`] read
        them: (kinds, packed weights, first scales, Q4_K minima, Q4_K super-scales, float biases, output sizes)."""
        def weights(part):
            buffers, names = self._buffers[part], self._names[part]
            fields = [[None if name is None else b[name] for b, name in zip(buffers, (n[i] for n in names))]
                      for i in range(5)]
            return (self._kinds[part], *fields, self._sizes[part])

        return weights(slice(0, 3)), weights(slice(3, 7))

    def routable(self, rows: int, dtype: torch.dtype) -> bool:
        """What does not depend on the cache or the mask: 1 to `max_rows` rows of `dtype` bf16, no gradients, bf16
        norms, every projection on pacer's kernels with a float32 bias or none."""
        layer = self.layer
        return (1 <= rows and (self.max_rows is None or rows <= self.max_rows) and dtype == torch.bfloat16
                and not torch.is_grad_enabled()
                and layer.input_layernorm.weight.dtype == torch.bfloat16
                and layer.post_attention_layernorm.weight.dtype == torch.bfloat16
                and all(getattr(m, "kernel", "pacer") == "pacer" for m in self.qkv + self.rest)
                and all(b[n[4]] is None or b[n[4]].dtype == torch.float32 for b, n in zip(self._buffers, self._names)))

    def _takes(self, hidden_states, attention_mask, cache, position_embeddings) -> bool:
        if (position_embeddings is None or hidden_states.dim() != 3 or hidden_states.shape[0] != 1
                or hidden_states.shape[2] != self.hidden
                or position_embeddings[0].shape[-2] != hidden_states.shape[1]):
            return False
        packed = packed_call(cache, hidden_states.shape[1])
        if packed is not None:  # a packed call: the rows' slots and ranges are the cache's plan, the mask says the same
            return self.routable(packed.longest, hidden_states.dtype) and self.routable(1, hidden_states.dtype)
        if not self.routable(hidden_states.shape[1], hidden_states.dtype):
            return False
        if cache is None:
            if self.max_rows is not None:  # a draft's steps always have a cache
                return False
        elif (type(cache) is not DynamicCache or len(cache.layers) <= self.layer_idx
              or type(cache.layers[self.layer_idx]) is not DynamicLayer):
            return False  # a static or sliding layer hands attention keys that are not these
        rows = hidden_states.shape[1]
        if attention_mask is None:
            return rows == 1  # several tokens: causal among themselves, which only a mask says
        # the new tokens see every key of the cache and each other causally (no padding, no window)
        length = (0 if cache is None else cache.get_seq_length(self.layer_idx)) + rows
        if self._mask[0] is attention_mask and self._mask[1] == length:
            return self._mask[2]
        causal = torch.ones(rows, length, dtype=torch.bool).tril(length - rows)
        visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        takes = attention_mask.dim() == 4 and attention_mask.shape[-2:] == (rows, length) and bool(
            (visible == causal).all())
        self._mask = (attention_mask, length, takes)
        return takes


class FusedModelStep:
    """A causal LM's forward whose decoder layers are all [`FusedDecoderStep`]s: a call of new tokens of one sequence
    after a non-empty DynamicCache (as many as the layers take), without padding, embeddings, labels, gradients or
    hidden states asked for, its position ids (if given) those after the cache (a decoding step or a verification as
    pacer's loop makes it, a step of plain `generate`), runs
    embedding -> the layers' kernels -> norm -> LM head in one function, the checks done once instead of once a layer,
    the layers in one kernel call where they can be ([`_layers`]); bitwise what the layers give through the model's
    own forward. Anything else calls that forward (`original`)."""

    def __init__(self, model: nn.Module):
        self.model, self.original = model, model.forward
        self.cache_name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self.layers = [layer.forward for layer in model.model.layers]
        steps = self.layers
        # every layer in one kernel call ([`kernels.decoder_layers`]) where they share head size and scaling: the
        # projections' kinds and sizes, and where to read each buffer at each step (their current tensors, as the
        # layers' own steps read them), seven a layer
        self._one_call = len({(s.scaling, s.head_dim) for s in steps}) == 1
        self._kinds = [kind for s in steps for kind in s._kinds]
        self._sizes = [size for s in steps for size in s._sizes]
        self._fields = [[(buffers, names[i]) for s in steps for buffers, names in zip(s._buffers, s._names)]
                        for i in range(5)]

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                 labels=None, use_cache=None, logits_to_keep=0, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        if not self._takes(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, kwargs):
            return self.original(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                 inputs_embeds=inputs_embeds, labels=labels, use_cache=use_cache,
                                 logits_to_keep=logits_to_keep, **{self.cache_name: cache}, **kwargs)
        inner = self.model.model
        rows = input_ids.shape[1]
        hidden = inner.embed_tokens(input_ids)
        packed = packed_call(cache, rows)
        if packed is not None:
            positions = packed.positions[None]
        else:
            past = cache.get_seq_length()
            positions = torch.arange(past, past + rows)[None]
        cos, sin = rotary_tables(inner.rotary_emb(hidden, positions), self.layers[0].head_dim)
        x = self._layers(hidden.reshape(rows, -1).contiguous(), cos, sin, cache)
        x = inner.norm(x[None])
        if isinstance(logits_to_keep, torch.Tensor):  # the rows a packed call keeps: each sequence's last ones
            keep = x[:, logits_to_keep]
        else:
            keep = x if not logits_to_keep else x[:, -logits_to_keep:]
        return CausalLMOutputWithPast(logits=self.model.lm_head(keep), past_key_values=cache)

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        """The decoder layers over `cache`: one kernel call for them all, each layer's keys and values written into
        its buffers ([`cache_room`]); layer by layer where that cannot be (an offloaded cache, torch.compile tracing,
        a clock on the layers' calls: [`timed_kernels`]). The same bits either way."""
        steps = self.layers
        packed = packed_call(cache, x.shape[0])
        if (not self._one_call or (packed is None and not writes_in_place(cache))
                or any(s._call is not _untimed for s in steps)):
            for step in steps:
                x = step.step(x, cos, sin, cache)
            return x
        rows = x.shape[0]
        if packed is not None:  # a packed call: every layer writes the rows at their slots, reads their ranges
            rooms = [(*row_buffers(cache, s.layer_idx, s.kv_heads, s.head_dim), 0) for s in steps]
        else:
            rooms = [cache_room(cache.layers[s.layer_idx], rows, s.kv_heads, s.head_dim) for s in steps]
        norms = [n for s in steps for n in (s.layer.input_layernorm, s.layer.post_attention_layernorm)]
        fields = [[None if name is None else buffers[name] for buffers, name in pairs] for pairs in self._fields]
        out = kernels.decoder_layers(x, cos, sin, steps[0].head_dim, steps[0].scaling, [n.weight for n in norms],
                                     [n.variance_epsilon for n in norms], (self._kinds, *fields, self._sizes),
                                     [r[0] for r in rooms], [r[1] for r in rooms], [r[2] for r in rooms],
                                     rows=None if packed is None else (packed.slots, packed.lo, packed.hi))
        if packed is None:
            for s, (keys, values, held) in zip(steps, rooms):
                hold(cache.layers[s.layer_idx], keys, values, held + rows)
        return out

    def _takes(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, kwargs) -> bool:
        if (input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or inputs_embeds is not None
                or labels is not None or torch.is_grad_enabled()):
            return False
        packed = packed_call(cache, input_ids.shape[1])
        if packed is not None:  # several sequences packed: the cache's plan says each row's place and keys
            dtype = self.model.model.embed_tokens.weight.dtype
            return (not any(value is not None and value is not False for key, value in kwargs.items()
                            if key not in ("return_dict", "pacer_key_ranges"))
                    and (position_ids is None or torch.equal(position_ids.reshape(-1), packed.positions))
                    and all(layer.forward is s and s.routable(packed.longest, dtype)
                            for s, layer in zip(self.layers, self.model.model.layers)))
        if (type(cache) is not DynamicCache
                # plain generate asks for a dict, which this returns
                or any(value is not None and value is not False and not (key == "return_dict" and value is True)
                       for key, value in kwargs.items())
                or cache.get_seq_length() == 0 or any(type(layer) is not DynamicLayer for layer in cache.layers)):
            return False
        if attention_mask is not None and not (attention_mask.dim() == 2 and bool(attention_mask.all())):
            return False
        if position_ids is not None:  # plain generate hands the positions after the cache: the ones used here
            past = cache.get_seq_length()
            if not torch.equal(position_ids, torch.arange(past, past + input_ids.shape[1])[None]):
                return False
        # every layer still routed and taking this call's rows and dtype (the layer's own test, once a step)
        rows, dtype = input_ids.shape[1], self.model.model.embed_tokens.weight.dtype
        return all(layer.forward is s and s.routable(rows, dtype)
                   for s, layer in zip(self.layers, self.model.model.layers))


def _fusable(layer: nn.Module, kinds: tuple) -> bool:
    attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if attention is None or mlp is None or getattr(attention, "sliding_window", None):
        return False
    projections = [getattr(attention, name, None) for name in (*_ATTENTION, "o_proj")] + \
                  [getattr(mlp, name, None) for name in ("gate_proj", "up_proj", "down_proj")]
    if not all(type(m) in kinds and getattr(m, "kernel", "pacer") == "pacer" for m in projections):
        return False
    head_dim = attention.head_dim
    norms = (getattr(layer, "input_layernorm", None), getattr(layer, "post_attention_layernorm", None))
    return (head_dim % 16 == 0 and head_dim <= 256 and all(hasattr(n, "variance_epsilon") for n in norms)
            and projections[0].out_features % head_dim == 0 and projections[1].out_features % head_dim == 0)


def fuse_draft_layers(model: nn.Module) -> int:
    """Route the decoding steps (1 to MAX_ROWS tokens) of `model`'s decoder layers through pacer's kernels, in place;
    returns how many layers were routed (0 where the kernels are unavailable, the architecture is not one of
    FUSED_MODEL_TYPES with SiLU, or a layer is not all Int4Linear(kernel="pacer") layers; those layers are left as
    they are)."""
    return _fuse(model, MAX_ROWS, (Int4Linear,))


def fuse_target_layers(model: nn.Module) -> int:
    """Route every forward of one sequence (any number of tokens, over a DynamicCache or none) of `model`'s decoder
    layers through pacer's kernels, in place: a W4A8 target (`quantize_from_gguf(..., activations="int8")`), whose
    layers are W4A8Linear / W8A8Linear (or Int4Linear(kernel="pacer")). Returns how many layers were routed (0 as
    [`fuse_draft_layers`] says, or where a layer has another kind of projection). Fuse the target before decoding
    with it at all: the routed layers compute other numbers than the eager ones (close, not equal), the same in
    plain decoding and under PACER, row for row bitwise in every call; `model._pacer_exact` says "rows-alone"."""
    fused = _fuse(model, None, (W4A8Linear, W8A8Linear, Int4Linear))
    if fused and fused_layers(model) == len(getattr(getattr(model, "model", model), "layers", ())):
        model._pacer_exact = "rows-alone"
    return fused


def _fuse(model: nn.Module, max_rows: int | None, kinds: tuple) -> int:
    config = model.config.get_text_config()
    if (not kernels.available() or config.model_type not in FUSED_MODEL_TYPES or config.hidden_act != "silu"
            or getattr(config, "mlp_bias", False)
            or any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())):
        return 0
    layers = getattr(getattr(model, "model", model), "layers", ())
    fused = 0
    for layer in layers:
        if isinstance(layer.forward, FusedDecoderStep) or not _fusable(layer, kinds):
            continue
        layer.forward = FusedDecoderStep(layer, config, max_rows)
        fused += 1
    # every layer routed, in a causal LM of the usual shape: its decoding steps skip the model's own forward too
    if (layers and all(isinstance(layer.forward, FusedDecoderStep) for layer in layers)
            and not isinstance(model.forward, FusedModelStep)
            and all(hasattr(getattr(model, "model", None), name) for name in ("embed_tokens", "rotary_emb", "norm"))
            and hasattr(model, "lm_head")):
        model.forward = FusedModelStep(model)
    return fused


def fused_layers(model: nn.Module) -> int:
    """How many of `model`'s decoder layers [`fuse_draft_layers`] or [`fuse_target_layers`] routed."""
    return sum(isinstance(getattr(m, "forward", None), FusedDecoderStep) for m in model.modules())


@contextlib.contextmanager
def timed_kernels(model: nn.Module, clock=time.perf_counter):
    """Within the block, every routed layer of `model` adds the seconds of its calls to the dict it yields, keyed
    "layer_qkv" or "layer_qkv_cached" (RMSNorm, q/k/v, rotary, the latter writing k and v into the cache), "update"
    or "cache_room" (transformers' cache update, or finding the cache's buffers) and "layer_rest" (attention, o_proj,
    the MLP, the residuals), summed over the layers: the split that module hooks cannot see (no module inside a
    fused layer is called). `clock` must wait for the device's work ([`costs.device_clock`]); the caller clears
    the dict between forwards."""
    spent: dict[str, float] = {}

    def timed(function, *args):
        start = clock()
        out = function(*args)
        spent[function.__name__] = spent.get(function.__name__, 0.0) + clock() - start
        return out

    steps = [m.forward for m in model.modules() if isinstance(getattr(m, "forward", None), FusedDecoderStep)]
    for step in steps:
        step._call = timed
    try:
        yield spent
    finally:
        for step in steps:
            step._call = _untimed


@contextlib.contextmanager
def layer_by_layer(*models: nn.Module):
    """Within the block, the routed model steps of `models` call their layers' kernels one layer at a time, as before
    [`kernels.decoder_layers`] ran them all in one call: the same bits, the Python between the calls paid again. What
    the one call saves, measured in one process (`pacer-bench run --methods pacer pacer-layerwise`)."""
    steps = [m.forward for m in models if m is not None and isinstance(getattr(m, "forward", None), FusedModelStep)]
    saved = [step._one_call for step in steps]
    for step in steps:
        step._one_call = False
    try:
        yield
    finally:
        for step, one_call in zip(steps, saved):
            step._one_call = one_call


@contextlib.contextmanager
def eager_layers(model: nn.Module):
    """Within the block, `model`'s routed layers and model step run their own (eager) forwards; restored after.
    What fusing changed, measured in one process (`pacer-bench run --methods target target-unfused`)."""
    routed = [m for m in model.modules() if isinstance(getattr(m, "forward", None), (FusedDecoderStep, FusedModelStep))]
    steps = [m.forward for m in routed]
    for m, step in zip(routed, steps):
        m.forward = step.original
    try:
        yield model
    finally:
        for m, step in zip(routed, steps):
            m.forward = step
