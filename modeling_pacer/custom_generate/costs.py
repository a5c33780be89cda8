"""What a forward costs, measured where it runs: the target's verification of 1..n tokens after a cached prefix, a
draft step, a head call ([`measure_costs`]), as the cost-aware rule reads them ([`CostModel`]). Every timing waits for
the models' devices ([`device_clock`]): a GPU runs what it is handed asynchronously. Imports only torch and transformers
(this folder travels to the Hub as is); `modeling_pacer.costs` caches curves per host and models above it."""

import statistics
import time
from dataclasses import dataclass, field

import torch

from .rows import RowCache, packed_forward
from .steps import cache_kwargs, crop_cache, model_forward, new_cache


def _curve(points: dict[int, float], n: int) -> float:
    """A measured curve's seconds at `n`: the point itself, else linear between the measured points around it, and
    beyond the last one linear from zero through it (a call that many times larger costs that many times more)."""
    if n in points:
        return points[n]
    known = max(points)
    if n > known:
        return points[known] * n / known
    below = max((m for m in points if m < n), default=None)
    above = min(m for m in points if m > n)
    if below is None:
        return points[above]
    return points[below] + (points[above] - points[below]) * (n - below) / (above - below)


@dataclass
class CostModel:
    """Measured seconds: a target forward of n input tokens after a cached prefix (in all: a call of several
    sequences costs what its total rows cost), one draft forward of one token, one head call over a draft, and one
    draft forward of one token for each of b sequences (`draft_rows`, b >= 2; measured for a batch). Verification of k
    drafts feeds k + 1 tokens."""

    target_forward: dict[int, float]
    draft_forward: float
    head_call: float = 0.0
    draft_rows: dict[int, float] = field(default_factory=dict)

    def target(self, num_tokens: int) -> float:
        """A target forward of `num_tokens` rows (between measured sizes: linear; past them: proportional)."""
        return _curve(self.target_forward, num_tokens)

    def draft(self, rows: int = 1) -> float:
        """A draft forward of one token for each of `rows` sequences (unmeasured sizes: as [`target`])."""
        return _curve({1: self.draft_forward, **self.draft_rows}, rows) if rows > 1 else self.draft_forward

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        """A step that drafts `drafted` tokens, `free` of them looked up (no draft forward), and verifies them."""
        return (drafted - free) * self.draft_forward + self.target(drafted + 1) + head_calls * self.head_call

    def to_dict(self) -> dict:
        out = {"target_forward": self.target_forward, "draft_forward": self.draft_forward, "head_call": self.head_call}
        if self.draft_rows:
            out["draft_rows"] = self.draft_rows
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """The inverse of `to_dict`, also after a JSON round trip (which turns the token counts into strings)."""
        return cls({int(k): v for k, v in data["target_forward"].items()}, data["draft_forward"], data.get("head_call", 0.0),
                   {int(k): v for k, v in data.get("draft_rows", {}).items()})


