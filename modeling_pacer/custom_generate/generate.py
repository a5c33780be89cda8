"""Speculative decoding with an adaptive draft length, as a `generate` strategy for transformers.

One loop serves every stopping policy (`policies.py` beside this file) and every batch (a single sequence is a
batch of one row, [`Row`]): per decode step, for each row still going, it

1. **proposes**: the draft extends the sequence token by token until the row's policy says stop (the rows still
   drafting share each draft forward);
2. **verifies**: the target scores `[last token, d_1..d_k]` in one forward (every row's in the same one, packed:
   `rows.py`), giving k + 1 next-token distributions;
3. **accepts**: greedy keeps the longest prefix on which the target's argmax agrees and adds the
   target's own token; sampling uses rejection sampling (accept d_i with min(1, p/q), else resample
   from norm(max(0, p - q)), or a bonus token from p_{k+1}), so the output distribution is exactly
   the target's;
4. **updates**: the new tokens are emitted one by one through the stopping criteria (EOS, max
   length, stop strings, ...) and the streamer, and both KV caches are cropped to the accepted prefix.

This folder is published as is as a `custom_generate` repo: its files (this one, `policies.py`, `steps.py`, `rows.py`,
`costs.py`, `lookup.py`, `processing.py`) import only torch, transformers and each other. `generate()` below is the entry point transformers calls for such a repo, and what
`modeling_pacer.enable_pacer(model)` binds as `model.generate`.
"""

import contextlib
import copy
import dataclasses
import functools
import inspect
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from transformers import DynamicCache, GenerationMixin, StoppingCriteriaList, StopStringCriteria
from transformers.cache_utils import BaseQuantizedLayer, DynamicLayer, LinearAttentionCacheLayerMixin
from transformers.generation.utils import GenerateDecoderOnlyOutput

from .costs import BatchCosts, curve_disagrees, fixed_prefix, measure_costs
from .lookup import NgramLookup
from .policies import DraftView, ExpectedThroughput, StoppingPolicy, head_policy, make_policy
from .processing import process, process_rows, row_processors
from .rows import RowCache, check_packable
from .steps import (  # noqa: F401 - the loop's step functions
    CACHE_NAMES, cache_kwargs, cache_length, crop_cache, crop_row, is_static_full_attention, model_forward, new_cache,
    row_length, rows_forward, static_cache_supported, wants_static_cache,
)


# --------------------------------------------------------------------------------------------------
# statistics, returned to the caller (never printed)
# --------------------------------------------------------------------------------------------------
@dataclass
class DecodeStep:
    """One draft-verify round of one row (one sequence of the call).

    Attributes:
        drafted: draft tokens sent to the target (0 = a plain target step).
        accepted: how many of them the target accepted.
        emitted: tokens appended to the output: `accepted + 1` (the target's correction or bonus
            token), fewer only on the last step when a stopping criterion cut the round short.
        stop_reason: why drafting stopped: the policy's reason (`"head"`, `"confidence"`, ...),
            `"max_draft_length"`, `"budget"` (max_length reached), `"eos"` (the draft proposed EOS), or
            `"prefill"` (the first step: the target reads the prompt and gives the first token, as plain decoding does).
        free: how many of the drafted tokens were looked up in the sequence (`pacer_lookup`), not drafted.
        row: which sequence of the batch (0 for a call of one).
    """

    drafted: int
    accepted: int
    emitted: int
    stop_reason: str
    free: int = 0
    row: int = 0


@dataclass
class PacerStats:
    """Counts and timings of one `generate` call. Times are wall-clock seconds.

    For a batch, `steps` holds every row's steps (each `DecodeStep.row` says whose) and the forward counts and times
    are the batch's own calls, each of which served every row it carried; `rows()` splits the steps by row."""

    policy: str = ""
    # how the target's verification is made bitwise that of single steps (`make_exact`: "rows-alone" on a CPU,
    # the way measured on a GPU), None where it was not: greedy output may then differ at near-ties
    target_exact: str | None = None
    steps: list[DecodeStep] = field(default_factory=list)
    draft_forwards: int = 0
    head_forwards: int = 0
    target_forwards: int = 0
    draft_time: float = 0.0
    head_time: float = 0.0
    target_time: float = 0.0
    prefill_time: float = 0.0  # the part of target_time the prefill took (the whole prompt, the first token)
    total_time: float = 0.0
    batch_size: int = 1  # the sequences decoded together

    def rows(self) -> list["PacerStats"]:
        """One `PacerStats` per row of the batch, with that row's steps alone (the counts and times stay the batch's:
        its calls were shared)."""
        return [dataclasses.replace(self, steps=[s for s in self.steps if s.row == row], batch_size=1)
                for row in range(self.batch_size)]

    @property
    def generated_tokens(self) -> int:
        return sum(s.emitted for s in self.steps)

    @property
    def mean_accepted(self) -> float:
        """tau: tokens gained per verified step of a row (accepted drafts + the target's own token)."""
        return self.generated_tokens / max(1, len(self.steps))

    @property
    def acceptance_rate(self) -> float:
        drafted = sum(s.drafted for s in self.steps)
        return sum(s.accepted for s in self.steps) / drafted if drafted else 0.0

    def draft_length_histogram(self) -> dict[int, int]:
        hist: dict[int, int] = {}
        for s in self.steps:
            hist[s.drafted] = hist.get(s.drafted, 0) + 1
        return dict(sorted(hist.items()))

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(
            generated_tokens=self.generated_tokens,
            mean_accepted=self.mean_accepted,
            acceptance_rate=self.acceptance_rate,
            draft_length_histogram=self.draft_length_histogram(),
        )
        return out


@dataclass
class PacerGenerateOutput(GenerateDecoderOnlyOutput):
    """`GenerateDecoderOnlyOutput` plus `pacer_stats` (a [`PacerStats`]) and `pacer_policy`: the stopping policy
    that decoded, in its adapted state at the end (a copy of the instance passed as `stopping_policy`, if one was);
    each row of a batch decodes with its own copy: `pacer_policies`, one a row (`pacer_policy` is the first row's)."""

    pacer_stats: PacerStats | None = None
    pacer_policy: StoppingPolicy | None = None
    pacer_policies: list | None = None


class _Timer:
    """Adds the elapsed time of a block to `stats.<name>_time`, waiting for `device` before each clock reading
    (a GPU runs what it is handed asynchronously: without the wait the time is the launches')."""

    def __init__(self, stats: PacerStats, name: str, device: torch.device):
        self.stats, self.name = stats, name
        self.device = device if device.type not in ("cpu", "meta") else None

    def __enter__(self):
        if self.device is not None:
            torch.accelerator.synchronize(self.device)
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        if self.device is not None:
            torch.accelerator.synchronize(self.device)
        attr = f"{self.name}_time"
        setattr(self.stats, attr, getattr(self.stats, attr) + time.perf_counter() - self.start)


# the field of generate's output that returns the cache
_OUTPUT_CACHE_FIELD = next(
    f.name for f in dataclasses.fields(GenerateDecoderOnlyOutput) if f.name in ("cache", "past_key_values")
)


def entropy(probs: torch.Tensor) -> torch.Tensor:
    """Entropy in nats over the last dimension of a probability tensor (`(..., vocab) -> (...)`)."""
    return -(probs * torch.log(probs.clamp_min(1e-30))).sum(-1)


