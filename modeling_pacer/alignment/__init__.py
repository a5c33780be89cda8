"""Aligning the draft with its target: `pacer-align` fine-tunes a LoRA adapter of the draft with trl on the
target's own greedy outputs (`pipeline`), its arguments (`config`) and command line (`cli`). The adapter
serves through `load_pair(aligned_draft=...)` (`pairs.loading.merge_adapter`)."""

from .config import PacerAlignConfig, PacerAlignScriptArguments
from .pipeline import Alignment, alignment_dataset, fit_adapter

__all__ = ["Alignment", "PacerAlignConfig", "PacerAlignScriptArguments", "alignment_dataset", "fit_adapter"]
