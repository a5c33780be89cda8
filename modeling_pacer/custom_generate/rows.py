"""Several sequences in one forward: each sequence's new tokens packed one after another into a single row of the
call (`(1, M)` tokens, M their total: no padding, a sequence that feeds nothing takes no room), each sequence's keys
and values in its own span of one cache ([`RowCache`]), each token attending to exactly its own sequence's keys.

The row cache of `batch` sequences keeps, per layer, one buffer `(1, kv_heads, batch * capacity, head_dim)`: sequence
b's position p lies at `b * capacity + p`, so the keys a token of sequence b at position p sees are one contiguous
range, `b * capacity .. b * capacity + p` (less what a sliding window drops), the very keys a single sequence's cache
holds, in the same order. A packed call ([`packed_forward`]) hands the model

- its tokens `(1, M)` and their positions in their own sequences (`position_ids`),
- the mask that says each token's range (a 4-D mask, boolean or additive as the attention implementation reads it),
- and the ranges themselves (`pacer_key_ranges=(lo, hi)`, forwarded by transformers to the attention function), which
  pacer's exact attention reads instead of the mask: each row computed alone over its range, bitwise what the same
  sequence alone computes over its own cache.

Linear layers see M rows, which an exact target computes row by row alike ([`modeling_pacer.make_exact`]); so a
sequence's logits in a packed call are, bit for bit, what it gets decoded alone over that target. Imports only torch
and transformers (this folder travels to the Hub as is).
"""

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

# the attention implementations a packed call's mask is built for: boolean (True: the key is seen) or additive
BOOLEAN_MASKS = ("pacer_exact", "pacer_kernel", "sdpa")
ADDITIVE_MASKS = ("eager",)
# the layer types a packed call masks (full attention; a sliding window, which keeps its whole past here)
LAYER_TYPES = ("full_attention", "sliding_attention")


@dataclass
class PackedCall:
    """Where a packed call's M tokens go: `rows` the sequences fed (in order) and `counts` their tokens; per token
    its position in its sequence (`positions`, (M,)), its slot in the flat cache buffers (`slots`, (M,)) and the
    range of slots it attends to, `lo`..`hi - 1` (full attention; a window narrows it per layer)."""

    rows: list[int]
    counts: list[int]
    positions: torch.Tensor
    slots: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor

    @property
    def longest(self) -> int:
        """The most tokens one sequence feeds in this call."""
        return max(self.counts)


class RowLayer(CacheLayerMixin):
    """One layer of a [`RowCache`]: its keys and values `(1, kv_heads, batch * capacity, head_dim)`, written in place at
    the packed call's slots."""

    is_sliding = False
    is_croppable = True

    def __init__(self, cache: "RowCache"):
        super().__init__()
        self.cache = cache

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        size = self.cache.batch * self.cache.capacity
        self.keys = key_states.new_zeros(1, key_states.shape[1], size, key_states.shape[-1])
        self.values = value_states.new_zeros(1, value_states.shape[1], size, value_states.shape[-1])
        self.device = key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        call = self.cache.call
        if call is None or key_states.shape[0] != 1 or key_states.shape[2] != call.slots.shape[0]:
            raise ValueError("a RowCache is written by packed calls only (modeling_pacer's packed_forward), one token "
                             "per planned slot")
        slots = call.slots.to(self.keys.device)
        self.keys.index_copy_(2, slots, key_states.to(self.keys.dtype))
        self.values.index_copy_(2, slots, value_states.to(self.values.dtype))
        seen = int(call.hi.max())  # the keys past the last one any token sees are never read
        return self.keys[:, :, :seen], self.values[:, :, :seen]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.cache.batch * self.cache.capacity, 0

    def get_seq_length(self) -> int:
        return max(self.cache.lengths)

    def get_max_length(self) -> int:
        return self.cache.capacity


class RowCache(Cache):
    """The keys and values of `batch` sequences, each at its own length (`lengths`), each in its own span of
    `capacity` positions of every layer's buffer. Written only by packed calls ([`plan`], then the model's forward);
    a sequence is rolled back alone ([`crop_row`]). Its length is `lengths[b]`; `get_seq_length()` is the longest."""

    def __init__(self, batch: int, capacity: int):
        if batch < 1 or capacity < 1:
            raise ValueError(f"a RowCache holds at least one sequence of one position, got {batch} x {capacity}")
        super().__init__(layers=[])
        self.batch, self.capacity = batch, capacity
        self.lengths = [0] * batch
        self.call: PackedCall | None = None

    def layer(self, layer_idx: int) -> RowLayer:
        """Layer `layer_idx`'s cache (made on first use)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(RowLayer(self))
        return self.layers[layer_idx]

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layer(layer_idx).update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(self.lengths)

    def plan(self, rows: list[int], counts: list[int], device) -> PackedCall:
        """The next call feeds `counts[i]` tokens of sequence `rows[i]` after what it holds: where they go. The
        lengths move on at once (a crop takes back what a verification rejects)."""
        positions, slots, lo = [], [], []
        for row, count in zip(rows, counts):
            start = self.lengths[row]
            if count < 1 or start + count > self.capacity:
                raise ValueError(f"sequence {row} cannot take {count} more tokens: it holds {start} of "
                                 f"{self.capacity}")
            base = row * self.capacity
            positions.extend(range(start, start + count))
            slots.extend(range(base + start, base + start + count))
            lo.extend([base] * count)
            self.lengths[row] = start + count
        slots_t = torch.tensor(slots, dtype=torch.int64)
        self.call = PackedCall(list(rows), list(counts), torch.tensor(positions, dtype=torch.int64).to(device),
                               slots_t, torch.tensor(lo, dtype=torch.int64), slots_t + 1)
        return self.call

    def crop_row(self, row: int, length: int) -> None:
        """Keep sequence `row`'s first `length` positions (what lies past them is never read and is overwritten)."""
        self.lengths[row] = min(self.lengths[row], length)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError("a RowCache is rolled back one sequence at a time (crop_row)")


