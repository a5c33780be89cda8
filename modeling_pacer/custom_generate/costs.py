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
    sequences costs what its total rows cost), one draft forward of one token, one head call over a draft, and, for a
    batch, one draft forward of one token for each of b sequences (`draft_rows`, b >= 2) and the draft's reading of a
    prompt, a token (`draft_prompt`: what a row that starts drafting late pays first). Verification of k drafts feeds
    k + 1 tokens."""

    target_forward: dict[int, float]
    draft_forward: float
    head_call: float = 0.0
    draft_rows: dict[int, float] = field(default_factory=dict)
    draft_prompt: float = 0.0

    def target(self, num_tokens: int) -> float:
        """A target forward of `num_tokens` rows (between measured sizes: linear; past them: proportional)."""
        return self._read("target", self.target_forward, num_tokens)

    def draft(self, rows: int = 1) -> float:
        """A draft forward of one token for each of `rows` sequences (unmeasured sizes: as [`target`])."""
        return self._read("draft", {1: self.draft_forward, **self.draft_rows}, rows) if rows > 1 else self.draft_forward

    def _read(self, curve: str, points: dict[int, float], n: int) -> float:
        """[`_curve`], each size read once (a batch's rule reads the curves many times a step)."""
        memo = self.__dict__.setdefault("_memo", {})
        key = (curve, n)
        if key not in memo:
            memo[key] = _curve(points, n)
        return memo[key]

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        """A step that drafts `drafted` tokens, `free` of them looked up (no draft forward), and verifies them."""
        return (drafted - free) * self.draft_forward + self.target(drafted + 1) + head_calls * self.head_call

    def to_dict(self) -> dict:
        out = {"target_forward": self.target_forward, "draft_forward": self.draft_forward, "head_call": self.head_call}
        if self.draft_rows:
            out.update(draft_rows=self.draft_rows, draft_prompt=self.draft_prompt)
        return out

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """The inverse of `to_dict`, also after a JSON round trip (which turns the token counts into strings)."""
        return cls({int(k): v for k, v in data["target_forward"].items()}, data["draft_forward"], data.get("head_call", 0.0),
                   {int(k): v for k, v in data.get("draft_rows", {}).items()}, data.get("draft_prompt", 0.0))


class BatchCosts:
    """One step of a batch as the cost-aware rule of each of its rows sees it: the rows still drafting share each draft
    forward (b rows cost `draft(b)`), one target forward verifies every row's draft (`target` of their rows in all).

    Each row's rule reports where its draft stands (`RowCosts.report`: its length, its looked-up tokens, its head
    calls, the tokens it expects from the step, whether it stopped) and weighs a longer draft of its own against the
    batch's rate, the tokens every row expects over the step's seconds: its extra tokens are worth drafting while
    they outweigh that rate times their extra seconds, the verification rows they add and its share of each draft
    forward it takes part in (`draft(n) / n` with the n rows still drafting: the rows draft in lockstep, so a forward
    is shared by all who go on). So a row drafts on alone less than with company, and as verification rows grow dear
    with the batch every row drafts less. `rows[i]` is row i's view, which its rule reads as its cost model."""

    def __init__(self, costs: CostModel, batch: int):
        self.costs = costs
        self.active = [True] * batch  # rows not yet ended
        self.rows = [RowCosts(self, row) for row in range(batch)]
        # what the rows' drafting steps gave, decayed a step: row-steps, their tokens (accepted + 1), their drafts
        self.steps = self.yielded = self.lengths = 0.0
        self.observed = 0  # drafting row-steps seen, all told
        self.read_prompt = [False] * batch  # rows whose draft has read their prompt (they have drafted)
        self.since_probe = 0  # steps since a row last drafted to measure the acceptance for all
        self.backoff = 1  # probes since drafting last paid: each waits twice as long as the one before
        # per row: the tokens its draft would first read (its prompt and what it made, until it drafts) and the tokens
        # it may still make (the loop says, each step), over which that reading is spread
        self.unread = [0] * batch
        self.remaining = [1] * batch
        self.begin()

    def begin(self) -> None:
        """A new step: nothing drafted yet, every active row may draft, no row has probed."""
        batch = len(self.active)
        self.drafted, self.free, self.head_calls = [0] * batch, [0] * batch, [0] * batch
        self.tokens = [1.0] * batch  # a row that drafts nothing still gets the target's own token
        self.alive = list(self.active)
        self.probed = False
        self.prober = None  # the row drafting this step to measure what a drafting step gives (`probe`)
        self.could_pay = None  # whether a draft the target accepted whole could pay this step (`could_pay`)
        self._now = None
        self.since_probe += 1
        # decayed a step: a half-life of about 14 steps, as a row's own count
        self.steps, self.yielded, self.lengths = 0.95 * self.steps, 0.95 * self.yielded, 0.95 * self.lengths

    def _forwards(self, row: int) -> int:
        return self.drafted[row] - self.free[row]

    def finish(self, row: int) -> None:
        """Row `row` has ended: it counts for nothing from now on."""
        self.active[row] = self.alive[row] = False
        self._now = None

    def now(self) -> float:
        """The step's seconds with every active row where it stands."""
        if self._now is None:
            self._now = self._price_now()
        return self._now

    def _price_now(self) -> float:
        rows = [r for r in range(len(self.active)) if self.active[r]]
        forwards = [self._forwards(r) for r in rows]
        drafting = sum(self.costs.draft(sum(n >= s for n in forwards)) for s in range(1, max(forwards, default=0) + 1))
        calls = sum(self.head_calls[r] for r in rows)
        return drafting + self.costs.target(sum(self.drafted[r] + 1 for r in rows)) + calls * self.costs.head_call

    def step(self, row: int, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        """The step's seconds as row `row` prices its draft at `drafted` tokens (`free` looked up, `head_calls` head
        calls): the step as it stands, plus this row's share of what the longer draft adds. The rows still drafting
        face the same choice in lockstep, so each is priced as one of them: a 1/n share of the verification rows that n
        rows drafting as far would add, and of each draft forward with the rows drafting then."""
        now = self.now()
        extra = drafted - self.drafted[row]
        if extra <= 0:
            return now
        rows = [r for r in range(len(self.active)) if self.active[r]]
        total = sum(self.drafted[r] + 1 for r in rows)
        # a probe measures what a drafting step gives a batch whose every row drafts: it is priced as one of them
        probe = row == self.prober
        along = len(rows) if probe else 1 + sum(1 for o in rows if o != row and self.alive[o])
        verify = (self.costs.target(total + along * extra) - self.costs.target(total)) / along
        share = 0.0
        for s in range(self._forwards(row) + 1, drafted - free + 1):
            n = len(rows) if probe else 1 + sum(1 for o in rows if o != row and (self.alive[o] or self._forwards(o) >= s))
            share += self.costs.draft(n) / n
        if drafted > free and not self.read_prompt[row]:  # its draft reads the sequence first: this step's share
            share += self.unread[row] * self.costs.draft_prompt * min(1.0, (drafted + 1) / self.remaining[row])
        return now + verify + share + max(0, head_calls - self.head_calls[row]) * self.costs.head_call

    def sequence(self, row: int, unread: int, remaining: int) -> None:
        """Row `row`'s draft would first read `unread` tokens, and it may make `remaining` more (the loop, each step)."""
        self.unread[row], self.remaining[row] = unread, max(1, remaining)


@dataclass
class RowCosts:
    """Row `row`'s view of a [`BatchCosts`], read by its cost-aware rule as its cost model: `step` prices the batch's
    step with this row's draft at a given length, `tokens_besides` the tokens the other rows expect from it, `report`
    says where this row's draft stands (and whether it stopped)."""

    batch: BatchCosts
    row: int

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        return self.batch.step(self.row, drafted, head_calls, free)

    @property
    def tokens_besides(self) -> float:
        b = self.batch
        return sum(t for other, (t, on) in enumerate(zip(b.tokens, b.active)) if on and other != self.row)

    def report(self, drafted: int, tokens: float, free: int = 0, head_calls: int = 0, stopped: bool = False) -> None:
        b = self.batch
        b.drafted[self.row], b.tokens[self.row], b.free[self.row], b.head_calls[self.row] = drafted, tokens, free, head_calls
        b._now = None
        if drafted > free:
            b.read_prompt[self.row] = True
        if stopped:
            self.stopped()

    def stopped(self) -> None:
        """This row drafts no more this step (its rule, an end of sequence or its cap stopped it)."""
        self.batch.alive[self.row] = False

    def observe(self, drafted: int, accepted: int) -> None:
        """A verification of this row's draft of `drafted` tokens, `accepted` of them kept."""
        b = self.batch
        b.steps, b.yielded, b.lengths, b.observed = b.steps + 1, b.yielded + accepted + 1, b.lengths + drafted, b.observed + 1

    def pooled(self) -> tuple[float, float] | None:
        """`(tokens, drafted)` a drafting step of a row has given the whole batch on average (decayed): its tokens
        (accepted + 1) and its draft's length; None before any."""
        b = self.batch
        return (b.yielded / b.steps, b.lengths / b.steps) if b.observed and b.steps > 0 else None

    def probe(self, every: int) -> bool:
        """Whether this row drafts this step to measure the acceptance for the whole batch, drafting not paying at
        what was measured: one row a step, once before anything was seen, then after `every` steps, and each probe
        since drafting last paid twice as long after the one before (a batch where drafting loses pays for few); a row
        whose draft has already read its prompt where one is left (another row's would first read its whole prompt)."""
        b = self.batch
        if b.probed or (b.observed and b.since_probe < every * b.backoff):
            return False
        if not b.read_prompt[self.row] and any(read and on for read, on in zip(b.read_prompt, b.active)):
            return False
        b.probed, b.since_probe, b.prober = True, 0, self.row
        b.backoff = b.backoff * 2 if b.observed else 1
        return True

    def pays(self) -> None:
        """Drafting pays at what the batch has measured: probes start over at `every` steps."""
        self.batch.backoff = 1

    def could_pay(self, judge) -> bool:
        """`judge()` (whether a draft the target accepted whole could pay, at some length), asked once a step: the
        first row to ask judges it, with the batch as it stands then, for all."""
        b = self.batch
        if b.could_pay is None:
            b.could_pay = judge()
        return b.could_pay

    def target(self, num_tokens: int) -> float:
        return self.batch.costs.target(num_tokens)

    def draft(self, rows: int = 1) -> float:
        return self.batch.costs.draft(rows)

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
            fns.append(lambda: model_forward(draft, input_ids, new_cache(draft, prefix + 1), 1))  # a prompt read
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
    draft_prompt = next(rest) / prefix if draft_rows else 0.0
    return CostModel(costs, draft_forward, next(rest) if head is not None else 0.0, draft_rows, draft_prompt)


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
