"""Training PACER heads: traces to labelled drafts (`data`), a packing collator and a `Trainer` subclass
(`trainer`, `training_args`), tuning of the stopping rule (`tuning`), and `pacer-train`: its arguments
(`arguments`), pipeline (`pipeline`), model card (`card`) and command line (`cli`). The recipes it runs are
data, in the repository's top-level `training/`."""
