"""`pacer-align`'s arguments: what it aligns on and how the adapter is shaped (`PacerAlignScriptArguments`), and
how it trains (`PacerAlignConfig`, trl's `SFTConfig` with this command's defaults). trl's `TrlParser` turns
them, with `PairArguments`, into flags, and reads a `--config` recipe file key by key."""

from dataclasses import dataclass, field

import torch
from trl import SFTConfig

from ..training.arguments import _check, held_out_count


@dataclass
class PacerAlignScriptArguments:
    """Where the target's greedy outputs come from, the LoRA adapter's shape, the run folder and the upload."""

    out: str = field(metadata={"help": "working folder: traces/ (unless --traces), trainer/ (checkpoints), adapter/ "
                                       "(the Hub-ready adapter with its card), summary.json"})
    n: int = field(default=480, metadata={"help": "ShareGPT prompts (training + held-out), selected as pacer-train "
                                                  "selects them, so a head run's traces serve both"})
    skip: int = field(default=0, metadata={"help": "ShareGPT prompts to skip first"})
    prompt_filter: str | None = field(default=None, metadata={"help": "as pacer-train's --prompt-filter",
                                                               "metavar": "REGEX"})
    eval_fraction: float = field(
        default=0.15, metadata={"help": "share of prompts (the last ones) held out: never trained on, evaluated "
                                        "before and after (the same split as a pacer-train run's)"},
    )
    traces: str | None = field(
        default=None, metadata={"help": "a pacer-train run's traces/ folder to read the target's greedy outputs from "
                                        "(missing prompts are recorded there); default OUT/traces",
                                "metavar": "DIR"},
    )
    max_new_tokens: int = field(default=128, metadata={"help": "greedy target tokens per prompt (as recorded)"})
    max_draft: int = field(default=12, metadata={"help": "the recorded traces' draft length (they are shared with "
                                                         "head training; alignment reads only the target's output)"})
    record_batch_size: int = field(default=8, metadata={"help": "prompts the target generates together when recording"})
    distillation: str = field(
        default="sequence",
        metadata={"help": "sequence: fine-tune on the target's greedy outputs (trl's SFTTrainer); token: match the "
                          "target's next-token distributions along them (trl's GKDTrainer, lmbda=0, forward KL; one "
                          "target forward more per step)", "choices": ("sequence", "token")},
    )
    lora_r: int = field(default=16, metadata={"help": "LoRA rank: the adapter's size and capacity"})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scale numerator (the update is alpha/r * B A)"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input while training"})
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["all-linear"],
        metadata={"help": "the draft's Linear layers that get an adapter (peft names; all-linear: every one but the "
                          "LM head)", "nargs": "+"},
    )
    base_model: str | None = field(
        default=None, metadata={"help": "Hub id of the draft, for the adapter's config and card (default pair: its "
                                        "draft's id)"},
    )
    resume: bool = field(default=False, metadata={"help": "reuse recorded traces and the last trainer checkpoint"})
    push_to_hub_repo: str | None = field(
        default=None, metadata={"help": "upload the adapter folder, card included, to this Hub repo",
                                "aliases": ["--push-to-hub", "--push_to_hub"], "metavar": "REPO_ID"},
    )
    private: bool = field(default=False, metadata={"help": "create the Hub repo private (with --push-to-hub)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (unset: torch's own choice)"})

    def __post_init__(self):
        _check(bool(self.out), "--out must name a folder.")
        _check(self.n > 0, f"--n must be positive, got {self.n}.")
        _check(0 < self.eval_fraction < 1, f"--eval-fraction must lie strictly between 0 and 1, got {self.eval_fraction}.")
        _check(self.n - held_out_count(self.n, self.eval_fraction) >= 1,
               f"--n {self.n} leaves no training prompt once --eval-fraction {self.eval_fraction} holds some out.")
        _check(self.skip >= 0, f"--skip cannot be negative, got {self.skip}.")
        _check(self.max_new_tokens >= 2, f"--max-new-tokens must be at least 2, got {self.max_new_tokens}.")
        _check(self.max_draft >= 1, f"--max-draft must be at least 1, got {self.max_draft}.")
        _check(self.record_batch_size >= 1, f"--record-batch-size must be at least 1, got {self.record_batch_size}.")
        _check(self.distillation in ("sequence", "token"),
               f"--distillation must be sequence or token, got {self.distillation!r}.")
        _check(self.lora_r >= 1, f"--lora-r must be at least 1, got {self.lora_r}.")
        _check(self.lora_alpha > 0, f"--lora-alpha must be positive, got {self.lora_alpha}.")
        _check(0 <= self.lora_dropout < 1, f"--lora-dropout must lie in [0, 1), got {self.lora_dropout}.")
        _check(bool(self.lora_target_modules), "--lora-target-modules needs at least one module name.")
        _check(not self.private or self.push_to_hub_repo is not None,
               "--private only applies to an upload: give --push-to-hub REPO_ID too.")
        _check(self.threads is None or self.threads >= 1, f"--threads must be at least 1, got {self.threads}.")

    def lora_config(self):
        """The adapter's peft `LoraConfig`."""
        from peft import LoraConfig

        modules = self.lora_target_modules
        return LoraConfig(r=self.lora_r, lora_alpha=self.lora_alpha, lora_dropout=self.lora_dropout, task_type="CAUSAL_LM",
                          target_modules=modules[0] if modules == ["all-linear"] else modules)


