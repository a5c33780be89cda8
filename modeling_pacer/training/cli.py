"""`pacer-train run|card`: from a model pair and a prompt source to a trained, tuned, Hub-ready PACER head.

    pacer-train run --n 200 --out runs/head                                 # the default pair
    pacer-train run training/qwen2.5-coder-1.5b-0.5b.yaml                   # a recipe: the flags as YAML or JSON
    pacer-train run --target org/big --draft org/small --n 500 --push-to-hub me/pacer-head-big-small
    pacer-train card --out runs/head --bench-results results.json           # the card again, with a benchmark

`run` (also when the first argument is not a command: `pacer-train --n 24 ...`, as before there were
commands) records greedy traces of every prompt, trains the head on the training prompts' drafts, tunes
(b, t0, rho, m) by replay on the held-out prompts and saves the head folder with its model card; `--resume`
continues a run. `card` renders a finished run's card again from its summary.json, with the Speed section
of a pacer-bench run of the head. `pacer-train run -h` lists run's flags: `PacerTrainScriptArguments`,
`PairArguments` and `PacerTrainingArguments` (every `TrainingArguments` field, e.g. `--lr`/`--learning-rate`,
`--epochs`/`--num-train-epochs`, `--batch-size`/`--per-device-train-batch-size`).
"""

import argparse
import json
import sys
from pathlib import Path

from transformers import HfArgumentParser

from ..extras import MissingExtra, require
from ..resources import ensure_writable_folder
from .arguments import (
    PacerCardArguments,
    PacerTrainScriptArguments,
    PairArguments,
    RunArguments,
    check_recipe_types,
    check_run,
)
from .training_args import PacerTrainingArguments

COMMANDS = {
    "run": "record traces, train, tune and save a head (the default command): [FLAGS | RECIPE.yaml | RECIPE.json]",
    "card": "render a finished run's head card again: --out RUN [--bench-results results.json]",
}
RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults beside every flag (HfArgumentParser's choice) and the description's layout kept."""


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: what `pacer-train -h` shows (each command parses its own arguments)."""
    parser = argparse.ArgumentParser(prog="pacer-train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", metavar="{run,card}")
    for name, text in COMMANDS.items():
        commands.add_parser(name, help=text)
    return parser


def build_run_parser() -> HfArgumentParser:
    """`pacer-train run`'s flags, one per dataclass field.

    `PacerTrainingArguments` comes first so that our `--push-to-hub REPO_ID` (the head folder, with its card)
    replaces TrainingArguments' boolean `--push-to-hub` (the trainer's checkpoints), under argparse's
    "resolve" conflict handler: the later definition takes the flag, and TrainingArguments' field keeps its
    default (False: the Trainer never pushes)."""
    parser = HfArgumentParser((PacerTrainingArguments, PairArguments, PacerTrainScriptArguments), prog="pacer-train run",
                              description=__doc__, formatter_class=_HelpFormatter, conflict_handler="resolve",
                              usage="pacer-train run [FLAGS | RECIPE.yaml | RECIPE.json]   (-h lists every flag)")
    parser.set_defaults(push_to_hub=False)
    return parser


def build_card_parser() -> HfArgumentParser:
    return HfArgumentParser(PacerCardArguments, prog="pacer-train card", description=COMMANDS["card"])


def parse_recipe(parser: HfArgumentParser, path: str) -> tuple:
    """A recipe file's keys (the run's flags, underscored) into the dataclasses, with HfArgumentParser's own
    readers (as trl's `--config`); an unknown key is an error, not ignored."""
    import yaml

    try:
        if path.endswith(".json"):
            return parser.parse_json_file(path)
        return parser.parse_yaml_file(path)
    except (OSError, yaml.YAMLError, AttributeError) as error:  # AttributeError: the file is not a mapping
        parser.error(f"recipe {path}: {error}")


def parse_run_args(argv: list[str], parser: HfArgumentParser | None = None) -> RunArguments:
    """`pacer-train run`'s arguments (flags, or a recipe file as the sole argument), every value checked; a
    bad one exits 2 with argparse's message, naming it."""
    parser = parser or build_run_parser()
    recipe = argv[0] if argv and argv[0].endswith(RECIPE_SUFFIXES) and not argv[0].startswith("-") else None
    if recipe and len(argv) > 1:
        parser.error(f"a recipe ({recipe}) is the sole argument of `pacer-train run`: put {' '.join(argv[1:])} in it")
    try:
        if recipe:
            training, pair, script = parse_recipe(parser, recipe)
            check_recipe_types(training, pair, script)
        else:
            training, pair, script, unknown = parser.parse_args_into_dataclasses(
                argv, return_remaining_strings=True, look_for_args_file=False)
            if "--card-only" in unknown:
                parser.error("--card-only is now a command of its own: pacer-train card --out RUN [--bench-results FILE]")
            if unknown:
                parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        args = RunArguments(script, pair, training)
        check_run(args)
    except ValueError as error:  # a dataclass's own check
        parser.error(str(error))
    except TypeError as error:  # a recipe's value of the wrong type, or a required key missing
        parser.error(f"recipe {recipe}: {error} (a value of the wrong type? YAML reads 1e-3 as a string: write 0.001 "
                     "or 1.0e-3)" if recipe else str(error))
    return args


def _run(argv: list[str]) -> int:
    from .pipeline import TrainingError, run
    from ..pairs import WeightsNotInstalledError

    parser = build_run_parser()
    args = parse_run_args(argv, parser)
    try:
        ensure_writable_folder(Path(args.script.out))
    except ValueError as error:
        parser.error(str(error))
    try:
        summary = run(args)
    except (TrainingError, WeightsNotInstalledError) as error:
        print(f"pacer-train: error: {error}", file=sys.stderr)
        return 1
    if summary:  # the main process
        print(json.dumps({k: summary[k] for k in ("metrics", "tuned", "ablations", "timings")}, indent=1, default=str))
    return 0


def _card(argv: list[str]) -> int:
    from .card import rerender_card

    parser = build_card_parser()
    try:
        (args,) = parser.parse_args_into_dataclasses(argv, look_for_args_file=False)
    except ValueError as error:
        parser.error(str(error))
    try:
        print(rerender_card(Path(args.out), args.bench_results))
    except (ValueError, KeyError) as error:  # a summary.json or results.json of another kind
        print(f"pacer-train card: error: cannot render the card: {error!r}", file=sys.stderr)
        return 1
    return 0


def split_command(argv: list[str]) -> tuple[str, list[str]]:
    """`(command, its arguments)`; a first argument that is not a command starts `run`, so that the commands
    written before there were commands (`pacer-train --n 24 ...`, quoted by committed cards) still work."""
    if argv[:1] and argv[0] in COMMANDS:
        return argv[0], list(argv[1:])
    return "run", list(argv)


def main(argv=None) -> int:
    """`pacer-train [run] ...` or `pacer-train card ...`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        build_parser().print_help()
        return 0
    command, argv = split_command(argv)
    if command != "card":
        try:
            require("train", "pacer-train")
        except MissingExtra as error:
            print(f"pacer-train: error: {error}", file=sys.stderr)
            return 2
    return _card(argv) if command == "card" else _run(argv)


if __name__ == "__main__":
    raise SystemExit(main())
