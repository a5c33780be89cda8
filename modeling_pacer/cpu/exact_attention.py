"""`attn_implementation="pacer_exact"`: attention whose every output row is computed the same way whatever
the number of queries fed with it.

Speculative decoding is lossless only if the target's verification forward (a block of k draft tokens
after the cache) gives, row for row, the logits that k single-token decoding steps give. Fused attention
kernels (`sdpa`) do not: how they tile, vectorise and reduce depends on the query length and on the key
length they are handed, so in bf16 a block's rows differ from the steps' by an ulp here and there, enough
to flip a near-tie between two tokens.

Here the output row of the query at position p is computed by the same ops on tensors of the same
shapes and layouts in every case (a decoding step, a verified block, a prefill):

    scores = q_p (groups, head_dim) @ K[lo_p:p+1]^T      # float32, K/V cut to the keys p may see
    probs  = softmax(scores * scaling)                   # float32
    out_p  = probs @ V[lo_p:p+1]                         # float32, then cast to the input dtype

Causality and sliding windows are applied by slicing the keys a row may see (a step at position p sees
keys lo_p..p, and so does row p of a block), never by masking with -inf over a width that depends on
the block. Grouped-query attention maps each key/value head to its `num_key_value_groups` query heads
without repeating keys per query head. The model's own 4-D mask (created through the mask function registered alongside)
is read to find each row's visible keys, and a mask that is not a causal (or sliding-window) pattern is
refused. PACER decodes batch size 1 without padding; a left-padded batch (pacer-train records many prompts
at once) is computed sequence by sequence, each row by the same ops on the same shapes as alone.

Attention is not the only op whose rows depend on the call's shape: on CPU, linear layers (q/k/v/o
projections, the MLP, the LM head) take other code paths for other row counts, so a decoding step's, a
block's and a prefill's rows differ there too. [`exact_linears`] (exact_linear.py) measures on the host
which row counts share a path and keeps every call inside them (padding short calls, chunking long ones);
RMSNorm, rotary embeddings, activations and embeddings are row-wise as they are (the tests check whole models).
[`make_exact`] does both:

    import modeling_pacer                               # registers "pacer_exact"
    target = modeling_pacer.make_exact(AutoModelForCausalLM.from_pretrained(..., dtype=torch.bfloat16))
    # pacer_exact alone: from_pretrained(..., attn_implementation="pacer_exact") or
    # model.set_attn_implementation("pacer_exact"); bitwise equality also needs exact_linears(model)

Use it for the target in plain decoding as well as under PACER: both then compute the same numbers. The
attention costs one small matmul pair per query row and layer instead of one fused kernel per layer; the
linear layers' padding costs little in bf16 (a few rows cost about what one does) and more in float32.
"""

from __future__ import annotations

import contextlib

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from . import kernels
from .last_call import LastCall

NAME = "pacer_exact"
KERNEL_NAME = "pacer_kernel"  # the same computation for speed alone (a draft): other masks go to sdpa, never refused


def exact_attention_mask(*args, **kwargs):
    """The model's mask for `pacer_exact`: `sdpa`'s boolean 4-D mask, never skipped (sdpa skips it for a
    plain causal pattern), so that padding reaches `exact_attention_forward`, which refuses it."""
    kwargs["allow_is_causal_skip"] = False
    kwargs["allow_is_bidirectional_skip"] = False
    return sdpa_mask(*args, **kwargs)


def _visible_keys(attention_mask, q_len: int, kv_len: int) -> torch.Tensor:
    """The 4-D mask as booleans `(batch, q_len, kv_len)`, True where a query sees a key; one mask per batch row
    (shared by the heads)."""
    mask = attention_mask
    if mask.dim() != 4 or mask.shape[-2] != q_len or mask.shape[-1] != kv_len:
        raise ValueError(
            f"pacer_exact attention: expected a (batch, 1, {q_len}, {kv_len}) mask, got {tuple(mask.shape)}."
        )
    if mask.dtype != torch.bool:
        # an additive mask: 0 where visible, a large negative number where not; any other bias is not a mask
        visible = mask == 0
        blocked = mask <= torch.finfo(mask.dtype).min / 2
        if not bool((visible | blocked).all()):
            raise ValueError("pacer_exact attention supports no attention bias, only a causal mask.")
        mask = visible
    if mask.shape[1] != 1 and not bool((mask == mask[:, :1]).all()):
        raise ValueError("pacer_exact attention needs one mask shared by the heads.")
    return mask[:, 0]


