"""`pacer-align`: a LoRA adapter that aligns the draft with its target, trained with trl on the target's own
greedy outputs, saved Hub-ready with its card.

    pacer-align --out runs/align --n 480                                    # the default pair
    pacer-align --out runs/align --traces runs/head/traces --n 480          # a head run's outputs, reused
    pacer-align --config training/qwen2.5-coder-0.5b-aligned.yaml           # a recipe (trl's --config YAML)

Flags: `PacerAlignScriptArguments` (prompts, adapter shape, folders), `PairArguments` (the models, as in every
pacer command) and `PacerAlignConfig` (trl's `SFTConfig`: every `TrainingArguments` field too, e.g. `--lr`,
`--epochs`, `--max-steps`). `--resume` continues from the last checkpoint. The adapter then serves through
`load_pair(aligned_draft=OUT/adapter)` and every command's `--aligned-draft OUT/adapter`.
"""

import argparse
import json
import sys
from pathlib import Path

from ..extras import MissingExtra, require
from ..pairs import PairArguments
from ..resources import ensure_writable_folder


def build_parser():
    """`pacer-align`'s flags, one per dataclass field (trl's `TrlParser`, which also reads `--config`).

    `PacerAlignConfig` comes first so that our `--push-to-hub REPO_ID` (the adapter folder, with its card)
    replaces TrainingArguments' boolean `--push-to-hub` (the trainer's checkpoints) under argparse's
    "resolve" conflict handler."""
    from trl import TrlParser

    from .config import PacerAlignConfig, PacerAlignScriptArguments

    parser = TrlParser((PacerAlignConfig, PairArguments, PacerAlignScriptArguments), prog="pacer-align",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       conflict_handler="resolve")
    parser.set_defaults(push_to_hub=False)
    return parser


def parse_args(argv: list[str], parser=None) -> tuple:
    """`(config, pair arguments, script arguments)`, every value checked; a bad one exits 2 naming it."""
    parser = parser or build_parser()
    try:
        config, pair, script = parser.parse_args_and_config(argv)
    except (ValueError, TypeError, OSError) as error:  # a dataclass's own check, or a recipe that cannot be read
        parser.error(str(error))
    if config.push_to_hub:
        parser.error("pacer-align uploads the adapter folder itself: name the repo with --push-to-hub REPO_ID.")
    if config.output_dir not in (None, "trainer_output") and not config.output_dir.endswith("trainer_output"):
        parser.error(f"--output-dir {config.output_dir}: pacer-align keeps its checkpoints in OUT/trainer; choose the "
                     "folder with --out.")
    return config, pair, script


def main(argv=None) -> int:
    try:
        require("align", "pacer-align")
    except MissingExtra as error:
        print(f"pacer-align: error: {error}", file=sys.stderr)
        return 2
    from ..pairs import WeightsNotInstalledError
    from ..training.pipeline import TrainingError
    from .pipeline import run

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parse_args(argv, parser)
    try:
        ensure_writable_folder(Path(args[2].out))
    except ValueError as error:
        parser.error(str(error))
    try:
        summary = run(args)
    except (TrainingError, WeightsNotInstalledError) as error:
        print(f"pacer-align: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in ("before", "after", "training_seconds", "prompts")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
