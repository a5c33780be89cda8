"""What a benchmark file records about how it was made: the command, the commit, the package versions and the
host, so that a figure can be traced to the code and the machine that produced it (and rerun at that commit)."""

from __future__ import annotations

import shlex
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from ..costs import describe_host

# the distributions whose versions decide a result (the ones installed are recorded; the others are left out)
RECORDED_PACKAGES = ("pacer-decoding", "torch", "transformers", "huggingface-hub", "accelerate", "safetensors",
                     "gguf", "bitsandbytes", "trl", "peft", "llama-cpp-python", "gradio")


def command_line(argv: list[str] | None = None) -> str:
    """The `pacer-bench` command as it was typed (quoted so that it can be pasted back)."""
    return "pacer-bench " + " ".join(shlex.quote(a) for a in (sys.argv[1:] if argv is None else argv))


def source_commit(folder: Path | None = None) -> dict | None:
    """`{"commit": sha, "dirty": bool}` of the git checkout pacer runs from (an editable install), or None where pacer
    is not run from one (an installed wheel: its version then says which release it is)."""
    folder = folder or Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        status = subprocess.run(["git", "-C", str(folder), "status", "--porcelain", "--untracked-files=no"],
                                capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return dict(commit=sha, dirty=bool(status.strip()))


def package_versions() -> dict[str, str]:
    versions = {}
    for name in RECORDED_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    versions["python"] = sys.version.split()[0]
    return versions


def run_meta(argv: list[str] | None = None, **fields) -> dict:
    """The `meta` of a results file: `command`, `source` (commit, dirty), `versions`, `host`, then `fields`."""
    return dict(command=command_line(argv), source=source_commit(), versions=package_versions(), host=describe_host(),
                **fields)
