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
from pathlib import Path

import torch
from transformers import DynamicCache

from .cpu import kernels
from .custom_generate import generate as _loop
from .custom_generate.costs import (  # noqa: F401 - the measurement, at the loop's floor; cached here per host
    STALE_RATIO,
    CostModel,
    _ratio_outside,
    curve_disagrees,
    device_clock,
    fixed_prefix,
    interleaved_medians,
    measure_costs,
    model_devices,
    synchronize,
)
from .custom_generate.steps import crop_cache, model_forward
from .draft_vocab import kept_tokens
from .cpu.exact_linear import is_exact_linear
from .cpu.fused_layers import FusedModelStep, fused_layers, timed_kernels
from .host import cache_root, cpuinfo_field
from .resources import write_json


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


# a fused layer's calls, as [`timed_kernels`] names them -> as a split reports them
FUSED_PARTS = {"layer_qkv": "qkv_kernel", "layer_qkv_cached": "qkv_kernel", "update": "cache_update",
               "cache_room": "cache_update", "layer_rest": "rest_kernel"}


def time_split(model, input_ids: torch.Tensor, tokens: int = 1, repeats: int = 5) -> dict[str, float]:
    """Where one forward of `tokens` tokens after a cached `input_ids` prefix spends its wall-clock time,
    in seconds (median over `repeats`): "linear" (every linear layer's forward, Python included),
    "attention" (the attention modules' own time, their projections excluded), "other" (norms, MLP
    activations, embeddings, rotary, the model's Python glue) and "total". Measured with forward hooks,
    whose own cost (a few microseconds per module) lands in the groups. The decoder layers of a fused model
    (modeling_pacer.cpu.fused_layers: two kernel calls a layer, no module inside them called) are split by their
    calls instead: "qkv_kernel" (RMSNorm, q/k/v, rotary, the cache write), "cache_update" (finding the cache's
    buffers, or transformers' update), "rest_kernel"
    (attention, o_proj, the MLP), summed over the layers; "linear" is then what runs outside them (the LM head),
    and "fused" is 1.0 (else 0.0)."""
    clock = device_clock(*model_devices(model))  # on a GPU every hook waits for the work before it
    # without gradients, as decoding runs (a fused layer takes no call that records them)
    with torch.inference_mode(), timed_kernels(model, clock) as kernel_spent:
        split = _time_split(model, input_ids, tokens, repeats, clock, kernel_spent)
    return dict(split, fused=float(fused_layers(model) > 0))


def _time_split(model, input_ids: torch.Tensor, tokens: int, repeats: int, clock, kernel_spent: dict) -> dict[str, float]:
    spent = {"linear": 0.0, "attention": 0.0}
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
            kernel_spent.clear()
            t0 = clock()
            model_forward(model, input_ids[:, -1:].repeat(1, tokens), cache, tokens)
            total = clock() - t0
            crop_cache(cache, prefix)
            fused = dict.fromkeys(FUSED_PARTS.values(), 0.0)
            for call, name in FUSED_PARTS.items():
                fused[name] += kernel_spent.get(call, 0.0)
            samples.append(dict(spent, **fused, total=total,
                                other=total - spent["linear"] - spent["attention"] - sum(fused.values())))
    finally:
        for handle in handles:
            handle.remove()
    samples = samples[1:]
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]}


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
                      + (":prompt-tiles" if getattr(m, "prompt_tiles", False) else "")
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
        # a draft whose decoder layers take one-token steps in pacer's kernels (modeling_pacer.cpu.fused_layers)
        **({"fused_layers": fused} if (fused := fused_layers(model)) else {}),
        # and whose decoding steps skip the model's own forward (modeling_pacer.cpu.fused_layers.FusedModelStep)
        **({"fused_model_step": True} if isinstance(getattr(model, "forward", None), FusedModelStep) else {}),
    )


def describe_host() -> dict:
    """The machine and runtime a cost curve belongs to."""
    import transformers

    cpu = cpuinfo_field("model name") or platform.processor() or platform.machine()
    return dict(host=platform.node(), cpu=cpu, threads=torch.get_num_threads(), torch=torch.__version__,
                transformers=transformers.__version__, amx_rows=kernels.amx_setting())


def _cost_key(target, draft, head, max_tokens: int, prefix_tokens: int, rows: int = 1) -> dict:
    key = dict(format=COST_FORMAT, host=describe_host(), target=describe_model(target), draft=describe_model(draft),
               head=describe_model(head), max_tokens=max_tokens, prefix_tokens=prefix_tokens)
    return key if rows == 1 else dict(key, rows=rows)  # a batch's curve: more sizes


def _cost_path(key_fields: dict, folder=None) -> Path:
    key = hashlib.sha256(json.dumps(key_fields, sort_keys=True).encode()).hexdigest()[:20]
    return (Path(folder) if folder is not None else cache_root() / "costs") / f"{key}.json"


def forget_costs(target, draft, head=None, *, max_tokens: int = 9, prefix_tokens: int = 128, folder=None,
                 rows: int = 1) -> bool:
    """Drop the cached curve of these models on this host, so that the next `host_costs` measures again.
    Returns whether there was one."""
    path = _cost_path(_cost_key(target, draft, head, max_tokens, prefix_tokens, rows), folder)
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def host_costs(target, draft, head=None, *, max_tokens: int = 9, prefix_tokens: int = 128, repeats: int = 5,
               folder: str | os.PathLike | None = None, refresh: bool = False, max_age_days: float = 7.0,
               check: bool = False, rows: int = 1) -> CostModel:
    """This machine's [`CostModel`] for `target`/`draft`/`head`: read from the cache when it was measured here,
    for these models in this dtype, within `max_age_days`; otherwise measured (a few seconds) and cached.

    The prefix is a fixed `prefix_tokens`-token sequence, so curves from different runs are comparable.
    The cache key is the host (name, CPU, thread count, torch and transformers versions) and the models as
    [`describe_model`] sees them; the file (`<folder>/<key>.json`, default `~/.cache/pacer/costs`) keeps
    both, readable. `refresh=True` measures again (the machines are shared: a curve measured under load
    is wrong until then). `check=True` (pacer-bench) times the target's one-token forward now and measures
    the whole curve again, with a warning, when a cached curve is more than `STALE_RATIO` off it; a curve it has
    just measured it checks once too ([`_recheck`]: the target's and the draft's steps timed again). `rows` > 1: the
    curve a batch of that many sequences decides with (its calls' sizes measured too: `measure_costs`), cached apart.
    """
    key_fields = _cost_key(target, draft, head, max_tokens, prefix_tokens, rows)
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
    costs = measure_costs(target, draft, head, prefix, max_tokens, repeats, rows=rows)
    if check:
        costs = _recheck(costs, target, draft, head, prefix, max_tokens, repeats, rows)
    write_json(path, dict(key_fields, measured_at=time.time(), costs=costs.to_dict()))
    return costs


def _recheck(costs: CostModel, target, draft, head, prefix, max_tokens: int, repeats: int, rows: int = 1) -> CostModel:
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
    return measure_costs(target, draft, head, prefix, max_tokens, repeats, rows=rows)


# this machine's curves, cached, for every cost-aware rule the loop runs without `pacer_costs`
# (looked up at each call, so that a replaced `host_costs`, a test's say, is the one used)
_loop.register_cost_provider(lambda *args, **kwargs: host_costs(*args, **kwargs),
                             lambda *args, **kwargs: forget_costs(*args, **kwargs))