def sample(probs: torch.Tensor) -> torch.LongTensor:
    """`(1, vocab)` probabilities (any positive total) -> `(1, 1)` a token drawn from them.

    The inverse of their cumulative sum at one uniform number: token i is drawn when u falls in
    [cdf[i-1], cdf[i]), an interval as long as its probability (empty for a probability of 0). The sums are
    float64, so each token's share is its float32 probability to about 1e-11 of the total. The distribution
    is torch.multinomial's; its one-sample path draws an exponential number per vocabulary entry instead of
    one number in all.
    """
    cdf = probs.double().cumsum(-1)
    total = cdf[..., -1:]
    while True:
        u = torch.rand(total.shape, dtype=cdf.dtype, device=cdf.device) * total
        token = torch.searchsorted(cdf, u, right=True)
        if int(token) < cdf.shape[-1]:
            return token
        # u rounded up to the total (about 1 in 2**53): draw again; a total of zero (or NaN) has nothing to draw
        if not float(total) > 0:
            raise ValueError(f"sample: the probabilities sum to {float(total)}, not a positive number")


def _pick(scores: torch.Tensor, do_sample: bool, probs: torch.Tensor | None = None) -> torch.LongTensor:
    """`(1, vocab)` processed scores -> `(1, 1)` next token; `probs`: their softmax, where the caller has it."""
    if do_sample:
        return sample(scores.softmax(-1) if probs is None else probs)
    return scores.argmax(-1, keepdim=True)


@dataclass
class Proposal:
    """The proposal of one step for one row: `tokens` `(1, k)`, processed draft `scores` `(1, k, vocab)`, what
    the policy saw of it (`None` when nothing was drafted), and the draft's last hidden states
    `(1, k, hidden)` that produced the tokens when they were kept."""

    tokens: torch.LongTensor
    scores: torch.Tensor
    stop_reason: str
    view: DraftView | None = None
    hidden: torch.Tensor | None = None
    free: int = 0  # the first `free` tokens were looked up ([`NgramLookup`]), after a match of `match` tokens
    match: int = 0


@dataclass
class Row:
    """One sequence of the call as the loop decodes it: a call of one sequence is a batch of one row.

    `ids` `(1, L)` its tokens so far, without the left padding it came with (`padding` tokens); `max_length` its own
    (the call's less its padding: every row gets the new tokens a left-padded batch gives it in transformers); its own
    copies of the stopping rule, the free-draft lookup, the logits processors and the stopping criteria (those that
    count the sequence's length shifted by its padding, so that each row is processed as if alone); `draft_offset`
    the prompt tokens its draft never reads (`pacer_draft_window`); `finished` once a criterion ended it."""

    index: int
    ids: torch.LongTensor
    padding: int
    max_length: int
    policy: StoppingPolicy
    processors: object
    criteria: object
    lookup: NgramLookup | None = None
    draft_offset: int = 0
    finished: bool = False
    scores: list = field(default_factory=list)
    logits: list = field(default_factory=list)

    @property
    def budget(self) -> int:
        """The most tokens this row may draft now: one verification yields one more token than was drafted, so
        never past max_length - 1."""
        return self.max_length - self.ids.shape[1] - 1


def _stopped(row: "Row") -> None:
    """Tell a batch's cost view (a cost-aware rule's `RowCosts`) that this row drafts no more this step."""
    stopped = getattr(getattr(row.policy, "costs", None), "stopped", None)
    if stopped is not None:
        stopped()


