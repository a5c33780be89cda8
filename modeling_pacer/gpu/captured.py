"""Captured steps ([`capture`]): a model's decoding calls compiled whole over a StaticCache, on a GPU as CUDA graphs
(`torch.compile(mode="reduce-overhead")`, the decode step of gpt-fast and of transformers' own static-cache
generation), so that a step costs what its kernels cost rather than what launching them costs.

A small model's step launches a few hundred kernels of a few microseconds' work each: run eagerly, the host's
launches are the step's cost, and a 0.5B draft costs nearly what a 1.5B target does. A CUDA graph replays the
recorded kernels in one launch, but only for the shapes and addresses it recorded, hence:

- the cache is transformers' `StaticCache` (keys, values and write position at fixed addresses, marked static), of a
  size fixed for the call ([`new_cache`]'s buckets, so that a few graphs serve calls of any length), and it is
  rolled back after a rejected draft by moving its write position back in place (`crop_cache`), outside the graph;
- a graph serves one row count: a model under `fixed_rows` (the exact target) makes every call `rows` tokens, so its
  one row count is captured for steps, verifications and the prompt's chunks alike; any other model (the draft) has
  the row counts in `rows` captured (one token a step, two after a fully accepted draft) and every other call (its
  prompt) runs eagerly over the same cache.

On a CPU the same compiled function runs without graphs (inductor's CPU code, or whichever backend the
`CompileConfig` names): that is how the logic is tested where CI has no GPU.
"""

from __future__ import annotations

import collections
import threading

import torch
from torch import nn
from transformers import CompileConfig, DynamicCache

from ..custom_generate.steps import cache_length, is_static_full_attention, static_cache_supported, static_capacity
from .fixed_rows import FixedRowsForward, fixed_rows_of

# graphs torch may compile for one forward's code (see CapturedForward.__call__)
RECOMPILE_LIMIT = 64
# a step feeds the draft one token, or two after a fully accepted draft (its last draft token and the target's)
DRAFT_ROWS = (1, 2)


class CapturedForward:
    """A forward whose calls of the captured row counts over a static cache run compiled; every other call runs
    `eager` (see the module's docstring). `calls` counts both kinds by row count.

    Every call of a captured row count runs the compiled function, the first one too: its kernels need not round as
    the eager ones do (inductor fuses them), so a row computed eagerly once and compiled the next time could differ,
    and the exact target's rows must all come from one function. What the compiled function cannot do itself is
    done eagerly on the side first, with one token: allocating a fresh cache's tensors (then emptied again), and
    setting up transformers' hidden-state hooks (over a scratch cache)."""

    def __init__(self, model: nn.Module, eager, rows, compile_config: CompileConfig):
        self.model, self.eager, self.rows, self.compile_config = model, eager, frozenset(rows), compile_config
        options = compile_config.to_dict()
        if options["backend"] != "inductor":
            options.pop("mode")  # a mode is inductor's (other backends warn and ignore it)
        self.compiled = torch.compile(eager, **options)
        self.calls: collections.Counter = collections.Counter()  # ("graph" | "eager", rows) -> calls
        self.hooks_ready = False  # transformers' hidden-state hooks installed on the model

    def __call__(self, input_ids=None, **kwargs):
        name = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(name)
        rows = input_ids.shape[1] if input_ids is not None else None
        graph = (rows in self.rows and kwargs.get("inputs_embeds") is None and is_static_full_attention(cache)
                 and cache_length(cache) + rows <= static_capacity(cache))
        self.calls["graph" if graph else "eager", rows] += 1
        if not graph:
            return self.eager(input_ids=input_ids, **kwargs)
        one = input_ids[:, :1]
        if kwargs.get("output_hidden_states") and not self.hooks_ready:
            config = self.model.config.get_text_config(decoder=True)
            self.eager(input_ids=one, use_cache=True, output_hidden_states=True, **{name: DynamicCache(config=config)})
            self.hooks_ready = True
        if not all(layer.is_initialized for layer in cache.layers):
            self.eager(input_ids=one, use_cache=True, **{name: cache})  # allocates the cache's tensors (static)
            cache.reset()
        if self.compile_config.mode in ("reduce-overhead", "max-autotune") or self.compile_config.backend == "cudagraphs":
            torch.compiler.cudagraph_mark_step_begin()  # the previous call's outputs may be overwritten now
        # every model of a class shares its forward's code, which torch compiles once per shape, dtype and model
        # (target and draft, each row count, with and without hidden states, each cache size): more than torch's
        # default limit of 8 graphs per code; past this one, fullgraph fails loudly rather than run eager unnoticed
        with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
            # a fresh (1, rows) tensor: the ids arrive as slices of longer sequences, whose strides torch would
            # otherwise compile a graph for each
            out = self.compiled(input_ids=input_ids.clone(memory_format=torch.contiguous_format), **kwargs)
        # a graph's outputs live in its own memory, overwritten by its next replay: the loop keeps logits and hidden
        # states across calls, so they leave as copies
        out.logits = out.logits.clone()
        if getattr(out, "hidden_states", None) is not None:
            out.hidden_states = tuple(h.clone() for h in out.hidden_states)
        return out


