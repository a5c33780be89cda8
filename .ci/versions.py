"""The versions CI tests, read from pyproject.toml so that the claimed ranges and the tested ones agree.

    python .ci/versions.py oldest      # e.g. "transformers==5.23 huggingface-hub==1.31"
    python .ci/versions.py installed   # what this interpreter has, e.g. "transformers 5.24.0 huggingface-hub 2.4.0"
"""

import importlib.metadata
import sys
import tomllib
from pathlib import Path

from packaging.requirements import Requirement

# the dependencies whose ranges CI tests at both ends (the loop and the head's Hub code run on them)
RANGED = ("transformers", "huggingface-hub")


def _requirements() -> dict[str, Requirement]:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    reqs = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    return {name: reqs[name] for name in RANGED}


def oldest() -> str:
    pins = []
    for name, req in _requirements().items():
        floors = [s.version for s in req.specifier if s.operator == ">="]
        if len(floors) != 1:
            sys.exit(f"{name}: pyproject must give one lower bound (>=), got {req.specifier}")
        pins.append(f"{name}=={floors[0]}")
    return " ".join(pins)


def installed() -> str:
    return " ".join(f"{name} {importlib.metadata.version(name)}" for name in _requirements())


if __name__ == "__main__":
    print({"oldest": oldest, "installed": installed}[sys.argv[1]]())