class _Draft:
    """One row's draft while it is drafted ([`propose`]): the tokens so far, what its rule saw, why it stopped.

    Opens with the tokens its lookup offers (each a point-mass proposal, no forward) while the rule goes on, then
    takes one token per draft forward ([`take`]) until the rule, an end-of-sequence token, the rule's length cap or
    the row's budget stops it."""

    def __init__(self, row: Row, draft_cache, head, stats: PacerStats, vocab, eos_token_ids: set[int], do_sample: bool):
        self.row, self.head, self.stats, self.vocab, self.eos, self.do_sample = row, head, stats, vocab, eos_token_ids, do_sample
        policy, budget, device = row.policy, row.budget, row.ids.device
        self.device = device
        step_cap = policy.begin_step()
        self.cap = min(step_cap, budget)
        self.cap_reason = "budget" if budget < step_cap else "max_draft_length"
        self.reason = None if self.cap > 0 else self.cap_reason
        if self.reason is not None:
            _stopped(row)
        self.tokens: list[torch.Tensor] = []
        self.scores: list[torch.Tensor] = []
        self.probs: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []
        self.states: list[torch.Tensor] = []
        self.head_cache: dict[int, torch.Tensor] = {}
        self.looked_up, self.match, self.free = [], 0, 0
        if self.reason is None and row.lookup is not None:
            continuation, match = row.lookup.continuation(row.ids[0].tolist())
            if continuation and row.lookup.worth_trying(match):
                self.looked_up, self.match = continuation, match
        self.seq = row.ids
        # the draft cache may lag behind the sequence (after a fully accepted step it misses the last draft token;
        # after looked-up tokens, those): each forward feeds everything it has not seen yet. It holds the sequence
        # from `draft_offset` on (a draft window: the draft never read the prompt's first tokens)
        self.fed = row.draft_offset + row_length(draft_cache, row.index)
        self.view = None

    @property
    def done(self) -> bool:
        return self.reason is not None

    def _acceptance(self) -> torch.Tensor:
        k = len(self.tokens)
        if k not in self.head_cache:
            head = self.head
            with _Timer(self.stats, "head", head.device):
                hidden = torch.cat(self.states, dim=1).to(head.device)
                features = None
                if getattr(head.config, "use_draft_features", False):
                    features = torch.stack([torch.stack(self.probs), torch.stack(self.entropies)], -1)[None]
                    features = features.float().to(head.device)
                self.head_cache[k] = head.acceptance_probabilities(hidden, draft_features=features)[0].to(self.device)
            self.stats.head_forwards += 1
        return self.head_cache[k]

    def _judge(self, token: torch.Tensor, view: DraftView) -> None:
        """After each drafted token: the end-of-sequence token, the rule, the length cap, in that order."""
        self.seq = torch.cat([self.seq, token], dim=1)
        self.view = view
        if int(token) in self.eos:
            self.reason = "eos"
        elif (reason := self.row.policy.stop_reason(view)) is not None:
            self.reason = reason
        elif len(self.tokens) >= self.cap:
            self.reason = self.cap_reason
        if self.reason is not None:
            _stopped(self.row)

    def take_free(self) -> None:
        """The looked-up tokens the draft opens with, while the rule goes on (they cost no forward)."""
        while not self.done and self.free < len(self.looked_up) and self.free == len(self.tokens):
            token = torch.tensor([[self.looked_up[self.free]]], device=self.device)
            score = torch.full((1, self.vocab[1]), float("-inf"), device=self.device)
            score[0, self.looked_up[self.free]] = 0.0
            self.tokens.append(token)
            self.scores.append(score)
            self.probs.append(torch.tensor(self.row.lookup.estimate(self.match), device=self.device))
            self.entropies.append(torch.tensor(0.0, device=self.device))
            self.free += 1
            view = DraftView(torch.stack(self.probs), torch.stack(self.entropies), None, self.free,
                             len(self.looked_up) - self.free)
            self._judge(token, view)

    def feed(self) -> torch.LongTensor:
        """What the next draft forward feeds of this row: every token its cache has not seen."""
        feed = self.seq[:, self.fed:]
        self.fed = self.seq.shape[1]
        if self.vocab[1] != self.vocab[0]:
            # a target's padding id (never a tokenizer's token) is fed to a draft whose table stops short as its last
            # id: only the draft's context changes, never the output
            feed = feed.clamp_max(self.vocab[0] - 1)
        return feed

    def take(self, logits: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The draft forward's row `(1, 1, vocab)` for this row: its next token, drawn or picked after processing."""
        logits = logits[:, 0, :].to(self.device)
        padding = self.vocab[1] - self.vocab[0]
        if padding:  # the target's padding ids: probability 0 in the draft's row
            logits = torch.nn.functional.pad(logits, (0, padding), value=float("-inf"))
        score = process(self.row.processors, self.seq, logits)
        dist = score.softmax(-1)
        token = _pick(score, self.do_sample, dist)
        self.tokens.append(token)
        self.scores.append(score)
        self.probs.append(dist[0, token[0, 0]])
        self.entropies.append(entropy(dist[0]))
        if hidden is not None:
            self.states.append(hidden)
        acceptance = self._acceptance if self.row.policy.needs_head else None
        self._judge(token, DraftView(torch.stack(self.probs), torch.stack(self.entropies), acceptance, self.free))

    def proposal(self) -> Proposal:
        if not self.tokens:
            return Proposal(self.row.ids[:, :0], torch.empty(1, 0, 0, device=self.device), self.reason)
        hidden_states = torch.cat(self.states, dim=1) if self.states else None
        dtype = functools.reduce(torch.promote_types, [s.dtype for s in self.scores])  # float32 rows of looked-up tokens
        scores = torch.stack([s[0].to(dtype) for s in self.scores], dim=0)[None]
        return Proposal(torch.cat(self.tokens, dim=1), scores, self.reason, self.view, hidden_states, self.free,
                        self.match)


def propose(draft_model, draft_cache, head, rows: list[Row], do_sample: bool, eos_token_ids: set[int],
            stats: PacerStats, keep_hidden: bool = False, vocab: tuple[int, int] | None = None) -> list[Proposal]:
    """Draft each of `rows` up to its budget, asking its rule after each token: every row its own length, the rows
    still drafting in one draft forward a token (the ones that stopped, or take a looked-up token, take no room in
    it). `vocab`: the draft's and the target's vocabulary sizes (the draft's a prefix of the target's padded one
    where they differ). A row's lookup opens its draft with the tokens that followed the sequence's last few tokens
    where they occurred before, while such tokens are being measured or have been accepted at least as often as the
    draft model's; each costs no forward, and the draft model takes over where they end."""
    vocab = vocab or (_vocab_size(draft_model),) * 2
    drafts = [_Draft(row, draft_cache, head, stats, vocab, eos_token_ids, do_sample) for row in rows]
    hidden = keep_hidden or any(row.policy.needs_head for row in rows)
    while True:
        for draft in drafts:
            draft.take_free()
        drafting = [draft for draft in drafts if not draft.done]
        if not drafting:
            return [draft.proposal() for draft in drafts]
        feeds = [(draft.row.index, draft.feed()) for draft in drafting]
        with _Timer(stats, "draft", draft_model.device):
            outs = rows_forward(draft_model, draft_cache, feeds, [1] * len(feeds), hidden=hidden)
        stats.draft_forwards += 1
        for draft, (logits, states) in zip(drafting, outs):
            draft.take(logits, states)


def verify(model, target_cache, rows: list[Row], proposals: list[Proposal], stats: PacerStats) -> list[tuple]:
    """One target forward over each row's `[ids not yet in the cache] + draft tokens` (every row in the same call).

    Returns per row `(raw logits, processed scores)`, both `(1, k + 1, vocab)`: row i is the target's
    next-token distribution after `ids + d_1..d_i`.
    """
    feeds = [(row.index, torch.cat([row.ids[:, row_length(target_cache, row.index):], p.tokens], dim=1))
             for row, p in zip(rows, proposals)]
    with _Timer(stats, "target", model.device):
        outs = rows_forward(model, target_cache, feeds, [p.tokens.shape[1] + 1 for p in proposals])
    stats.target_forwards += 1
    verified = []
    for row, proposal, (logits, _) in zip(rows, proposals, outs):
        logits = logits.to(row.ids.device)
        prefix = torch.cat([row.ids, proposal.tokens], dim=1)
        verified.append((logits, process_rows(row.processors, prefix, logits)))
    return verified


def speculative_sample(tokens: torch.LongTensor, draft_scores: torch.Tensor, target_scores: torch.Tensor):
    """Algorithm 1 of Leviathan et al. (2023), as transformers' `_speculative_sampling` computes it, its one draw made
    by [`sample`]: the output's distribution is exactly the target's.

    `tokens` `(1, k)` drawn from q = softmax(`draft_scores`) `(1, k, vocab)`; p = softmax(`target_scores`)
    `(1, k + 1, vocab)`. Draft token i is kept with probability min(1, p_i / q_i) (a uniform r < p_i / q_i), up to
    the first rejection n; the next token is drawn from the residual max(p_n - q_n, 0) (normalized), or from
    p_k when every draft token was kept. Returns `(new_tokens (1, n + 1), n)`.
    """
    k = tokens.shape[1]
    q = draft_scores.softmax(-1)[0]
    p = target_scores.softmax(-1)[0]
    rows = torch.arange(k, device=tokens.device)
    ratio = p[rows, tokens[0]] / q[rows, tokens[0]]
    # r in [0, 1): `<` keeps a token with probability exactly min(1, ratio), never one the target gives 0
    kept = torch.rand_like(ratio) < ratio
    n = int((~kept).cumsum(-1).lt(1).sum())
    following = p[n]
    if n < k:
        residual = (p[n] - q[n]).clamp_min(0)
        # a rejection means p_n(x) < q_n(x) for the drafted x, so some other token has p > q and the residual has mass;
        # only rounding could leave none, and then p_n itself is the distribution left
        if float(residual.sum()) > 0:
            following = residual
    return torch.cat([tokens[:, :n], sample(following[None])], dim=1), n


def accept(ids: torch.LongTensor, proposal: Proposal, target_scores: torch.Tensor, do_sample: bool):
    """Which draft tokens survive, plus one token from the target.

    Returns `(new_tokens (1, num_accepted + 1), num_accepted)`.
    """
    k = proposal.tokens.shape[1]
    if k == 0:
        return _pick(target_scores[:, 0, :], do_sample), 0
    if do_sample:
        return speculative_sample(proposal.tokens, proposal.scores, target_scores)
    target_tokens = target_scores.argmax(-1)  # (1, k + 1)
    num_accepted = int((proposal.tokens == target_tokens[:, :k]).int().cumprod(dim=1).sum())
    return torch.cat([proposal.tokens[:, :num_accepted], target_tokens[:, num_accepted : num_accepted + 1]], dim=1), num_accepted


# --------------------------------------------------------------------------------------------------
# the loop
# --------------------------------------------------------------------------------------------------
# what `generate` itself puts in `model_kwargs` for a decoder-only model; anything else came from the user
_ALLOWED_MODEL_KWARGS = {"attention_mask", "position_ids", "use_cache", "logits_to_keep", "cache_position", *CACHE_NAMES}


def _given_cache(model_kwargs: dict):
    """The cache `generate` prepared or the user passed, under whichever name the installed transformers uses."""
    return next((model_kwargs[name] for name in CACHE_NAMES if model_kwargs.get(name) is not None), None)


# `cache_implementation`s that give a rollback-able DynamicCache ("hybrid": transformers reads it as unset)
_DYNAMIC_CACHE_IMPLEMENTATIONS = (None, "dynamic", "hybrid")
# ... and the static one: PACER then builds and sizes both static caches itself (`new_cache`)
_STATIC = "static"
_USE_INSTEAD = (
    "Leave `cache_implementation` unset (or pass cache_implementation='dynamic' or 'static'), and pass no cache or an "
    "empty DynamicCache"
)
_OFFLOADING = (
    "its roll-back of the cache after every rejected draft is not verified with transformers' CUDA-stream "
    "offloading, which on a CPU fails outright"
)


def _check_cache_implementation(implementation, source: str) -> None:
    """Refuse a `cache_implementation` other than the dynamic or the static one before transformers builds the cache
    (a quantized one would otherwise fail on a missing backend package before PACER sees it)."""
    if implementation in _DYNAMIC_CACHE_IMPLEMENTATIONS or implementation == _STATIC:
        return
    if "offloaded" in str(implementation):
        why = f"PACER decoding does not support an offloaded cache: {_OFFLOADING}"
    else:
        why = ("PACER decoding rolls the KV caches back after every rejected draft, which needs a DynamicCache or a "
               "static cache of full-attention layers, not a quantized or sliding-window static one")
    raise ValueError(f"cache_implementation={implementation!r} ({source}) is not supported: {why}. {_USE_INSTEAD}.")


def _static_mode(model, draft_model, generation_config) -> bool:
    """Whether PACER decodes over static caches: asked for (`cache_implementation="static"`), or a model's steps are
    captured ([`modeling_pacer.capture`]), which run over a static cache only."""
    return (generation_config.cache_implementation == _STATIC or wants_static_cache(model)
            or wants_static_cache(draft_model))


def _check_static(model) -> None:
    """A static cache of `model` PACER can roll back: full-attention layers only (a sliding-window static layer keeps
    a ring whose overwritten keys a rejected draft would need back)."""
    if not model._supports_default_dynamic_cache():
        raise ValueError(f"PACER decoding over a static cache needs a model of attention layers; {type(model).__name__} "
                         "keeps its own recurrent state, which cannot be rolled back after a rejected draft.")
    if not static_cache_supported(model):
        raise ValueError(f"PACER decoding over a static cache supports full-attention layers only; {type(model).__name__}"
                         " has sliding-window or other layers. Use the dynamic cache (leave cache_implementation unset).")


def _check_cache(model, cache) -> None:
    """PACER rolls both caches back after every rejected draft: only a `DynamicCache` of attention
    layers (full or sliding-window) can be rolled back exactly. Checked before any forward."""
    if not model._supports_default_dynamic_cache():
        raise ValueError(
            f"PACER decoding needs a model that uses transformers' DynamicCache; {type(model).__name__} keeps its "
            "own recurrent state, which cannot be rolled back after a rejected draft."
        )
    if cache is None:
        return
    rollback = isinstance(cache, DynamicCache) and all(
        isinstance(layer, DynamicLayer) and not isinstance(layer, (BaseQuantizedLayer, LinearAttentionCacheLayerMixin))
        for layer in cache.layers
    )
    if not rollback:
        kinds = sorted({type(layer).__name__ for layer in getattr(cache, "layers", [])})
        raise ValueError(
            f"PACER decoding needs a DynamicCache it can roll back after a rejected draft; got a {type(cache).__name__}"
            f"{' with ' + ', '.join(kinds) if kinds else ''}. "
            f"{_USE_INSTEAD} (a static cache is asked for with cache_implementation='static': PACER sizes it itself; "
            "no quantized or linear-attention cache)."
        )
    if getattr(cache, "offloading", False):
        raise ValueError(
            "PACER decoding does not support an offloaded cache (cache_implementation='offloaded', or "
            f"DynamicCache(offloading=True)): {_OFFLOADING}. {_USE_INSTEAD}."
        )
    if cache.get_seq_length() > 0:
        raise ValueError(
            f"PACER decoding needs an empty cache; the one passed already holds {cache.get_seq_length()} tokens. "
            "Pass the whole prompt as input_ids and no cache (PACER does not continue from a prefilled cache)."
        )


def _special_ids(model) -> dict:
    """The special token ids a model's configs name (None where unset): two models of one tokenizer name the same."""
    configs = (getattr(model, "generation_config", None), model.config.get_text_config())
    ids = {}
    for name in ("eos_token_id", "bos_token_id", "pad_token_id"):
        values = [getattr(c, name, None) for c in configs if c is not None]
        ids[name] = next((v for v in values if v is not None), None)
    return ids


# the most a draft's table may stop short of the target's, as a share of the target's: padding to a round size
# (Qwen2.5-7B pads 151665 tokens to 152064 rows, 0.5B to 151936: 128 rows apart, 0.08%)
PADDING_SHARE = 1 / 32


def _check_vocabularies(model, draft_model, input_ids) -> None:
    """The draft must embed and score the ids of the target's tokenizer. Equal vocabularies pass; a draft whose
    embedding table is shorter passes too where it is a prefix of the target's padded one: short by padding alone
    (at most `PADDING_SHARE` of the target's rows), the models' special token ids the same where both name them,
    and the prompt inside the draft's table. The draft then never proposes the target's padding ids (they score
    -inf in its row)."""
    target_vocab, draft_vocab = _vocab_size(model), _vocab_size(draft_model)
    if target_vocab == draft_vocab:
        return
    theirs, ours = _special_ids(model), _special_ids(draft_model)
    clash = [f"{name} {theirs[name]} vs {ours[name]}" for name in theirs
             if theirs[name] is not None and ours[name] is not None and theirs[name] != ours[name]]
    padding = draft_vocab < target_vocab and target_vocab - draft_vocab <= target_vocab * PADDING_SHARE
    why = (f" (special tokens differ: {', '.join(clash)})" if clash else
           "" if not padding or int(input_ids.max()) < draft_vocab else
           f" (the prompt holds id {int(input_ids.max())}, beyond the draft's table)")
    if not padding or why:
        raise ValueError(
            f"The draft's vocabulary ({draft_vocab} tokens) differs from the target's ({target_vocab}){why}: PACER "
            "needs a draft that shares the target's tokenizer (its table may stop short of the target's by padding)."
        )


def _vocab_size(model) -> int:
    """Rows of the LM head (what the logits really have; quantized heads keep `out_features` too)."""
    head = model.get_output_embeddings()
    if head is not None and hasattr(head, "out_features"):
        return int(head.out_features)
    return int(model.config.get_text_config().vocab_size)


# how a user gets each draft setting a head can be trained on, for the error that names it
_DRAFT_FLAGS = {
    "int4": "`--quantize-draft int4`, `load_pair(quantize_draft='int4')`",
    "dynamic-int8": "`--quantize-draft int8`, `load_pair(quantize_draft='int8')`",
    "none": "`--quantize-draft none`, `load_pair(quantize_draft=False)`",
}


def draft_setting(draft_model) -> str:
    """`"int4"` (pacer's int4 weight layers), `"dynamic-int8"` (torch's dynamic int8 Linear) or `"none"`: the draft
    setting a head's `draft_quantization` names. Read from the layers' classes by name, since this file also runs
    as Hub remote code without pacer installed."""
    classes = {type(m) for m in draft_model.modules()}
    if any(cls.__name__ == "Int4Linear" for cls in classes):
        return "int4"
    if any(cls.__module__.startswith("torch.ao.nn.quantized.dynamic") for cls in classes):
        return "dynamic-int8"
    return "none"


def _sequences(input_ids: torch.LongTensor, mask) -> list[tuple[torch.LongTensor, int]]:
    """Each row of `input_ids` `(B, L)` without its left padding, and how much it had: `(ids (1, L_i), L - L_i)`.
    `mask` (the attention mask, or None: no padding) must be a left-padded batch's, each row zeros then ones."""
    if mask is None:
        return [(input_ids[b : b + 1], 0) for b in range(input_ids.shape[0])]
    if tuple(mask.shape) != tuple(input_ids.shape):
        raise ValueError(f"attention_mask {tuple(mask.shape)} does not match input_ids {tuple(input_ids.shape)}.")
    mask = mask.to("cpu")
    if not bool(((mask == 0) | (mask == 1)).all()):
        raise ValueError("PACER decoding reads attention_mask as padding (0) and tokens (1); it holds other values.")
    lengths = mask.sum(-1)
    # a left-padded row's mask is zeros, then ones to the end: its ones are the last `length` positions
    left = torch.arange(mask.shape[1]).expand_as(mask) >= (mask.shape[1] - lengths)[:, None]
    bad = [b for b in range(mask.shape[0]) if not torch.equal(mask[b].bool(), left[b]) or int(lengths[b]) == 0]
    if bad:
        b = bad[0]
        what = ("has no token" if int(lengths[b]) == 0 else
                "is padded on the right" if bool(mask[b, 0]) else "has a hole (padding between tokens)")
        raise ValueError(f"PACER decoding takes left-padded batches (a tokenizer with padding_side='left'): row {b} of "
                         f"attention_mask {what}.")
    return [(input_ids[b : b + 1, mask.shape[1] - int(lengths[b]):], mask.shape[1] - int(lengths[b]))
            for b in range(mask.shape[0])]


def _pad_id(generation_config) -> int | None:
    """The id transformers pads a batch's ended rows with (`pad_token_id`, which `generate` sets to the first
    end-of-sequence id where it is unset)."""
    pad = getattr(generation_config, "_pad_token_tensor", None)
    if pad is None:
        pad = generation_config.pad_token_id
    return None if pad is None else int(torch.as_tensor(pad).flatten()[0])


def _check_batch(model, draft_model, generation_config, batch: int, streamer, step_callback) -> None:
    """What a call of several sequences cannot do, refused before any work."""
    if batch == 1:
        return
    if streamer is not None and not callable(getattr(streamer, "put_row", None)):
        raise ValueError(f"A streamer takes one sequence (transformers' streamers print one row); this call decodes "
                         f"{batch}: stream one sequence a call, pass no streamer, or a row streamer (one with "
                         "`put_row(row, tokens)`, which gets the batch's prompts by `put` first, then each row's "
                         "tokens as they come).")
    if step_callback is not None and "row" not in inspect.signature(step_callback).parameters:
        raise ValueError(f"pacer_step_callback sees one sequence's steps; this call decodes {batch}: record one "
                         "sequence a call, or take the row's index as a keyword `row`.")
    if _static_mode(model, draft_model, generation_config):
        raise ValueError(f"PACER decodes a batch ({batch} sequences) over its own cache of each sequence at its own "
                         "length, not a static cache or a captured model's: decode one sequence a call there, or leave "
                         "cache_implementation unset.")
    if _pad_id(generation_config) is None:
        raise ValueError("A batch's rows end at different lengths and are padded after their end: set pad_token_id "
                         "(or eos_token_id) in the generation config.")


def _check_inputs(model, draft_model, head, input_ids, generation_config, model_kwargs, streamer=None,
                  step_callback=None) -> list[tuple[torch.LongTensor, int]]:
    """Everything about the call that can be checked before a forward or a cost measurement runs. Returns the
    batch's sequences without their left padding ([`_sequences`])."""
    if draft_model is None:
        raise ValueError("PACER decoding needs a draft model: pass `assistant_model=draft`.")
    if model.config.is_encoder_decoder or draft_model.config.is_encoder_decoder:
        raise ValueError("PACER decoding supports decoder-only models only.")
    if generation_config.num_beams > 1 or generation_config.num_return_sequences > 1:
        raise ValueError("PACER decoding does not support beam search or num_return_sequences > 1.")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0:
        raise ValueError(f"PACER decoding takes input_ids of shape (batch, length), got {tuple(input_ids.shape)}.")
    if input_ids.shape[1] == 0:
        raise ValueError("PACER decoding needs a prompt of at least one token; input_ids is empty.")
    if generation_config.output_attentions or generation_config.output_hidden_states:
        raise ValueError("PACER decoding does not return attentions or hidden states.")
    sequences = _sequences(input_ids, model_kwargs.get("attention_mask"))
    _check_batch(model, draft_model, generation_config, len(sequences), streamer, step_callback)
    _check_vocabularies(model, draft_model, torch.cat([ids for ids, _ in sequences], dim=1))
    # checked even when the rule does not read the head (e.g. its default rule reads the draft alone): a head
    # trained for another draft is a mistake worth naming
    if head is not None and head.config.draft_hidden_size != draft_model.config.get_text_config().hidden_size:
        raise ValueError(
            f"The PACER head reads hidden states of size {head.config.draft_hidden_size}, but the draft's "
            f"hidden size is {draft_model.config.get_text_config().hidden_size}: use a head trained for this draft."
        )
    trained_on = getattr(head.config, "draft_quantization", None) if head is not None else None
    given = draft_setting(draft_model) if trained_on is not None else None
    if trained_on != given:
        raise ValueError(
            f"This PACER head was trained on the {trained_on!r} draft, but the draft given is {given!r}: "
            f"its hidden states and probabilities differ. Load the draft as the head expects "
            f"({_DRAFT_FLAGS[trained_on]}), or use a head trained for this draft."
        )
    unknown = {k for k, v in model_kwargs.items() if v is not None} - _ALLOWED_MODEL_KWARGS
    if unknown:
        raise ValueError(f"PACER decoding does not support these generate arguments: {sorted(unknown)}.")
    _check_cache_implementation(generation_config.cache_implementation, "in the generation config")
    if _static_mode(model, draft_model, generation_config):
        _check_static(model)  # the cache transformers prepared is not used: PACER sizes both static caches
        _check_static(draft_model)
    else:
        _check_cache(model, _given_cache(model_kwargs))
        _check_cache(draft_model, None)
    if len(sequences) > 1:
        for m in (model, draft_model):
            check_packable(m)  # an attention implementation or layer type a packed call cannot mask: refused now
    return sequences


def _check_policy(policy, head) -> None:
    """What the chosen policy asks of the head."""
    if policy.needs_head and head is None:
        raise ValueError(f"The {policy.name!r} stopping policy needs a head: pass `pacer_head=...`.")
    if policy.needs_head and policy.max_draft_length > head.config.max_draft_length:
        raise ValueError(
            f"The policy's max_draft_length ({policy.max_draft_length}) exceeds the head's "
            f"max_draft_length ({head.config.max_draft_length})."
        )


def _cost_inputs(stopping_policy, head, do_sample) -> tuple | None:
    """`(head, max_tokens)` of the cost curve this call's rule needs measured for it, or None: a cost-aware rule
    named without costs, as the head's default (the head's cost in the curve where the rule reads it),
    `stopping_policy="throughput"` (the rule on the draft's probability, no head call in it) or its settings."""
    settings = stopping_policy
    if stopping_policy is None and head is not None:
        settings = head_policy(head.config, do_sample)
    elif stopping_policy == ExpectedThroughput.name:
        settings = dict(name=ExpectedThroughput.name)
    if isinstance(stopping_policy, dict):  # every setting checked before anything is measured
        _check_policy(make_policy(stopping_policy, costs=_UNMEASURED), head)
    if not isinstance(settings, dict) or settings.get("name") != ExpectedThroughput.name:
        return None
    reads_head = settings.get("estimate", "draft") != "draft"
    return (head if reads_head else None), settings.get("max_draft_length", _THROUGHPUT_MAX_DRAFT) + 1


class _Unmeasured:
    """Stands for a cost model while a rule's settings are checked, before the curve is measured."""

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        raise RuntimeError("the cost model is not measured yet")


_UNMEASURED = _Unmeasured()
_THROUGHPUT_MAX_DRAFT = inspect.signature(ExpectedThroughput).parameters["max_draft_length"].default


# who gives a cost-aware rule this machine's costs when the caller passes none: `modeling_pacer` registers its
# `host_costs` (measured once per host and models, cached on disk) when it is imported; without it (this folder as
# Hub remote code alone) the loop measures the curve itself, once per process and models
_COST_PROVIDER: dict = {}
_MEASURED: dict = {}


def register_cost_provider(measure, forget) -> None:
    """`measure(target, draft, head, max_tokens=...) -> CostModel` and `forget(target, draft, head, max_tokens=...)
    -> bool` (drop a curve found stale) for every cost-aware rule run without `pacer_costs`."""
    _COST_PROVIDER.update(measure=measure, forget=forget)


def _host_costs(model, draft_model, head, max_tokens: int, rows: int = 1):
    """This machine's cost model for a cost-aware rule (for a batch of `rows` sequences: its calls' sizes too): the
    registered provider's, or measured here once per process."""
    if "measure" in _COST_PROVIDER:
        extra = {"rows": rows} if rows > 1 else {}
        return _COST_PROVIDER["measure"](model, draft_model, head, max_tokens=max_tokens, **extra)
    key = (id(model), id(draft_model), id(head), max_tokens, rows)
    if key not in _MEASURED:
        _MEASURED[key] = measure_costs(model, draft_model, head, fixed_prefix(model, 128, draft_model), max_tokens,
                                       rows=rows)
    return _MEASURED[key]


def _curve_rows(batch: int) -> int:
    """The batch size a batch's cost curve is measured for: the next power of two (a curve for more rows prices fewer
    just as well), so that batches of nearby sizes share one measurement."""
    return 1 << (batch - 1).bit_length()


def _cost_aware(policy) -> bool:
    """A rule that prices its steps with a cost model (the cost-aware rule, or one like it)."""
    costs = getattr(policy, "costs", None)
    return all(hasattr(costs, name) for name in ("target", "draft", "step", "draft_forward"))


def _forget_costs(model, draft_model, head, max_tokens: int) -> bool:
    if "forget" in _COST_PROVIDER:
        return _COST_PROVIDER["forget"](model, draft_model, head, max_tokens=max_tokens)
    return _MEASURED.pop((id(model), id(draft_model), id(head), max_tokens), None) is not None


def _check_host_costs(model, draft_model, head, max_tokens, costs, stats) -> None:
    """After a call that decided with the cached curve: if its verifications took more than 2x (or less than
    half) what the curve predicts, over enough steps to say so, the curve is dropped (once per process and
    models), so the next call measures it again instead of deciding a week of runs with a busy minute's curve.
    (2x, not pacer-bench's 1.3x: live steps run after longer contexts than the curve's fixed prefix.) Curves of
    forwards under 5 ms (tiny models: Python overhead and timer noise) are not judged."""
    drafted = [s.drafted for s in stats.steps if s.stop_reason != "prefill"]
    if len(drafted) < 16 or costs.target(1) < 0.005:
        return
    ratio = curve_disagrees(costs, drafted, stats.target_time - stats.prefill_time, limit=2.0)
    key = (id(model), id(draft_model), id(head))
    if ratio is None or key in _FORGOTTEN:
        return
    _FORGOTTEN.add(key)
    if _forget_costs(model, draft_model, head, max_tokens):
        warnings.warn(f"this call's target forwards took {ratio:.2f}x what the cached cost curve predicts: "
                      "it will be measured again on the next call", stacklevel=4)


_FORGOTTEN: set = set()


def _lookup(settings, stopping_policy, head, do_sample, step_callback) -> NgramLookup | None:
    """This call's own [`NgramLookup`] from `pacer_lookup` (None, True, an instance whose settings are copied, or
    settings), every setting and the rule it runs under checked before anything is measured."""
    if settings is None or settings is False:
        return None
    if settings is True:
        lookup = NgramLookup()
    elif isinstance(settings, dict):
        lookup = NgramLookup(**settings)
    elif all(hasattr(settings, a) for a in ("to_dict", "continuation", "update", "estimate")):
        lookup = NgramLookup(**settings.to_dict())  # a fresh state: one instance can serve concurrent calls
    else:
        raise ValueError(f"pacer_lookup must be True, an NgramLookup or its settings (a dict), got {settings!r}.")
    if step_callback is not None:
        raise ValueError("pacer_lookup cannot record training data (pacer_step_callback): looked-up tokens have no "
                         "draft hidden states.")
    policy = make_policy(stopping_policy, getattr(head, "config", None), _UNMEASURED, do_sample)
    if policy.needs_head:
        raise ValueError(f"pacer_lookup proposes tokens no draft forward produced, so no head can read them: the "
                         f"{policy.name!r} rule reads the head; choose one that does not (e.g. "
                         "stopping_policy='throughput', the default head's rule).")
    return lookup


def _own_copy(policy):
    """A copy of a policy instance for one `generate` call: calls adapt their own state, so one instance can
    serve concurrent calls. Modules it holds (a learned scorer, say) are shared, not copied."""
    shared = {id(v): v for v in getattr(policy, "__dict__", {}).values() if isinstance(v, torch.nn.Module)}
    return copy.deepcopy(policy, shared)


def _draft_offset(window, prompt_length: int) -> int:
    """How many of the prompt's first tokens the draft never reads (`pacer_draft_window`), checked."""
    if window is None:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"pacer_draft_window must be a number of tokens >= 1 (or None: the whole prompt), got {window!r}.")
    return max(0, prompt_length - window)