class BatchCosts:
    """One step of a batch as the cost-aware rule of each of its rows sees it: the rows still drafting share each draft
    forward (b rows cost `draft(b)`), one target forward verifies every row's draft (`target` of their rows in all).

    Each row's rule reports where its draft stands (`report`: its length, its looked-up tokens, its head calls and
    the tokens it expects from the step), and judges a length of its own against the batch's rate: the tokens every
    row expects, over the whole step's seconds, with the other rows where they last said they were. So a row drafts on
    while its next token is worth more than the batch's rate at its extra seconds: as verification rows grow dear with
    the batch, every row drafts less. `rows[i]` is row i's view ([`RowCosts`]), which the rule reads as its costs."""

    def __init__(self, costs: CostModel, batch: int):
        self.costs = costs
        self.drafted = [0] * batch
        self.free = [0] * batch
        self.head_calls = [0] * batch
        self.tokens = [1.0] * batch  # a row that drafts nothing still gets the target's own token
        self.active = [True] * batch
        self.rows = [RowCosts(self, row) for row in range(batch)]

    def step(self, row: int, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        """The batch's step, in seconds, with row `row` at `drafted` tokens (`free` looked up) and the other active rows
        where they stand."""
        lengths, forwards, calls = [], [], 0
        for other in range(len(self.active)):
            if other == row:
                k, f, h = drafted, free, head_calls
            elif self.active[other]:
                k, f, h = self.drafted[other], self.free[other], self.head_calls[other]
            else:
                continue
            lengths.append(k)
            forwards.append(k - f)
            calls += h
        drafting = sum(self.costs.draft(sum(n >= s for n in forwards)) for s in range(1, max(forwards, default=0) + 1))
        return drafting + self.costs.target(sum(k + 1 for k in lengths)) + calls * self.costs.head_call


@dataclass
class RowCosts:
    """Row `row`'s view of a [`BatchCosts`], read by its cost-aware rule as its cost model: `step` prices the batch's
    step with this row's draft at a given length, `tokens_besides` the tokens the other rows expect from it, `report`
    says where this row's draft stands."""

    batch: BatchCosts
    row: int

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        return self.batch.step(self.row, drafted, head_calls, free)

    @property
    def tokens_besides(self) -> float:
        b = self.batch
        return sum(t for other, (t, on) in enumerate(zip(b.tokens, b.active)) if on and other != self.row)

    def report(self, drafted: int, tokens: float, free: int = 0, head_calls: int = 0) -> None:
        b = self.batch
        b.drafted[self.row], b.tokens[self.row], b.free[self.row], b.head_calls[self.row] = drafted, tokens, free, head_calls

    def target(self, num_tokens: int) -> float:
        return self.batch.costs.target(num_tokens)

    @property
    def draft_forward(self) -> float:
        return self.batch.costs.draft_forward

    @property
    def head_call(self) -> float:
        return self.batch.costs.head_call


def synchronize(devices) -> None:
    """Wait until the work queued on each of `devices` is done: a GPU runs what it is handed asynchronously,
    so a clock read right after a launch measures the launch, not the work. Nothing to wait for on a CPU
    (or on `meta`, which runs nothing)."""
    for device in devices:
        device = torch.device(device)
        if device.type not in ("cpu", "meta"):
            torch.accelerator.synchronize(device)


def device_clock(*devices):
    """A clock for timing work on `devices` (torch devices or strings): `time.perf_counter` read after
    [`synchronize`]. Every timing of the cost model goes through it."""
    devices = tuple(dict.fromkeys(torch.device(d) for d in devices))

    def clock() -> float:
        synchronize(devices)
        return time.perf_counter()

    return clock


def model_devices(*models) -> tuple[torch.device, ...]:
    """The devices the parameters of `models` (None skipped) sit on, each once."""
    return tuple(dict.fromkeys(p.device for m in models if m is not None for p in m.parameters()))


def interleaved_medians(fns: list, repeats: int, clock=time.perf_counter) -> list[float]:
    """The median seconds of each of `fns` over `repeats` rounds that call every one of them once, in turn
    (after one warm-up round, excluded). On a shared machine a burst of load lasts a while: timing each
    function `repeats` times in a row lets one burst inflate every sample of one size (a curve with a false
    step), while rounds spread it over one sample of several sizes, which the median then drops. For work on a
    GPU, pass [`device_clock`] of its devices."""
    times = [[] for _ in fns]
    for round_ in range(repeats + 1):
        for fn, samples in zip(fns, times):
            start = clock()
            fn()
            if round_:
                samples.append(clock() - start)
    return [statistics.median(samples) for samples in times]


def batch_sizes(max_tokens: int, rows: int) -> list[int]:
    """The target forwards a batch of `rows` sequences' curve measures: every size to `max_tokens`, then about a
    dozen more up to `rows * max_tokens` (each row's longest verification), spaced by about a quarter."""
    sizes, n = list(range(1, max_tokens + 1)), max_tokens
    while n < rows * max_tokens:
        n = min(rows * max_tokens, max(n + 1, round(n * 1.25)))
        sizes.append(n)
    return sizes


@torch.no_grad()
def measure_costs(target, draft, head, input_ids: torch.Tensor, max_tokens: int, repeats: int = 5,
                  rows: int = 1) -> CostModel:
    """Time forwards after a cached `input_ids` prefix `(1, L)`: the target for 1..max_tokens input
    tokens, the draft for one (none: `draft` None, its cost 0), the head over a `max_tokens - 1` draft. Every tensor
    made here follows the device and dtype of the model that reads it, and the clock waits for those devices
    ([`device_clock`]). `rows` > 1 (a batch): also the target for more tokens, up to `rows * max_tokens`
    ([`batch_sizes`]; a call costs what its rows cost, however many sequences they belong to), and the draft's step of
    one token for each of 2..`rows` sequences packed in one call, each after its own copy of the prefix."""
    def after_prefix(model):  # over the cache the loop gives it (a captured model's static one)
        cache = new_cache(model, input_ids.shape[1] + max_tokens + 1)
        model_forward(model, input_ids, cache, 1)
        return cache

    target_cache = after_prefix(target)
    prefix = input_ids.shape[1]

    def target_step(n):
        model_forward(target, input_ids[:, -1:].repeat(1, n), target_cache, n)
        crop_cache(target_cache, prefix)

    sizes = batch_sizes(max_tokens, rows)
    fns = [lambda n=n: target_step(n) for n in sizes]
    if draft is not None:
        draft_cache = after_prefix(draft)

        def draft_step():
            model_forward(draft, input_ids[:, -1:], draft_cache, 1)
            crop_cache(draft_cache, prefix)

        fns.append(draft_step)
        if rows > 1:
            packed = RowCache(rows, prefix + 1)
            packed_forward(draft, packed, [(row, input_ids) for row in range(rows)], [1] * rows,
                           cache_kwargs=cache_kwargs)

            def draft_rows(b):
                packed_forward(draft, packed, [(row, input_ids[:, -1:]) for row in range(b)], [1] * b,
                               cache_kwargs=cache_kwargs)
                for row in range(b):
                    packed.crop_row(row, prefix)

            fns.extend(lambda b=b: draft_rows(b) for b in range(2, rows + 1))
    if head is not None:
        length = max(1, min(max_tokens - 1, head.config.max_draft_length))  # the longest draft it reads
        # as the loop hands them: the draft's hidden states in the head's dtype, features in float32, on its device
        hidden = torch.randn(1, length, head.config.draft_hidden_size, dtype=head.dtype, device=head.device)
        features = (torch.rand(1, length, 2, device=head.device)
                    if getattr(head.config, "use_draft_features", False) else None)
        fns.append(lambda: head.acceptance_probabilities(hidden, draft_features=features))
    seconds = interleaved_medians(fns, repeats, clock=device_clock(*model_devices(target, draft, head)))
    costs = dict(zip(sizes, seconds))
    rest = iter(seconds[len(sizes):])
    draft_forward = next(rest) if draft is not None else 0.0
    draft_rows = {b: next(rest) for b in range(2, rows + 1)} if draft is not None and rows > 1 else {}
    return CostModel(costs, draft_forward, next(rest) if head is not None else 0.0, draft_rows)


def fixed_prefix(model, tokens: int = 128, *others) -> torch.Tensor:
    """The `(1, tokens)` prefix every timing here runs after, on `model`'s device: fixed ids (only time is
    measured), so curves from different runs are comparable; ids every one of `model` and `others` (None
    skipped) embeds (a draft's vocabulary may stop short of its target's padded one)."""
    vocab = min(m.config.get_text_config(decoder=True).vocab_size for m in (model, *others) if m is not None)
    return (torch.arange(tokens) * 7919 % vocab).view(1, -1).to(next(model.parameters()).device)


STALE_RATIO = 1.3  # an observed cost this far (either way) from the cached curve's says the curve is not this hour's


def curve_disagrees(costs: CostModel, drafted: list[int], target_seconds: float, limit: float = STALE_RATIO) -> float | None:
    """The ratio observed / predicted of a run's target forwards (verifications of `drafted` tokens, `target_seconds`
    in all) when it lies outside 1/limit..limit, else None."""
    if not drafted:
        return None
    return _ratio_outside(target_seconds, sum(costs.target(k + 1) for k in drafted), limit)


def _ratio_outside(observed: float, predicted: float, limit: float = STALE_RATIO) -> float | None:
    """observed / predicted when it lies outside 1/limit..limit, else None."""
    ratio = observed / predicted if predicted > 0 else float("inf")
    return ratio if not 1 / limit <= ratio <= limit else None
