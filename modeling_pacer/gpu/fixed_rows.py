"""Every forward of a model in one row shape ([`fixed_rows`]): the way to bitwise-exact verification on a GPU
that this module offers for measurement (`pacer-bench rows`, tests/gpu/).

Speculative decoding is lossless only if a verification call's rows equal, bit for bit, the rows single-token
steps give. On a GPU they do not out of the box: the matmul library picks another kernel (tile shape, split of
the reduction) for another number of rows, and a reduction summed in another order rounds differently (in bf16 by
up to 0.1 in the logits of a 1.5B model, enough to flip near-ties). Computing every row alone (`make_exact`, the
CPU's way) is exact but launch-bound there: its cost grows with the rows.

Here every call of the model is cut into calls of exactly `rows` tokens: a decoding step's one token, a
verification's k + 1 and a prompt's tail are padded up to `rows` with copies of their last token, a longer input
is fed in consecutive chunks of `rows`. The padding sits after the real tokens, so causal attention keeps every
real row from seeing it, and the cache is cropped back to the real tokens after each call. Every matmul, norm and
reduction then sees one shape whatever the call, so one kernel configuration computes every row; on a GPU a call
of a few rows costs about what one row does (the weights' read dominates), so the price is the padding's small
share, paid by the target alone as well (which must run the same function to give the same numbers).

What this does not fix by itself: attention reads a key length that grows with the cache, and a kernel may
split that reduction differently at different lengths. Whether a device computes a row the same way at every
position of the fixed shape and at every cache length is a property of its kernels: [`row_agreement`] measures
it, and nothing here claims it untested.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..custom_generate.steps import (
    cache_kwargs, cache_length, crop_cache, is_static_full_attention, model_forward, new_cache, static_capacity,
)

# the output's cache field (transformers 5.24 renamed `past_key_values` to `cache`)
_OUTPUT_CACHE = next(f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name in ("cache", "past_key_values"))


class FixedRowsForward:
    """`model.forward` with every call in blocks of exactly `rows` input tokens (see the module's docstring). Calls it
    cannot pad exactly (a batch, embeddings instead of ids, a mask with padding, labels, explicit positions, a cache
    that is not a DynamicCache or StaticCache of full-attention layers, a StaticCache without room for the padding)
    are refused: a silent fallback would break exactness. `inner` is the call of exactly `rows` tokens (the model's
    own forward, or a captured one: [`modeling_pacer.capture`])."""

    def __init__(self, model: nn.Module, rows: int):
        self.model, self.original, self.rows = model, model.forward, rows
        self.inner = self.original

    def __call__(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                 labels=None, use_cache=None, logits_to_keep=0, output_hidden_states=None, **kwargs):
        cache = kwargs.pop("past_key_values", cache)
        self._check(input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache, kwargs)
        kwargs.pop("return_dict", None)
        kwargs.pop("cache_position", None)  # recomputed per chunk from the cache's length
        if cache is None:
            cache = DynamicCache(config=self.model.config.get_text_config(decoder=True))
        static = is_static_full_attention(cache)
        n = input_ids.shape[1]
        keep = n if not logits_to_keep else min(int(logits_to_keep), n)  # the last `keep` rows' logits are returned
        logits, hidden = [], []
        for start in range(0, n, self.rows):
            chunk = input_ids[:, start : start + self.rows]
            real = chunk.shape[1]
            padded = torch.cat([chunk, chunk[:, -1:].expand(1, self.rows - real)], dim=1)
            past = cache_length(cache)
            if static and past + self.rows > static_capacity(cache):
                raise ValueError(f"fixed_rows: a call of {self.rows} rows after {past} positions does not fit this "
                                 f"StaticCache of {static_capacity(cache)}: size it with modeling_pacer.new_cache "
                                 "(the call's max_length plus the row shape's padding)")
            if position_ids is not None:  # the caller's positions for the real rows, the padding's continue them
                given = position_ids[:, start : start + real]
                kwargs["position_ids"] = torch.cat([given, given[:, -1:] + torch.arange(
                    1, self.rows - real + 1, device=given.device)], dim=1)
            out = self.inner(input_ids=padded, use_cache=True, logits_to_keep=0,
                                output_hidden_states=output_hidden_states, **cache_kwargs(self.model, cache), **kwargs)
            crop_cache(cache, past + real)  # the padding's keys and values leave the cache
            first = max(0, (n - keep) - start)  # rows of this chunk whose logits are returned
            if first < real:
                logits.append(out.logits[:, first:real])
            if output_hidden_states:
                hidden.append([h[:, :real] for h in out.hidden_states])
        states = tuple(torch.cat(layer, dim=1) for layer in zip(*hidden)) if output_hidden_states else None
        return CausalLMOutputWithPast(logits=torch.cat(logits, dim=1), hidden_states=states, **{_OUTPUT_CACHE: cache})

    def _check(self, input_ids, attention_mask, position_ids, cache, inputs_embeds, labels, use_cache, kwargs):
        def refuse(what):
            raise ValueError(f"fixed_rows: {what} cannot be computed in the fixed row shape exactly; this model "
                             "decodes batch size 1 from token ids, without padding, over a DynamicCache or StaticCache")

        if input_ids is None or inputs_embeds is not None:
            refuse("a call without input_ids (inputs_embeds)")
        if input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
            refuse(f"input_ids of shape {tuple(input_ids.shape)}")
        if labels is not None or use_cache is False:
            refuse("labels or use_cache=False")
        if position_ids is not None and tuple(position_ids.shape) != tuple(input_ids.shape):
            refuse(f"position_ids of shape {tuple(position_ids.shape)}")
        # a dict: the causal masks transformers prepares ahead for a static cache, which the padded calls rebuild
        if isinstance(attention_mask, torch.Tensor) and not bool(attention_mask.all()):
            refuse("an attention mask with padding")
        dynamic = type(cache) is DynamicCache and all(type(layer) is DynamicLayer for layer in cache.layers)
        if cache is not None and not dynamic and not is_static_full_attention(cache):
            refuse(f"a {type(cache).__name__} (sliding-window or other layers)")
        if kwargs.get("output_attentions"):
            refuse("output_attentions")


def fixed_rows(model: nn.Module, rows: int = 16) -> nn.Module:
    """Every forward of `model` in calls of exactly `rows` tokens ([`FixedRowsForward`]), in place; returns the model.
    `rows` is the longest verification it takes in one call (a longer input runs in several): the longest draft + 1.
    Use it on the target, for plain decoding as well as under PACER. A model with sliding-window attention is
    refused (its cache drops keys the padding would push out)."""
    if not isinstance(rows, int) or rows < 1:
        raise ValueError(f"fixed_rows: rows must be an integer >= 1, got {rows!r}")
    if getattr(model, "_pacer_static_cache", False):
        raise ValueError("fixed_rows: this model's steps are captured already; apply fixed_rows (make_exact) first, "
                         "then capture")
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None or any(t != "full_attention" for t in layer_types):
            raise ValueError("fixed_rows: sliding-window attention is not supported (its cache drops what padding pushes out)")
    if isinstance(model.forward, FixedRowsForward):
        model.forward.rows = rows
    else:
        model.forward = FixedRowsForward(model, rows)
    model._pacer_cache_slack = rows  # a static cache's room for the padding (`new_cache`)
    return model


def fixed_rows_of(model: nn.Module) -> int | None:
    """The row shape [`fixed_rows`] set on `model`, or None."""
    forward = getattr(model, "forward", None)
    return forward.rows if isinstance(forward, FixedRowsForward) else None


@torch.no_grad()
def row_agreement(model: nn.Module, prefix: torch.LongTensor, sizes=range(1, 17), draft: torch.LongTensor | None = None,
                  static: bool = False) -> dict[int, float]:
    """How far a call of k tokens after `prefix` `(1, L)` is from k single-token steps, for each k in `sizes`: the
    largest absolute difference between their float32 logits (0.0: bitwise equal). The k tokens are `draft[:, :k]`
    (default: a fixed sequence of ids). Also `"prefill"`: the prefix read in one call, its last row against the same
    prefix read up to its last token and then stepped once. `static`: over StaticCaches of one size (what a captured
    model decodes over), else DynamicCaches."""

    device = next(model.parameters()).device
    prefix = prefix.to(device)
    vocab = model.config.get_text_config(decoder=True).vocab_size
    longest = max(sizes)
    if draft is None:
        draft = (torch.arange(longest, device=device) * 104729 % vocab).view(1, -1)

    length = prefix.shape[1] + longest + 1  # every cache here one size: a static cache's rows read all of it

    def empty():
        return new_cache(model, length, static=static)

    def after(ids: torch.LongTensor):
        cache = empty()
        model_forward(model, ids, cache, 1)
        return cache

    cache = after(prefix)
    singles = []
    for i in range(longest):  # the steps: one token at a time
        logits, _ = model_forward(model, draft[:, i : i + 1], cache, 1)
        singles.append(logits[0, 0])
    out: dict = {}
    for k in sizes:
        cache = after(prefix)
        logits, _ = model_forward(model, draft[:, :k], cache, k)
        out[k] = max(float((logits[0, i] - singles[i]).abs().max()) for i in range(k))
    whole, _ = model_forward(model, prefix, empty(), 1)
    stepped, _ = model_forward(model, prefix[:, -1:], after(prefix[:, :-1]), 1)
    out["prefill"] = float((whole[0, -1] - stepped[0, -1]).abs().max())
    return out
