"""`pacer-train`'s arguments as dataclasses, which transformers' `HfArgumentParser` turns into flags (as trl's
scripts build theirs with `TrlParser`) and which a recipe file (YAML or JSON) fills key by key.

- `PacerTrainScriptArguments`: the prompts, the recording, the head's shape, the run folder, the upload;
- `PairArguments`: the models, chosen as in every pacer command;
- `PacerTrainingArguments` (training_args.py): the optimisation, as `TrainingArguments` fields;
- `PacerCardArguments`: what `pacer-train card` re-renders.

Every dataclass checks its values when it is built, and `check_run` what needs two of them, so that a bad flag
or recipe key stops the command with a message naming it before a model is loaded or a trace recorded: a run
can take hours, and an argument that cannot work should not cost them.
"""

import dataclasses
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..pairs import PairArguments
from .data import PROMPT_FILTERS, prompt_pattern
from .training_args import PacerTrainingArguments


def held_out_count(num_prompts: int, eval_fraction: float) -> int:
    """How many of `num_prompts` prompts (the last ones) are held out for evaluation and tuning: at least one."""
    return max(1, round(num_prompts * eval_fraction))


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


@dataclass
class PacerTrainScriptArguments:
    """What `pacer-train run` records, how it shapes the head, where it writes and what it uploads."""

    out: str = field(metadata={"help": "working folder: traces/, trainer/, head/ (the Hub-ready head with its card), "
                                       "summary.json"})
    n: int = field(default=200, metadata={"help": "ShareGPT prompts to use (training + held-out)"})
    skip: int = field(default=0, metadata={"help": "ShareGPT prompts to skip first (another sample of the same kind)"})
    prompt_filter: str | None = field(
        default=None,
        metadata={"help": "keep only ShareGPT prompts containing a match of this case-insensitive regex, or of a named "
                          f"one ({', '.join(PROMPT_FILTERS)}: requests for code or calculations), to train on "
                          "requests like the deployment's", "metavar": "REGEX"},
    )
    eval_fraction: float = field(
        default=0.15, metadata={"help": "share of prompts (the last ones) held out for evaluation and tuning"},
    )
    max_new_tokens: int = field(
        default=128, metadata={"help": "greedy tokens recorded per prompt; every output position starts a draft"},
    )
    max_draft: int = field(
        default=16, metadata={"help": "longest draft recorded and allowed (the head's max_draft_length)"},
    )
    record_batch_size: int = field(
        default=8, metadata={"help": "prompts whose greedy outputs the target generates together (left-padded, exact "
                                     "per sequence; about 5x the tokens/s of one at a time on a CPU)"},
    )
    target_outputs_from: str | None = field(
        default=None,
        metadata={"help": "another run's traces/ folder, recorded with the same target settings: its target outputs "
                          "are reused, so only the draft's side is recorded (a head for an --aligned-draft, say)",
                  "metavar": "DIR"},
    )
    head_hidden_size: int = field(default=256, metadata={"help": "width of the head (small: it runs at every block)"})
    head_heads: int = field(
        default=4, metadata={"help": "attention heads of the head's one layer (must divide --head-hidden-size)"},
    )
    head_intermediate_size: int = field(default=512, metadata={"help": "width of that layer's feed-forward block"})
    head_dropout: float = field(default=0.0, metadata={"help": "dropout inside the head while training"})
    head_draft_features: bool = field(
        default=False,
        metadata={"help": "let the head also read the draft's probability of each drafted token and the entropy it "
                          "was drafted from (its own confidence), beside its hidden states"},
    )
    head_draft_prior: bool = field(
        default=False, metadata={"help": "with --head-draft-features: the head's output corrects the draft's own "
                                         "cumulative estimate (the product of its token probabilities) instead of "
                                         "predicting from scratch"},
    )
    ablate_position_embedding: bool = field(
        default=False, metadata={"help": "also train a head without draft-position embeddings, for the card's ablation"},
    )
    ablate_draft_features: bool = field(
        default=False, metadata={"help": "also train the head the other way round (without --head-draft-features if "
                                         "set, else with), for the card's ablation"},
    )
    ablate_training_sizes: list[int] = field(
        default_factory=list, metadata={"help": "also train heads on only the first N training prompts, for each N "
                                                "given, judged on the same held-out prompts (the card's data-size "
                                                "ablation)", "nargs": "*"},
    )
    resume: bool = field(
        default=False, metadata={"help": "reuse the traces recorded in --out (with the same settings) and the last "
                                         "trainer checkpoint"},
    )
    base_model: str | None = field(
        default=None,
        metadata={"help": "Hub id of the draft, for the card's base_model (default pair: its draft's id)"},
    )
    push_to_hub_repo: str | None = field(
        default=None,
        metadata={"help": "upload the head folder, card included, to this Hub repo (not TrainingArguments' push of "
                          "trainer checkpoints)", "aliases": ["--push-to-hub", "--push_to_hub"], "metavar": "REPO_ID"},
    )
    private: bool = field(default=False, metadata={"help": "create the Hub repo private (with --push-to-hub)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (unset: torch's own choice)"})

    def __post_init__(self):
        _check(bool(self.out), "--out must name a folder.")
        _check(self.n > 0, f"--n must be positive, got {self.n}.")
        _check(0 < self.eval_fraction < 1, f"--eval-fraction must lie strictly between 0 and 1, got {self.eval_fraction}.")
        held_out = held_out_count(self.n, self.eval_fraction)
        _check(self.n - held_out >= 1,
               f"--n {self.n} leaves no training prompt once --eval-fraction {self.eval_fraction} holds out {held_out}: "
               "give more prompts or a smaller fraction.")
        _check(self.skip >= 0, f"--skip cannot be negative, got {self.skip}.")
        if self.prompt_filter is not None:
            _check(bool(self.prompt_filter), "--prompt-filter is empty; leave it out to keep every prompt.")
            try:
                re.compile(prompt_pattern(self.prompt_filter))
            except re.error as error:
                raise ValueError(f"--prompt-filter {self.prompt_filter!r} is not a valid regular expression: {error}.") from None
        _check(self.max_new_tokens >= 2,
               f"--max-new-tokens must be at least 2 (one token to draft from, one to draft), got {self.max_new_tokens}.")
        _check(self.max_draft >= 1, f"--max-draft must be at least 1, got {self.max_draft}.")
        _check(self.record_batch_size >= 1, f"--record-batch-size must be at least 1, got {self.record_batch_size}.")
        _check(self.target_outputs_from is None or Path(self.target_outputs_from).is_dir(),
               f"--target-outputs-from {self.target_outputs_from}: no such folder.")
        for name in ("head_hidden_size", "head_heads", "head_intermediate_size"):
            _check(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}.")
        _check(self.head_hidden_size % self.head_heads == 0,
               f"--head-hidden-size {self.head_hidden_size} is not divisible by --head-heads {self.head_heads} "
               "(each attention head takes an equal share of the width).")
        _check(all(size >= 1 for size in self.ablate_training_sizes),
               f"--ablate-training-sizes must be positive prompt counts, got {self.ablate_training_sizes}.")
        _check(not self.head_draft_prior or self.head_draft_features,
               "--head-draft-prior needs --head-draft-features (it reads the draft's probabilities).")
        _check(0 <= self.head_dropout < 1, f"--head-dropout must lie in [0, 1), got {self.head_dropout}.")
        if self.push_to_hub_repo is not None:
            from huggingface_hub.utils import validate_repo_id

            try:
                validate_repo_id(self.push_to_hub_repo)
            except ValueError as error:
                raise ValueError(f"--push-to-hub {self.push_to_hub_repo!r} is not a Hub repo id: {error}") from None
        _check(not self.private or self.push_to_hub_repo is not None,
               "--private only applies to an upload: give --push-to-hub REPO_ID too.")
        _check(self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}.")


