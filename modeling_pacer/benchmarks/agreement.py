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
