"""Loading a pair: the registry's default offline, or any target/draft (repo ids, folders, .gguf files)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import time
import warnings
from dataclasses import dataclass, field, replace

import torch

from ..extras import require
from .gguf import ensure_converted, source_gguf
from .registry import DEFAULT_PAIR, PAIRS, ModelSource, PairSpec

# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
@dataclass
class LoadedPair:
    """A loaded pair. `target` and `draft` are in eval mode; `tokenizer` is the target's.

    `load_seconds` maps "target"/"draft"/"tokenizer" to wall-clock load time (s).
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    name: str
    target_source: ModelSource
    draft_source: ModelSource
    load_seconds: dict[str, float] = field(default_factory=dict)
    dtype: torch.dtype = torch.float32  # the target's
    exact: bool = False  # the target's verification is bitwise row-invariant (`make_exact`)
    quantize_target: str | None = None  # the target's weight-only quantization (TARGET_QUANTIZATIONS), if any
    fused_target: bool = False  # the target's decoder layers run in pacer's kernels (`fuse_target_layers`)
    aligned_draft: str | None = None  # the LoRA adapter merged into the draft (`load_pair(aligned_draft=...)`), if any

    @property
    def setting(self) -> str:
        """How the target runs: its dtype, "exact" where its verification is, and its weight quantization
        (e.g. "bfloat16 exact", "bfloat16 exact, int4 weights")."""
        return (str(self.dtype).removeprefix("torch.") + (" exact" if self.exact else "")
                + (f", {self.quantize_target} weights" if self.quantize_target else "")
                + (", fused layers" if self.fused_target else ""))

    def describe(self) -> str:
        """One line for reports: the pair, the target's dtype and whether its verification is exact."""
        return f"{self.name}, target {self.setting}" + (f", draft aligned by {self.aligned_draft}" if self.aligned_draft else "")


def resolve_pair(name_or_target: str | os.PathLike | PairSpec, draft=None) -> PairSpec:
    """A PairSpec from a registry name, a PairSpec, or a target (repo id / folder / .gguf) plus `draft`.

    With a registry name, `draft` (if given) replaces the registered draft, and with it the pair's draft setting
    and head (made for the registered draft).
    """
    if isinstance(name_or_target, PairSpec):
        spec = name_or_target
    elif isinstance(name_or_target, str) and name_or_target in PAIRS:
        spec = PAIRS[name_or_target]
    else:
        if draft is None:
            raise ValueError(
                f"{name_or_target!r} is not a registered pair ({sorted(PAIRS)}); "
                "to load any other target, pass `draft=` too"
            )
        target = ModelSource.from_string(name_or_target)
        return PairSpec(name=f"{target.describe()} / {draft}", target=target, draft=_as_source(draft))
    return spec if draft is None else replace(spec, draft=_as_source(draft), quantize_draft=None, head=None)


def _as_source(src) -> ModelSource:
    return src if isinstance(src, ModelSource) else ModelSource.from_string(src)