@dataclass
class PacerCardArguments:
    """What `pacer-train card` re-renders: a finished run's head card, with a benchmark of the head."""

    out: str = field(metadata={"help": "the folder of a finished `pacer-train run` (its summary.json and head/), "
                                       "or a head folder holding its run's training_summary.json"})
    bench_results: list[str] | None = field(
        default=None,
        metadata={"help": "pacer-bench results.json files measured with this head (e.g. one per dtype), for the "
                          "card's Speed section, in this order"},
    )

    def __post_init__(self):
        out = Path(self.out)
        _check(((out / "summary.json").is_file() and (out / "head").is_dir())
               or ((out / "training_summary.json").is_file() and (out / "config.json").is_file()),
               f"--out {self.out} holds no finished run (summary.json and head/, as `pacer-train run` writes them) "
               "and is no head folder with its training_summary.json.")
        missing = [path for path in self.bench_results or [] if not Path(path).is_file()]
        _check(not missing, f"--bench-results {' '.join(missing)}: no such file.")


class RunArguments(NamedTuple):
    """`pacer-train run`'s three dataclasses, as the parser returns them (and unpacked as trl's scripts do)."""

    script: PacerTrainScriptArguments
    pair: PairArguments
    training: PacerTrainingArguments


def check_run(args: RunArguments) -> None:
    """What no single dataclass can check: settings of two of them that must agree."""
    _check(args.script.max_draft <= args.training.max_tokens_per_row,
           f"--max-draft {args.script.max_draft} does not fit --max-tokens-per-row {args.training.max_tokens_per_row}: "
           "a draft is packed whole into one training row.")
    _check(not args.training.push_to_hub,
           "pacer-train uploads the head folder itself: name the repo with --push-to-hub REPO_ID "
           "(recipe key push_to_hub_repo), not TrainingArguments' push_to_hub.")
    _check(args.training.output_dir == "trainer_output",
           f"--output-dir {args.training.output_dir}: pacer-train keeps the trainer's checkpoints in OUT/trainer; "
           "choose the folder with --out.")


def _plain_type(annotation):
    """`int` for `int` and `int | None`; the annotation itself otherwise."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(annotation) if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def check_recipe_types(*instances) -> None:
    """A recipe's values reach the dataclasses as YAML or JSON typed them (HfArgumentParser converts the
    flags' strings, not a file's values): a number, or a switch, of another type would otherwise fail only when
    training uses it, hours later. YAML reads `1e-3` as a string."""
    accepted = {int: (int,), float: (int, float), bool: (bool,)}
    for instance in instances:
        hints = typing.get_type_hints(type(instance))
        for f in dataclasses.fields(instance):
            kind = _plain_type(hints[f.name]) if f.init else None
            value = getattr(instance, f.name)
            if kind not in accepted or value is None:
                continue
            if not isinstance(value, accepted[kind]) or (kind is not bool and isinstance(value, bool)):
                raise ValueError(f"recipe key {f.name}: {value!r} is not {'true or false' if kind is bool else 'a number'}"
                                 + (" (YAML reads 1e-3 as a string: write 0.001 or 1.0e-3)" if isinstance(value, str) else "")
                                 + ".")
