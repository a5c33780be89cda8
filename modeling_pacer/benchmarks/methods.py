"""The methods a benchmark compares: the target alone, transformers' assisted generation as shipped and its prompt
lookup, every stopping policy of our loop (with free drafts looked up in the sequence, `pacer-lookup`), and (opt-in)
plain llama.cpp on the target's GGUF, its prompt-lookup decoding, its server, and the server speculating with the
pair's draft (llama.cpp's own speculative decoding). Each method is one `generate` call on the same inputs."""

import contextlib
import copy
import re
from dataclasses import dataclass, field, replace
from typing import Callable

import torch
from transformers import GenerationMixin

from ..custom_generate.policies import (
    SVIP,
    Confidence,
    ExpectedThroughput,
    FixedLength,
    Heuristic,
    Pacer,
    SpecDecPP,
    StoppingPolicy,
    head_rule,
    make_policy,
)
from ..draft_vocab import output_head
from .llamaserver import Speculation, server_binary


@dataclass
class Method:
    """One way to generate. `policy` builds a fresh stopping policy per call (None: not our loop);
    `assistant_config` overrides the draft's generation config for transformers' assisted methods."""

    name: str
    # "target", "hf", "pacer", "llamacpp" (llama-cpp-python), "llama-server" (llama.cpp's server: `speculation` set,
    # speculating with the pair's draft) or "unfused" (the target alone on its eager layers)
    family: str
    policy: Callable[[], StoppingPolicy] | None = None
    assistant_config: dict = field(default_factory=dict)
    needs_head: bool = False
    needs_costs: bool = False  # `policy` takes this machine's CostModel (a cost-aware rule)
    costs: object = None  # the CostModel a live run measured; replay passes each trace file's own
    lookup: int = 0  # > 0: drafts looked up in the sequence, at most this many tokens a lookup (pacer's NgramLookup,
    # transformers' prompt_lookup_num_tokens, llama.cpp's LlamaPromptLookupDecoding num_pred_tokens)
    draft_window: int = 0  # > 0: the draft reads only the prompt's last this many tokens (pacer_draft_window)
    draft_vocab: int = 0  # > 0: the draft's LM head computes only this many tokens (modeling_pacer.draft_vocab)
    draft_head: object = None  # that head, built from the draft's own by the run (draft_vocab.reduced_head)
    layerwise: bool = False  # fused models call their layers' kernels one layer at a time (fused_layers.layer_by_layer)
    int8_prompt: bool = False  # the int4 draft reads its prompt on the int8 path, not the bf16 tiles (untiled_prompts)
    speculation: Speculation | None = None  # llama-server's draft-model speculation (llamaserver.py)

    def make_policy(self, costs=None) -> StoppingPolicy:
        """A fresh policy; a cost-aware one gets `costs`, else the method's own (the live run's)."""
        if not self.needs_costs:
            return self.policy()
        costs = costs if costs is not None else self.costs
        if costs is None:
            raise ValueError(f"{self.name} needs this machine's cost model (modeling_pacer.costs.host_costs).")
        return self.policy(costs)

    @property
    def opt_in(self) -> bool:
        """Chosen only when `--methods` names it: it needs an optional extra (llama.cpp), a fused target, or a
        head the run builds for it (a reduced draft vocabulary)."""
        return self.family in LLAMA_CPP or self.family == "unfused" or self.draft_vocab > 0 or self.layerwise \
            or self.int8_prompt

    @property
    def own_numerics(self) -> bool:
        """Computes another function than the torch target (llama.cpp's quantized kernels, a fused target's eager
        layers): its output is not expected to equal the target's, so it is never counted as a mismatch."""
        return self.family in LLAMA_CPP or self.family == "unfused"


LLAMA_CPP = ("llamacpp", "llama-server")  # the families that run llama.cpp, not the torch models


def _hf(name: str, **assistant_config) -> Method:
    return Method(name, "hf", assistant_config=assistant_config)


def _ours(name: str, policy: Callable[..., StoppingPolicy], needs_head: bool = False, costs=None,
          needs_costs: bool = False, lookup: int = 0, draft_window: int = 0, draft_vocab: int = 0) -> Method:
    return Method(name, "pacer", policy=policy, needs_head=needs_head, needs_costs=needs_costs, costs=costs,
                  lookup=lookup, draft_window=draft_window, draft_vocab=draft_vocab)


# prompt tokens the draft reads in the `pacer-window-*` methods
DRAFT_WINDOWS = (32, 64, 128)
# tokens the draft's LM head computes in the `pacer-vocab-*` methods (alone, and with a window of 128 tokens)
DRAFT_VOCABS = (65536,)


# llama.cpp's tuned speculation: drafting stops under the draft's probability 0.75, at most 16 tokens (its defaults
# are 0 and 3)
TUNED_SPECULATION = dict(n_max=16, p_min=0.75)

# tokens a lookup proposes: transformers' and llama.cpp's defaults for their prompt lookup are 10; pacer's rule
# usually stops before its 16
LOOKUP_TOKENS = {"pacer": 16, "hf": 10, "llamacpp": 10}


