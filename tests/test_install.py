"""`pip install .` (not editable) gives a working package: every module imports from the installed copy,
and the data folders (the default pair's head, the card templates) are found there, not in a checkout."""

import site
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CHECK = textwrap.dedent("""
    import importlib, pkgutil, sys
    from pathlib import Path
    import modeling_pacer
    root = Path(modeling_pacer.__file__).parent
    assert "site-packages" in str(root) and not str(root).startswith(sys.argv[1]), root
    names = [m.name for m in pkgutil.walk_packages([str(root)], "modeling_pacer.")]
    for name in names:
        importlib.import_module(name)
    from modeling_pacer.pairs import DEFAULT_PAIR, default_head_path
    from modeling_pacer.resources import data_folder
    head = default_head_path(DEFAULT_PAIR)
    assert head is not None and (head / "model.safetensors").is_file() and not str(head).startswith(sys.argv[1]), head
    assert (data_folder("hub_cards") / "pacer_head.md").is_file()
    from modeling_pacer import PacerHead
    PacerHead.from_pretrained(head)
    print(len(names), "modules")
""")


def layered_venv(folder: Path) -> Path:
    """A new virtualenv that sees the packages of the environment these tests run in, after its own: a .pth
    file adds this interpreter's site-packages (`--system-site-packages` would add the *base* interpreter's,
    which on a clean machine has none of the dependencies). Returns its python."""
    subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
    python = folder / "bin" / "python"
    purelib = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    lines = "; ".join(f"site.addsitedir({p!r})" for p in site.getsitepackages())
    (Path(purelib) / "_pacer_parent_env.pth").write_text(f"import site; {lines}\n")
    return python


def test_a_layered_venv_sees_this_environment_and_not_the_base_interpreter(tmp_path):
    """The venv above imports what this environment has (torch, transformers) from this environment's
    site-packages, whatever the base interpreter holds."""
    python = layered_venv(tmp_path / "venv")
    code = "import torch, transformers; print(torch.__file__); print(transformers.__file__)"
    out = subprocess.run([python, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    here = [str(Path(m.__file__).resolve()) for m in (__import__("torch"), __import__("transformers"))]
    assert [str(Path(p).resolve()) for p in out] == here


@pytest.mark.timeout(900)
def test_non_editable_install_imports_every_module_and_finds_its_data(tmp_path):
    # the wheel is built in a plain venv: a build inside a layered one would see the setuptools of every
    # environment under it (pip's build isolation hides only the venv's own site-packages), and under
    # .ci/test-with's layer an old one (no PEP 639 license string) was picked up
    builder = tmp_path / "build-venv"
    subprocess.run([sys.executable, "-m", "venv", str(builder)], check=True)
    subprocess.run([builder / "bin" / "python", "-m", "pip", "wheel", "--quiet", "--no-deps", "--disable-pip-version-check",
                    "--wheel-dir", str(tmp_path / "dist"), str(ROOT)], check=True, cwd=tmp_path)
    wheel = next((tmp_path / "dist").glob("pacer_decoding-*.whl"))
    python = layered_venv(tmp_path / "venv")
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check", str(wheel)],
                   check=True, cwd=tmp_path)
    out = subprocess.run([python, "-c", CHECK, str(ROOT)], check=True, cwd=tmp_path, capture_output=True, text=True)
    assert "modules" in out.stdout


def test_torch_is_a_range_and_an_installed_build_of_it_is_kept():
    """pyproject asks for a torch range (no `==` pin: the CPU wheel is the README's and CI's command) that the
    installed build satisfies, a CUDA build of the same release too; pip leaves a requirement that is already
    satisfied as it is (its default strategy), so `pip install .` keeps the user's torch. Every other requirement is
    satisfied here as well: the environment CI tests is the one pyproject describes."""
    import importlib.metadata as metadata
    import tomllib

    import torch
    from packaging.requirements import Requirement
    from packaging.version import Version

    requirements = [Requirement(r) for r in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]]
    spec = next(r.specifier for r in requirements if r.name == "torch")
    assert not any(s.operator == "==" for s in spec), spec
    assert Version(torch.__version__) in spec and Version("2.13.0+cu130") in spec
    unmet = [str(r) for r in requirements if Version(metadata.version(r.name)) not in r.specifier]
    assert not unmet, unmet
