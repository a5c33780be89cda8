"""KV caches. Sliding-window attention (Mistral, Qwen2 with a window on some layers, Gemma 3 mixing sliding and
full layers), with windows shorter than the generation and drafts rejected often, so that both caches are cropped
past the window: greedy output token for token the target's own `generate`, and sampling runs through. Every
cache PACER cannot roll back (static, quantized, offloaded, prefilled) is a clear ValueError before any forward."""

import copy
import warnings

import pytest
import torch
from transformers import (
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    QuantizedCache,
    Qwen2Config,
    Qwen2ForCausalLM,
    StaticCache,
)

from modeling_pacer import SVIP, Confidence, FixedLength, Pacer, enable_pacer
from modeling_pacer.custom_generate.generate import _OUTPUT_CACHE_FIELD, CACHE_NAMES

from conftest import VOCAB, make_head, make_pair

WINDOW = 8
NEW_TOKENS = 40  # five windows
SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=512, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _mistral(seed: int, layers: int):
    """Every layer sliding (Mistral's `sliding_window`)."""
    torch.manual_seed(seed)
    return MistralForCausalLM(MistralConfig(num_hidden_layers=layers, sliding_window=WINDOW, **SMALL)).eval()


def _qwen2(seed: int, layers: int):
    """Qwen2's `use_sliding_window`: the layers from `max_window_layers` on are sliding, the first ones full."""
    torch.manual_seed(seed)
    config = Qwen2Config(num_hidden_layers=layers, use_sliding_window=True, sliding_window=WINDOW,
                         max_window_layers=layers // 2, **SMALL)
    assert "sliding_attention" in config.layer_types and "full_attention" in config.layer_types
    return Qwen2ForCausalLM(config).eval()


def _gemma3(seed: int, layers: int):
    """Gemma 3: sliding and full layers alternating (`layer_types`)."""
    torch.manual_seed(seed)
    config = Gemma3TextConfig(num_hidden_layers=layers, sliding_window=WINDOW, head_dim=8,
                              layer_types=["sliding_attention", "full_attention"] * (layers // 2), **SMALL)
    return Gemma3ForCausalLM(config).eval()


ARCHS = {"mistral": _mistral, "qwen2": _qwen2, "gemma3": _gemma3}


def _sliding_pair(arch: str, kind: str):
    """A target and a draft of the same architecture (with its sliding layers). "random": an unrelated draft,
    rejected at its first token nearly always; "noisy": the target's weights plus noise, partly accepted."""
    target = enable_pacer(ARCHS[arch](seed=1, layers=4))
    if kind == "random":
        return target, ARCHS[arch](seed=2, layers=2)
    draft = copy.deepcopy(target)
    torch.manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(0.1 * p.std() * torch.randn_like(p))
    return target, draft


@pytest.fixture(scope="module")
def pairs():
    """`(arch, kind) -> (target, draft, head, [(prompt, greedy output)])`, built once."""
    built = {}

    def get(arch, kind):
        if (arch, kind) not in built:
            target, draft = _sliding_pair(arch, kind)
            g = torch.Generator().manual_seed(0)
            prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (1, 5, 2 * WINDOW + 3)]
            cases = [(p, target.generate(p, do_sample=False, max_new_tokens=NEW_TOKENS)) for p in prompts]
            built[arch, kind] = target, draft, make_head(draft, max_draft_length=16), cases
        return built[arch, kind]

    return get


POLICIES = {
    "fixed1": lambda: FixedLength(1),
    "fixed2": lambda: FixedLength(2),
    "fixed3": lambda: FixedLength(3),
    "fixed4": lambda: FixedLength(4),
    "fixed5": lambda: FixedLength(5),
    "fixed-by-name": lambda: "fixed",
    "svip-by-name": lambda: "svip",
    "svip": lambda: SVIP(threshold=0.55),
    "confidence": lambda: Confidence(threshold=0.3),
    "pacer-head": lambda: Pacer(block_size=2, threshold=0.4, growth=1.1, max_draft_length=8),
}


def _sliding_layers(cache):
    return [layer for layer in cache.layers if getattr(layer, "is_sliding", False)]


@pytest.mark.parametrize("kind", ["random", "noisy"])
@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("arch", list(ARCHS))
def test_sliding_window_greedy_identical_to_target(pairs, arch, policy, kind):
    target, draft, head, cases = pairs(arch, kind)
    rejected_past_window = 0
    for prompt, expected in cases:
        out = target.generate(prompt, assistant_model=draft, pacer_head=head, stopping_policy=POLICIES[policy](),
                              do_sample=False, max_new_tokens=NEW_TOKENS, return_dict_in_generate=True)
        assert out.sequences.tolist() == expected.tolist(), (arch, policy, kind, prompt.shape[1])
        length = prompt.shape[1]
        for step in out.pacer_stats.steps:
            rejected_past_window += step.accepted < step.drafted and length > WINDOW
            length += step.emitted
        # the crop after every step trims the sliding layers back to their window
        cache = getattr(out, _OUTPUT_CACHE_FIELD)
        assert _sliding_layers(cache) and all(layer.keys.shape[-2] <= WINDOW - 1 for layer in _sliding_layers(cache))
    assert rejected_past_window > 0  # both caches really were rolled back past the window


@pytest.mark.parametrize("kind", ["random", "noisy"])
@pytest.mark.parametrize("arch", list(ARCHS))
def test_sliding_window_sampling_runs(pairs, arch, kind):
    """Seeded sampling (rejection sampling, resampled tokens) through the same crops: it completes."""
    target, draft, head, cases = pairs(arch, kind)
    rejected = 0
    for policy in (FixedLength(3), Pacer(block_size=2, threshold=0.4, max_draft_length=8)):
        for prompt, _ in cases:
            torch.manual_seed(0)
            out = target.generate(prompt, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                                  do_sample=True, temperature=0.8, top_k=20, max_new_tokens=NEW_TOKENS,
                                  return_dict_in_generate=True)
            assert out.sequences.shape == (1, prompt.shape[1] + NEW_TOKENS)
            assert out.sequences[0, : prompt.shape[1]].tolist() == prompt[0].tolist()
            rejected += sum(s.drafted > s.accepted for s in out.pacer_stats.steps)
    assert rejected > 0


# --------------------------------------------------------------------------------------------------
# caches that cannot be rolled back: refused before any forward
# --------------------------------------------------------------------------------------------------
PROMPT = torch.tensor([[3, 1, 4, 1, 5]])


@pytest.fixture(scope="module")
def llama():
    target, draft = make_pair("llama", "llama", "noisy")
    return target, draft


@pytest.fixture
def forwards(llama):
    """Counts the forwards of the target and the draft during a test."""
    calls = []
    hooks = [model.register_forward_hook(lambda *_: calls.append(1)) for model in llama]
    yield calls
    for hook in hooks:
        hook.remove()


def _pacer(llama, **kwargs):
    target, draft = llama
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # `past_key_values=` is deprecated on transformers >= 5.24
        return target.generate(PROMPT, assistant_model=draft, stopping_policy="fixed", max_new_tokens=8, **kwargs)


def _static(llama):
    return StaticCache(config=llama[0].config, max_cache_len=64)


def _fp8(llama):
    return QuantizedCache(backend="fp8", config=llama[0].config)  # the backend needing no extra package


def _offloaded(llama):
    return DynamicCache(config=llama[0].config, offloading=True)


def _prefilled(llama):
    cache = DynamicCache(config=llama[0].config)
    with torch.no_grad():
        llama[0](PROMPT, use_cache=True, **{CACHE_NAMES[0]: cache})
    return cache


# the names a user writes: `past_key_values` (deprecated on >= 5.24, still accepted) and the installed one's own
CACHE_KEYWORDS = sorted({"past_key_values", CACHE_NAMES[0]})


@pytest.mark.parametrize("keyword", CACHE_KEYWORDS)
@pytest.mark.parametrize(
    "build, message",
    [
        (_static, r"needs a DynamicCache it can roll back.*StaticCache"),
        (_fp8, r"needs a DynamicCache it can roll back.*QuantizedCache with Fp8QuantizedLayer"),
        (_offloaded, r"does not support an offloaded cache.*cache_implementation='dynamic'"),
        (_prefilled, r"needs an empty cache; the one passed already holds 5 tokens"),
    ],
    ids=["static", "quantized-fp8", "offloaded", "prefilled"],
)
def test_passed_cache_refused_before_any_forward(llama, forwards, keyword, build, message):
    cache = build(llama)
    forwards.clear()
    with pytest.raises(ValueError, match=message):
        _pacer(llama, **{keyword: cache})
    assert not forwards


@pytest.mark.parametrize(
    "implementation, extra, message",
    [
        ("offloaded_static", {}, r"cache_implementation='offloaded_static'.*offloaded cache"),
        ("sliding_window", {}, r"cache_implementation='sliding_window'.*DynamicCache"),
        # the default backend (quanto) is not installed: refused before transformers asks for it
        ("quantized", {}, r"cache_implementation='quantized'.*DynamicCache"),
        ("quantized", {"cache_config": {"backend": "fp8"}}, r"cache_implementation='quantized'.*DynamicCache"),
        ("offloaded", {}, r"cache_implementation='offloaded'.*offloaded cache.*cache_implementation='dynamic'"),
    ],
    ids=["offloaded_static", "sliding_window", "quantized", "quantized-fp8", "offloaded"],
)
def test_cache_implementation_refused_before_any_forward(llama, forwards, implementation, extra, message):
    with pytest.raises(ValueError, match=message):
        _pacer(llama, cache_implementation=implementation, **extra)
    assert not forwards


def test_cache_implementation_from_the_models_generation_config(llama, forwards):
    target, _ = llama
    saved = target.generation_config.cache_implementation
    target.generation_config.cache_implementation = "quantized"
    try:
        with pytest.raises(ValueError, match=r"'quantized' \(in the model's generation_config\).*'dynamic'"):
            _pacer(llama)
        assert not forwards
        # overriding it per call, as the message says, works
        assert _pacer(llama, cache_implementation="dynamic").tolist() == target.generate(
            PROMPT, do_sample=False, max_new_tokens=8, cache_implementation="dynamic").tolist()
    finally:
        target.generation_config.cache_implementation = saved


@pytest.mark.parametrize("how", ["dynamic", "hybrid", "empty DynamicCache"])
def test_dynamic_cache_is_lossless(llama, how):
    target, _ = llama
    kwargs = {CACHE_NAMES[0]: DynamicCache(config=target.config)} if how == "empty DynamicCache" else {
        "cache_implementation": how}
    expected = target.generate(PROMPT, do_sample=False, max_new_tokens=8)
    assert _pacer(llama, **kwargs).tolist() == expected.tolist()