def _mask(call: PackedCall, keys: int, window: int | None, implementation: str, dtype, device) -> torch.Tensor:
    """`(1, 1, M, keys)`: token t sees slots lo_t..hi_t - 1 (the last `window` of them in a sliding layer)."""
    index = torch.arange(keys)
    lo = call.lo if window is None else torch.maximum(call.lo, call.hi - window)
    seen = (index >= lo[:, None]) & (index < call.hi[:, None])
    seen = seen[None, None].to(device)
    if implementation in BOOLEAN_MASKS:
        return seen
    return torch.zeros(seen.shape, dtype=dtype, device=device).masked_fill_(~seen, torch.finfo(dtype).min)


def cache_slack(model) -> int:
    """Positions a call of `model` may write past its real tokens before the cache is cropped back (the padding of a
    fixed row shape, `modeling_pacer.fixed_rows`): room a StaticCache must have; a packed call cannot be padded so."""
    return int(getattr(model, "_pacer_cache_slack", 0))


def check_packable(model) -> None:
    """A clear error where `model` has an attention implementation or a layer type a packed call cannot mask, or pads
    each call to a fixed row shape ([`cache_slack`])."""
    if cache_slack(model):
        raise ValueError(f"{type(model).__name__}'s forward runs each call as one sequence padded to a fixed number of "
                         f"rows (fixed_rows; make_exact's choice on this device: {getattr(model, '_pacer_exact', None)!r}), "
                         "which a packed call of several sequences cannot keep exact: decode one sequence a call, or "
                         "make it exact by rows alone (modeling_pacer.exact.exact_candidates(16)['rows-alone'](model)).")
    config = model.config.get_text_config(decoder=True)
    implementation = config._attn_implementation
    if implementation not in BOOLEAN_MASKS + ADDITIVE_MASKS:
        raise ValueError(f"decoding several sequences at once masks each one's keys for the attention implementations "
                         f"{BOOLEAN_MASKS + ADDITIVE_MASKS}; {type(model).__name__} runs {implementation!r}: load it "
                         "with one of them (attn_implementation=...) or decode one sequence at a time.")
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    unknown = sorted(set(layer_types) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(f"decoding several sequences at once supports {LAYER_TYPES} layers; {type(model).__name__} "
                         f"has {unknown}: decode one sequence at a time.")


def packed_masks(model, call: PackedCall):
    """The 4-D mask (or one per layer type, as transformers' models take a prepared mapping) of a packed call for
    `model`'s attention implementation ([`check_packable`])."""
    check_packable(model)
    config = model.config.get_text_config(decoder=True)
    implementation = config._attn_implementation
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    keys = int(call.hi.max())
    dtype, device = model.dtype, model.device
    window = getattr(config, "sliding_window", None)
    masks = {kind: _mask(call, keys, window if kind == "sliding_attention" else None, implementation, dtype, device)
             for kind in dict.fromkeys(layer_types)}
    return masks if len(masks) > 1 or "full_attention" not in masks else masks["full_attention"]


def packed_forward(model, cache: RowCache, feeds: list[tuple[int, torch.Tensor]], num_logits: list[int],
                   hidden: bool = False, cache_kwargs=None):
    """Feed each `(row, tokens (1, n))` of `feeds` after what sequence `row` of `cache` holds, all in one forward.

    Returns one `(logits (1, num_logits[i], vocab) float32, last hidden states (1, num_logits[i], hidden) or None)` per
    feed: its last `num_logits[i]` tokens' (the rows of a single sequence's own forward). `cache_kwargs(model, cache)`
    names the cache as `model.forward` takes it."""
    counts = [int(tokens.shape[1]) for _, tokens in feeds]
    device = model.device
    call = cache.plan([row for row, _ in feeds], counts, device)
    tokens = torch.cat([t.reshape(-1) for _, t in feeds]).to(device)[None]
    ends = torch.tensor(counts).cumsum(0)
    keep = torch.cat([torch.arange(int(end) - n, int(end)) for end, n in zip(ends, num_logits)])
    kwargs = {"output_hidden_states": True} if hidden else {}
    if getattr(model, "_supports_logits_to_keep", lambda: False)():
        kwargs["logits_to_keep"] = keep.to(device)
        picked = torch.arange(keep.shape[0])
    else:
        picked = keep
    try:
        out = model(input_ids=tokens, position_ids=call.positions[None], attention_mask=packed_masks(model, call),
                    use_cache=True, pacer_key_ranges=(call.lo, call.hi), **cache_kwargs(model, cache), **kwargs)
    finally:
        cache.call = None
    logits = out.logits[0, picked.to(out.logits.device)].float()
    states = out.hidden_states[-1][0, keep.to(out.hidden_states[-1].device)] if hidden else None
    results, start = [], 0
    for n in num_logits:
        results.append((logits[start:start + n][None], None if states is None else states[start:start + n][None]))
        start += n
    return results