def _causal_ranges(rows: torch.Tensor, window: int | None, padded: bool) -> list[tuple[int, int] | None]:
    """`rows` `(q_len, kv_len)` visible keys of one sequence -> each query's key range [lo, hi), checked to be
    what a causal (sliding-window) pattern gives. `padded`: the sequence may start with left padding, i.e.
    keys before its first visible one are never seen, and padding queries that see no key at all get None."""
    kv_len = rows.shape[-1]
    counts = rows.sum(-1)
    empty = counts == 0
    if bool(empty.any()) and not padded:
        raise ValueError("pacer_exact attention: a query row sees no key (padding?); batch size 1 without padding only.")
    idx = torch.arange(kv_len, device=rows.device)
    lo = torch.where(rows, idx, kv_len).amin(-1)
    hi = torch.where(rows, idx, -1).amax(-1) + 1
    seen = ~empty
    first_seen = int(seen.long().argmax()) if bool(seen.any()) else rows.shape[0]
    start = int(lo[seen].min()) if bool(seen.any()) else 0  # the first key that is not padding
    lo_l, hi_l = lo[seen].tolist(), hi[seen].tolist()
    ok = bool(((hi - lo)[seen] == counts[seen]).all())  # contiguous
    ok = ok and not bool(empty[first_seen:].any())  # padding queries only before the sequence's own
    ok = ok and all(b - a == 1 for a, b in zip(hi_l, hi_l[1:]))
    ok = ok and lo_l == [max(start if padded else 0, h - window) if window else (start if padded else 0) for h in hi_l]
    if not ok:
        raise ValueError(
            "pacer_exact attention: the attention mask is not a plain causal"
            + (f" (sliding window {window})" if window else "")
            + " pattern" + (" after left padding." if padded else ", e.g. it has padding. It supports batch size 1 "
                            "without padding (pass no attention_mask, or an all-ones one), or left-padded batches.")
        )
    return [None] * first_seen + list(zip(lo_l, hi_l))


# transformers builds a fresh mask for every forward and never edits it in place: an inference-mode mask (no
# version counter) is known by its identity alone
_LAST_RANGES = LastCall(unversioned_by_identity=True)


def _row_ranges(attention_mask, q_len: int, kv_len: int, window: int | None) -> list[list[tuple[int, int] | None]]:
    """[`_read_row_ranges`], computed once per forward: every layer of a forward is handed the same mask tensor
    ([`LastCall`])."""
    return _LAST_RANGES.get(attention_mask, (q_len, kv_len, window),
                            lambda: _read_row_ranges(attention_mask, q_len, kv_len, window))


def _read_row_ranges(attention_mask, q_len: int, kv_len: int, window: int | None) -> list[list[tuple[int, int] | None]]:
    """For each sequence of the batch and each query row, the range [lo, hi) of keys it attends to (None: a
    padding query that sees nothing; its output row is zeros and never read).

    Without a mask the keys are the cache's positions ending at the last query (a DynamicCache); with one,
    the ranges are read from it and must be what a causal (sliding-window) pattern gives, after left padding
    when the sequences of a batch differ, else a clear error. A mask shared by the batch gives one list.
    """
    if attention_mask is None:
        ranges = []
        for i in range(q_len):
            hi = kv_len - q_len + i + 1
            ranges.append((max(0, hi - window) if window else 0, hi))
        return [ranges]
    visible = _visible_keys(attention_mask, q_len, kv_len)
    if visible.shape[0] == 1 or bool((visible == visible[:1]).all()):
        return [_causal_ranges(visible[0], window, padded=False)]
    return [_causal_ranges(rows, window, padded=True) for rows in visible]


