"""A draft window (`pacer_draft_window=K`): the draft reads only the prompt's last K tokens. Lossless as every path:
token for token the target alone's greedy output (several policies, prompts, lengths, dtypes, dynamic and static
caches), the sampled distribution the target's; the draft's prefill really reads K tokens; bad windows refused."""

import pytest
import torch

from modeling_pacer import CostModel, ExpectedThroughput, new_cache

from conftest import make_head, make_pair

VOCAB = 97
PROMPT_LENGTHS = (1, 6, 23)
NEW_TOKENS = (1, 8, 30)


def _prompts():
    return [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_a_draft_window_is_the_target_alone(dtype, static):
    from test_greedy import POLICIES

    from modeling_pacer import make_exact

    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    target, draft = make_exact(target.to(dtype)), draft.to(dtype)
    head = make_head(draft)
    methods = {name: dict(pacer_head=head, stopping_policy=POLICIES[name]()) for name in ("fixed4", "svip", "pacer-b3")}
    methods["throughput"] = dict(stopping_policy=ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 20)}, 0.05),
                                                                    max_draft_length=8))
    failures, drafted = [], 0
    for ids in _prompts():
        for new in NEW_TOKENS:
            cache = dict(past_key_values=new_cache(target, ids.shape[1] + new, static=True)) if static else {}
            alone = target.generate(ids, max_new_tokens=new, do_sample=False, **cache)
            for window in (1, 4, 64):
                for name, kwargs in methods.items():
                    out = target.generate(ids, assistant_model=draft, max_new_tokens=new, do_sample=False,
                                          pacer_draft_window=window, return_dict_in_generate=True,
                                          cache_implementation="static" if static else None, **kwargs)
                    if not torch.equal(out.sequences, alone):
                        failures.append((name, window, ids.shape[1], new))
                    drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert not failures, f"{len(failures)} runs differ from the target alone: {failures[:10]}"
    assert drafted > 0


def test_the_draft_reads_only_the_window():
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    seen = []
    draft.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs["input_ids"].shape[1]),
                                    with_kwargs=True)
    ids = _prompts()[2]  # 23 tokens
    target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=12, pacer_draft_window=5)
    assert seen[0] == 5 + 1  # the window and the target's first token
    assert max(seen[1:]) <= 2
    seen.clear()
    target.generate(ids, assistant_model=draft, stopping_policy="fixed", max_new_tokens=12)
    assert seen[0] == 23 + 1


def test_sampled_distribution_with_a_draft_window_is_the_targets():
    import test_sampling as s

    target, draft = make_pair("llama", "llama", "random", vocab=s.V)
    target_probs, draft_probs = s._exact_distribution(target), s._exact_distribution(draft)
    counts, drafted, accepted = {}, 0, 0
    head = make_head(draft, max_draft_length=8)
    for seed in range(s.RUNS):
        torch.manual_seed(seed)
        out = target.generate(s.PROMPT, assistant_model=draft, pacer_head=head, stopping_policy=s.POLICIES["pacer"](),
                              pacer_draft_window=2, return_dict_in_generate=True, **s.SETTINGS)
        outcome = tuple(out.sequences[0, s.PROMPT.shape[1]:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        drafted += sum(step.drafted for step in out.pacer_stats.steps)
        accepted += sum(step.accepted for step in out.pacer_stats.steps)
    assert 0 < accepted < drafted
    assert s._chi_square_p_value(counts, target_probs, s.RUNS) > 1e-3
    assert s._chi_square_p_value(counts, draft_probs, s.RUNS) < 1e-6


@pytest.mark.parametrize("window", [0, -3, 2.5, True, "64"])
def test_a_bad_window_is_refused_before_any_forward(window):
    target, draft = make_pair("qwen2", "qwen2", "noisy", hidden=64, layers=2, vocab=VOCAB)
    calls = []
    target.register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match="pacer_draft_window must be a number of tokens"):
        target.generate(_prompts()[1], assistant_model=draft, stopping_policy="fixed", max_new_tokens=4,
                        pacer_draft_window=window)
    assert not calls
