"""A draft whose LM head computes only some tokens (`modeling_pacer.draft_vocab`): the kept logits are the full
head's, the rest can never be drafted, and decoding stays lossless, greedy and sampled."""

import pytest
import torch
from torch import nn

from modeling_pacer import ExpectedThroughput, FixedLength, Pacer
from modeling_pacer.costs import CostModel, describe_model
from modeling_pacer.draft_vocab import (
    ReducedVocabHead,
    frequent_token_ids,
    kept_tokens,
    output_head,
    reduce_draft_vocabulary,
    reduced_head,
    special_token_ids,
)
from modeling_pacer.cpu import kernels
from modeling_pacer.cpu.quantization import Int4Linear, quantize_linears

from conftest import VOCAB, make_head, make_model, make_pair, word_tokenizer
from test_sampling import RUNS, V, _chi_square_p_value, _exact_distribution, sample_outcomes


@torch.no_grad()
def test_kept_logits_are_the_full_heads_and_the_rest_are_minus_infinity():
    model = make_model("llama", seed=2)
    full_head = model.get_output_embeddings()
    keep = torch.tensor([0, 5, 17, 40, 41, 96])
    hidden = torch.randn(1, 3, model.config.hidden_size)
    expected = full_head(hidden)
    reduce_draft_vocabulary(model, token_ids=keep)
    logits = model.get_output_embeddings()(hidden)
    assert logits.shape == expected.shape
    # the same weights' dot products (a GEMM over fewer rows may block its sums differently: float rounding)
    torch.testing.assert_close(logits[..., keep], expected[..., keep], rtol=1e-5, atol=1e-6)
    rest = torch.ones(VOCAB, dtype=torch.bool)
    rest[keep] = False
    assert bool(torch.isneginf(logits[..., rest]).all())
    assert kept_tokens(model) == 6
    # the whole model's forward: the same function on the kept tokens
    ids = torch.tensor([[3, 9, 27]])
    plain = make_model("llama", seed=2)
    torch.testing.assert_close(model(ids).logits[..., keep], plain(ids).logits[..., keep], rtol=1e-5, atol=1e-6)


def test_frequent_tokens_keep_the_special_ones_and_fill_with_the_lowest_ids():
    ids = frequent_token_ids(1000, 20, always=[999, 500])
    assert ids.numel() == 32  # rounded up to the int4 kernel's multiple of 16
    assert {999, 500} <= set(ids.tolist())
    assert ids.tolist() == sorted(ids.tolist())
    assert set(ids.tolist()) - {999, 500} == set(range(30))
    assert frequent_token_ids(40, 100).tolist() == list(range(40))  # capped at the vocabulary
    with pytest.raises(ValueError, match="at least 1"):
        frequent_token_ids(1000, 0)
    with pytest.raises(ValueError, match="smaller than the 40 special tokens"):
        frequent_token_ids(1000, 16, always=range(40))
    with pytest.raises(ValueError, match="special token ids must lie in"):
        frequent_token_ids(100, 16, always=[100])


def test_special_tokens_of_a_tokenizer_stay_draftable():
    tokenizer = word_tokenizer()
    tokenizer.add_special_tokens({"eos_token": "<eos>"})
    eos = tokenizer.convert_tokens_to_ids("<eos>")
    assert eos in special_token_ids(tokenizer)
    model = make_model("llama", seed=2, vocab=len(tokenizer))
    reduce_draft_vocabulary(model, 16, tokenizer=tokenizer)
    assert eos in model.get_output_embeddings().token_ids.tolist()


def test_bad_requests_are_clear_errors():
    model = make_model("llama", seed=2)
    with pytest.raises(ValueError, match="either size"):
        reduce_draft_vocabulary(model)
    with pytest.raises(ValueError, match="either size"):
        reduce_draft_vocabulary(model, 16, token_ids=[1, 2])
    with pytest.raises(ValueError, match="needs the tokenizer"):
        reduce_draft_vocabulary(model, 16)
    with pytest.raises(ValueError, match="ids in 0..96"):
        reduce_draft_vocabulary(model, token_ids=[3, VOCAB])
    quantized = quantize_linears(make_model("llama", seed=2, vocab=96), "int4")  # 96: the int4 kernel's multiple of 16
    with pytest.raises(ValueError, match="before quantization"):
        reduce_draft_vocabulary(quantized, token_ids=[1, 2])


def test_the_pair_arguments_refuse_a_non_positive_size():
    from modeling_pacer.pairs import PairArguments

    with pytest.raises(ValueError, match="--draft-vocab must be a positive"):
        PairArguments(draft_vocab=0)


def test_the_cost_cache_tells_a_reduced_draft_from_the_full_one():
    full, reduced = make_model("llama", seed=2), make_model("llama", seed=2)
    reduce_draft_vocabulary(reduced, token_ids=range(48))
    assert "kept_tokens" not in describe_model(full)
    assert describe_model(reduced)["kept_tokens"] == 48


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (1, n), generator=g) for n in (1, 6, 19)]


GREEDY_POLICIES = {
    "fixed4": lambda: FixedLength(4),
    "pacer-b2": lambda: Pacer(block_size=2, threshold=0.4, growth=1.05, max_draft_length=8),
    "throughput": lambda: ExpectedThroughput(CostModel({n: 1.0 for n in range(1, 20)}, 0.05), calibration=1.0,
                                             max_draft_length=8),
}