def _packed_bounds(packed, batch: int, q_len: int, kv_len: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The key ranges of a packed call of several sequences ([`modeling_pacer.custom_generate.rows`]): `(lo, hi)`, (M,)
    int64 each, token t seeing keys lo_t..hi_t - 1, narrowed to the last `window` of them in a sliding layer."""
    lo, hi = packed
    if batch != 1 or lo.shape != (q_len,) or hi.shape != (q_len,) or int(hi.max()) > kv_len or bool((lo >= hi).any()):
        raise ValueError(f"pacer_exact attention: a packed call's key ranges must give each of its {q_len} tokens "
                         f"keys within the {kv_len} it is handed.")
    return (torch.maximum(lo, hi - window) if window else lo), hi


def exact_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """`query` (batch, heads, q_len, head_dim), `key`/`value` (batch, kv_heads, kv_len, head_dim) ->
    `(attn_output (batch, q_len, heads, head_dim), None)`, as transformers' attention functions."""
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        raise ValueError("pacer_exact attention is for causal decoders only.")
    for name in ("s_aux", "sinks", "position_bias"):
        if kwargs.get(name) is not None:
            raise ValueError(f"pacer_exact attention does not support `{name}`.")
    batch, heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"pacer_exact attention: {heads} query heads for {kv_heads} key/value heads.")
    groups = heads // kv_heads
    if scaling is None:
        scaling = head_dim**-0.5
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    softcap = kwargs.get("softcap")
    dtype = query.dtype
    packed = kwargs.get("pacer_key_ranges")  # several sequences packed into one call: each token's keys, given
    if packed is not None:
        lo, hi = _packed_bounds(packed, batch, q_len, kv_len, window)
        if _kernel_applies(query, key, value, softcap, dropout):
            return kernels.exact_attention(query, key, value, lo[None], hi[None], scaling).to(dtype), None
        ranges = [list(zip(lo.tolist(), hi.tolist()))]
    else:
        ranges = _row_ranges(attention_mask, q_len, kv_len, window)
    if packed is None and _kernel_applies(query, key, value, softcap, dropout):
        spans = [[span or (0, 0) for span in sequence] for sequence in ranges]
        bounds = torch.tensor(spans * batch if len(spans) == 1 else spans, dtype=torch.int64)  # (batch, q_len, 2)
        return kernels.exact_attention(query, key, value, bounds[..., 0], bounds[..., 1], scaling).to(dtype), None
    # (batch, kv_heads, groups, q_len, head_dim): the query heads that share a key/value head, side by side
    q = query.reshape(batch, kv_heads, groups, q_len, head_dim)
    if len(ranges) == 1:  # one pattern for the whole batch (batch size 1, or equal sequences)
        rows = [_attend(q[:, :, :, i, :], key[:, :, lo:hi, :], value[:, :, lo:hi, :], scaling, softcap, dropout).to(dtype)
                for i, (lo, hi) in enumerate(ranges[0])]
        return torch.stack(rows, dim=1), None  # (batch, q_len, heads, head_dim)
    # left-padded batch: each sequence's rows alone, by the same ops on the same shapes as at batch size 1
    out = query.new_zeros(batch, q_len, heads, head_dim)
    for b, sequence in enumerate(ranges):
        for i, span in enumerate(sequence):
            if span is not None:
                lo, hi = span
                out[b, i] = _attend(q[b : b + 1, :, :, i, :], key[b : b + 1, :, lo:hi, :], value[b : b + 1, :, lo:hi, :],
                                    scaling, softcap, dropout)[0].to(dtype)
    return out, None


def _kernel_applies(query, key, value, softcap, dropout) -> bool:
    """pacer's C++ kernel ([`modeling_pacer.cpu.kernels.exact_attention`]: one call per layer, each row computed alone
    by fixed SIMD code) where it is built for this CPU, for bf16 without softcap or dropout; elsewhere the torch
    ops below, one small matmul pair per row. Which one runs is fixed for a process, so a model's steps and
    blocks always go through the same one."""
    if softcap is not None or dropout > 0.0 or not all(t.dtype == query.dtype for t in (key, value)):
        return False
    return _kernel_takes(query.shape[-1], query.dtype, query.device)


