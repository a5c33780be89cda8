"""`make_exact`: verification that computes, row for row, bitwise what single-token steps compute, on whatever device
the model sits: on a CPU each row alone (pacer_exact attention and row-invariant linear layers: `cpu/`), elsewhere the
way measured on the device among fixed-shape calls (`gpu/fixed_rows.py`) and rows alone. Above both runtimes: it
chooses between them."""

from __future__ import annotations

import warnings

import torch

from .cpu.exact_attention import NAME
from .cpu.exact_linear import exact_linears, is_exact_linear
from .custom_generate.costs import fixed_prefix
from .gpu.fixed_rows import fixed_rows, row_agreement


def make_exact(model: torch.nn.Module, rows=None, *, verify_rows: int = 16) -> torch.nn.Module:
    """Make `model`'s forward of any number of tokens give, row for row, bitwise the logits of single-token steps:
    a verification block, a prefill and transformers' assisted generation compute what plain decoding does.

    On a CPU: `attn_implementation="pacer_exact"` and row-invariant linear layers ([`exact_linears`]); `rows`
    forces one row range `(lo, hi)` for every linear layer (default: measured on this host per layer).
    On another device (a GPU): the way is chosen by measurement there ([`choose_exact`]), for verifications of up
    to `verify_rows` tokens. `model._pacer_exact` says which way was taken (None: none was exact there, with a
    warning). Returns the model."""
    if model.device.type in ("cpu", "meta"):
        _rows_alone(model, rows)
        model._pacer_exact = "rows-alone"
        return model
    return choose_exact(model, verify_rows)


# the prefix lengths the device probe reads after: attention kernels may split a short and a long key range apart
PROBE_PREFIXES = (37, 300)


def _rows_alone(model, rows=None):
    model.set_attn_implementation(NAME)
    exact_linears(model, rows)


def _undo_rows_alone(model, attention):
    model.set_attn_implementation(attention)
    for module in model.modules():
        if is_exact_linear(module):
            del module.forward, module._pacer_rows, module._pacer_probed, module._pacer_plain_forward


def _fixed(attention: str | None, rows: int):
    def apply(model):
        if attention is not None:
            model.set_attn_implementation(attention)
        fixed_rows(model, rows)
    return apply


def exact_candidates(rows: int) -> dict:
    """The ways to exact verification [`choose_exact`] tries, cheapest first on a GPU: name -> a function that
    applies it to a model in place. "fixed-rows": every call `rows` tokens ([`modeling_pacer.fixed_rows`]), attention
    as loaded; "fixed-rows-eager": the same with transformers' eager attention; "rows-alone": each row alone
    (pacer_exact attention, row-invariant linear layers: the CPU's way, launch-bound on a GPU)."""
    return {"fixed-rows": _fixed(None, rows), "fixed-rows-eager": _fixed("eager", rows), "rows-alone": _rows_alone}


def undo_exact(model: torch.nn.Module, attention: str, forward=None) -> torch.nn.Module:
    """Take any of [`exact_candidates`] off `model`: its attention back to `attention`, its instance's `forward` back
    to `forward` (None: the class's), its linear layers unwrapped."""
    if forward is not None:
        model.forward = forward
    elif "forward" in vars(model):
        del model.forward
    _undo_rows_alone(model, attention)
    vars(model).pop("_pacer_cache_slack", None)
    model._pacer_exact = None
    return model


def probe_exact(model: torch.nn.Module, rows: int, prefixes=PROBE_PREFIXES) -> float:
    """The largest logit difference between a call of 1..`rows` tokens (and a prefill) and single-token steps over
    `model` as it is, after each prefix length in `prefixes` (0.0: bitwise equal everywhere)."""
    worst = 0.0
    for length in prefixes:
        worst = max(worst, max(row_agreement(model, fixed_prefix(model, length), sizes=range(1, rows + 1)).values()))
    return worst


def choose_exact(model: torch.nn.Module, rows: int = 16, candidates=None) -> torch.nn.Module:
    """Try each of [`exact_candidates`] in turn on `model` (on its device) and keep the first whose verification of
    1..`rows` tokens and prefill give bitwise the rows of single steps ([`probe_exact`]); `model._pacer_exact` names
    it. Where none does, the model is left as loaded, `_pacer_exact` is None and a warning says so: greedy
    speculative decoding may then differ from the target alone at near-ties."""
    attention = model.config.get_text_config()._attn_implementation
    forward = vars(model).get("forward")  # a forward set on the instance before (a fused step, say) stays
    tried = {}
    for name, apply in (candidates or exact_candidates(rows)).items():
        apply(model)
        tried[name] = probe_exact(model, rows)
        if tried[name] == 0.0:
            model._pacer_exact = name
            return model
        undo_exact(model, attention, forward)
    warnings.warn(f"no way to exact verification was found on {model.device} ({tried}: the largest logit difference "
                  "of each from single steps): greedy speculative decoding may differ from the target alone at "
                  "near-ties", stacklevel=2)
    model._pacer_exact = None
    return model
