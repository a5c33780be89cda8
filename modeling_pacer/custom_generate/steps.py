"""A model's forward over a cache, the cache's roll-back, and the caches a step runs over: the steps the loop (`generate.py`) and the cost
measurement (`costs.py`) both take. Imports only torch and transformers (this folder travels to the Hub as is)."""

import functools
import inspect

import torch
from transformers import DynamicCache, StaticCache
from transformers.cache_utils import StaticLayer
from transformers.generation.utils import ALL_CACHE_NAMES

from .rows import RowCache, cache_slack, packed_forward

# --------------------------------------------------------------------------------------------------
# the cache's name: transformers 5.24 renamed it from `past_key_values` to `cache`, both in the
# `model_kwargs` that `generate` hands a decoding method and in the models' forwards
# --------------------------------------------------------------------------------------------------
# the names `generate` may hold a cache under, the current one first (transformers' own list)
CACHE_NAMES = tuple(ALL_CACHE_NAMES)


@functools.lru_cache(maxsize=None)
def _forward_cache_name(forward) -> str:
    parameters = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in parameters:
            return name
    return CACHE_NAMES[0]  # a forward taking only **kwargs: the installed transformers' name


def cache_kwargs(model, cache) -> dict:
    """`{name: cache}` under the name `model.forward` expects (`cache` on transformers >= 5.24 models,
    `past_key_values` before, or for remote-code models written for it), so no deprecation warning fires."""
    return {_forward_cache_name(type(model).forward): cache}


def model_forward(model, tokens: torch.LongTensor, cache, num_logits: int, hidden: bool = False):
    """Feed `tokens` `(1, n)` after what `cache` holds.

    Returns `(logits (1, num_logits, vocab) float32, last hidden states (1, num_logits, hidden) or None)`.
    """
    kwargs = {"output_hidden_states": True} if hidden else {}
    if getattr(model, "_supports_logits_to_keep", lambda: False)():
        kwargs["logits_to_keep"] = num_logits
    out = model(input_ids=tokens.to(model.device), use_cache=True, **cache_kwargs(model, cache), **kwargs)
    logits = out.logits[:, -num_logits:, :].float()
    states = out.hidden_states[-1][:, -num_logits:, :] if hidden else None
    return logits, states


def rows_forward(model, cache, feeds: list[tuple[int, torch.LongTensor]], num_logits: list[int], hidden: bool = False):
    """Feed each `(row, tokens (1, n))` of `feeds` after what its sequence of `cache` holds, in one forward: a
    [`RowCache`]'s sequences packed into one call ([`packed_forward`]), a single sequence's cache as
    [`model_forward`]. Returns one [`model_forward`] result per feed."""
    if isinstance(cache, RowCache):
        return packed_forward(model, cache, feeds, num_logits, hidden, cache_kwargs)
    if len(feeds) != 1 or feeds[0][0] != 0:
        raise ValueError("a single sequence's cache takes one sequence's tokens")
    return [model_forward(model, feeds[0][1], cache, num_logits[0], hidden)]


def row_length(cache, row: int) -> int:
    """How many positions sequence `row` of `cache` holds (a single sequence's cache: row 0)."""
    return cache.lengths[row] if isinstance(cache, RowCache) else cache_length(cache)


def crop_row(cache, row: int, length: int) -> None:
    """Keep the first `length` positions of sequence `row` of `cache` ([`crop_cache`] for a single sequence's)."""
    if isinstance(cache, RowCache):
        cache.crop_row(row, length)
    else:
        crop_cache(cache, length)


def cache_length(cache) -> int:
    """How many positions `cache` holds, as an int (a StaticCache counts in a tensor on the model's device)."""
    return int(cache.get_seq_length())


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of `cache` (transformers 5's `crop` takes a negative count to drop).

    Called after every step, even with nothing to drop: `crop(0)` trims sliding-window layers, which
    keep their whole past while a draft is pending (`activate_past_recording`), back to the window.
    A StaticCache only moves its write position back, in place (its tensors keep their addresses, which a captured
    step reads): what lies past it is masked from every later row and overwritten by the next write. That is what
    `StaticLayer.crop` does where transformers has it (5.25; 5.23 has no crop for static layers).
    """
    held = cache_length(cache)
    if held == 0:
        return  # an empty cache (the draft's, after the prefill step) has no layers to crop
    if isinstance(cache, StaticCache):
        for layer in cache.layers:
            layer.cumulative_length.sub_(max(0, held - length))
        return
    cache.crop(-max(0, held - length))


# --------------------------------------------------------------------------------------------------
# static caches: what a captured step (a CUDA graph, `modeling_pacer.capture`) decodes over
# --------------------------------------------------------------------------------------------------
def wants_static_cache(model) -> bool:
    """Whether `model`'s steps are captured ([`modeling_pacer.capture`]): it then decodes over a StaticCache."""
    return bool(getattr(model, "_pacer_static_cache", False))


# a static cache's size: the smallest power of two, at least this, that holds the call: few sizes, so few graphs
STATIC_MIN_SIZE = 256


def static_size(model, max_length: int) -> int:
    """The positions of `model`'s static cache for a call of up to `max_length` tokens ([`new_cache`])."""
    size, need = STATIC_MIN_SIZE, max_length + cache_slack(model)
    while size < need:
        size *= 2
    return size


def new_cache(model, max_length: int, static: bool = False):
    """An empty cache for `model` decoding up to `max_length` tokens: a StaticCache of [`static_size`] positions where
    `static` or [`wants_static_cache`], else a DynamicCache. A static cache's rows attend over all its positions
    (masked past the ones written), so runs compare bitwise only over caches of one size: the target alone takes
    its cache from here too.

    A captured model keeps one static cache per size and hands it out again, emptied: its graphs were recorded
    reading those tensors' addresses (a new cache would be compiled and recorded anew). So one captured model
    decodes one call at a time, and a cache it returned is emptied by its next call (as transformers' own
    static-cache generation does)."""
    config = model.config.get_text_config(decoder=True)
    if not (static or wants_static_cache(model)):
        return DynamicCache(config=config)
    size = static_size(model, max_length)
    if not wants_static_cache(model):
        return StaticCache(config=config, max_cache_len=size)
    pool = model.__dict__.setdefault("_pacer_static_caches", {})
    if size not in pool:
        pool[size] = StaticCache(config=config, max_cache_len=size)
    else:
        pool[size].reset()
    return pool[size]


def static_capacity(cache) -> int:
    """The positions a StaticCache holds."""
    return cache.layers[0].max_cache_len


def static_cache_supported(model) -> bool:
    """Whether `model`'s static cache would be one this package rolls back (full-attention layers only), judged on a
    new one-position cache (never a captured model's own, which another call may be using)."""
    config = model.config.get_text_config(decoder=True)
    return is_static_full_attention(StaticCache(config=config, max_cache_len=1))


def is_static_full_attention(cache) -> bool:
    """A StaticCache of full-attention layers only: the static cache this package rolls back."""
    return isinstance(cache, StaticCache) and all(type(layer) is StaticLayer for layer in cache.layers)
