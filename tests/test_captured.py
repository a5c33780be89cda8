"""Static caches and captured steps (`modeling_pacer.capture`, `cache_implementation="static"`) on the CPU: every
method token for token the target alone over a static cache of the same size, with steps captured and not, in float32
and bfloat16; the sampled distribution the target's; the roll-back of a static cache in place; which calls run as
graphs; the caches a captured model reuses; and the refusals. On the CPU the captured function is compiled by dynamo
with `fullgraph=True` (a graph break fails the test) for torch's "cudagraphs" backend, which on a CPU runs the traced
graph without CUDA graphs: its numerics are not the eager model's (`pacer-bench device` shows the difference), so a
row computed once eagerly and once compiled would show here. The logic, not a GPU's graphs (tests/gpu/ runs those)."""

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache

from modeling_pacer import (
    CostModel, ExpectedThroughput, capture, captured_calls, generate, make_exact, new_cache, uncapture,
)
from modeling_pacer.custom_generate.steps import cache_length, crop_cache, static_capacity, static_size
from modeling_pacer.gpu.fixed_rows import fixed_rows

from conftest import make_head, make_model, make_pair

VOCAB = 97
# the target's fixed row shape in the identity tests: one row, so that every row is computed alone by one function,
# exact by construction on any CPU (a row's bits in a call of several can depend on its slot in the CPU's kernels,
# which vary by host); a GPU's row shape of 16 is tested where it is claimed, in tests/gpu
ROWS = 1
ON_CPU = CompileConfig(fullgraph=True, dynamic=False, backend="cudagraphs")
PROMPT_LENGTHS = (1, 7, 20)
NEW_TOKENS = (1, 9, 30)


def _prompts():
    return [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS]


def _pair(dtype, exact: str, captured: bool):
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    target, draft = target.to(dtype), draft.to(dtype)
    if exact == "fixed-rows":
        fixed_rows(target, ROWS)  # a GPU's way: every target call ROWS tokens
    else:
        make_exact(target)  # the CPU's way: every row alone
    if captured:
        capture(target, compile_config=ON_CPU)
        capture(draft, compile_config=ON_CPU)
    return target, draft


def _methods(draft):
    from test_greedy import POLICIES

    head = make_head(draft)
    methods = {name: dict(pacer_head=head, stopping_policy=make()) for name in ("fixed4", "svip", "pacer-b3", "throughput-draft")
               for make in [POLICIES[name]]}
    methods["throughput by name (costs measured over the static caches)"] = dict(stopping_policy="throughput")
    methods["free drafts"] = dict(pacer_lookup=True, stopping_policy=ExpectedThroughput(
        CostModel({n: 1.0 for n in range(1, 20)}, 0.05), max_draft_length=8))
    return methods