def _one_call_at_a_time(*models) -> contextlib.ExitStack:
    """Hold the lock of every captured model among `models` ([`modeling_pacer.capture`]), in the order given."""
    stack = contextlib.ExitStack()
    for model in models:
        lock = getattr(model, "_pacer_capture_lock", None)
        if lock is not None:
            stack.enter_context(lock)
    return stack


def pacer_decoding(
    model,
    input_ids: torch.LongTensor,
    logits_processor,
    stopping_criteria,
    generation_config,
    draft_model=None,
    pacer_head=None,
    stopping_policy: "str | StoppingPolicy | None" = None,
    pacer_streamer=None,
    pacer_step_callback=None,
    pacer_costs=None,
    pacer_lookup=None,
    pacer_draft_window=None,
    **model_kwargs,
):
    """The decoding loop, in the shape of transformers' `custom_generate` callables: `generate`
    prepares the generation config, logits processors and stopping criteria, then calls this.

    `input_ids` `(B, L)`, left-padded where its rows differ in length (`attention_mask`, as a tokenizer with
    `padding_side="left"` gives it): every row is decoded as if alone, with its own draft length, stopping rule,
    free drafts and end ([`Row`]); the rows still drafting share each draft forward and every row's draft is verified
    in one target forward (each row's tokens packed after its own cache: [`RowCache`]). Over an exact target a row's
    tokens are, bit for bit, its own output decoded alone.

    `pacer_lookup` (True, an [`NgramLookup`] or its settings as a dict): open each draft with tokens looked up in the
    sequence so far where its last few tokens occurred before ([`NgramLookup`]: free drafts, no draft forward), under
    the rule's control; the rule must not read the head (looked-up tokens have no draft hidden states).

    `pacer_draft_window` (an int K): the draft reads only the prompt's last K tokens, so its prefill costs K tokens
    whatever the prompt's length; lossless as any draft is (the target verifies every token), at some cost in
    acceptance where the draft would have needed the rest.

    `pacer_step_callback(ids, proposal, target_scores, num_accepted)`, if given, sees every step before
    its tokens are emitted (`ids` `(1, L)` the sequence so far, `proposal` a [`Proposal`] with hidden states
    kept, `target_scores` `(1, k + 1, vocab)`): this is how training data is recorded from real decoding. In a batch
    it is told the row too (`row=`, a keyword it must take), and a streamer must be a row streamer
    (`put_row(row, tokens)`: the batch's prompts come by `put` first, then each row's tokens by `put_row`).

    A `stopping_policy` instance is copied at the start of the call and each row's copy adapts (`reset`, `update`),
    so the instance passed is never modified and one instance can serve concurrent calls; the copies, in their final
    state, are `pacer_policies` of the [`PacerGenerateOutput`] (`pacer_policy`: the first row's).

    Returns `(B, L + new)` token ids (rows that ended early padded with `pad_token_id`, as transformers pads them),
    or a [`PacerGenerateOutput`] with `return_dict_in_generate=True`.
    """
    head_config = getattr(pacer_head, "config", None)
    do_sample = generation_config.do_sample
    # every check before the first forward, the cost measurement's included
    sequences = _check_inputs(model, draft_model, pacer_head, input_ids, generation_config, model_kwargs,
                              pacer_streamer, pacer_step_callback)
    offsets = [_draft_offset(pacer_draft_window, ids.shape[1]) for ids, _ in sequences]
    lookup = _lookup(pacer_lookup, stopping_policy, pacer_head, do_sample, pacer_step_callback)
    batch = len(sequences)
    with _one_call_at_a_time(model, draft_model):  # a captured model's graphs and static caches are shared
        # the head's default rule follows the mode: its config may name another rule for sampled decoding
        measured_here = _cost_inputs(stopping_policy, pacer_head, do_sample) if pacer_costs is None else None
        if measured_here:
            pacer_costs = _host_costs(model, draft_model, *measured_here, rows=_curve_rows(batch))
        policy = make_policy(stopping_policy, head_config, pacer_costs, do_sample)
        _check_policy(policy, pacer_head)
        # in a batch, a cost-aware rule prices the batch's step: each row's copy reads its view of it
        batch_costs = BatchCosts(policy.costs, batch) if batch > 1 and _cost_aware(policy) else None

        stats = PacerStats(policy=repr(policy), target_exact=getattr(model, "_pacer_exact", None), batch_size=batch)
        start = time.perf_counter()
        eos = generation_config._eos_token_tensor
        eos_token_ids = set(eos.flatten().tolist()) if eos is not None else set()
        want_scores = generation_config.return_dict_in_generate and generation_config.output_scores
        want_logits = generation_config.return_dict_in_generate and generation_config.output_logits

        rows = []
        for index, ((ids, padding), offset) in enumerate(zip(sequences, offsets)):
            own = _own_copy(policy) if policy is stopping_policy or index else policy
            if batch_costs is not None:
                own.costs = batch_costs.rows[index]
                own.draft_nothing = True  # in a batch, drafting at all is judged too: verification rows grow dear
            own.reset()
            rows.append(Row(index, ids, padding, generation_config.max_length - padding, own,
                            row_processors(logits_processor, index, padding),
                            row_processors(stopping_criteria, index, padding),
                            lookup=NgramLookup(**lookup.to_dict()) if lookup is not None and index else lookup,
                            draft_offset=offset))
        if batch > 1:  # each sequence at its own length in one cache a model (sized for the longest)
            target_cache = RowCache(batch, generation_config.max_length + 1)
            draft_cache = RowCache(batch, generation_config.max_length + 1)
        elif _static_mode(model, draft_model, generation_config):
            # sized for the whole call plus any padding a model's fixed row shape writes past its real tokens; the target
            # alone compares bitwise only over a cache of the same size (`new_cache`)
            target_cache = new_cache(model, generation_config.max_length, static=True)
            draft_cache = new_cache(draft_model, generation_config.max_length, static=True)
        else:
            target_cache = _given_cache(model_kwargs) or new_cache(model, generation_config.max_length)
            draft_cache = new_cache(draft_model, generation_config.max_length)
        for cache in (target_cache, draft_cache):
            cache.activate_past_recording()  # sliding-window layers keep what a rejected draft needs back
        if pacer_streamer is not None:
            pacer_streamer.put(input_ids.cpu())

        vocab = (_vocab_size(draft_model), _vocab_size(model))
        prefill = True
        active = rows
        while active:
            if prefill:
                # the first step drafts nothing: the target reads each whole prompt in one forward and takes the first
                # token from its last row, the very call plain decoding (`generate` without a draft) makes
                proposals = [Proposal(row.ids[:, :0], torch.empty(1, 0, 0, device=row.ids.device), "prefill")
                             for row in active]
            else:
                if batch_costs is not None:
                    batch_costs.begin()
                    for row in active:
                        unread = row.ids.shape[1] - row.draft_offset - row_length(draft_cache, row.index)
                        batch_costs.sequence(row.index, unread, row.budget + 1)
                proposals = propose(draft_model, draft_cache, pacer_head, active, do_sample, eos_token_ids, stats,
                                    keep_hidden=pacer_step_callback is not None, vocab=vocab)
            verified = verify(model, target_cache, active, proposals, stats)
            if prefill:
                stats.prefill_time = stats.target_time
            for row, proposal, (raw_logits, target_scores) in zip(active, proposals, verified):
                new_tokens, num_accepted = accept(row.ids, proposal, target_scores, do_sample)
                k = proposal.tokens.shape[1]
                if not prefill:
                    row.policy.update(proposal.view, num_accepted)
                    if row.lookup is not None:
                        row.lookup.update(proposal.match, proposal.free, k, num_accepted)
                if pacer_step_callback is not None:
                    extra = {"row": row.index} if batch > 1 else {}  # a batch's callback takes the row (`_check_batch`)
                    pacer_step_callback(row.ids, proposal, target_scores, num_accepted, **extra)

                emitted = 0
                for i in range(new_tokens.shape[1]):
                    row.ids = torch.cat([row.ids, new_tokens[:, i : i + 1]], dim=1)
                    emitted += 1
                    if want_scores:
                        row.scores.append(target_scores[:, i, :])
                    if want_logits:
                        row.logits.append(raw_logits[:, i, :])
                    if bool(row.criteria(row.ids, target_scores[:, i, :]).any()):
                        row.finished = True
                        break
                stats.steps.append(DecodeStep(drafted=k, accepted=num_accepted, emitted=emitted,
                                              stop_reason=proposal.stop_reason, free=proposal.free, row=row.index))
                if pacer_streamer is not None:
                    if batch > 1:  # a row streamer (`_check_batch`): each row's tokens as they come
                        pacer_streamer.put_row(row.index, row.ids[0, -emitted:].cpu())
                    else:
                        pacer_streamer.put(row.ids[0, -emitted:].cpu())

                # roll the caches back to the accepted prefix: the target holds all of the row's ids but the last
                # token, the draft whatever of that it has actually seen (it never fed its own last draft token)
                crop_row(target_cache, row.index, row.ids.shape[1] - 1)
                crop_row(draft_cache, row.index, row.ids.shape[1] - 1 - row.draft_offset)
            prefill = False
            active = [row for row in active if not row.finished]
            if batch_costs is not None:
                for row in rows:
                    if row.finished:
                        batch_costs.finish(row.index)

        if pacer_streamer is not None:
            pacer_streamer.end()
        stats.total_time = time.perf_counter() - start
        if measured_here and pacer_costs is not None and batch == 1:  # a batch's calls are not the curve's sizes
            _check_host_costs(model, draft_model, *measured_here, pacer_costs, stats)

        output_ids = _padded_output(input_ids, rows, generation_config)
        if not generation_config.return_dict_in_generate:
            return output_ids
        return PacerGenerateOutput(
            sequences=output_ids,
            scores=_stacked(rows, "scores") if want_scores else None,
            logits=_stacked(rows, "logits") if want_logits else None,
            pacer_stats=stats,
            pacer_policy=rows[0].policy,
            pacer_policies=[row.policy for row in rows],
            **{_OUTPUT_CACHE_FIELD: target_cache if generation_config.use_cache else None},
        )


