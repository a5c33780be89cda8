"""A model's forward over a cache, and the cache's roll-back: the steps the loop (`generate.py`) and the cost
measurement (`costs.py`) both take. Imports only torch and transformers (this folder travels to the Hub as is)."""

import functools
import inspect

import torch
from transformers.generation.utils import ALL_CACHE_NAMES

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


def crop_cache(cache, length: int) -> None:
    """Keep the first `length` positions of `cache` (transformers 5's `crop` takes a negative count to drop).

    Called after every step, even with nothing to drop: `crop(0)` trims sliding-window layers, which
    keep their whole past while a draft is pending (`activate_past_recording`), back to the window.
    """
    if cache.get_seq_length() == 0:
        return  # an empty cache (the draft's, after the prefill step) has no layers to crop
    cache.crop(-max(0, cache.get_seq_length() - length))
