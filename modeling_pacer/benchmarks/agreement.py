"""How far a quantized target is from the model it approximates, on real prompts.

Speculative decoding is lossless against the target it loaded; whether that target (4-bit weights, say)
still says what the bf16 model says is a separate question, measured here. For each prompt the quantized
model writes its greedy continuation; the reference model reads the same tokens in one forward, and at
every position we ask whether it would have chosen the same next token:

    agreement     = mean over positions of [argmax reference(prefix) == token the quantized model chose]
    agree_prefix  = positions before the first disagreement: exactly how long the two models' own greedy
                    outputs stay identical (until then both read the same prefix)
    reference_nll = mean -log p_reference(token): the reference's perplexity of the quantized model's text
"""

from __future__ import annotations

import torch


@torch.no_grad()
def greedy_agreement(reference, model, input_ids: torch.Tensor, max_new_tokens: int) -> dict:
    """`model`'s greedy continuation of `input_ids` (1, L), scored by `reference` teacher-forced (see the
    module docstring). Both must be causal LMs over the same tokenizer."""
    out = model.generate(input_ids, do_sample=False, max_new_tokens=max_new_tokens)
    start = input_ids.shape[1]
    generated = out[0, start:]
    n = generated.numel()
    if n == 0:
        return dict(tokens=0, agree_prefix=0, agreement=float("nan"), reference_nll=float("nan"))
    # logits of the positions that predicted each generated token: the last n+1 minus the final one
    logits = reference(out, logits_to_keep=n + 1).logits[0, :-1].float()
    same = logits.argmax(-1) == generated
    mismatch = (~same).nonzero()
    nll = -torch.log_softmax(logits, -1).gather(-1, generated[:, None]).squeeze(-1)
    return dict(tokens=n, agree_prefix=int(mismatch[0, 0]) if mismatch.numel() else n,
                agreement=same.float().mean().item(), reference_nll=nll.mean().item())


def summarize(rows: list[dict]) -> list[dict]:
    """Per dataset and over all: prompts, tokens, mean agree_prefix, token-weighted agreement and perplexity."""
    import math

    out = []
    for dataset in sorted({r["dataset"] for r in rows}) + ["all"]:
        part = [r for r in rows if dataset in ("all", r["dataset"]) and r["tokens"]]
        tokens = sum(r["tokens"] for r in part)
        if not tokens:
            continue
        out.append(dict(
            dataset=dataset, prompts=len(part), tokens=tokens,
            agree_prefix=sum(r["agree_prefix"] for r in part) / len(part),
            agreement=sum(r["agreement"] * r["tokens"] for r in part) / tokens,
            reference_perplexity=math.exp(sum(r["reference_nll"] * r["tokens"] for r in part) / tokens),
        ))
    return out


@torch.no_grad()
def draft_agreement(draft, input_ids: torch.Tensor, output: torch.Tensor, cap: int = 8) -> dict:
    """How often `draft` proposes the target's greedy `output` `(N,)` after `input_ids` `(1, L)`, teacher-forced.

    Greedy speculative decoding accepts a draft token exactly when it is the target's greedy choice after
    the same prefix, so:

        agreement = mean over positions of [argmax draft(prefix) == output token]
        run       = mean over positions of how many draft tokens from there in a row agree (at most `cap`):
                    the tokens a draft of `cap` started there would have accepted (the oracle's side)
        nll       = mean -log p_draft(output token): the draft's loss on the target's text
    """
    n = output.numel()
    if n == 0:
        return dict(tokens=0, agreement=float("nan"), run=float("nan"), nll=float("nan"))
    ids = torch.cat([input_ids, output[None]], dim=1).to(draft.device)
    logits = draft(ids[:, :-1], logits_to_keep=n).logits[0].float().cpu()
    same = logits.argmax(-1) == output
    runs, current = torch.zeros(n), 0
    for i in range(n - 1, -1, -1):  # agreeing tokens in a row from position i, capped
        current = current + 1 if same[i] else 0
        runs[i] = min(current, cap)
    nll = -torch.log_softmax(logits, -1).gather(-1, output[:, None]).mean().item()
    return dict(tokens=n, agreement=same.float().mean().item(), run=runs.mean().item(), nll=nll)


def lookup_agreement(input_ids: torch.Tensor, output: torch.Tensor, max_ngram: int = 6, cap: int = 16) -> dict:
    """How often a lookup in the sequence ([`NgramLookup`], every match length from 1 to `max_ngram`) proposes the
    target's greedy `output` `(N,)` after `input_ids` `(1, L)`, at each position where one is found: per match length,
    `lookups`, `first` (how many proposed the next token right) and `tokens` (how many proposed tokens in a row
    were right, at most `cap`: what a lookup of `cap` tokens would have had accepted there)."""
    from ..custom_generate.lookup import NgramLookup

    lookup = NgramLookup(max_ngram=max_ngram, min_ngram=1, max_tokens=cap)
    sequence = input_ids[0].tolist() + output.tolist()
    start = input_ids.shape[1]
    counts = {}
    for i in range(start, len(sequence)):
        proposed, match = lookup.continuation(sequence[:i])
        if not proposed:
            continue
        right = next((j for j, token in enumerate(proposed[: len(sequence) - i]) if token != sequence[i + j]),
                     min(len(proposed), len(sequence) - i))
        c = counts.setdefault(str(match), dict(lookups=0, first=0, tokens=0))
        c["lookups"] += 1
        c["first"] += right > 0
        c["tokens"] += right
    return dict(positions=len(sequence) - start, by_match=counts)


def summarize_lookups(rows: list[dict]) -> list[dict]:
    """Per dataset (and over all) and match length: lookups found, the share whose first token was the target's, the
    mean tokens right in a row, and the share of positions where a lookup of that length was found."""
    out = []
    for dataset in sorted({r["dataset"] for r in rows}) + ["all"]:
        part = [r for r in rows if dataset in ("all", r["dataset"])]
        positions = sum(r["positions"] for r in part)
        for match in sorted({m for r in part for m in r["by_match"]}, key=int):
            lookups = sum(r["by_match"].get(match, {}).get("lookups", 0) for r in part)
            first = sum(r["by_match"].get(match, {}).get("first", 0) for r in part)
            tokens = sum(r["by_match"].get(match, {}).get("tokens", 0) for r in part)
            out.append(dict(dataset=dataset, match=int(match), lookups=lookups, found=lookups / positions,
                            first=first / lookups, run=tokens / lookups))
    return out


def summarize_drafts(rows: list[dict]) -> list[dict]:
    """Per draft and dataset (and over all datasets): prompts, tokens, token-weighted agreement and run."""
    out = []
    for draft in dict.fromkeys(r["draft"] for r in rows):
        for dataset in sorted({r["dataset"] for r in rows}) + ["all"]:
            part = [r for r in rows if r["draft"] == draft and dataset in ("all", r["dataset"]) and r["tokens"]]
            tokens = sum(r["tokens"] for r in part)
            if tokens:
                out.append(dict(draft=draft, dataset=dataset, prompts=len(part), tokens=tokens,
                                agreement=sum(r["agreement"] * r["tokens"] for r in part) / tokens,
                                run=sum(r["run"] * r["tokens"] for r in part) / tokens))
    return out