def _padded_output(input_ids: torch.LongTensor, rows: list[Row], generation_config) -> torch.LongTensor:
    """The call's `(B, L + new)` ids: each row's input (its left padding kept) and new tokens, the rows that ended
    first padded after their end with `pad_token_id`, as transformers' batched `generate` returns them."""
    if len(rows) == 1 and rows[0].padding == 0:
        return rows[0].ids
    new = [row.ids[0, input_ids.shape[1] - row.padding:] for row in rows]
    width = max(n.shape[0] for n in new)
    pad = _pad_id(generation_config)  # required for a batch (`_check_batch`); a single row fills all it has
    out = input_ids.new_full((len(rows), input_ids.shape[1] + width), 0 if pad is None else pad)
    out[:, : input_ids.shape[1]] = input_ids
    for i, n in enumerate(new):
        out[i, input_ids.shape[1] : input_ids.shape[1] + n.shape[0]] = n
    return out


def _stacked(rows: list[Row], name: str) -> tuple:
    """A `(B, vocab)` tensor a generated token, as transformers returns scores and logits for a batch: row i's of
    its t-th token, zeros past a row's end."""
    lists = [getattr(row, name) for row in rows]
    steps = max(len(values) for values in lists)
    out = []
    for t in range(steps):
        first = next(values[t] for values in lists if len(values) > t)
        out.append(torch.cat([values[t] if len(values) > t else torch.zeros_like(first) for values in lists]))
    return tuple(out)