@pytest.mark.parametrize("exact, captured", [("fixed-rows", False), ("fixed-rows", True), ("rows-alone", False)],
                         ids=["fixed-rows-eager", "fixed-rows-captured", "rows-alone-eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_every_method_over_static_caches_is_the_target_alone(dtype, exact, captured):
    target, draft = _pair(dtype, exact, captured)
    failures, drafted, rejected = [], 0, 0
    for ids in _prompts():
        for new in NEW_TOKENS:
            length = ids.shape[1] + new
            alone = target.generate(ids, max_new_tokens=new, do_sample=False, output_logits=True,
                                    return_dict_in_generate=True, past_key_values=new_cache(target, length, static=True))
            for name, kwargs in _methods(draft).items():
                out = target.generate(ids, assistant_model=draft, max_new_tokens=new, do_sample=False, output_logits=True,
                                      cache_implementation="static", return_dict_in_generate=True, **kwargs)
                # the tokens, and every emitted token's logits bit for bit: a row computed by another function (an
                # eager call among compiled ones) shows here even where it flips no token
                if not (torch.equal(out.sequences, alone.sequences)
                        and all(torch.equal(a.float(), b.float()) for a, b in zip(out.logits, alone.logits))):
                    failures.append((name, ids.shape[1], new))
                drafted += sum(s.drafted for s in out.pacer_stats.steps)
                rejected += sum(s.drafted > s.accepted for s in out.pacer_stats.steps)
                assert isinstance(out.past_key_values if hasattr(out, "past_key_values") else out.cache, StaticCache)
    assert not failures, f"{len(failures)} runs differ from the target alone: {failures[:10]}"
    assert drafted > 0 and rejected > 0  # drafts were made and rolled back
    if captured:  # the steps really ran as graphs: the target's every call after the first, the draft's steps
        target_calls, draft_calls = captured_calls(target), captured_calls(draft)
        if exact == "fixed-rows":
            assert target_calls["graph", ROWS] > 10 * target_calls["eager", ROWS]
        assert draft_calls["graph", 1] > 0 and draft_calls["graph", 2] > 0


def test_a_fixed_row_shape_over_static_caches_pads_and_crops():
    """Calls of 8 rows over static caches (the GPU's exact way): PACER, captured, gives the tokens of the target alone
    through the same function, and logits within float64's rounding of them (not bitwise: on a CPU a row's bits in a
    call of 8 may depend on its slot); the padding never stays in the cache."""
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    target, draft = fixed_rows(target.double(), 8), draft.double()
    capture(target, compile_config=ON_CPU)
    for ids in _prompts():
        alone = target.generate(ids, max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True,
                                past_key_values=new_cache(target, ids.shape[1] + 20, static=True))
        out = target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=20, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        assert torch.equal(out.sequences, alone.sequences)
        torch.testing.assert_close(torch.stack(out.logits), torch.stack(alone.logits), rtol=0, atol=1e-9)
        cache = out.past_key_values if hasattr(out, "past_key_values") else out.cache
        assert cache_length(cache) == out.sequences.shape[1] - 1  # the padding's positions rolled back
    assert captured_calls(target)["graph", 8] > 0


def test_every_call_of_a_captured_row_count_is_compiled():
    """The first call on a fresh cache runs the compiled function too: the same input twice, into a fresh cache and
    into the same cache emptied, gives the same bits. (With a first call run eagerly, the version before this rule,
    these differed by 0.004 on an AMD EPYC: torch's cudagraphs backend does not round a 4-row call of this model as
    the eager model does. Where a CPU rounds both alike, this cannot fail; it never fails wrongly.)"""
    from modeling_pacer.benchmarks.device import random_model

    model = fixed_rows(random_model("tiny", torch.bfloat16), 4)
    capture(model, compile_config=ON_CPU)
    ids = (torch.arange(7) * 7919 % 512).view(1, -1)
    first = model(input_ids=ids, past_key_values=new_cache(model, 16)).logits
    again = model(input_ids=ids, past_key_values=new_cache(model, 16)).logits
    assert torch.equal(first, again)
    assert captured_calls(model) == {("graph", 4): 4}


def test_sampled_distribution_over_captured_steps_is_the_targets():
    import test_sampling as s

    target, draft = make_pair("llama", "llama", "random", vocab=s.V)
    target_probs, draft_probs = s._exact_distribution(target), s._exact_distribution(draft)
    # the calls these short runs make: the draft reads the 4-token prompt and a token, then steps; the target
    # verifies up to 4 drafted tokens
    capture(draft, rows=(1, 2, 5), compile_config=ON_CPU)
    capture(target, rows=(2, 3, 4, 5), compile_config=ON_CPU)
    counts, drafted, accepted = s.sample_outcomes(target, draft, make_head(draft, max_draft_length=8), s.POLICIES["pacer"])
    assert 0 < accepted < drafted
    assert s._chi_square_p_value(counts, target_probs, s.RUNS) > 1e-3
    assert s._chi_square_p_value(counts, draft_probs, s.RUNS) < 1e-6
    assert captured_calls(draft)["graph", 5] > s.RUNS / 2 and captured_calls(target)["graph", 2] > s.RUNS / 2


def test_a_static_cache_rolls_back_in_place():
    """The roll-back moves the write position back without moving a tensor (a graph reads their addresses), and
    the next call overwrites what was dropped: its logits are those of a cache that never held it."""
    model = make_model("qwen2", seed=1, hidden=64, layers=2, vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(0))
    cache = new_cache(model, 20, static=True)
    model(input_ids=ids[:, :8], past_key_values=cache)
    addresses = [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr())
                 for layer in cache.layers]
    model(input_ids=ids[:, 8:11], past_key_values=cache)  # a draft of three, then two of them rejected
    crop_cache(cache, 9)
    assert cache_length(cache) == 9
    assert addresses == [(layer.keys.data_ptr(), layer.values.data_ptr(), layer.cumulative_length.data_ptr())
                         for layer in cache.layers]
    after = model(input_ids=ids[:, 11:12], past_key_values=cache).logits
    fresh = new_cache(model, 20, static=True)
    model(input_ids=ids[:, :8], past_key_values=fresh)
    model(input_ids=ids[:, 8:9], past_key_values=fresh)
    want = model(input_ids=ids[:, 11:12], past_key_values=fresh).logits
    # close, not bitwise: position 8's key was computed in a call of three rows there, of one here (the end-to-end
    # test above compares whole runs bitwise); what this shows is that the dropped positions 9 and 10 are not read
    torch.testing.assert_close(after, want, rtol=1e-5, atol=1e-5)
    dropped = model(input_ids=ids[:, 10:11], past_key_values=new_cache(model, 20, static=True)).logits
    assert not torch.allclose(after, dropped, atol=1e-3)


def test_static_cache_sizes_and_a_captured_models_reuse():
    model = make_model("qwen2", seed=1, hidden=64, layers=2, vocab=VOCAB)
    assert static_size(model, 10) == 256 and static_size(model, 256) == 256 and static_size(model, 257) == 512
    fixed_rows(model, 8)
    assert static_size(model, 250) == 512  # room for the padding of the fixed row shape
    one, two = new_cache(model, 30, static=True), new_cache(model, 30, static=True)
    assert one is not two and static_capacity(one) == 256  # not captured: a new cache each time
    capture(model, compile_config=ON_CPU)
    one = new_cache(model, 30)
    model(input_ids=torch.zeros(1, 8, dtype=torch.long), past_key_values=one)
    assert cache_length(one) == 8
    again = new_cache(model, 40)
    assert again is one and cache_length(again) == 0  # the same tensors, emptied
    assert new_cache(model, 400) is not one


def test_which_calls_run_as_graphs():
    """Every call of a captured row count over a static cache runs compiled, the first one too (a row computed by
    the eager kernels once and the compiled ones later could round differently); other calls run eagerly."""
    model = make_model("qwen2", seed=1, hidden=64, layers=2, vocab=VOCAB)
    capture(model, rows=(1, 2), compile_config=ON_CPU)
    cache = new_cache(model, 30)
    ids = torch.zeros(1, 9, dtype=torch.long)
    model(input_ids=ids[:, :1], past_key_values=cache)  # the first call, into an empty cache
    model(input_ids=ids[:, 1:6], past_key_values=cache)  # a row count not captured
    model(input_ids=ids[:, 6:7], past_key_values=cache)
    model(input_ids=ids[:, 7:9], past_key_values=cache)
    model(input_ids=ids[:, :1], past_key_values=cache, output_hidden_states=True)
    model(input_ids=ids[:, :1], past_key_values=DynamicCache(config=model.config))  # not a static cache
    assert captured_calls(model) == {("graph", 1): 3, ("graph", 2): 1, ("eager", 5): 1, ("eager", 1): 1}
    assert cache_length(cache) == 10


def test_refusals():
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    ids = torch.zeros(1, 3, dtype=torch.long)
    with pytest.raises(ValueError, match="builds and sizes both caches itself"):
        target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=4,
                        cache_implementation="static", past_key_values=new_cache(target, 7, static=True))
    with pytest.raises(ValueError, match="is not supported"):
        target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=4,
                        cache_implementation="offloaded_static")
    capture(draft, compile_config=ON_CPU)
    with pytest.raises(ValueError, match="captured already"):
        capture(draft, compile_config=ON_CPU)
    with pytest.raises(ValueError, match="apply fixed_rows .make_exact. first"):
        fixed_rows(draft, ROWS)
    with pytest.raises(ValueError, match="row counts"):
        capture(target, rows=(0,))
    with pytest.raises(ValueError, match="rows alone"):
        capture(make_exact(make_model("qwen2", seed=1, hidden=64, layers=2, vocab=VOCAB)), compile_config=ON_CPU)
    with pytest.raises(TypeError, match="CompileConfig"):
        capture(target, compile_config=dict(backend="eager"))
    from test_caches import _mistral

    sliding = _mistral(seed=1, layers=2)
    with pytest.raises(ValueError, match="sliding-window"):
        capture(sliding, compile_config=ON_CPU)
    with pytest.raises(ValueError, match="full-attention layers only"):
        generate(sliding, ids, assistant_model=_mistral(seed=2, layers=1), stopping_policy="fixed", max_new_tokens=4,
                 cache_implementation="static")
    fixed_rows(target, 4)
    with pytest.raises(ValueError, match="does not fit this StaticCache"):
        target(input_ids=ids, past_key_values=StaticCache(config=target.config, max_cache_len=3))