def _kernel_takes(head_dim: int, dtype: torch.dtype, device: torch.device) -> bool:
    """The C++ kernel computes attention of this head size, dtype and device (bf16 on a CPU it is built for)."""
    return device.type == "cpu" and dtype == torch.bfloat16 and head_dim % 16 == 0 and head_dim <= 256 and \
        kernels.available()


def _attend(q_i, k_i, v_i, scaling, softcap, dropout) -> torch.Tensor:
    """One query row: `q_i` (batch, kv_heads, groups, head_dim), `k_i`/`v_i` (batch, kv_heads, n, head_dim) ->
    (batch, heads, head_dim) float32."""
    batch, kv_heads, groups, head_dim = q_i.shape
    # float32 copies, contiguous: the same values in the same layout whatever the call's q_len / kv_len
    q_i, k_i, v_i = (t.to(torch.float32).contiguous() for t in (q_i, k_i, v_i))
    scores = torch.matmul(q_i, k_i.transpose(-1, -2)) * scaling  # (batch, kv_heads, groups, n)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    probs = torch.softmax(scores, dim=-1)
    if dropout > 0.0:
        probs = torch.nn.functional.dropout(probs, p=dropout, training=True)
    out = torch.matmul(probs, v_i)  # (batch, kv_heads, groups, head_dim)
    return out.reshape(batch, kv_heads * groups, head_dim)


def kernel_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """`attn_implementation="pacer_kernel"`: [`exact_attention_forward`] where the mask is a causal pattern, transformers'
    `sdpa` where it is not, e.g. where transformers' assisted generation masks a drafted token that equals the
    draft's padding id (its generate infers a mask from the padding id when given none). For a model whose attention
    is there for speed alone (a draft: its numerics choose proposals, never the output), which must run wherever
    transformers runs it."""
    try:
        if kwargs.get("pacer_key_ranges") is None:
            _row_ranges(attention_mask, query.shape[2], key.shape[2],
                        kwargs.get("sliding_window", getattr(module, "sliding_window", None)))
    except ValueError:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    return exact_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def kernel_attention(model: torch.nn.Module) -> bool:
    """`attn_implementation="pacer_kernel"` on a model whose attention pacer's C++ kernel computes (bf16 weights on
    CPU, a head size it takes, the kernels built for this CPU), for speed alone: for one query row (a draft's
    decoding step) the kernel is one call per layer against `sdpa`'s flash path, which costs about 150 us per
    layer there; a mask the kernel does not take goes to `sdpa` ([`kernel_attention_forward`]). Linear layers
    are left as they are. Used on the draft, whose numerics change which tokens it proposes, never the output.
    Returns whether it was set."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if not all(p.device.type == "cpu" for p in model.parameters()) or not _kernel_takes(head_dim, model.dtype, model.device):
        return False
    model.set_attn_implementation(KERNEL_NAME)
    return True


@contextlib.contextmanager
def any_mask_attention(model: torch.nn.Module):
    """Within the block, a model on `pacer_exact` attention runs transformers' `sdpa` instead, which takes any 4-D
    mask (a tree of drafts: [`modeling_pacer.replay`]'s continuations); pacer's attention takes causal masks only.
    For a draft ([`kernel_attention`]: speed alone), never for an exact target, whose verification it would make
    inexact. Other models are left as they are."""
    previous = model.config.get_text_config()._attn_implementation
    if previous not in (NAME, KERNEL_NAME):
        yield model
        return
    model.set_attn_implementation("sdpa")
    try:
        yield model
    finally:
        model.set_attn_implementation(previous)


def register() -> None:
    """Register `pacer_exact` and `pacer_kernel` with transformers (done on `import modeling_pacer`; idempotent)."""
    AttentionInterface.register(NAME, exact_attention_forward)
    AttentionMaskInterface.register(NAME, exact_attention_mask)
    AttentionInterface.register(KERNEL_NAME, kernel_attention_forward)
    AttentionMaskInterface.register(KERNEL_NAME, exact_attention_mask)


register()
