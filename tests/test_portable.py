"""No committed file names a folder of the machine it was made on: a recipe, card, result or test that names
one works only where that folder exists (a clean machine, CI's clone, a user's checkout lack it)."""

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _tracked_text_files() -> list[Path]:
    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True, capture_output=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: no list of committed files")
    files = []
    for name in filter(None, listed.decode().split("\0")):
        path = ROOT / name
        if path.is_file() and b"\0" not in path.read_bytes()[:8192]:
            files.append(path)
    return files


def test_no_committed_file_names_a_path_of_this_machine():
    # the checkout's parent (its scratch folders sit beside it) and the home folder (its caches)
    folders = {str(ROOT.parent.resolve()) + "/", str(Path.home().resolve()) + "/"} - {"//"}
    leaks = []
    for path in _tracked_text_files():
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), start=1):
            if any(folder in line for folder in folders):
                leaks.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:120]}")
    assert not leaks, "committed files name paths of this machine:\n" + "\n".join(leaks[:20])
