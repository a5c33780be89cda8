"""Aligning the draft with its target: `pacer-align` fine-tunes a LoRA adapter of the draft with trl on the
target's own greedy outputs (`pipeline`), its arguments (`config`) and command line (`cli`). The adapter
serves through `load_pair(aligned_draft=...)` (`pairs.loading.merge_adapter`).

trl and peft come with the `align` extra: the names below are imported on first use, so that `pacer-align` can name
the extra when they are missing instead of failing on import."""

_FROM = {"PacerAlignConfig": "config", "PacerAlignScriptArguments": "config", "Alignment": "pipeline",
         "alignment_dataset": "pipeline", "fit_adapter": "pipeline"}


def __getattr__(name):
    if name in _FROM:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_FROM[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Alignment", "PacerAlignConfig", "PacerAlignScriptArguments", "alignment_dataset", "fit_adapter"]
