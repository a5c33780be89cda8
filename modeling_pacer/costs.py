"""What generation costs on the machine that runs it: the target's verification forward for 1..n input
tokens, a draft forward, a head call. Measured in a few seconds and cached per host, model and dtype,
so that every cost-dependent choice (the oracle, pacer-train's tuning, cost-aware stopping rules) uses
this machine's curve, never one stored from another machine: on CPU its shape changes with the host's
kernels and with the dtype (a flat bf16 curve, an fp32 staircase whose steps move from host to host).
"""

import hashlib
import json
import os
import platform
import statistics
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import DynamicCache

from . import kernels
from .custom_generate.generate import crop_cache, model_forward
from .draft_vocab import kept_tokens
from .exact_linear import is_exact_linear
from .fused_draft import FusedDraftStep, fused_layers
from .host import cache_root, cpuinfo_field
from .resources import write_json


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

    def step(self, drafted: int, head_calls: int = 0) -> float:
        return drafted * self.draft_forward + self.target(drafted + 1) + head_calls * self.head_call

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
    tokens, the draft for one, the head over a `max_tokens - 1` draft. Every tensor made here follows the
    device and dtype of the model that reads it, and the clock waits for those devices ([`device_clock`])."""
    def after_prefix(model):
        cache = DynamicCache(config=model.config)
        model_forward(model, input_ids, cache, 1)
        return cache

    target_cache, draft_cache = after_prefix(target), after_prefix(draft)
    prefix = input_ids.shape[1]

    def target_step(n):
        model_forward(target, input_ids[:, -1:].repeat(1, n), target_cache, n)
        crop_cache(target_cache, prefix)

    def draft_step():
        model_forward(draft, input_ids[:, -1:], draft_cache, 1)
        crop_cache(draft_cache, prefix)

    fns = [lambda n=n: target_step(n) for n in range(1, max_tokens + 1)] + [draft_step]
    if head is not None:
        length = max(1, min(max_tokens - 1, head.config.max_draft_length))  # the longest draft it reads
        # as the loop hands them: the draft's hidden states in the head's dtype, features in float32, on its device
        hidden = torch.randn(1, length, head.config.draft_hidden_size, dtype=head.dtype, device=head.device)
        features = (torch.rand(1, length, 2, device=head.device)
                    if getattr(head.config, "use_draft_features", False) else None)
        fns.append(lambda: head.acceptance_probabilities(hidden, draft_features=features))
    seconds = interleaved_medians(fns, repeats, clock=device_clock(*model_devices(target, draft, head)))
    costs = dict(zip(range(1, max_tokens + 1), seconds))
    return CostModel(costs, seconds[max_tokens], seconds[max_tokens + 1] if head is not None else 0.0)


def _is_linear(module) -> bool:
    # nn.Linear, pacer's Int4Linear/Int8Linear, torch's dynamic-int8 Linear, bitsandbytes' Linear8bitLt ...
    return "Linear" in type(module).__name__


def weight_bytes(model) -> int:
    """Bytes of weights a forward reads: every linear layer's parameters and buffers (packed codes, scales),
    the norms' weights; not the embedding table (a lookup reads one row per token), though a LM head tied to
    it counts (it is read in full). A tensor shared by two modules counts once."""
    seen, total = set(), 0
    for module in model.modules():
        if isinstance(module, torch.nn.Embedding):
            continue
        skip = getattr(module, "not_read_per_step", ())  # e.g. Int4Linear's dense copy, read by long calls only
        buffers = [t for name, t in module.named_buffers(recurse=False) if name not in skip]
        for tensor in [*module.parameters(recurse=False), *buffers]:
            if tensor.data_ptr() not in seen and tensor.dim() > 0:
                seen.add(tensor.data_ptr())
                total += tensor.numel() * tensor.element_size()
    return total  # a tied LM head shares the embedding's storage and counts here, as the linear layer it is


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """This host's memory read bandwidth, bytes per second, now: the median of `repeats` sums over a `gib`-GiB
    tensor (far larger than any cache), under torch's current thread count."""
    data = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    seconds = interleaved_medians([lambda: data.sum()], repeats)[0]
    return data.numel() * 4 / seconds


def fixed_prefix(model, tokens: int = 128, *others) -> torch.Tensor:
    """The `(1, tokens)` prefix every timing here runs after, on `model`'s device: fixed ids (only time is
    measured), so curves from different runs are comparable; ids every one of `model` and `others` (None
    skipped) embeds (a draft's vocabulary may stop short of its target's padded one)."""
    vocab = min(m.config.get_text_config(decoder=True).vocab_size for m in (model, *others) if m is not None)
    return (torch.arange(tokens) * 7919 % vocab).view(1, -1).to(next(model.parameters()).device)


