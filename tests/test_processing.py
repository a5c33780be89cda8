"""The processors' shortcuts give transformers' own processed scores, bit for bit (custom_generate/processing.py).

Each shortcut is compared with the transformers processor it replaces on rows of the kinds a model gives: float32
scores, bfloat16 values (many ties), rows a top-k left mostly at -inf, several top-p values and `min_tokens_to_keep`;
and where equal scores straddle top-p's boundary the shortcut must hand the row to transformers' warper.
"""

import math
from unittest import mock

import pytest
import torch
from transformers import (
    LogitsProcessorList, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper,
)

from modeling_pacer.custom_generate.processing import (
    min_length, min_new_tokens, process, process_rows, sorted_values, top_p,
)

IDS = torch.tensor([[3, 17, 17, 250, 9]])


def _rows(vocab: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, vocab, generator=g) * 4
    after_top_k = TopKLogitsWarper(40)(IDS, logits)
    return {
        "float32": logits,
        "bf16 values": logits.to(torch.bfloat16).float(),
        "bf16 values, coarse": (logits * 0.25).to(torch.bfloat16).float(),  # few distinct values: long ties
        "after top-k": after_top_k,
        "after top-k, bf16": TopKLogitsWarper(40)(IDS, logits.to(torch.bfloat16).float()),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (NaN where NaN)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


@pytest.mark.parametrize("vocab", [50, 1000, 151936])
def test_sorted_values_are_the_sorts_values(vocab):
    for seed in range(3):
        for name, row in _rows(vocab, seed).items():
            assert torch.equal(sorted_values(row[0]), torch.sort(row[0]).values), name
    nan = torch.randn(vocab)
    nan[vocab // 2] = float("nan")
    for row in (nan, -nan):  # NaN of either sign, in a float32 row and in a row of bf16 values
        assert sorted_values(row) is None and sorted_values(row.to(torch.bfloat16).float()) is None


@pytest.mark.parametrize("vocab", [50, 1000, 151936])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.8, 0.9, 0.95, 0.999, 1.0])
def test_top_p_gives_the_warpers_scores(vocab, p):
    for seed in range(2):
        for name, row in _rows(vocab, seed).items():
            for keep in (1, 7):
                warper = TopPLogitsWarper(p, min_tokens_to_keep=keep)
                assert _same(top_p(warper, IDS, row), warper(IDS, row)), (name, seed, keep)
    warper = TopPLogitsWarper(p, filter_value=-1e4)
    row = _rows(vocab, 5)["bf16 values"]
    assert _same(top_p(warper, IDS, row), warper(IDS, row))


def test_top_p_takes_its_shortcut_and_hands_a_tie_at_the_boundary_to_the_warper():
    warper = TopPLogitsWarper(0.5)
    row = torch.tensor([[0.0, 1.0, 3.0, 3.0, 5.0, 5.0, -2.0, 4.0]])
    # ascending: -2 0 1 3 3 4 5 5; the two 5s hold 0.75 of the mass, so top_p 0.5 removes up to the 4 ...
    calls = []
    original = TopPLogitsWarper.__call__
    with mock.patch.object(TopPLogitsWarper, "__call__", lambda self, i, s: calls.append(1) or original(self, i, s)):
        expected = original(warper, IDS, row)
        assert _same(top_p(warper, IDS, row), expected) and calls == []  # ... with no tie there: no call
        tied = row.clone()
        tied[0, 7] = 5.0  # three 5s: 0.91 of the mass; top_p 0.6 removes one of them and keeps two
        warper = TopPLogitsWarper(0.6)
        assert _same(top_p(warper, IDS, tied), original(warper, IDS, tied)) and calls == [1]


def test_top_p_gives_the_warpers_scores_on_nan_float64_and_batched_rows():
    warper = TopPLogitsWarper(0.9)
    nan = torch.randn(1, 100)
    nan[0, 3] = float("nan")
    inf = torch.randn(1, 100).to(torch.bfloat16).float()
    inf[0, 7] = float("inf")
    for scores in (nan, inf, torch.randn(1, 100).double(), torch.randn(2, 100)):
        assert torch.equal(top_p(warper, IDS, scores).isnan(), warper(IDS, scores).isnan())
        assert torch.equal(top_p(warper, IDS, scores).nan_to_num(), warper(IDS, scores).nan_to_num())


@pytest.mark.parametrize("eos", [2, [2, 7], torch.tensor([7, 2]), [2, 10_000]])
def test_min_new_tokens_gives_the_processors_scores(eos):
    scores = torch.randn(1, 100)
    for prompt_length, minimum in [(5, 0), (5, 1), (3, 2), (3, 3), (0, 10)]:
        processor = MinNewTokensLengthLogitsProcessor(prompt_length, minimum, eos)
        out = min_new_tokens(processor, IDS, scores)
        assert _same(out, processor(IDS, scores)) and out.data_ptr() != scores.data_ptr()


@pytest.mark.parametrize("eos", [2, [2, 7], torch.tensor([7, 2]), [2, 10_000]])
def test_min_length_gives_the_processors_scores_without_calling_it(eos, monkeypatch):
    scores = torch.randn(1, 100)
    expected = {m: MinLengthLogitsProcessor(m, eos)(IDS, scores) for m in (0, IDS.shape[1], IDS.shape[1] + 1, 50)}
    monkeypatch.setattr(MinLengthLogitsProcessor, "__call__", lambda *a: pytest.fail("the processor was called"))
    for minimum, want in expected.items():  # below, at and past the length
        processor = MinLengthLogitsProcessor(minimum, eos)
        out = min_length(processor, IDS, scores)
        assert _same(out, want) and out.data_ptr() != scores.data_ptr()
        assert _same(process(LogitsProcessorList([processor]), IDS, scores), want)
    assert bool(expected[50][0, 2] == -math.inf) and bool(expected[0][0, 2] == scores[0, 2])  # the test's own check


def test_a_processor_list_gives_its_own_scores_row_by_row():
    processors = LogitsProcessorList([
        MinNewTokensLengthLogitsProcessor(3, 4, [5, 9]), MinLengthLogitsProcessor(IDS.shape[1] + 2, [5, 9]),
        RepetitionPenaltyLogitsProcessor(1.3),
        TemperatureLogitsWarper(0.7), TopKLogitsWarper(60), TopPLogitsWarper(0.8),
    ])
    logits = (torch.randn(1, 4, 1000) * 3).to(torch.bfloat16).float()
    prefix = torch.cat([IDS, torch.tensor([[11, 12, 13]])], dim=1)  # the sequence, then 3 draft tokens
    rows = process_rows(processors, prefix, logits)
    for i in range(4):
        assert _same(rows[:, i], processors(prefix[:, : IDS.shape[1] + i], logits[:, i]))
    for p in (0.3, 0.9):  # top-p alone, over the whole vocabulary
        alone = LogitsProcessorList([TopPLogitsWarper(p)])
        assert _same(process(alone, IDS, logits[:, 0]), alone(IDS, logits[:, 0]))


def test_a_processor_that_needs_more_arguments_is_refused_as_the_list_refuses_it():
    class NeedsMore:
        def __call__(self, input_ids, scores, cur_len):
            return scores

    with pytest.raises(ValueError, match="required parameters"):
        process(LogitsProcessorList([NeedsMore()]), IDS, torch.randn(1, 10))