def _stop_strings_as_criteria(model, generation_config, stopping_criteria, kwargs):
    """transformers gives a `custom_generate` callable no tokenizer, so it cannot build the stop-string
    criterion itself: build it here and hand it over as an ordinary stopping criterion."""
    config = generation_config if generation_config is not None else model.generation_config
    stop_strings = kwargs.pop("stop_strings", None) or config.stop_strings
    if not stop_strings:
        return generation_config, stopping_criteria
    tokenizer = kwargs.pop("tokenizer", None)
    if tokenizer is None:
        raise ValueError("`stop_strings` needs the tokenizer: pass `tokenizer=...` to `generate`.")
    if config.stop_strings:
        config = copy.deepcopy(config)
        config.stop_strings = None
        generation_config = config
    criteria = StoppingCriteriaList(stopping_criteria or [])
    criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=stop_strings))
    return generation_config, criteria


def generate(*args, model=None, **kwargs):
    """`model.generate` with PACER: `generate(model, ids, assistant_model=draft, pacer_head=head, ...)`.

    The arguments are `GenerationMixin.generate`'s, plus `pacer_head` (a `PacerHead`),
    `stopping_policy` (a [`StoppingPolicy`], a name from `POLICIES`, or a rule's settings as `to_dict()` writes them; default the head's own rule for the mode, its
    config's `stopping_rule`, or `sampling_stopping_rule` with `do_sample=True` where the head names one; an instance is copied for the call and left unmodified, the adapted copy is returned as
    `out.pacer_policy` with `return_dict_in_generate=True`). With neither of the two this is plain `GenerationMixin.generate` (transformers' own
    assisted generation when `assistant_model` is given). Otherwise transformers prepares everything
    as usual and runs [`pacer_decoding`]; `assistant_model` and `streamer` travel under other names
    because transformers passes neither to a `custom_generate` callable. `pacer_lookup=True` (or an [`NgramLookup`],
    or its settings): free drafts looked up in the sequence open each draft ([`pacer_decoding`]; without a head or a
    rule, the cost-aware rule on the draft's probability decides). `pacer_draft_window=K`: the draft reads only the
    prompt's last K tokens ([`pacer_decoding`]). `pacer_costs`: this machine's
    `CostModel` for a head whose rule is cost-aware (default: measured once and cached, `host_costs`).

    The model comes first, or as the keyword `model`: transformers binds a repo's
    `custom_generate/generate.py` as `functools.partial(generate, model=model)` and calls it with the
    user's positional arguments (`target.generate(ids, ...)`), or calls it as `generate(model=model, **arguments)`.
    """
    if model is None:
        if not args:
            raise TypeError("generate() needs the model: generate(model, input_ids, ...).")
        model, *args = args
    return _generate(model, *args, **kwargs)