def time_split(model, input_ids: torch.Tensor, tokens: int = 1, repeats: int = 5) -> dict[str, float]:
    """Where one forward of `tokens` tokens after a cached `input_ids` prefix spends its wall-clock time,
    in seconds (median over `repeats`): "linear" (every linear layer's forward, Python included),
    "attention" (the attention modules' own time, their projections excluded), "other" (norms, MLP
    activations, embeddings, rotary, the model's Python glue) and "total". Measured with forward hooks,
    whose own cost (a few microseconds per module) lands in the groups."""
    spent = {"linear": 0.0, "attention": 0.0}
    clock = device_clock(*model_devices(model))  # on a GPU every hook waits for the work before it
    starts, handles, in_attention = {}, [], set()  # in_attention: ids of the attention modules' projections
    groups = {id(m): "linear" if _is_linear(m) else "attention" for m in model.modules()
              if _is_linear(m) or type(m).__name__.endswith("Attention")}

    def pre(module, args):
        starts[id(module)] = clock()

    def post(module, args, output):
        seconds = clock() - starts.pop(id(module))
        spent[groups[id(module)]] += seconds
        if id(module) in in_attention:
            spent["attention"] -= seconds  # the projections count as linear layers, not as attention

    for module in model.modules():
        if groups.get(id(module)) == "attention":
            in_attention.update(id(child) for child in module.modules() if child is not module and _is_linear(child))
        if id(module) in groups:
            handles.append(module.register_forward_pre_hook(pre))
            handles.append(module.register_forward_hook(post))
    cache = DynamicCache(config=model.config)
    model_forward(model, input_ids, cache, 1)
    prefix = input_ids.shape[1]
    samples = []
    try:
        for _ in range(repeats + 1):  # the first one warms up
            spent.update(linear=0.0, attention=0.0)
            t0 = clock()
            model_forward(model, input_ids[:, -1:].repeat(1, tokens), cache, tokens)
            total = clock() - t0
            crop_cache(cache, prefix)
            samples.append(dict(spent, total=total, other=total - spent["linear"] - spent["attention"]))
    finally:
        for handle in handles:
            handle.remove()
    samples = samples[1:]
    return {key: statistics.median(s[key] for s in samples) for key in ("linear", "attention", "other", "total")}


# --------------------------------------------------------------------------------------------------
# measured once per host, model and dtype
# --------------------------------------------------------------------------------------------------
COST_FORMAT = "pacer-costs/2"  # 2: timed in interleaved rounds (curves measured before are measured again)


def device_name(device) -> str | None:
    """The accelerator's product name (e.g. "NVIDIA H200") for a CUDA device; None for a CPU and elsewhere."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name(device)
    return None


def describe_model(model) -> dict | None:
    """What decides a model's forward cost, as JSON: its checkpoint, parameter dtype, attention
    implementation, and the classes of its linear layers (quantized or not) with pacer's row padding."""
    if model is None:
        return None
    config = getattr(model, "config", None)
    param = next(model.parameters(), None)
    linears = sorted({f"{type(m).__module__}.{type(m).__name__}:{'exact' if is_exact_linear(m) else 'plain'}"
                      + (f":dense>={m.dense_rows}" if getattr(m, "dense_rows", None) is not None else "")
                      # pacer's kernels: their ABI, which changes with their numerics and speed
                      + (f":{m.kernel}-kernel-abi{kernels.ABI}" if getattr(m, "kernel", "torch") != "torch" else "")
                      for m in model.modules() if "Linear" in type(m).__name__})
    return dict(
        name=str(getattr(config, "_name_or_path", "") or type(model).__name__),
        model_class=type(model).__name__,
        dtype=str(param.dtype) if param is not None else None,
        device=str(param.device) if param is not None else None,
        # a curve measured on one GPU model says nothing of another's (on a CPU the host's fields say which)
        **({"device_name": name} if param is not None and (name := device_name(param.device)) else {}),
        attn_implementation=getattr(config, "_attn_implementation", None),
        parameters=sum(p.numel() for p in model.parameters()),
        linears=linears,
        # a draft whose LM head computes fewer tokens (modeling_pacer.draft_vocab) costs less per step
        **({"kept_tokens": kept} if (kept := kept_tokens(model)) is not None else {}),
        # a draft whose decoder layers take one-token steps in pacer's kernels (modeling_pacer.fused_draft)
        **({"fused_layers": fused} if (fused := fused_layers(model)) else {}),
        # and whose decoding steps skip the model's own forward (modeling_pacer.fused_draft.FusedDraftStep)
        **({"fused_model_step": True} if isinstance(getattr(model, "forward", None), FusedDraftStep) else {}),
    )