def capture(model: nn.Module, rows=DRAFT_ROWS, compile_config: CompileConfig | None = None) -> nn.Module:
    """Run `model`'s decoding steps compiled over a StaticCache (CUDA graphs on a GPU), in place; returns the model.

    A model under `fixed_rows` (the exact target, `make_exact` on a GPU) has its one row shape captured and `rows` is
    ignored; otherwise the calls of `rows` tokens are (default: one and two, a draft's steps). Apply it after
    `make_exact`. PACER then decodes over static caches ([`new_cache`]), as it does with
    `cache_implementation="static"`. `compile_config`: transformers' `CompileConfig` (default: its defaults,
    `mode="reduce-overhead"`, with `fullgraph=True` and `dynamic=False`: a graph break would leave launches in the step).

    The target alone, to compare with: `model.generate(ids, past_key_values=new_cache(model, max_length, static=True))`
    runs plain decoding through the same captured calls (transformers' own compilation of the model's call is turned
    off on this model: it would compile pacer's wrapper around the graph)."""
    if isinstance(model.forward, CapturedForward) or isinstance(getattr(model.forward, "inner", None), CapturedForward):
        raise ValueError("capture: this model's steps are captured already")
    if compile_config is None:
        compile_config = CompileConfig(fullgraph=True, dynamic=False)
    if not isinstance(compile_config, CompileConfig):
        raise TypeError(f"capture: compile_config must be a transformers CompileConfig, got {type(compile_config).__name__}")
    if getattr(model, "_pacer_exact", None) == "rows-alone":
        raise ValueError("capture: a model made exact with rows alone (make_exact on a CPU, or its last resort on a "
                         "GPU) runs pacer's row-by-row layers, which torch cannot capture; capture a model under "
                         "fixed_rows or one as loaded")
    fixed = fixed_rows_of(model)
    if fixed is None:
        rows = tuple(rows)
        if not rows or any(not isinstance(r, int) or r < 1 for r in rows):
            raise ValueError(f"capture: rows must be row counts >= 1, got {rows!r}")
    if not static_cache_supported(model):
        raise ValueError(f"capture: {type(model).__name__} has sliding-window or other cache layers; a captured step "
                         "needs a static cache of full-attention layers")
    if fixed is not None:
        forward: FixedRowsForward = model.forward
        forward.inner = CapturedForward(model, forward.original, (fixed,), compile_config)
    else:
        model.forward = CapturedForward(model, model.forward, rows, compile_config)
    model._pacer_static_cache = True
    model._pacer_capture_lock = threading.RLock()  # one call at a time: its graphs and static caches are shared
    if getattr(model, "generation_config", None) is not None:
        model._pacer_disable_compile = model.generation_config.disable_compile  # uncapture puts it back
        model.generation_config.disable_compile = True
    return model


def uncapture(model: nn.Module) -> nn.Module:
    """Undo [`capture`]: `model`'s calls run eagerly again, over the caches PACER gives an uncaptured model; its
    static caches are let go. Returns the model."""
    forward = getattr(model, "forward", None)
    if isinstance(forward, CapturedForward):
        model.forward = forward.eager
    elif isinstance(getattr(forward, "inner", None), CapturedForward):
        forward.inner = forward.original
    else:
        raise ValueError("uncapture: this model's steps are not captured")
    if getattr(model, "generation_config", None) is not None and "_pacer_disable_compile" in vars(model):
        model.generation_config.disable_compile = model._pacer_disable_compile
    for name in ("_pacer_static_cache", "_pacer_capture_lock", "_pacer_static_caches", "_pacer_disable_compile"):
        vars(model).pop(name, None)
    return model


def captured_calls(model: nn.Module) -> collections.Counter | None:
    """How `model`'s calls ran since [`capture`]: ("graph" | "eager", rows) -> calls; None if not captured."""
    forward = getattr(model, "forward", None)
    forward = getattr(forward, "inner", forward)
    return forward.calls if isinstance(forward, CapturedForward) else None