def _requested_cache_implementation(model, generation_config, kwargs) -> tuple:
    """`(cache_implementation, where it was set)` as `generate` will resolve it: its own argument first, then the
    `generation_config` passed, then the model's."""
    if "cache_implementation" in kwargs:
        return kwargs["cache_implementation"], "passed to generate"
    for config, source in ((generation_config, "in the generation_config passed"),
                           (getattr(model, "generation_config", None), "in the model's generation_config")):
        if config is not None and getattr(config, "cache_implementation", None) is not None:
            return config.cache_implementation, source
    return None, "unset"


def _generate(
    model,
    inputs: torch.Tensor | None = None,
    generation_config=None,
    logits_processor=None,
    stopping_criteria=None,
    prefix_allowed_tokens_fn=None,
    synced_gpus=None,
    assistant_model=None,
    streamer=None,
    *,
    pacer_head=None,
    stopping_policy: "str | StoppingPolicy | None" = None,
    pacer_step_callback=None,
    pacer_costs=None,
    pacer_lookup=None,
    pacer_draft_window=None,
    **kwargs,
):
    plain = dict(
        generation_config=generation_config,
        logits_processor=logits_processor,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn,
        synced_gpus=synced_gpus,
    )
    kwargs.pop("custom_generate", None)  # set when transformers loaded this file as a custom_generate repo
    kwargs.pop("trust_remote_code", None)
    if (pacer_lookup not in (None, False) or pacer_draft_window is not None) and pacer_head is None and stopping_policy is None:
        stopping_policy = ExpectedThroughput.name  # pacer's best rule without a head, on free drafts too
    if pacer_head is None and stopping_policy is None:
        return GenerationMixin.generate(
            model, inputs, stopping_criteria=stopping_criteria, assistant_model=assistant_model, streamer=streamer,
            **plain, **kwargs,
        )
    if assistant_model is None:
        raise ValueError("PACER decoding needs a draft model: pass `assistant_model=draft`.")
    implementation, source = _requested_cache_implementation(model, generation_config, kwargs)
    _check_cache_implementation(implementation, source)
    static = implementation == _STATIC or wants_static_cache(model) or wants_static_cache(assistant_model)
    if static and any(kwargs.get(name) is not None for name in (*CACHE_NAMES, "past_key_values")):
        raise ValueError("PACER decoding over static caches builds and sizes both caches itself (the whole call plus "
                         "a fixed row shape's padding): pass no cache with cache_implementation='static' or a "
                         "captured model.")
    plain["generation_config"], stopping_criteria = _stop_strings_as_criteria(
        model, generation_config, stopping_criteria, kwargs
    )
    return GenerationMixin.generate(
        model,
        inputs,
        stopping_criteria=stopping_criteria,
        custom_generate=pacer_decoding,
        draft_model=assistant_model,
        pacer_head=pacer_head,
        stopping_policy=stopping_policy,
        pacer_streamer=streamer,
        pacer_step_callback=pacer_step_callback,
        pacer_costs=pacer_costs,
        pacer_lookup=pacer_lookup,
        pacer_draft_window=pacer_draft_window,
        **plain,
        **kwargs,
    )