def describe_host() -> dict:
    """The machine and runtime a cost curve belongs to."""
    import transformers

    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return dict(host=platform.node(), cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__)


def _cost_key(target, draft, head, max_tokens: int, prefix_tokens: int) -> dict:
    return dict(format=COST_FORMAT, host=describe_host(), target=describe_model(target), draft=describe_model(draft),
                head=describe_model(head), max_tokens=max_tokens, prefix_tokens=prefix_tokens)


def _cost_path(key_fields: dict, folder=None) -> Path:
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    return (Path(folder) if folder is not None else cache_root() / "costs") / f"{key}.json"


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


def forget_costs(target, draft, head=None, *, max_tokens: int = 9, prefix_tokens: int = 128, folder=None) -> bool:
    """Drop the cached curve of these models on this host, so that the next `host_costs` measures again.
    Returns whether there was one."""
    path = _cost_path(_cost_key(target, draft, head, max_tokens, prefix_tokens), folder)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def host_costs(target, draft, head=None, *, max_tokens: int = 9, prefix_tokens: int = 128, repeats: int = 5,
               folder: str | os.PathLike | None = None, refresh: bool = False, max_age_days: float = 7.0,
               check: bool = False) -> CostModel:
    """This machine's [`CostModel`] for `target`/`draft`/`head`: read from the cache when it was measured here,
    for these models in this dtype, within `max_age_days`; otherwise measured (a few seconds) and cached.

    The prefix is a fixed `prefix_tokens`-token sequence, so curves from different runs are comparable.
    The cache key is the host (name, CPU, thread count, torch and transformers versions) and the models as
    [`describe_model`] sees them; the file (`<folder>/<key>.json`, default `~/.cache/pacer/costs`) keeps
    both, readable. `refresh=True` measures again (the machines are shared: a curve measured under load
    is wrong until then). `check=True` (pacer-bench) times the target's one-token forward now and measures
    the whole curve again, with a warning, when a cached curve is more than `STALE_RATIO` off it; a curve it has
    just measured it checks once too ([`_recheck`]: the target's and the draft's steps timed again).
    """
    key_fields = _cost_key(target, draft, head, max_tokens, prefix_tokens)
    path = _cost_path(key_fields, folder)
    if not refresh and path.is_file():
        try:
            saved = json.loads(path.read_text())
            if time.time() - saved["measured_at"] <= max_age_days * 86400:
                cached = CostModel.from_dict(saved["costs"])
                if not check:
                    return cached
                now = measure_costs(target, draft, None, fixed_prefix(target, prefix_tokens, draft), 1, repeats=3)
                ratio = curve_disagrees(cached, [0], now.target(1))
                if ratio is None:
                    return cached
                warnings.warn(
                    f"the cached cost curve ({path}) says {1000 * cached.target(1):.0f} ms for one target token, "
                    f"measured now {1000 * now.target(1):.0f} ms ({ratio:.2f}x): measuring the curve again", stacklevel=2)
        except (ValueError, KeyError, TypeError):
            pass  # unreadable or from another version: measure again
    prefix = fixed_prefix(target, prefix_tokens, draft)
    costs = measure_costs(target, draft, head, prefix, max_tokens, repeats)
    if check:
        costs = _recheck(costs, target, draft, head, prefix, max_tokens, repeats)
    write_json(path, dict(key_fields, measured_at=time.time(), costs=costs.to_dict()))
    return costs


def _recheck(costs: CostModel, target, draft, head, prefix, max_tokens: int, repeats: int) -> CostModel:
    """A curve just measured, checked once: a burst of load on a shared machine during the measurement makes
    it wrong for the whole run (seen: a draft step priced 83 ms that ran at 33). Time the target's and the draft's
    one-token steps again; if either is more than `STALE_RATIO` off the curve, measure the curve again, with a
    warning, and keep the second."""
    now = measure_costs(target, draft, None, prefix, 1, repeats=3)
    target_off = curve_disagrees(costs, [0], now.target(1))  # the test a cached curve gets
    draft_off = _ratio_outside(now.draft_forward, costs.draft_forward) if costs.draft_forward > 0 else None
    if target_off is None and draft_off is None:
        return costs
    warnings.warn(
        f"the cost curve just measured says {1000 * costs.target(1):.0f} ms for one target token and "
        f"{1000 * costs.draft_forward:.0f} ms for a draft step, timed again {1000 * now.target(1):.0f} and "
        f"{1000 * now.draft_forward:.0f} ms: the machine was busy; measuring the curve again", stacklevel=3)
    return measure_costs(target, draft, head, prefix, max_tokens, repeats)
