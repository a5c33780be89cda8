"""`pip install .` (not editable) gives a working package: every module imports from the installed copy,
and the data folders (the default pair's head, the card templates) are found there, not in a checkout."""

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


@pytest.mark.timeout(900)
def test_non_editable_install_imports_every_module_and_finds_its_data(tmp_path):
    venv = tmp_path / "venv"
    # the dependencies come from this environment; only pacer itself is installed, from a built wheel
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run([python, "-m", "pip", "install", "--quiet", "--no-deps", "--disable-pip-version-check",
                    str(ROOT)], check=True, cwd=tmp_path)
    out = subprocess.run([python, "-c", CHECK, str(ROOT)], check=True, cwd=tmp_path, capture_output=True, text=True)
    assert "modules" in out.stdout
