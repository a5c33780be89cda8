"""A draft whose LM head computes only the most frequent tokens (after FR-Spec, Zhao et al. 2025).

A small draft spends a large share of each step on its LM head: Qwen2.5-0.5B's is 151,936 x 896 weights,
about a quarter of the bytes the int4 draft reads per token. [`reduce_draft_vocabulary`] replaces the head
by one over `size` of its rows, and writes their logits into a full-vocabulary row whose other entries
are `-inf`:

- **Lossless.** The target still scores every token of its vocabulary and decides every output token.
  A token outside the kept set cannot be drafted, so at such a position the draft is simply wrong (the
  target's own token is emitted as after any rejection). In sampled decoding the draft's distribution q
  is the softmax over the kept tokens (zero elsewhere), the very q its tokens were drawn from, which is
  all that rejection sampling needs to return exactly the target's distribution.
- **What changes is speed**: fewer bytes per draft step, against the positions the kept set cannot cover.
  The draft's probability (the default stopping rule's estimate) is then renormalised over the kept
  tokens; the cost-aware rule fits its calibration online, so it adapts.

Which tokens: by default the first `size` ids, plus every special and added token (an end-of-sequence
token must stay draftable). Byte-level BPE vocabularies (GPT-2, Llama 3, Qwen2) number their tokens in
merge order, the most frequent merges first, so a prefix of the ids is a frequency ranking learned on the
tokenizer's own corpus. Pass `token_ids` to keep another set (a ranking counted on your own data).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn


class ReducedVocabHead(nn.Module):
    """`hidden (..., d) -> logits (..., vocab_size)`: `proj` computes the rows of `token_ids`, every other
    logit is `-inf` (a probability of exactly 0 after the softmax)."""

    def __init__(self, proj: nn.Module, token_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.proj = proj  # an nn.Linear over the kept rows (quantized like any other linear layer of the draft)
        self.register_buffer("token_ids", token_ids.to(torch.long).contiguous(), persistent=False)
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kept = self.proj(hidden)
        logits = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))
        return logits.index_copy_(-1, self.token_ids, kept)

    def extra_repr(self) -> str:
        return f"kept={self.token_ids.numel()}, vocab_size={self.vocab_size}"


def special_token_ids(tokenizer) -> list[int]:
    """Every special or added token id of a tokenizer (end of sequence, chat markers, ...)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    ids.update(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    return sorted(int(i) for i in ids)


def frequent_token_ids(vocab_size: int, size: int, always: list[int] | tuple[int, ...] = ()) -> torch.Tensor:
    """The ids a reduced head keeps: `always` (the special tokens), then the lowest ids (byte-level BPE's merge
    order: the most frequent first) up to `size` in all, sorted. `size` is rounded up to a multiple of 16 (the
    int4 kernel's output granularity), capped at `vocab_size`."""
    if size < 1:
        raise ValueError(f"draft vocabulary size must be at least 1, got {size}")
    size = min(vocab_size, -(-size // 16) * 16)
    always = sorted({int(i) for i in always})
    if always and (always[0] < 0 or always[-1] >= vocab_size):
        raise ValueError(f"special token ids must lie in 0..{vocab_size - 1}, got {always[0]}..{always[-1]}")
    if len(always) > size:
        raise ValueError(f"draft vocabulary size {size} is smaller than the {len(always)} special tokens it must keep")
    keep = torch.zeros(vocab_size, dtype=torch.bool)
    keep[always] = True
    fill = size - int(keep.sum())
    free = (~keep).nonzero().flatten()[:fill]
    keep[free] = True
    return keep.nonzero().flatten()


def reduced_head(model: nn.Module, size: int | None = None, *, tokenizer=None,
                 token_ids: torch.Tensor | None = None) -> ReducedVocabHead:
    """A [`ReducedVocabHead`] over `token_ids`, or over the `size` ids of [`frequent_token_ids`] (the special tokens
    of `tokenizer` included), made from `model`'s LM head as it is now; `model` is left as it is. From an
    `nn.Linear`, its rows as an `nn.Linear` (quantize it as the draft's others); from a quantized layer that
    selects its outputs (`select_outputs`: pacer's int4 layer), its rows with the same codes: the kept logits are
    then bitwise the full head's."""
    head = model.get_output_embeddings()
    if isinstance(head, ReducedVocabHead):
        raise ValueError(f"the draft's LM head already computes {head.token_ids.numel()} tokens only; reduce the full head")
    if type(head) is not nn.Linear and not hasattr(head, "select_outputs"):
        raise ValueError(f"a reduced draft vocabulary needs the draft's LM head as an nn.Linear (before quantization) "
                         f"or a layer that selects its outputs (pacer's int4 kernel), got {type(head).__name__}")
    vocab_size = head.out_features
    if (size is None) == (token_ids is None):
        raise ValueError("pass either size (the most frequent tokens) or token_ids (the tokens to keep)")
    if token_ids is None:
        if tokenizer is None:
            raise ValueError("a reduced draft vocabulary needs the tokenizer, to keep its special tokens draftable")
        token_ids = frequent_token_ids(vocab_size, size, special_token_ids(tokenizer))
    token_ids = torch.as_tensor(token_ids, dtype=torch.long).unique()  # sorted, each once
    if token_ids.numel() == 0 or int(token_ids[0]) < 0 or int(token_ids[-1]) >= vocab_size:
        raise ValueError(f"token_ids must be a non-empty set of ids in 0..{vocab_size - 1}")
    if type(head) is nn.Linear:
        proj = nn.Linear(head.in_features, token_ids.numel(), bias=head.bias is not None,
                         dtype=head.weight.dtype, device=head.weight.device)
        with torch.no_grad():
            proj.weight.copy_(head.weight[token_ids])
            if head.bias is not None:
                proj.bias.copy_(head.bias[token_ids])
        device = head.weight.device
    else:
        proj = head.select_outputs(token_ids)
        device = next(proj.buffers()).device
    return ReducedVocabHead(proj, token_ids.to(device), vocab_size)


def reduce_draft_vocabulary(model: nn.Module, size: int | None = None, *, tokenizer=None,
                            token_ids: torch.Tensor | None = None) -> nn.Module:
    """Replace `model`'s LM head, in place, by a [`ReducedVocabHead`] over `token_ids`, or over the `size` ids of
    [`frequent_token_ids`] (the special tokens of `tokenizer` included). Call it before quantizing the draft:
    the kept rows are an `nn.Linear` that the quantization converts like any other. Returns the model."""
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear:
        raise ValueError(f"reduce_draft_vocabulary needs the draft's LM head as an nn.Linear (before quantization), "
                         f"got {type(head).__name__}")
    model.set_output_embeddings(reduced_head(model, size, tokenizer=tokenizer, token_ids=token_ids))
    # the embedding keeps the full table; the head no longer shares its storage
    model.config.get_text_config(decoder=True).tie_word_embeddings = False
    return model


@contextlib.contextmanager
def output_head(model: nn.Module, head: nn.Module):
    """Within the block, `model`'s LM head is `head` (e.g. a [`reduced_head`] of it); its own again after."""
    own = model.get_output_embeddings()
    model.set_output_embeddings(head)
    try:
        yield model
    finally:
        model.set_output_embeddings(own)


def kept_tokens(model: nn.Module) -> int | None:
    """How many tokens the draft's LM head computes when it is a [`ReducedVocabHead`] (None: the full vocabulary)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return int(head.token_ids.numel()) if isinstance(head, ReducedVocabHead) else None
