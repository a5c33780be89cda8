"""The logits processors of `generate`, applied to each drafted and verified row; exact shortcuts for the costly ones.

Plain decoding processes one row a token; pacer processes every drafted row and every verified row, so a processor's
cost counts several times a step. Two of transformers' processors spend most of their time on work whose result is
already known:

- `TopPLogitsWarper` sorts the whole vocabulary (values and indices) to find which tokens' cumulative probability,
  summed from the least likely up, stays within 1 - top_p. The cumulative sums depend on the sorted *values* alone
  (a sequence that any correct sort gives, ties included), and the tokens it removes are a prefix of that order. So
  [`top_p`] builds the same ascending values (a counting sort over 65,536 keys where every score is a bfloat16 value,
  as a bf16 model's logits are; else the finite scores alone where a top-k left few, or a plain sort), runs the warper's
  softmax and cumulative sum over them (the same tensor, so the same bits), and removes every score below the first
  kept value: exactly transformers' set, unless equal scores straddle the boundary, where which of them an unstable
  sort places first decides it, and transformers' warper itself is called.
- `MinNewTokensLengthLogitsProcessor` and `MinLengthLogitsProcessor` (`generate` adds both for `min_new_tokens`) build
  a vocabulary-sized range and an `isin` mask on every call to set the end-of-sequence scores to -inf while too few
  tokens are out; [`min_new_tokens`] and [`min_length`] set them by index.

Every other processor is called as `LogitsProcessorList` calls it. The shortcuts return transformers' values bit for
bit (tests/test_processing.py compares them on random, tied and bf16 rows); this file imports only torch and
transformers, like the rest of this folder.
"""

import copy
import functools
import math

import torch
from transformers import (
    ExponentialDecayLengthPenalty, ForcedEOSTokenLogitsProcessor, LogitsProcessorList, MaxLengthCriteria,
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor, StoppingCriteriaList, SuppressTokensAtBeginLogitsProcessor, TopPLogitsWarper,
)

__all__ = ["process", "process_rows", "row_processors", "top_p", "min_new_tokens", "min_length", "sorted_values"]


def _bf16_table(device: torch.device) -> torch.Tensor:
    """The 65,536 bfloat16 values as float32, in the order of their keys ([`_bf16_counts`]; NaNs at both ends)."""
    key = torch.arange(65536, dtype=torch.int32, device=device)
    bits = torch.where(key >= 0x8000, key - 0x8000, 0xFFFF - key)
    return (bits << 16).view(torch.float32)


_TABLES: dict[torch.device, torch.Tensor] = {}
_NAN_BELOW, _NAN_FROM = 0x7F, 0xFF81  # keys under -inf's (0x7F) and over +inf's (0xFF80) are NaNs


def _bf16_counts(row: torch.Tensor) -> torch.Tensor | None:
    """How many scores of the 1-D float32 `row` take each of the 65,536 bfloat16 values, indexed by a key ordered as
    the values are (-0.0 just below +0.0, which a sort treats as equal); None where a score is not a bf16 value."""
    bits = row.view(torch.int32)
    top = bits >> 16  # sign, exponent and the 7 bits of mantissa a bf16 keeps (arithmetic shift: negatives stay so)
    if not torch.equal(top << 16, bits):
        return None
    sign = top >> 31  # -1 for a negative score, else 0
    # negative: 0xFFFF minus its unsigned top (larger magnitudes first) = ~top; positive: top + 0x8000
    return torch.bincount((top ^ sign) | ((sign + 1) << 15), minlength=65536)


def sorted_values(row: torch.Tensor) -> torch.Tensor | None:
    """The values of a 1-D float32 `row` in ascending order, `torch.sort(row).values` without the indices; None where
    the row holds a NaN.

    A row of bfloat16 values (every float32 with its low 16 bits zero) is counted into its 65,536 possible values; of
    any other, a row that is mostly -inf sorts its finite scores alone, and one that is not is sorted whole."""
    counts = _bf16_counts(row)
    if counts is not None:
        if bool(counts[:_NAN_BELOW].any()) or bool(counts[_NAN_FROM:].any()):
            return None
        table = _TABLES.get(row.device)
        if table is None:
            table = _TABLES[row.device] = _bf16_table(row.device)
        return torch.repeat_interleave(table, counts, output_size=row.numel())
    if bool(torch.isnan(row).any()):
        return None
    finite = row > float("-inf")
    count = int(finite.sum())
    if 0 < count <= row.numel() // 8:
        rest = torch.sort(row[finite]).values
        return torch.cat([row.new_full((row.numel() - count,), float("-inf")), rest])
    return torch.sort(row).values


def top_p(warper: TopPLogitsWarper, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
    """`warper(input_ids, scores)`, bit for bit, without sorting the indices (see the module's docstring)."""
    if scores.dtype != torch.float32 or scores.dim() != 2:
        return warper(input_ids, scores)
    rows = []
    for row in scores:
        ascending = sorted_values(row)
        if ascending is None:  # NaN: where the sort puts it is the sort's business
            return warper(input_ids, scores)
        # transformers' arithmetic on the same values: its softmax, its cumulative sum, its comparison
        cumulative = ascending[None].softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - warper.top_p)
        remove[..., -warper.min_tokens_to_keep :] = 0
        removed = int(remove.sum())
        if removed == 0:
            rows.append(row.clone())
            continue
        # the cumulative sums only grow (non-negative terms), so the removed tokens are the first `removed` in order
        first_kept, last_removed = ascending[removed], ascending[removed - 1]
        if removed == row.numel() or not bool(remove[0, removed - 1]) or not first_kept > last_removed:
            return warper(input_ids, scores)  # equal scores on both sides of the boundary: the sort's order decides
        rows.append(row.masked_fill(row < first_kept, warper.filter_value))
    return torch.stack(rows)


