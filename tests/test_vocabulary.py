"""A draft whose embedding table stops short of the target's padded one (Qwen2.5-7B's 152064 rows against 0.5B's
151936): accepted, lossless greedy and sampled, never proposing the target's padding ids; anything else refused
before any forward, naming both sizes."""

import itertools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper

from modeling_pacer import FixedLength, Pacer
from modeling_pacer.custom_generate import generate as loop

from conftest import make_head, make_model

PROMPTS = [torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[999, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6]])]


def _padded_pair(target_vocab=1024, draft_vocab=1000):
    target = loop_enabled(make_model("llama", seed=1, vocab=target_vocab))
    draft = make_model("llama", seed=1, vocab=draft_vocab)
    with torch.no_grad():  # the draft: the target's weights on its rows, plus noise (mostly agrees)
        for (name, p), q in zip(draft.named_parameters(), target.parameters()):
            rows = min(p.shape[0], q.shape[0])
            p[:rows].copy_(q[:rows])
            p.add_(0.2 * p.std() * torch.randn_like(p))
        # the target's padding rows score high now and then, as a random model's would: the draft is fed such ids
        target.lm_head.weight[draft_vocab:].mul_(3.0)
    return target, draft


def loop_enabled(model):
    from modeling_pacer import enable_pacer

    return enable_pacer(model)


@pytest.mark.parametrize("policy", ["fixed", "svip", "pacer", "heuristic"])
def test_a_draft_with_a_shorter_table_is_lossless_greedy(policy):
    target, draft = _padded_pair()
    head = make_head(draft)
    padding_seen, drafted = False, 0
    for prompt in PROMPTS:
        for new in (1, 9, 60):
            want = target.generate(prompt, max_new_tokens=new, do_sample=False)
            out = target.generate(prompt, assistant_model=draft, pacer_head=head, stopping_policy=policy,
                                  max_new_tokens=new, do_sample=False, return_dict_in_generate=True)
            assert torch.equal(out.sequences, want), (policy, prompt.shape, new)
            padding_seen |= bool((want >= 1000).any())
            drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert padding_seen and drafted > 0  # the target did emit padding ids, and the draft carried on past them


def test_a_draft_with_a_shorter_table_is_lossless_sampled(monkeypatch):
    """Sampling over an 8-row target and a 7-row draft (short by padding; the share allowed raised for so small a
    table): the 3-token outcomes follow the target's exact distribution, enumerated (chi-square as in test_sampling)."""
    from test_sampling import _chi_square_p_value

    monkeypatch.setattr(loop, "PADDING_SHARE", 0.2)
    target = loop_enabled(make_model("llama", seed=1, vocab=8))
    draft = make_model("llama", seed=2, layers=1, vocab=7)
    prompt, runs = torch.tensor([[1, 4, 2, 5]]), 2000
    warp = LogitsProcessorList([TemperatureLogitsWarper(0.8)])
    exact = {}
    with torch.no_grad():
        for seq in itertools.product(range(8), repeat=3):
            p = 1.0
            for i in range(3):
                ids = torch.cat([prompt, torch.tensor([seq[:i]], dtype=torch.long)], dim=1)
                p *= float(warp(ids, target(ids).logits[:, -1, :].float()).softmax(-1)[0, seq[i]])
            exact[seq] = p
    counts, drafted = {}, 0
    for seed in range(runs):
        torch.manual_seed(seed)
        out = target.generate(prompt, assistant_model=draft, stopping_policy=FixedLength(2), do_sample=True,
                              temperature=0.8, top_k=0, max_new_tokens=3, return_dict_in_generate=True)
        outcome = tuple(out.sequences[0, 4:].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
        drafted += sum(s.drafted for s in out.pacer_stats.steps)
    assert drafted > 0 and any(7 in outcome for outcome in counts)  # the padding id was drawn (by the target)
    assert _chi_square_p_value(counts, exact, runs) > 1e-3


@pytest.mark.parametrize("case, message", [
    ("larger draft", r"draft's vocabulary \(1100 tokens\) differs from the target's \(1024\)"),
    ("far shorter", r"draft's vocabulary \(500 tokens\) differs from the target's \(1024\)"),
    ("special ids", r"special tokens differ: eos_token_id 7 vs 8"),
    ("prompt id", r"the prompt holds id 1010, beyond the draft's table"),
])
def test_other_vocabularies_are_refused_before_any_forward(case, message, monkeypatch):
    target, draft = _padded_pair(1024, {"larger draft": 1100, "far shorter": 500}.get(case, 1000))
    prompt = PROMPTS[0]
    if case == "special ids":
        target.generation_config.eos_token_id, draft.generation_config.eos_token_id = 7, 8
    if case == "prompt id":
        prompt = torch.tensor([[3, 1010, 4]])
    monkeypatch.setattr(loop, "model_forward", lambda *a, **k: pytest.fail("a forward ran"))
    with pytest.raises(ValueError, match=message):
        target.generate(prompt, assistant_model=draft, stopping_policy=Pacer(), pacer_head=make_head(draft),
                        max_new_tokens=4)
