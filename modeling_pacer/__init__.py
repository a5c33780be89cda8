"""pacer: speculative decoding with an adaptive draft length (PACER) for transformers.

    from modeling_pacer import PacerConfig, PacerHead, enable_pacer
    enable_pacer(target)                      # the one line of setup: binds PACER's generate
    out = target.generate(ids, assistant_model=draft, pacer_head=head, max_new_tokens=128)
"""

import types

from .configuration_pacer import PacerConfig
from .custom_generate.generate import (
    DecodeStep,
    PacerGenerateOutput,
    PacerStats,
    generate,
    pacer_decoding,
)
from .custom_generate.lookup import NgramLookup
from .custom_generate.policies import (
    POLICIES,
    SVIP,
    Confidence,
    DraftView,
    ExpectedThroughput,
    FixedLength,
    Heuristic,
    Pacer,
    SpecDecPP,
    StoppingPolicy,
    head_policy,
    make_policy,
    policy_from_dict,
)
from .costs import CostModel, host_costs
from .custom_generate.steps import new_cache
from .gpu.captured import capture, captured_calls, uncapture
from .exact import make_exact  # importing registers attn_implementation="pacer_exact" (cpu/exact_attention.py)
from .cpu.exact_linear import exact_linears
from .modeling_pacer import PacerHead, PacerHeadOutput


def enable_pacer(model):
    """Bind PACER's `generate` to this one model instance (no global patching), as transformers itself
    does for a model repo that ships `custom_generate/generate.py`.

    Afterwards `model.generate(..., assistant_model=draft, pacer_head=head)` (or `stopping_policy=...`)
    runs PACER decoding; without those two arguments `model.generate` behaves exactly as before.
    Returns the model, so `target = enable_pacer(AutoModelForCausalLM.from_pretrained(...))` reads well.
    """
    model.generate = types.MethodType(generate, model)
    return model


__all__ = [
    "capture",
    "captured_calls",
    "uncapture",
    "new_cache",
    "POLICIES",
    "SVIP",
    "Confidence",
    "CostModel",
    "DecodeStep",
    "DraftView",
    "ExpectedThroughput",
    "FixedLength",
    "Heuristic",
    "Pacer",
    "PacerConfig",
    "PacerGenerateOutput",
    "PacerHead",
    "PacerHeadOutput",
    "PacerStats",
    "SpecDecPP",
    "StoppingPolicy",
    "enable_pacer",
    "exact_linears",
    "generate",
    "host_costs",
    "make_exact",
    "head_policy",
    "NgramLookup",
    "make_policy",
    "policy_from_dict",
    "pacer_decoding",
]