def _without_eos(eos_token_id: torch.Tensor, scores: torch.Tensor, too_short: bool) -> torch.Tensor:
    """A copy of `scores`, its end-of-sequence columns -inf where `too_short`: what both length processors compute
    with a vocabulary-sized range and `isin`."""
    processed = scores.clone()
    if too_short:
        ids = eos_token_id.to(scores.device).reshape(-1)
        ids = ids[(ids >= 0) & (ids < scores.shape[-1])]  # isin over the vocabulary's range: other ids match nothing
        processed[..., ids] = -math.inf
    return processed


def min_new_tokens(processor: MinNewTokensLengthLogitsProcessor, input_ids: torch.LongTensor, scores: torch.Tensor):
    """`processor(input_ids, scores)`, bit for bit: the end-of-sequence scores set to -inf by index."""
    too_short = input_ids.shape[-1] - processor.prompt_length_to_skip < processor.min_new_tokens
    return _without_eos(processor.eos_token_id, scores, too_short)


def min_length(processor: MinLengthLogitsProcessor, input_ids: torch.LongTensor, scores: torch.Tensor):
    """`processor(input_ids, scores)`, bit for bit (`generate` adds it beside the one above: `min_new_tokens` sets
    `min_length` to the prompt's length plus it)."""
    return _without_eos(processor.eos_token_id, scores, input_ids.shape[-1] < processor.min_length)


_SHORTCUTS = {TopPLogitsWarper: top_p, MinNewTokensLengthLogitsProcessor: min_new_tokens,
              MinLengthLogitsProcessor: min_length}


def process(logits_processor, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
    """`logits_processor(input_ids, scores)` for a `LogitsProcessorList` (or any callable), each processor of an exact
    type in `_SHORTCUTS` through its shortcut, every other one as the list itself calls it (its own check of the
    arguments a processor asks for included)."""
    if not isinstance(logits_processor, LogitsProcessorList):
        return logits_processor(input_ids, scores)
    for processor in logits_processor:
        shortcut = _SHORTCUTS.get(type(processor))
        if shortcut is not None:
            scores = shortcut(processor, input_ids, scores)
        else:
            scores = LogitsProcessorList([processor])(input_ids, scores)
    return scores


def process_rows(logits_processor, prefix: torch.LongTensor, logits: torch.Tensor) -> torch.Tensor:
    """Apply the logits processors to each row of `logits` `(1, n, vocab)`; row i continues `prefix` extended by the
    first i tokens, exactly as plain decoding would see it. `prefix` is `(1, L + n - 1)`: the sequence followed by
    the n - 1 draft tokens."""
    n = logits.shape[1]
    start = prefix.shape[1] - (n - 1)
    return torch.stack([process(logits_processor, prefix[:, : start + i], logits[:, i, :]) for i in range(n)], dim=1)


# transformers' processors and criteria that count a position in the (left-padded) input, and the field they count it in
_LENGTH_FIELDS = {MinLengthLogitsProcessor: "min_length", MinNewTokensLengthLogitsProcessor: "prompt_length_to_skip",
                  ForcedEOSTokenLogitsProcessor: "max_length", ExponentialDecayLengthPenalty: "regulation_start",
                  SuppressTokensAtBeginLogitsProcessor: "begin_index", MaxLengthCriteria: "max_length"}


def row_processors(processors, row: int, padding: int):
    """The logits processors (or stopping criteria) of row `row` of a left-padded batch, which the loop hands that
    row's ids alone, without its `padding` tokens. A list of the same processors, except copies of transformers' that
    read the batch's layout: those that count a position of the padded input (`_LENGTH_FIELDS`: `min_length`,
    `max_length`, the prompt's length ...) count `padding` fewer, so a row gets the lengths transformers gives it in the
    batch (with `max_new_tokens` or `min_new_tokens`, those of the row alone); the repetition penalty's padding to skip
    is the row's own (none: the row comes without it); a prefix constraint's function is told the row's index as its
    batch id (and sees the row's tokens without padding). Every other processor is the list's own: it reads the row's
    tokens, as it would the row's alone."""
    if not isinstance(processors, (LogitsProcessorList, StoppingCriteriaList)):
        return processors
    rows = type(processors)()
    for processor in processors:
        kind = type(processor)
        if kind in _LENGTH_FIELDS:
            processor = copy.copy(processor)
            setattr(processor, _LENGTH_FIELDS[kind], getattr(processor, _LENGTH_FIELDS[kind]) - padding)
        elif kind is RepetitionPenaltyLogitsProcessor and processor.prompt_ignore_length is not None:
            ignore = processor.prompt_ignore_length
            ignore = int(ignore[row]) if isinstance(ignore, torch.Tensor) else int(ignore)
            processor = copy.copy(processor)
            processor.prompt_ignore_length = max(0, ignore - padding) or None
        elif kind is PrefixConstrainedLogitsProcessor:
            processor = copy.copy(processor)
            processor._prefix_allowed_tokens_fn = functools.partial(_as_row, processor._prefix_allowed_tokens_fn, row)
        rows.append(processor)
    return rows


def _as_row(function, row: int, batch_id: int, tokens):
    return function(row + batch_id, tokens)