@dataclass
class PacerAlignConfig(SFTConfig):
    """trl's `SFTConfig` with `pacer-align`'s defaults: sequence-level distillation, i.e. supervised fine-tuning
    on the target's own greedy outputs with the loss on the completion only (the prompt is context)."""

    # the prompt is the user's text, not the target's: only the target's tokens teach the draft what it says
    completion_only_loss: bool | None = field(default=True, metadata={"help": "Loss on the target's output only."})
    # LoRA on a 0.5B draft: the usual adapter learning rate, one pass over a few hundred outputs
    learning_rate: float = field(default=2e-4, metadata={"help": "Peak learning rate (AdamW).", "aliases": ["--lr"]})
    num_train_epochs: float = field(default=1.0, metadata={"help": "Passes over the training outputs.",
                                                           "aliases": ["--epochs"]})
    per_device_train_batch_size: int = field(default=4, metadata={"help": "Sequences per step.",
                                                                  "aliases": ["--batch-size"]})
    per_device_eval_batch_size: int = field(default=4, metadata={"help": "Sequences per evaluation step."})
    lr_scheduler_type: str = field(default="cosine", metadata={"help": "Learning-rate schedule."})
    warmup_steps: float = field(default=0.05, metadata={"help": "Linear warm-up: steps, or a share when below 1."})
    # prompt + 128 output tokens fit; longer ShareGPT prompts are cut from the right (their output last)
    max_length: int | None = field(default=640, metadata={"help": "Tokens per sequence at most (prompt + output)."})
    # sequences of similar length share a batch: less padding, which a CPU pays for in full
    train_sampling_strategy: str = field(default="group_by_length", metadata={"help": "Training sampler."})
    # activations of 4 x 640 tokens fit in memory; recomputing them would cost a third more time
    gradient_checkpointing: bool = field(default=False, metadata={"help": "Recompute activations in backward."})
    logging_steps: float = field(default=5, metadata={"help": "Log every this many steps."})
    save_strategy: str = field(default="steps", metadata={"help": "When to write a checkpoint (what --resume continues)."})
    save_steps: float = field(default=20, metadata={"help": "Checkpoint every this many steps."})
    save_total_limit: int | None = field(default=1, metadata={"help": "Checkpoints kept (the newest)."})
    report_to: None | str | list[str] = field(default="none", metadata={"help": "Loggers to report to."})
    seed: int = field(default=0, metadata={"help": "Seed of the adapter's initialisation and the data order."})
    use_cpu: bool = field(default=not torch.cuda.is_available(),
                          metadata={"help": "Train on the CPU (default: when no CUDA device is present)."})
