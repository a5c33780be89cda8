"""Training arguments of the PACER head trainer (a `TrainingArguments` dataclass, as trl does).

Its defaults are `pacer-train`'s, so that the command's flags are this dataclass's fields (through
`HfArgumentParser`) and a `PacerTrainer` built without arguments trains a head the way the command does.
"""

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments
from transformers.trainer_utils import SaveStrategy, SchedulerType


@dataclass
class PacerTrainingArguments(TrainingArguments):
    """`TrainingArguments` plus what training a pre-verification head needs, with the defaults that trained
    the committed head.

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
    # typed as TrainingArguments types it: HfArgumentParser reads a union with None first
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Loggers to report to."})
    # pacer-train's optimisation: a small head on hundreds of thousands of drafts learns in a few epochs at a
    # learning rate that would be far too high for a language model. The short flags are the command's old names.
    num_train_epochs: float = field(default=4.0, metadata={"help": "Passes over the training drafts.", "aliases": ["--epochs"]})
    learning_rate: float = field(default=1e-3, metadata={"help": "Peak learning rate (AdamW).", "aliases": ["--lr"]})
    per_device_train_batch_size: int = field(
        default=256, metadata={"help": "Drafts per batch (packed into rows of max_tokens_per_row tokens).",
                               "aliases": ["--batch-size", "--batch_size"]},
    )
    per_device_eval_batch_size: int | None = field(
        default=None, metadata={"help": "Drafts per evaluation batch (default: the training batch size)."},
    )
    lr_scheduler_type: SchedulerType | str = field(
        default="cosine", metadata={"help": "Learning-rate schedule (see `SchedulerType`)."},
    )
    warmup_steps: float = field(
        default=0.05, metadata={"help": "Linear warm-up: steps, or a share of all steps when below 1."},
    )
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW weight decay (not on biases and norms)."})
    logging_steps: float = field(default=10, metadata={"help": "Log every this many optimisation steps."})
    save_strategy: SaveStrategy | str = field(
        default="epoch", metadata={"help": "When to write a trainer checkpoint (what --resume continues from)."},
    )
    save_total_limit: int | None = field(default=1, metadata={"help": "Trainer checkpoints kept (the newest)."})
    seed: int = field(default=0, metadata={"help": "Seed of the head's initialisation and of the data order."})
    # without CUDA, CPU explicitly: accelerate then joins several CPU processes over gloo, and a Mac's MPS
    # is not picked for a head this small (pacer-train has always trained on the CPU there)
    use_cpu: bool = field(
        default=not torch.cuda.is_available(),
        metadata={"help": "Train on the CPU (default: when no CUDA device is present)."},
    )

    def __post_init__(self):
        # checked before TrainingArguments' own set-up, which already starts accelerate's process state
        if self.learning_rate <= 0:
            raise ValueError(f"--learning-rate (--lr) must be positive, got {self.learning_rate}.")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            raise ValueError(
                f"--num-train-epochs (--epochs) must be positive, got {self.num_train_epochs}: no optimisation step "
                "would be made and the head would stay untrained (or set --max-steps)."
            )
        if self.per_device_train_batch_size <= 0:
            raise ValueError(f"--per-device-train-batch-size (--batch-size) must be positive, got "
                             f"{self.per_device_train_batch_size}.")
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        if self.max_tokens_per_row <= 0:
            raise ValueError(f"--max-tokens-per-row must be positive, got {self.max_tokens_per_row}.")
        if self.positive_weight <= 0:
            raise ValueError(f"--positive-weight must be positive, got {self.positive_weight}.")
        super().__post_init__()