def all_methods(gammas=(1, 2, 3, 4, 5, 6), head_config=None, costs=None, do_sample: bool = False) -> dict[str, Method]:
    """Every method by name. `pacer` is the head's default rule for the mode (`do_sample`: its config's
    `stopping_rule`, or `sampling_stopping_rule` for sampled decoding where set: the tuned block rule,
    `pacer-blocks`, or the cost-aware one, on the head's estimate, `pacer-throughput`, or the draft's,
    `throughput`); SpecDec++ uses the head's length cap; the cost-aware rules use `costs`, this machine's
    measured cost model."""
    longest = head_config.max_draft_length if head_config else 16
    # the head's own default rule (its config's stopping_rule)
    pacer = _ours("pacer", lambda *c: make_policy(None, head_config, *c, do_sample=do_sample), needs_head=True,
                  costs=costs, needs_costs=head_config is not None and head_rule(head_config, do_sample)[0] == "throughput")
    methods = [
        Method("target", "target"),
        # opt-in: a fused target (load_pair's default for w4a8) alone on transformers' eager layers over the same
        # kernels, the step fusing saves; its numbers are the eager layers'
        Method("target-unfused", "unfused"),
        # opt-in: the target alone and PACER (its costs, its decisions) with the fused models' layers called one at a
        # time: the same tokens and work as `target` / `pacer`, what running every layer in one kernel call saves
        Method("target-layerwise", "target", layerwise=True),
        _hf("hf-assisted"),  # transformers' defaults: 20 tokens, confidence threshold 0.4
        _hf("hf-heuristic", num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0),
        *[_hf(f"hf-constant-{g}", num_assistant_tokens=g, num_assistant_tokens_schedule="constant",
              assistant_confidence_threshold=0.0) for g in gammas],
        *[_ours(f"fixed-{g}", lambda g=g: FixedLength(g)) for g in gammas],
        _ours("heuristic", lambda: Heuristic(initial_gamma=5)),
        _ours("confidence", lambda: Confidence()),
        _ours("svip", lambda: SVIP()),
        _ours("specdec++", lambda: SpecDecPP(max_draft_length=head_config.max_draft_length if head_config else 16),
              needs_head=True),
        pacer,
        # the same, the draft reading only the prompt's last K tokens: its prefill costs K tokens
        *[replace(pacer, name=f"pacer-window-{k}", draft_window=k) for k in DRAFT_WINDOWS],
        # the same, the draft's LM head over its most frequent tokens only: a cheaper draft step (its costs measured
        # with that head by the run)
        *[replace(pacer, name=f"pacer{'-window-' + str(k) if k else ''}-vocab-{n}", draft_window=k, draft_vocab=n)
          for n in DRAFT_VOCABS for k in (0, 128)],
        replace(pacer, name="pacer-layerwise", layerwise=True),
        # opt-in: PACER with the int4 draft's prompt on the int8 path where it would go to the AMX-BF16 tiles: the same
        # policy and target, the draft's prompt computed as before the tiles (what they save)
        replace(pacer, name="pacer-int8-prompt", int8_prompt=True),
        _ours("pacer-blocks", lambda: Pacer.from_config(head_config), needs_head=True),  # the paper's block rule
        _ours("throughput", lambda c: ExpectedThroughput(c, "draft", longest), costs=costs, needs_costs=True),
        _ours("pacer-throughput", lambda c: ExpectedThroughput(c, "head", longest), needs_head=True, costs=costs,
              needs_costs=True),
        # free drafts: tokens looked up in the sequence open each draft, the cost-aware rule on the draft's
        # probability (the default head's) deciding, the draft model extending
        _ours("pacer-lookup", lambda c: ExpectedThroughput(c, "draft", longest), costs=costs, needs_costs=True,
              lookup=LOOKUP_TOKENS["pacer"]),
        Method("hf-prompt-lookup", "hf", lookup=LOOKUP_TOKENS["hf"]),  # transformers' prompt lookup, no draft model
        Method("llama.cpp", "llamacpp"),  # opt-in: plain greedy llama.cpp on the target's GGUF file
        Method("llama.cpp-lookup", "llamacpp", lookup=LOOKUP_TOKENS["llamacpp"]),  # opt-in: its prompt lookup
        # opt-in: llama.cpp's server, plain (the speculative methods' reference: the same build), speculating with the
        # pair's draft at llama.cpp's defaults, and with the adaptive stop its docs suggest for a CPU
        Method("llama.cpp-server", "llama-server"),
        Method("llama.cpp-speculative", "llama-server", speculation=Speculation()),
        Method("llama.cpp-speculative-tuned", "llama-server", speculation=Speculation(**TUNED_SPECULATION)),
    ]
    return {m.name: m for m in methods}


