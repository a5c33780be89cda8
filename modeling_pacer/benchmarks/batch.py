"""`pacer-bench batch`: throughput at several batch sizes. The prompts, in the run's order, are cut into groups of B
consecutive prompts, each group one left-padded batch; per group every method decodes the whole batch (methods
interleaved, their order rotated from group to group; a warm-up group first at each B, excluded, which also measures
the cost curve a batch of B decides with). Per B and method: the aggregate tokens per second (every row's new tokens
over the calls' seconds), the latency a sequence sees (its batch's call: every row waits for the slowest), and each
method's time against `target-packed`'s, paired per group. Every row is compared token for token with the target
alone on its prompt (one sequence, transformers' `generate`): pacer's methods must match it (a row of an exact target
is its own output whatever its neighbours); transformers' batched `generate` is reported as it is (rows that differ).

Methods: `target` (transformers' batched greedy `generate` over the target), `target-packed` (the target alone through
pacer's loop drafting nothing: each row's step packed into one call of pacer's exact kernels), `pacer` (the head's
default rule, its cost-aware rule pricing the batch's calls by their rows), `llama.cpp` (opt-in: the target's GGUF
decoded by llama.cpp as its server decodes parallel slots, every row's step in one `llama_decode`, in a process of its
own: [`LlamaCppRunner.generate_rows`]; its own numerics, so its rows are reported against the target alone, as
transformers' batched rows are, not required to match)."""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch
from transformers import GenerationMixin

from ..custom_generate.generate import generate
from ..custom_generate.policies import FixedLength
from .report import speedup_interval

BATCH_METHODS = ("target", "target-packed", "pacer", "llama.cpp")
DEFAULT_BATCH_METHODS = BATCH_METHODS[:3]
BASELINE = "target-packed"
OWN_NUMERICS = ("target", "llama.cpp")  # methods whose rows need not be the target alone's (reported, not required)