def test_uncapture_gives_the_model_back():
    model = make_model("qwen2", seed=1, hidden=64, layers=2, vocab=VOCAB)
    plain_forward, compile_before = model.forward, model.generation_config.disable_compile
    capture(model, compile_config=ON_CPU)
    assert model.generation_config.disable_compile is True and captured_calls(model) is not None
    uncapture(model)
    assert model.forward == plain_forward and model.generation_config.disable_compile == compile_before
    assert captured_calls(model) is None and not getattr(model, "_pacer_static_cache", False)
    assert type(new_cache(model, 10)).__name__ == "DynamicCache"
    with pytest.raises(ValueError, match="not captured"):
        uncapture(model)
    fixed_rows(model, ROWS)  # allowed again once uncaptured


def test_concurrent_calls_on_a_captured_model_each_get_their_own_answer():
    """A captured model's static caches and graphs are shared: two threads decoding with it take turns (a lock), and
    each gets what it would alone."""
    import threading

    target, draft = _pair(torch.float32, "fixed-rows", captured=True)
    prompts = _prompts()
    alone = [target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=20, do_sample=False)
             for ids in prompts]
    results = {}

    def run(i):
        results[i] = target.generate(prompts[i], assistant_model=draft, stopping_policy="fixed", max_new_tokens=20,
                                     do_sample=False)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(torch.equal(results[i], alone[i]) for i in range(len(prompts)))