def select_methods(patterns: list[str] | None, available: dict[str, Method]) -> list[Method]:
    """Methods whose names match any of the glob-like `patterns` (`fixed-*`), in registry order.

    No patterns: every method but the opt-in ones (`llama.cpp`, which needs an optional extra). A chosen
    `llama.cpp` whose library is missing raises `LlamaCppNotInstalledError` (an ImportError and a
    ValueError, naming the install command) here, so pacer-bench reports it before any model loads.
    """
    if not patterns:
        return [m for m in available.values() if not m.opt_in]
    regexes = [re.compile("^" + re.escape(p).replace(r"\*", ".*") + "$") for p in patterns]
    chosen = [m for name, m in available.items() if any(r.match(name) for r in regexes)]
    unknown = [p for p, r in zip(patterns, regexes) if not any(r.match(n) for n in available)]
    if unknown:
        raise ValueError(f"Unknown methods {unknown}; available: {sorted(available)}")
    if any(m.family == "llamacpp" for m in chosen):
        from .llamacpp import require_llama_cpp

        require_llama_cpp()
    if any(m.family == "llama-server" for m in chosen):
        server_binary()  # LlamaServerNotInstalledError
    return chosen


def sampling_settings(temperature: float, top_p: float = 1.0) -> dict:
    """`generate`'s settings for the benchmark's sampled decoding: the target's distribution at `temperature`,
    cut to the smallest set of tokens holding `top_p` of it (1.0: nothing cut; no top-k, whatever the model's
    generation config says), and exactly `max_new_tokens` tokens (end of sequence suppressed), so that every
    method's time covers the same number of tokens, which a sampled output's length would not otherwise guarantee."""
    if not temperature > 0:
        raise ValueError(f"sampling needs a temperature > 0, got {temperature} (greedy decoding: leave --do-sample out)")
    if not 0 < top_p <= 1:
        raise ValueError(f"top-p must be in (0, 1], got {top_p} (1.0 keeps every token)")
    return dict(do_sample=True, temperature=temperature, top_k=0, top_p=top_p, min_p=None)


def run_method(method: Method, target, draft, head, input_ids: torch.Tensor, max_new_tokens: int, llamacpp=None,
               sampling: dict | None = None):
    """Generation with `method`: greedy, or with `sampling` (from [`sampling_settings`]) sampled, every method
    then producing exactly `max_new_tokens` tokens. Returns `(sequences (1, L + new), PacerStats or None)`.

    `llamacpp`: the [`LlamaCppRunner`] that a llama.cpp method runs (built once per benchmark), or one per such
    method by name."""
    settings = dict(max_new_tokens=max_new_tokens, do_sample=False)
    if sampling is not None:
        if method.family in LLAMA_CPP:
            raise ValueError("the llama.cpp method runs greedy decoding only: leave it out of a sampled benchmark")
        settings.update(sampling, min_new_tokens=max_new_tokens)
    if method.family in LLAMA_CPP:
        runner = llamacpp.get(method.name) if isinstance(llamacpp, dict) else llamacpp
        if runner is None:
            raise ValueError("the llama.cpp method needs a LlamaCppRunner (run_live builds one when it is selected)")
        return runner.generate(input_ids, max_new_tokens), None
    if method.layerwise:
        from ..cpu.fused_layers import layer_by_layer

        with layer_by_layer(target, draft):
            return run_method(replace(method, layerwise=False), target, draft, head, input_ids, max_new_tokens,
                              llamacpp, sampling)
    if method.int8_prompt:
        from ..cpu.quantization import untiled_prompts

        with untiled_prompts(draft):
            return run_method(replace(method, int8_prompt=False), target, draft, head, input_ids, max_new_tokens,
                              llamacpp, sampling)
    if method.family == "target":
        return GenerationMixin.generate(target, input_ids, **settings), None
    if method.family == "unfused":
        from ..cpu.fused_layers import eager_layers

        with eager_layers(target):
            return GenerationMixin.generate(target, input_ids, **settings), None
    if method.family == "hf" and method.lookup:  # transformers' prompt lookup: candidates from the prompt, no draft
        return GenerationMixin.generate(target, input_ids, prompt_lookup_num_tokens=method.lookup, **settings), None
    if method.family == "hf":
        # transformers reads the assisted settings from the draft's own generation config
        saved = copy.deepcopy(draft.generation_config)
        try:
            for key, value in method.assistant_config.items():
                setattr(draft.generation_config, key, value)
            return GenerationMixin.generate(target, input_ids, assistant_model=draft, **settings), None
        finally:
            draft.generation_config = saved
    from ..custom_generate.generate import generate

    lookup = dict(max_tokens=method.lookup) if method.lookup else None
    if method.draft_vocab and method.draft_head is None:
        raise ValueError(f"{method.name} needs the draft's reduced LM head (draft_vocab.reduced_head): the run builds it")
    with output_head(draft, method.draft_head) if method.draft_vocab else contextlib.nullcontext():
        out = generate(target, input_ids, assistant_model=draft, stopping_policy=method.make_policy(),
                       pacer_head=head if method.needs_head else None, pacer_lookup=lookup,
                       pacer_draft_window=method.draft_window or None, return_dict_in_generate=True, **settings)
    return out.sequences, out.pacer_stats
