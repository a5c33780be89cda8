"""What a forward costs, measured where it runs: the target's verification of 1..n tokens after a cached prefix, a
draft step, a head call ([`measure_costs`]), as the cost-aware rule reads them ([`CostModel`]). Every timing waits for
the models' devices ([`device_clock`]): a GPU runs what it is handed asynchronously. Imports only torch and transformers
(this folder travels to the Hub as is); `modeling_pacer.costs` caches curves per host and models above it."""

import statistics
import time
from dataclasses import dataclass

import torch

from .steps import crop_cache, model_forward, new_cache


@dataclass
class CostModel:
    """Measured seconds: a target forward of n input tokens after a cached prefix, one draft forward of
    one token, one head call over a draft. Verification of k drafts feeds k + 1 tokens."""

    target_forward: dict[int, float]
    draft_forward: float
    head_call: float = 0.0

    def target(self, num_tokens: int) -> float:
        known = max(self.target_forward)
        if num_tokens <= known:
            return self.target_forward[num_tokens]
        return self.target_forward[known] * num_tokens / known  # beyond the measured range: linear

    def step(self, drafted: int, head_calls: int = 0, free: int = 0) -> float:
        """A step that drafts `drafted` tokens, `free` of them looked up (no draft forward), and verifies them."""
        return (drafted - free) * self.draft_forward + self.target(drafted + 1) + head_calls * self.head_call

    def to_dict(self) -> dict:
        return {"target_forward": self.target_forward, "draft_forward": self.draft_forward, "head_call": self.head_call}

    @classmethod
    def from_dict(cls, data: dict) -> "CostModel":
        """The inverse of `to_dict`, also after a JSON round trip (which turns the token counts into strings)."""
        return cls({int(k): v for k, v in data["target_forward"].items()}, data["draft_forward"], data.get("head_call", 0.0))


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


@torch.no_grad()
def measure_costs(target, draft, head, input_ids: torch.Tensor, max_tokens: int, repeats: int = 5) -> CostModel:
    """Time forwards after a cached `input_ids` prefix `(1, L)`: the target for 1..max_tokens input
    tokens, the draft for one (none: `draft` None, its cost 0), the head over a `max_tokens - 1` draft. Every tensor
    made here follows the device and dtype of the model that reads it, and the clock waits for those devices
    ([`device_clock`])."""
    def after_prefix(model):  # over the cache the loop gives it (a captured model's static one)
        cache = new_cache(model, input_ids.shape[1] + max_tokens + 1)
        model_forward(model, input_ids, cache, 1)
        return cache

    target_cache = after_prefix(target)
    prefix = input_ids.shape[1]

    def target_step(n):
        model_forward(target, input_ids[:, -1:].repeat(1, n), target_cache, n)
        crop_cache(target_cache, prefix)

    fns = [lambda n=n: target_step(n) for n in range(1, max_tokens + 1)]
    if draft is not None:
        draft_cache = after_prefix(draft)

        def draft_step():
            model_forward(draft, input_ids[:, -1:], draft_cache, 1)
            crop_cache(draft_cache, prefix)

        fns.append(draft_step)
    if head is not None:
        length = max(1, min(max_tokens - 1, head.config.max_draft_length))  # the longest draft it reads
        # as the loop hands them: the draft's hidden states in the head's dtype, features in float32, on its device
        hidden = torch.randn(1, length, head.config.draft_hidden_size, dtype=head.dtype, device=head.device)
        features = (torch.rand(1, length, 2, device=head.device)
                    if getattr(head.config, "use_draft_features", False) else None)
        fns.append(lambda: head.acceptance_probabilities(hidden, draft_features=features))
    seconds = interleaved_medians(fns, repeats, clock=device_clock(*model_devices(target, draft, head)))
    costs = dict(zip(range(1, max_tokens + 1), seconds))
    rest = iter(seconds[max_tokens:])
    return CostModel(costs, next(rest) if draft is not None else 0.0, next(rest) if head is not None else 0.0)


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
