"""The README's first command, as a new user copies it, installs everything the main job reads: the
extras it names, then `pacer-pairs install`, which must bring the prompt sets beside the model pair
(a fresh machine once failed here: the prompts were installed by `.ci/run` only)."""

import re
import shlex
from pathlib import Path

from modeling_pacer import prompts
from modeling_pacer.pairs import cli as pairs_cli
from modeling_pacer.pairs import DEFAULT_PAIR, get_pair
from modeling_pacer.benchmarks import cli as bench_cli

README = Path(__file__).resolve().parent.parent / "README.md"


def _quickstart_commands() -> list[str]:
    """The fenced block under '## Quickstart', one shell line each, comments dropped (as
    `shared/tools/fresh-machine-check` reads it)."""
    block = README.read_text().split("## Quickstart", 1)[1].split("```", 2)[1]
    return [re.sub(r"\s+#.*$", "", line).strip() for line in block.splitlines()[1:] if line.strip()]


def test_first_command_installs_the_pair_and_the_prompt_sets_before_the_benchmark(monkeypatch, tmp_path):
    steps = [shlex.split(step) for step in _quickstart_commands()[0].split("&&")]
    programs = [step[0] for step in steps]
    assert programs.index("pacer-pairs") < programs.index("pacer-bench")
    install = steps[programs.index("pacer-pairs")]
    bench = steps[programs.index("pacer-bench")]

    # run `pacer-pairs install` as written, recording pip instead of running it, with the weights stubbed
    installed: list[str] = []
    monkeypatch.setattr(pairs_cli, "pip_install", lambda reqs: installed.extend(reqs))
    monkeypatch.setattr(pairs_cli, "ensure_gguf", lambda *a, **k: tmp_path / "x.gguf")
    monkeypatch.setattr(pairs_cli, "ensure_converted", lambda *a, **k: tmp_path / "converted")
    assert pairs_cli.main(install[1:]) == 0

    # what the benchmark, run as written, reads: its datasets' prompt packages and the pair's parts
    args = bench_cli.parse_args([*bench[1:], "--out", str(tmp_path / "bench-out")])
    needed = [f"{prompts.SOURCES[d].dist}=={prompts.SOURCES[d].version}" for d in args.datasets]
    for _, parts in pairs_cli.registry_parts(get_pair(DEFAULT_PAIR)):
        needed += parts.requirements()
    assert set(needed) <= set(installed), sorted(set(needed) - set(installed))


def test_second_command_is_the_ci_script():
    assert _quickstart_commands()[1] == "bash .ci/run"