@dataclass
class BatchRecord:
    """One method on one group of prompts (one batch)."""

    batch_size: int
    group: int
    method: str
    seconds: float
    prompts: list[str]  # "dataset/prompt_id", one a row
    new_tokens: list[int]  # each row's
    matches_target: list[bool]  # each row against the target alone on its prompt
    agree_prefix: list[int]  # each row's tokens equal to the target alone's before the first difference
    target_forwards: int | None = None
    draft_forwards: int | None = None
    prefill_seconds: float | None = None  # pacer's loop: the target's prefill of every row's prompt (one call)
    draft_lengths: list[int] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def left_padded(prompts: list[torch.Tensor], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`(input_ids, attention_mask)` of `prompts` (each (1, L_i)) as a tokenizer with padding_side='left' gives them."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[1]:], mask[row, width - p.shape[1]:] = p[0], 1
    return ids, mask


def run_batch_method(method: str, pair, head, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, pad: int,
                     llamacpp=None):
    """One batched greedy call of `method` (`llamacpp`: the batched [`LlamaCppRunner`] of the llama.cpp method).
    Returns `(new tokens per row (each without the padding after its end), PacerStats or None)`."""
    settings = dict(attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
    if method == "llama.cpp":
        rows = llamacpp.generate_rows([ids[row][mask[row].bool()].tolist() for row in range(ids.shape[0])],
                                      max_new_tokens)
        return [torch.tensor(r, dtype=torch.long) for r in rows], None
    if method == "target":
        out, stats = GenerationMixin.generate(pair.target, ids, **settings), None
    else:
        rule = dict(stopping_policy=FixedLength(0)) if method == "target-packed" else dict(pacer_head=head)
        result = generate(pair.target, ids, assistant_model=pair.draft, return_dict_in_generate=True, **rule,
                          **settings)
        out, stats = result.sequences, result.pacer_stats
    rows = []
    for row in range(ids.shape[0]):
        new = out[row, ids.shape[1]:]
        if stats is not None:  # pacer's loop says how many tokens each row made
            new = new[: sum(s.emitted for s in stats.steps if s.row == row)]
        rows.append(new)
    return rows, stats


def _trim(tokens: torch.Tensor, pad: int, reference: list[int]) -> list[int]:
    """transformers' batched rows carry padding after an early end: cut it where the reference ended there too."""
    values = tokens.tolist()
    if len(values) > len(reference) and all(v == pad for v in values[len(reference):]):
        return values[: len(reference)]
    return values


def run_batches(pair, head, prompts, batch_sizes, methods, max_new_tokens: int, progress=None) -> tuple[list, dict]:
    """Every method on every group of B prompts, for each B of `batch_sizes`. `prompts`: `(dataset, prompt_id,
    input_ids (1, L))`. Returns `(records, references)`: a [`BatchRecord`] per B, group and method, and each prompt's
    reference output (the target alone's new tokens)."""
    unknown = sorted(set(methods) - set(BATCH_METHODS))
    if unknown:
        raise ValueError(f"unknown batch methods {unknown}: {list(BATCH_METHODS)}")
    if "pacer" in methods and head is None:
        raise ValueError("the batch method 'pacer' runs the head's default rule: pass a head")
    pad = pair.tokenizer.pad_token_id if pair.tokenizer.pad_token_id is not None else pair.tokenizer.eos_token_id
    references = {}
    for dataset, prompt_id, input_ids in prompts:  # the target alone, one sequence: every row's reference
        alone = GenerationMixin.generate(pair.target, input_ids, max_new_tokens=max_new_tokens, do_sample=False,
                                         pad_token_id=pad)
        references[f"{dataset}/{prompt_id}"] = alone[0, input_ids.shape[1]:].tolist()
        if progress is not None:
            progress.update(1)
    records = []
    for b in batch_sizes:
        with contextlib.ExitStack() as stack:
            llamacpp = None
            if "llama.cpp" in methods:  # a process of its own for each B, b sequences of the longest prompt's context
                from .llamacpp import LlamaCppRunner

                llamacpp = LlamaCppRunner.for_pair(pair, prompts, max_new_tokens, sequences=b)
                stack.callback(llamacpp.close)
            records += _run_batch_size(pair, head, prompts, b, methods, max_new_tokens, pad, references, llamacpp,
                                       progress)
    return records, references


def _run_batch_size(pair, head, prompts, b: int, methods, max_new_tokens: int, pad: int, references, llamacpp,
                    progress) -> list[BatchRecord]:
    """[`run_batches`] at one batch size."""
    records = []
    groups = [prompts[i:i + b] for i in range(0, len(prompts), b)]
    # warm-up (excluded): a batch of B and the last, smaller one, a few tokens; measures the batches' cost curves
    for group in {len(g): g for g in (groups[0], groups[-1])}.values():
        ids, mask = left_padded([p for _, _, p in group], pad)
        for method in methods:
            run_batch_method(method, pair, head, ids, mask, min(8, max_new_tokens), pad, llamacpp)
    for g, group in enumerate(groups):
        ids, mask = left_padded([p for _, _, p in group], pad)
        names = [f"{d}/{p}" for d, p, _ in group]
        for method in methods[g % len(methods):] + methods[:g % len(methods)]:
            start = time.perf_counter()
            rows, stats = run_batch_method(method, pair, head, ids, mask, max_new_tokens, pad, llamacpp)
            seconds = time.perf_counter() - start
            got = [_trim(r, pad, references[n]) for r, n in zip(rows, names)]
            agree = [next((i for i, (x, y) in enumerate(zip(row, references[n])) if x != y),
                          min(len(row), len(references[n]))) for row, n in zip(got, names)]
            records.append(BatchRecord(
                b, g, method, seconds, names, [len(r) for r in got],
                [row == references[n] for row, n in zip(got, names)], agree,
                target_forwards=stats.target_forwards if stats else None,
                draft_forwards=stats.draft_forwards if stats else None,
                prefill_seconds=stats.prefill_time if stats else None,
                draft_lengths=[s.drafted for s in stats.steps if s.stop_reason != "prefill"] if stats else []))
            if progress is not None:
                progress.update(1)
    return records


def summarize_batches(records: list[dict]) -> list[dict]:
    """Per batch size and method: sequences, tokens, seconds, aggregate tokens per second, the mean latency a
    sequence sees, its rows equal to the target alone's, its mean draft length, and its time against
    `target-packed`'s paired per group (ratio of summed seconds, 95% bootstrap interval over groups)."""
    by = defaultdict(list)
    for r in records:
        by[(r["batch_size"], r["method"])].append(r)
    rows = []
    for (b, method), rs in sorted(by.items(), key=lambda item: (item[0][0], BATCH_METHODS.index(item[0][1]))):
        seconds = sum(r["seconds"] for r in rs)
        tokens = sum(sum(r["new_tokens"]) for r in rs)
        sequences = sum(len(r["new_tokens"]) for r in rs)
        drafts = [k for r in rs for k in r["draft_lengths"]]
        row = dict(batch_size=b, method=method, groups=len(rs), sequences=sequences, new_tokens=tokens, seconds=seconds,
                   tokens_per_second=tokens / seconds,
                   latency=sum(r["seconds"] * len(r["new_tokens"]) for r in rs) / sequences,
                   matches=sum(sum(r["matches_target"]) for r in rs),
                   mean_draft=sum(drafts) / len(drafts) if drafts else None)
        base = {r["group"]: r["seconds"] for r in by.get((b, BASELINE), [])}
        pairs = [(base[r["group"]], r["seconds"]) for r in rs if r["group"] in base]
        if pairs and method != BASELINE:
            row["vs_packed"] = sum(o for o, _ in pairs) / sum(m for _, m in pairs)
            row["vs_packed_interval"] = speedup_interval(pairs)
        rows.append(row)
    return rows


def batch_table(rows: list[dict]) -> str:
    lines = ["| batch | method | sequences | tokens/s (all rows) | latency a sequence sees (s) | rows = target alone | "
             f"mean draft | vs {BASELINE}, paired per batch (95% CI) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        draft = "–" if r["mean_draft"] is None else f"{r['mean_draft']:.2f}"
        ratio = "–"
        if "vs_packed" in r:
            ci = r["vs_packed_interval"]
            ratio = f"{r['vs_packed']:.3f}x" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else "")
        lines.append(f"| {r['batch_size']} | {r['method']} | {r['sequences']} | {r['tokens_per_second']:.2f} | "
                     f"{r['latency']:.2f} | {r['matches']}/{r['sequences']} | {draft} | {ratio} |")
    return "\n".join(lines) + "\n"