@pytest.mark.parametrize("quantized", [False, True], ids=["float", "int4"])
@pytest.mark.parametrize("policy_name", list(GREEDY_POLICIES))
def test_greedy_output_is_the_targets_own(policy_name, quantized):
    target, draft = make_pair("llama", "llama", "noisy")
    keep = torch.arange(0, VOCAB, 2)[:48]  # every other token: about half the target's tokens cannot be drafted
    reduce_draft_vocabulary(draft, token_ids=keep)
    if quantized:
        quantize_linears(draft, "int4")
        assert isinstance(draft.get_output_embeddings().proj, Int4Linear)
    head = make_head(draft, max_draft_length=16)
    drafted = accepted = outside = 0
    for ids in _prompts():
        for new in (1, 7, 33):
            expected = target.generate(ids, do_sample=False, max_new_tokens=new)
            out = target.generate(ids, assistant_model=draft, pacer_head=head, stopping_policy=GREEDY_POLICIES[policy_name](),
                                  do_sample=False, max_new_tokens=new, return_dict_in_generate=True)
            assert out.sequences.tolist() == expected.tolist(), (policy_name, ids.shape, new)
            drafted += sum(s.drafted for s in out.pacer_stats.steps)
            accepted += sum(s.accepted for s in out.pacer_stats.steps)
            outside += int((~torch.isin(expected[0, ids.shape[1]:], keep)).sum())
    # the loop drafted and some drafts were accepted, and the target wrote tokens the draft could never propose
    assert drafted > 0 and accepted > 0 and outside > 0


def test_sampling_distribution_is_the_targets():
    """The chi-square test of tests/test_sampling.py with a draft that can propose 4 of the 6 tokens."""
    target, draft = make_pair("llama", "llama", "random", vocab=V)
    target_probs = _exact_distribution(target)
    keep = torch.tensor([0, 2, 3, 5])
    reduce_draft_vocabulary(draft, token_ids=keep)
    reduced_probs = _exact_distribution(draft)
    counts, drafted, accepted = sample_outcomes(target, draft, make_head(draft, max_draft_length=8), lambda: FixedLength(3))
    assert 0 < accepted < drafted
    # tokens 1 and 4 appear in the output (the target's corrections), although the draft never proposes them
    assert any(t in (1, 4) for outcome in counts for t in outcome)
    assert _chi_square_p_value(counts, target_probs, RUNS) > 1e-3
    assert _chi_square_p_value(counts, reduced_probs, RUNS) < 1e-6  # the test has the power to see a wrong sampler


def test_load_draft_reduces_then_quantizes(tmp_path):
    from modeling_pacer.pairs.loading import load_draft

    model = make_model("qwen2", seed=2, vocab=VOCAB)
    model.save_pretrained(tmp_path / "draft")
    draft = load_draft(str(tmp_path / "draft"), torch.bfloat16, "int4", draft_vocab=32, tokenizer=word_tokenizer())
    head = draft.get_output_embeddings()
    assert isinstance(head, ReducedVocabHead) and isinstance(head.proj, Int4Linear)
    assert kept_tokens(draft) == 32
    with pytest.raises(ValueError, match="needs the tokenizer"):
        load_draft(str(tmp_path / "draft"), torch.float32, None, draft_vocab=32)
    assert isinstance(load_draft(str(tmp_path / "draft"), torch.float32).get_output_embeddings(), nn.Linear)


@pytest.mark.skipif(not kernels.available(), reason=f"pacer's kernels: {kernels.unavailable_reason()}")
@torch.no_grad()
def test_a_head_reduced_after_quantizing_is_the_one_reduced_before():
    """`reduced_head` of a draft already on pacer's int4 kernel (what `pacer-bench run`'s `pacer-*vocab-*` methods
    swap in, `output_head`) computes the kept tokens with the full head's codes: bitwise the head that reducing
    before quantizing makes (load_pair's `draft_vocab`), and the draft's own head is back after the block."""
    before = make_model("qwen2", seed=3, hidden=64, vocab=112).to(torch.bfloat16)
    after = make_model("qwen2", seed=3, hidden=64, vocab=112).to(torch.bfloat16)
    keep = torch.tensor([0, 3, 5, *range(20, 45), 60, 61, 62, 111])  # 32 tokens, not one tile of 16 outputs
    reduce_draft_vocabulary(before, token_ids=keep)
    quantize_linears(before, "int4", int4_kernel="pacer")
    quantize_linears(after, "int4", int4_kernel="pacer")
    own = after.get_output_embeddings()
    reduced = reduced_head(after, token_ids=keep)
    assert isinstance(reduced.proj, Int4Linear) and reduced.proj.out_features == 32
    ids = torch.tensor([[3, 9, 27, 100, 4]])
    with output_head(after, reduced):
        logits = after(ids).logits
        assert kept_tokens(after) == 32
    assert torch.equal(logits, before(ids).logits)
    assert after.get_output_embeddings() is own and kept_tokens(after) is None
    # and the kept rows are the full head's rows, bit for bit
    hidden = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(reduced.proj(hidden), own(hidden)[:, keep])
    with pytest.raises(ValueError, match="already computes 32 tokens"):
        reduced_head(before, token_ids=keep)
    with pytest.raises(ValueError, match="a multiple of 16"):
        reduced_head(after, token_ids=keep[:20])
    torch_kernel = quantize_linears(make_model("qwen2", seed=3, hidden=64, vocab=112), "int4")
    with pytest.raises(ValueError, match="kernel='torch'"):
        reduced_head(torch_kernel, token_ids=keep)
