"""Each script in examples/ runs as a user runs it (`python examples/NAME.py`, tiny random models built by the
script) and prints what it promises: PACER's output equal to the target's, a trained head that loads, draws in
the target's distribution, streamed tokens that are the output."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _run(tmp_path, name: str, *args: str) -> str:
    env = dict(os.environ, PACER_CACHE=str(tmp_path / "pacer-cache"), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(EXAMPLES / name), *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_every_example_has_a_test():
    tested = {"quickstart.py", "own_pair.py", "sampling.py", "streaming.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart(tmp_path):
    out = _run(tmp_path, "quickstart.py")
    assert "identical to the target's greedy output: True" in out and "target verifications" in out


def test_own_pair_trains_loads_and_generates(tmp_path):
    out = _run(tmp_path, "own_pair.py", "--out", str(tmp_path / "run"))
    assert (tmp_path / "run" / "head" / "config.json").is_file() and (tmp_path / "run" / "head" / "README.md").is_file()
    assert re.search(r"trained on 4 prompts, held-out AUC [01]\.\d{3}", out)
    assert "identical to the target's greedy output: True" in out


def test_sampling_draws_follow_the_target(tmp_path):
    out = _run(tmp_path, "sampling.py")
    distance = float(re.search(r"total variation distance over 400 draws: (\d\.\d+)", out).group(1))
    noise = float(re.search(r"sampling noise alone is about (\d\.\d+)", out).group(1))
    drafts = float(re.search(r"the draft's distribution is (\d\.\d+) away", out).group(1))
    # the seeds are fixed: the same draws on every run; draws that followed the draft (a wrong acceptance rule)
    # would sit near the draft's distribution, which is several times the noise away from the target's
    assert drafts > 4 * noise and distance < 2 * noise, out


def test_streaming(tmp_path):
    out = _run(tmp_path, "streaming.py")
    assert "streamed tokens are the output: True" in out and "identical to the target's greedy output: True" in out
    assert re.search(r"step: drafted \d+ \(\w+\), accepted \d+", out)