def model_location(source: ModelSource, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> tuple[str, dict]:
    """`(path, extra from_pretrained kwargs)` for a source; converts registry GGUF parts on first use."""
    if source.parts is not None:
        return str(ensure_converted(source.parts, pacer_cache, pair_name=pair_name)), {}
    if source.gguf_file:
        require("pairs", f"Loading {source.gguf_file} (a GGUF file, read by transformers' GGUF loader)", ("gguf", "accelerate"))
    return source.path, ({"gguf_file": source.gguf_file} if source.gguf_file else {})


# the target's weight-only quantizations, as quantize_from_gguf's (other, activations): the GGUF's Q4_K tensors
# stay 4-bit, the rest (Q6_K, the LM head) become int4 (fastest of torch's) or int8 (closer to the file), with
# bf16 activations on torch's kernels; w4a8: int8 activations on pacer's VNNI kernels (a verification block
# of a few tokens costs about one step); see modeling_pacer.cpu.quantization
TARGET_QUANTIZATIONS = {"int4": ("int4", "bfloat16"), "int4+int8": ("int8", "bfloat16"), "w4a8": ("int8", "int8")}
# the draft's, with how reports name them: dynamic int8 (float32 activations), or int4 weights (bf16 activations)
DRAFT_QUANTIZATIONS = {"int8": "dynamic-int8", "int4": "int4"}


def quantize_dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every `nn.Linear` (weights int8 with one scale per output channel,
    activations quantized per call), in place.

    Used on the draft: its precision changes which tokens it proposes, never what the target accepts, so
    speculative decoding stays lossless; on CPU it makes the draft's forward ~2.3x cheaper. Per-channel
    scales, not torch's default per-tensor ones: same speed, but one scale for the whole 151936-row
    lm_head (and each projection) loses enough precision to cut the draft's agreement with the target
    visibly (default pair, teacher-forced greedy match over the target's first 32 tokens on the first
    prompt of HumanEval/GSM8K/MT-Bench: 0.97/0.94/0.50 per-channel, 0.88/0.84/0.34 per-tensor, fp32
    1.00/0.97/0.63 -- a small sample, but the same direction on all three).
    Needs an fp32 model on CPU. The model's other modules (embeddings, norms) stay fp32.

    Not row-invariant: the input is quantized with one scale per call, so a long forward (as `record_trace`
    runs over a whole output) computes other logits than decoding steps do (up to 4.8 apart on the default
    draft, benchmarks/results/2026-11-30-draft-row-invariance): traces, and heads trained on them, then
    describe another draft than the one that runs. The weight-only int4 draft (`quantize_draft="int4"`) has
    no such gap.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch 2.13 flags the eager torch.ao API as deprecated in favour of torchao; it still works and
        # needs no extra package, and the warning would otherwise be shown on every load.
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning, FutureWarning))
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def cpu_has_fast_bf16() -> bool:
    """True when this CPU computes bf16 matrix products natively (AVX512-BF16 or AMX), where a bf16
    model runs faster than float32; without them torch emulates bf16 and float32 is the better choice."""
    from ..host import cpuinfo_field

    flags = (cpuinfo_field("flags") or "").split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_dtype(dtype: torch.dtype | str, device_map=None) -> torch.dtype:
    """A torch dtype from a dtype or its name; `"auto"` picks bf16 where it is fast (a CPU with native bf16,
    or a GPU that supports it) and float32 elsewhere."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device_map not in (None, "cpu") and torch.cuda.is_available():
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be a torch dtype, 'auto' or one of {sorted(DTYPES)}, got {dtype!r}.")
    return DTYPES[dtype]


def load_model(
    source: ModelSource | str, *, dtype: torch.dtype = torch.float32, device_map=None, pacer_cache=None,
    pair_name: str = DEFAULT_PAIR, **kwargs,
) -> torch.nn.Module:
    """One causal LM from a source, in eval mode. `kwargs` go to `AutoModelForCausalLM.from_pretrained`."""
    from transformers import AutoModelForCausalLM

    path, extra = model_location(_as_source(source), pacer_cache, pair_name=pair_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map, **extra, **kwargs)
    return model.eval()


def load_tokenizer(source: ModelSource | str, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR, **kwargs):
    """The tokenizer of a source (`AutoTokenizer.from_pretrained`)."""
    from transformers import AutoTokenizer

    path, extra = model_location(_as_source(source), pacer_cache, pair_name=pair_name)
    return AutoTokenizer.from_pretrained(path, **extra, **kwargs)


def load_pair(
    name_or_target: str | os.PathLike | PairSpec = DEFAULT_PAIR,
    draft: str | os.PathLike | ModelSource | None = None,
    *,
    dtype: torch.dtype | str = "auto",
    draft_dtype: torch.dtype | str | None = None,
    device_map=None,
    quantize_draft: bool | str | None = None,
    quantize_target: str | None = None,
    fuse_target: bool | None = None,
    exact: bool = True,
    load_in_8bit_target: bool = False,
    aligned_draft: str | os.PathLike | None = None,
    draft_vocab: int | None = None,
    pacer_cache: str | os.PathLike | None = None,
    **kwargs,
) -> LoadedPair:
    """Load a target/draft pair and the target's tokenizer.

    Args:
        name_or_target: a registered pair name (default: the offline Qwen2.5-Coder 1.5B/0.5B pair), a
            PairSpec, or the target as a Hub repo id, local folder or `.gguf` file (then `draft` is required).
        draft: the draft as a repo id / folder / `.gguf` / ModelSource; overrides a registered pair's draft.
        dtype: target dtype (and the draft's unless `draft_dtype` is given, or `quantize_draft`, which needs
            float32): a torch dtype, its name, or `"auto"` (default): bf16 on a CPU with native bf16 (or a
            bf16-capable GPU), float32 elsewhere. `LoadedPair.dtype` says which was used.
        device_map: passed to both `from_pretrained` calls (e.g. `"auto"`).
        quantize_draft: quantize the draft's Linear layers (CPU): "int4" for 4-bit weights in groups of 32 with
            bf16 activations, True or "int8" for dynamic int8 (float32 draft), False (or "none") for none; None
            (default): the registered pair's setting (`PairSpec.quantize_draft`: int4 for the default pair), none
            for any other pair. Only speed changes: the target decides every token.
        quantize_target: keep a GGUF target's 4-bit weights 4-bit (CPU): "int4" repacks its Q4_K tensors
            unchanged for torch's int4 kernel (bf16 activations) and requantizes the rest (Q6_K, the LM head)
            to int4; "int4+int8" makes the rest int8 (closer to the file, slower); "w4a8" keeps the Q4_K
            tensors exactly (float16 scales too) for pacer's VNNI kernels, int8 activations, the rest int8:
            a verification block of a few tokens costs about one decoding step (AVX512-VNNI and a C++
            compiler; [`modeling_pacer.cpu.kernels`]). Needs a GGUF target (a
            registered pair, or a `.gguf` file) and bf16 (`dtype="auto"` picks it).
            See [`modeling_pacer.cpu.quantization.quantize_from_gguf`].
        fuse_target: run a "w4a8" target's decoder layers in two of pacer's kernel calls each, every forward
            ([`modeling_pacer.cpu.fused_layers.fuse_target_layers`]): about 1.4x cheaper decoding steps than
            transformers' eager layer over the same kernels, rows still bitwise alone; the fused target's numbers are
            its own (close to the eager layer's, not equal), in plain decoding as under PACER. None (default): with
            "w4a8"; True without it is refused.
        exact: make the target's verification forward bitwise equal, row for row, to single-token steps
            ([`modeling_pacer.make_exact`]), so greedy speculative decoding reproduces the target's own
            output exactly; the target alone runs the same function. Not with `load_in_8bit_target`.
        load_in_8bit_target: load the target with bitsandbytes 8-bit weights (bitsandbytes runs on CPU).
        aligned_draft: a LoRA adapter of the draft (a folder or Hub repo id, as `pacer-train align` writes
            it): merged into the draft's weights before any `quantize_draft`, so the aligned draft runs as
            fast as the plain one. Only speed changes: the target decides every token.
        draft_vocab: the draft's LM head computes only this many tokens, the most frequent ones and every special
            token ([`modeling_pacer.draft_vocab`]): a cheaper draft step; the others are never drafted. Only speed
            changes: the target decides every token. None (default): the full vocabulary.
        pacer_cache: pacer cache (default `$PACER_CACHE` or `~/.cache/pacer`), used by registry GGUF pairs.
            (Named so that `cache_dir`, the Hub download cache, can still reach `from_pretrained`.)
        kwargs: more `from_pretrained` arguments for both models (e.g. `attn_implementation`, `cache_dir`);
            the tokenizer is loaded with defaults.

    Raises:
        WeightsNotInstalledError: a registered pair's weights are missing; the message names the command.
    """
    spec = resolve_pair(name_or_target, draft)
    if aligned_draft is not None:
        require("align", "An aligned draft (a peft adapter)", ("peft",))
    on_cpu = device_map in (None, "cpu") or not torch.accelerator.is_available()  # where the models will sit
    if quantize_draft is None and not on_cpu:
        quantize_draft = False  # the registered pair's draft setting is a CPU kernel's: a GPU draft runs unquantized
    quantize_draft = _check_draft_quantization(spec.quantize_draft if quantize_draft is None else quantize_draft)
    if quantize_draft and not on_cpu:
        raise ValueError(f"quantize_draft={quantize_draft!r} runs on the CPU only (pacer's and torch's CPU kernels); "
                         f"with device_map={device_map!r} pass quantize_draft=False")
    if quantize_target is not None:
        _check_target_quantization(quantize_target, spec.target, dtype, load_in_8bit_target, device_map)
        dtype = torch.bfloat16
    if fuse_target is None:
        fuse_target = quantize_target == "w4a8"
    elif fuse_target and quantize_target != "w4a8":
        raise ValueError(f"fuse_target=True runs a W4A8 target's layers in pacer's kernels: it needs "
                         f"quantize_target='w4a8' (got {quantize_target!r})")
    dtype = resolve_dtype(dtype, device_map)
    if draft_dtype is None:
        draft_dtype = default_draft_dtype(quantize_draft, dtype)
    draft_dtype = resolve_dtype(draft_dtype, device_map)
    if quantize_draft == "int8" and draft_dtype != torch.float32:
        raise ValueError("quantize_draft='int8' needs an fp32 draft (dynamic int8 quantizes fp32 Linear weights)")
    if exact and load_in_8bit_target:
        raise ValueError("exact=True makes nn.Linear layers row-invariant; an 8-bit bitsandbytes target has none: "
                         "pass exact=False (and check its outputs: its kernels' row invariance is not tested)")
    if load_in_8bit_target:  # after the settings it cannot go with are refused
        require("quantization", "load_in_8bit_target")
    target_kwargs = dict(kwargs)
    if load_in_8bit_target:
        target_kwargs["quantization_config"] = _bnb_8bit_config()
    common = dict(device_map=device_map, pacer_cache=pacer_cache, pair_name=spec.name)
    seconds = {}

    t0 = time.perf_counter()
    # models first: on a registry pair this also assembles + converts on first use, which the tokenizer reuses
    target = load_model(spec.target, dtype=dtype, **common, **target_kwargs)
    if quantize_target is not None:
        from ..cpu.quantization import place_on_huge_pages, quantize_from_gguf

        gguf_file = source_gguf(spec.target, pacer_cache, pair_name=spec.name) or _hub_gguf(spec.target)
        other, activations = TARGET_QUANTIZATIONS[quantize_target]
        quantize_from_gguf(target, gguf_file, other=other, activations=activations)
        place_on_huge_pages(target)  # its 4-bit weights, streamed once a forward
    if exact:
        from ..exact import make_exact

        make_exact(target)
    fused_target = False
    if fuse_target:
        from ..cpu.fused_layers import fuse_target_layers

        # before any forward: every call the target makes then runs these layers
        fused_target = fuse_target_layers(target) == target.config.get_text_config().num_hidden_layers
        if not fused_target:
            raise ValueError(f"fuse_target: {target.config.model_type} target's layers are not all W4A8 layers of a "
                             f"Llama/Qwen2 architecture pacer's kernels compute; pass fuse_target=False")
    seconds["target"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(spec.target, pacer_cache, pair_name=spec.name)
    seconds["tokenizer"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    draft_model = load_draft(spec.draft, draft_dtype, quantize_draft, aligned_draft, draft_vocab=draft_vocab,
                             tokenizer=tokenizer, **common, **kwargs)
    seconds["draft"] = time.perf_counter() - t0
    return LoadedPair(target, draft_model, tokenizer, spec.name, spec.target, spec.draft, seconds, dtype, exact,
                      quantize_target, fused_target=fused_target,
                      aligned_draft=None if aligned_draft is None else str(aligned_draft))


def default_draft_dtype(quantize_draft: str | None, dtype: torch.dtype | str) -> torch.dtype | str:
    """The dtype a draft loads in when none is given: what its quantization needs (dynamic int8 quantizes fp32
    weights; int4 runs bf16 activations), else the target's `dtype`."""
    return {"int8": torch.float32, "int4": torch.bfloat16}.get(quantize_draft, dtype)


# an int4 draft on torch's int4 kernel (a CPU without pacer's) reads a prompt of at least this many tokens with a
# dense bf16 copy of its weights: that kernel costs in proportion to the rows, a bf16 matmul about one weight read (the
# two cross near 24 rows on an AMD EPYC: benchmarks/results/2026-12-03-draft-dense-prefill). On pacer's int4 kernel
# the prompt stays int4: as fast as the copy up to 256 tokens and faster below, 5-9% slower from 512, and no copy to
# hold (benchmarks/results/2026-12-03-draft-kernel-prefill)
DRAFT_DENSE_ROWS = 32


def load_draft(source: ModelSource | str, dtype: torch.dtype, quantize_draft: str | None = None,
               aligned_draft: str | os.PathLike | None = None, *, draft_vocab: int | None = None, tokenizer=None,
               dense_rows: int | None | str = "auto", **kwargs) -> torch.nn.Module:
    """A draft as `load_pair` makes it: loaded in `dtype`, the `aligned_draft` adapter merged in, its LM head
    reduced to `draft_vocab` tokens (with `tokenizer`, whose special tokens it keeps), then its Linear layers
    quantized (`quantize_draft`: one of DRAFT_QUANTIZATIONS, or None; an int4 draft runs calls of `dense_rows`
    rows or more, its prompt, on a dense bf16 copy: None for int4 everywhere; "auto": int4 everywhere on pacer's
    kernel, DRAFT_DENSE_ROWS on torch's). `kwargs` go to `load_model`."""
    if not (dense_rows is None or dense_rows == "auto" or (isinstance(dense_rows, int) and dense_rows >= 2)):
        raise ValueError(f"dense_rows must be an integer >= 2, None or 'auto', got {dense_rows!r}")
    if draft_vocab is not None and tokenizer is None:
        raise ValueError("draft_vocab needs the tokenizer (its special tokens stay draftable)")
    draft_model = load_model(source, dtype=dtype, **kwargs)
    if aligned_draft is not None:
        draft_model = merge_adapter(draft_model, aligned_draft)
    if draft_vocab is not None:
        from ..draft_vocab import reduce_draft_vocabulary

        reduce_draft_vocabulary(draft_model, draft_vocab, tokenizer=tokenizer)
    if quantize_draft:
        if any(p.device.type != "cpu" for p in draft_model.parameters()):
            raise ValueError("quantize_draft runs on CPU only (torch's int8/int4 kernels); the draft was placed elsewhere")
        if quantize_draft == "int8":
            draft_model = quantize_dynamic_int8(draft_model)
        else:
            from ..cpu.quantization import place_on_huge_pages, quantize_linears, tile_prompts

            from ..cpu import kernels

            # pacer's int4 kernel where this CPU runs it (about twice torch's speed at one row on a small draft's
            # shapes: benchmarks/results/2026-12-03-draft-int4-kernel), else torch's
            kernel = "pacer" if kernels.available() else "torch"
            if dense_rows == "auto":
                dense_rows = None if kernel == "pacer" else DRAFT_DENSE_ROWS
            draft_model = quantize_linears(draft_model, "int4", dense_rows=dense_rows, int4_kernel=kernel)
            # its prompt on AMX-BF16 tiles where the CPU has them (about twice the int8 path's speed from 64 tokens)
            tile_prompts(draft_model)
            place_on_huge_pages(draft_model)  # its int4 weights, streamed once a step
            from ..cpu.fused_layers import fuse_draft_layers

            # and its one-token steps two kernel calls a decoder layer, not ~40 torch operators (Llama / Qwen2)
            fuse_draft_layers(draft_model)
    if "attn_implementation" not in kwargs:  # one the caller names is kept
        from ..cpu.exact_attention import kernel_attention

        kernel_attention(draft_model)  # a bf16 draft on CPU: pacer's attention kernel, cheaper per step than sdpa's
    return draft_model


def row_variant_linears(model: torch.nn.Module) -> int:
    """How many of `model`'s layers compute a row differently depending on the other rows of the call (torch's
    dynamic-int8 Linear: one input scale per call). 0 means a long forward gives each position what a
    decoding step would, up to floating-point rounding."""
    return sum(1 for m in model.modules() if type(m).__module__.startswith("torch.ao.nn.quantized.dynamic"))


def merge_adapter(model: torch.nn.Module, adapter: str | os.PathLike) -> torch.nn.Module:
    """`model` with the peft adapter `adapter` (folder or Hub repo id) merged into its weights, in eval mode.

    Raises ValueError when `adapter` is no adapter, or one made for a model of another shape."""
    require("align", "An aligned draft (a peft adapter)", ("peft",))
    from peft import PeftConfig, PeftModel

    try:
        config = PeftConfig.from_pretrained(str(adapter))
    except (OSError, ValueError) as error:
        raise ValueError(f"aligned_draft {adapter}: no peft adapter there (adapter_config.json): {error}") from None
    try:
        merged = PeftModel.from_pretrained(model, str(adapter), config=config).merge_and_unload()
    except (RuntimeError, ValueError, KeyError) as error:  # e.g. a size mismatch: an adapter of another model
        raise ValueError(f"aligned_draft {adapter} does not fit this draft ({type(model).__name__}, "
                         f"hidden size {model.config.get_text_config().hidden_size}): {error}") from None
    return merged.eval()


def _check_draft_quantization(quantize_draft) -> str | None:
    """`quantize_draft` as one of DRAFT_QUANTIZATIONS or None for none (True means "int8", as before "int4" existed)."""
    if quantize_draft in (None, False, "", "none"):
        return None
    if quantize_draft is True:
        return "int8"
    if quantize_draft not in DRAFT_QUANTIZATIONS:
        raise ValueError(f"quantize_draft must be True/False or one of {tuple(DRAFT_QUANTIZATIONS)}, got {quantize_draft!r}")
    return quantize_draft


def _check_target_quantization(quantize_target, source: ModelSource, dtype, load_in_8bit_target, device_map) -> None:
    """Clear errors, before anything loads, for a target quantization this target or setting cannot have."""
    from ..cpu.quantization import int4_kernel_available

    if quantize_target not in TARGET_QUANTIZATIONS:
        raise ValueError(f"quantize_target must be one of {sorted(TARGET_QUANTIZATIONS)} or None, got {quantize_target!r}")
    if source.parts is None and source.gguf_file is None:
        raise ValueError(f"quantize_target={quantize_target!r} keeps a GGUF file's 4-bit weights; the target "
                         f"{source.describe()} is not a GGUF file (pass a .gguf target or a registered pair)")
    if dtype not in ("auto", torch.bfloat16, "bfloat16", "bf16"):
        raise ValueError(f"quantize_target={quantize_target!r} runs the target in bfloat16 (the int4 kernel's fast "
                         f"path); dtype={dtype!r} cannot be combined with it")
    if load_in_8bit_target:
        raise ValueError("quantize_target and load_in_8bit_target are two different quantizations: choose one")
    if device_map not in (None, "cpu"):
        raise ValueError("quantize_target uses torch's CPU kernels: load the pair without device_map")
    if TARGET_QUANTIZATIONS[quantize_target][1] == "int8":
        from ..cpu import kernels

        if not kernels.available():
            raise ValueError(f"quantize_target={quantize_target!r} needs pacer's VNNI kernels: "
                             f"{kernels.unavailable_reason()}; quantize_target='int4' runs on torch's kernels")
    elif not int4_kernel_available():
        raise ValueError(f"quantize_target needs torch's CPU int4 kernels, which torch {torch.__version__} lacks")


def _hub_gguf(source: ModelSource) -> str:
    """A Hub repo's `.gguf` file, from the Hub cache (where loading the model just put it)."""
    from huggingface_hub import hf_hub_download

    return hf_hub_download(source.path, source.gguf_file)


@dataclass
class PairArguments:
    """The models, chosen as in every pacer command (`--pair`, `--target`, `--draft`, `--quantize-draft`,
    `--quantize-target`, `--dtype`, `--no-exact`)."""

    pair: str | None = field(
        default=None, metadata={"help": f"a registered pair (default: {DEFAULT_PAIR}, offline from PyPI)"},
    )
    target: str | None = field(
        default=None, metadata={"help": "target repo id, folder or .gguf (with --draft), instead of --pair"},
    )
    draft: str | None = field(default=None, metadata={"help": "draft repo id, folder or .gguf (replaces the pair's draft)"})
    quantize_draft: str | None = field(
        default=None,
        metadata={"help": "the draft's quantization: cheaper drafting, still lossless (only the target's numerics "
                          "matter); default: the pair's (int4 for the default pair, none for another); int4 is "
                          "4-bit weights with bf16 activations (the same function in one forward as in decoding "
                          "steps, so its traces describe it), int8 (or the flag alone) dynamic int8, none the "
                          "unquantized draft; a head is trained on (and recorded with) the draft it will serve",
                  "choices": (*DRAFT_QUANTIZATIONS, "none"), "nargs": "?", "const": "int8"},
    )
    quantize_target: str | None = field(
        default=None,
        metadata={"help": "keep a GGUF target's 4-bit weights 4-bit: int4 (torch's CPU int4 kernel, bf16 "
                          "activations; the rest, Q6_K and the LM head, requantized to int4), int4+int8 (the rest "
                          "int8), or w4a8 (pacer's VNNI kernels, int8 activations: a verification block of a few "
                          "tokens costs about one step; the rest int8)",
                  "choices": tuple(TARGET_QUANTIZATIONS)},
    )

    dtype: str = field(
        default="auto",
        metadata={"help": "the target's dtype: auto (bf16 on a CPU with native bf16, else float32), bfloat16 or float32"},
    )
    exact: bool = field(
        default=True,
        metadata={"help": "bitwise-exact verification (make_exact on the target); --no-exact turns it off"},
    )
    aligned_draft: str | None = field(
        default=None,
        metadata={"help": "a LoRA adapter of the draft (folder or Hub repo id, from `pacer-train align`), merged "
                          "into it before any --quantize-draft", "metavar": "ADAPTER"},
    )
    draft_vocab: int | None = field(
        default=None,
        metadata={"help": "the draft's LM head computes only the N most frequent tokens (and every special token): "
                          "a cheaper draft step, still lossless (the others are never drafted); default: the full "
                          "vocabulary", "metavar": "N", "type": int},
    )
    fuse_target: bool = field(
        default=True,
        metadata={"help": "a w4a8 target's decoder layers run in two of pacer's kernel calls each (cheaper steps; its "
                          "numbers its own, the same alone and under PACER); --no-fuse-target runs transformers' "
                          "eager layers over the same kernels"},
    )

    def __post_init__(self):
        unset = self.quantize_draft is None  # the pair's own setting, known once the pair is
        try:  # a recipe's `quantize_draft: true` is int8, the flag's meaning before int4 drafts existed
            self.quantize_draft = _check_draft_quantization(self.quantize_draft)
        except ValueError:
            raise ValueError(f"--quantize-draft must be one of {(*DRAFT_QUANTIZATIONS, 'none')} (a recipe's true means "
                             f"int8, false none), got {self.quantize_draft!r}") from None
        if self.draft_vocab is not None and int(self.draft_vocab) < 1:
            raise ValueError(f"--draft-vocab must be a positive number of tokens, got {self.draft_vocab}")
        try:
            resolve_dtype(self.dtype)
        except ValueError as error:
            raise ValueError(f"--dtype: {error}") from None
        # the names alone (registered pair, or a target with its draft): nothing is read or loaded yet
        if self.target and not self.draft and self.target not in PAIRS:
            raise ValueError(f"--target {self.target} needs --draft (the draft model that proposes its tokens).")
        try:
            spec = resolve_pair(self.target or self.pair or DEFAULT_PAIR, self.draft)
        except (KeyError, ValueError) as error:
            raise ValueError(f"{'--target' if self.target else '--pair'}: {error}") from None
        if unset:  # from here on, the setting that runs (None: no quantization)
            self.quantize_draft = spec.quantize_draft
        if self.quantize_target:
            try:
                _check_target_quantization(self.quantize_target, spec.target, self.dtype, False, None)
            except ValueError as error:
                raise ValueError(f"--quantize-target: {error}") from None

    @property
    def is_default(self) -> bool:
        """No model was named: the registry's default pair, whose draft's Hub id the card can name."""
        return not (self.pair or self.target or self.draft)


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """`--pair`, `--target`, `--draft`, `--quantize-draft`, `--quantize-target`, `--dtype`, `--no-exact`,
    `--aligned-draft`, `--draft-vocab`, `--no-fuse-target` on an argparse parser, from [`PairArguments`]."""
    for f in dataclasses.fields(PairArguments):
        flag = "--" + f.name.replace("_", "-")
        extra = {k: f.metadata[k] for k in ("choices", "nargs", "const", "metavar", "type") if k in f.metadata}
        if f.type in (bool, "bool") and f.default is True:
            parser.add_argument("--no-" + f.name.replace("_", "-"), dest=f.name, action="store_false", help=f.metadata["help"])
        elif f.type in (bool, "bool"):
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            parser.add_argument(flag, default=f.default, help=f.metadata["help"], **extra)


def pair_from_args(args, **kwargs) -> LoadedPair:
    """`load_pair` from the arguments that `add_pair_arguments` defines."""
    return load_pair(**load_arguments(args), **kwargs)


def load_arguments(args) -> dict:
    """[`load_pair`]'s keyword arguments from those that `add_pair_arguments` defines (plain values: a child process
    can load the same pair from them)."""
    # `PairArguments` has resolved the pair's default already: None there means none
    return dict(name_or_target=args.target or args.pair or DEFAULT_PAIR, draft=args.draft,
                quantize_draft=args.quantize_draft or False, quantize_target=args.quantize_target, dtype=args.dtype,
                exact=args.exact, aligned_draft=getattr(args, "aligned_draft", None),
                draft_vocab=getattr(args, "draft_vocab", None),
                fuse_target=None if getattr(args, "fuse_target", True) else False)


def _bnb_8bit_config():
    from transformers import BitsAndBytesConfig

    require("quantization", "load_in_8bit_target")
    return BitsAndBytesConfig(load_in_8bit=True)


def tokenizers_match(a, b) -> bool:
    """True when two tokenizers map every token string to the same id (and have the same special tokens)."""
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


