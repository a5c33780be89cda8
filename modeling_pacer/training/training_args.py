"""Training arguments of the PACER head trainer (a `TrainingArguments` dataclass, as trl does)."""

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class PacerTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus what training a pre-verification head needs.

    A batch of `per_device_train_batch_size` drafts is packed into rows of `max_tokens_per_row`
    tokens, so one batch holds hundreds of drafts (the paper's Figure 5).
    """

    max_tokens_per_row: int = field(
        default=256,
        metadata={"help": "Tokens per packed training row; drafts are packed whole with a block-diagonal causal mask."},
    )
    soft_labels: bool = field(
        default=False,
        metadata={"help": "Train on the acceptance probability prod(min(1, p/q)) (sampling data) instead of 0/1 labels."},
    )
    positive_weight: float = field(
        default=1.0,
        metadata={"help": "Weight of accepted tokens in the loss (BCE pos_weight), for very unbalanced pairs."},
    )
    # defaults that differ from TrainingArguments': the dataset's columns are not forward's arguments,
    # and the collator builds `labels`
    remove_unused_columns: bool = field(default=False, metadata={"help": "Keep the draft columns for the collator."})
    label_names: list[str] | None = field(default_factory=lambda: ["labels"], metadata={"help": "The label key."})
    report_to: str | list[str] | None = field(default="none", metadata={"help": "Loggers to report to."})
