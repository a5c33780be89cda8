"""Files pacer reads and writes outside the package: its data folders (`heads/`, `hub_cards/`), wherever
pacer is installed, and the check that an output folder can be written.

A wheel (`pip install .`) carries them as data files under `<prefix>/share/pacer/` (pyproject's
`data-files`); an editable install (`pip install -e .`) reads them from its source tree, which pip
records in the distribution's `direct_url.json` (PEP 610).
"""

import json
import os
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlparse
from urllib.request import url2pathname

DISTRIBUTION = "pacer-decoding"


class DataNotInstalledError(FileNotFoundError):
    """pacer's data folders cannot be found: it is not installed as a distribution."""


def data_folder(name: str) -> Path:
    """The installed folder `name` (`"heads"` or `"hub_cards"`); it may not exist when nothing of it shipped."""
    # several may be visible: a build leaves `pacer_decoding.egg-info` in the source tree, which shadows
    # the installed one when Python runs from there; only an installed one says where its data went
    dists = list(metadata.distributions(name=DISTRIBUTION))
    if not dists:
        raise DataNotInstalledError(
            f"pacer's {name}/ folder ships with the installed package, and {DISTRIBUTION} is not installed: "
            "run `pip install .` (or `pip install -e .`) in pacer's source tree."
        )
    for dist in dists:
        direct = json.loads(dist.read_text("direct_url.json") or "{}")
        if direct.get("dir_info", {}).get("editable"):
            return Path(url2pathname(urlparse(direct["url"]).path)) / name
        for file in dist.files or []:
            if f"share/pacer/{name}/" in file.as_posix():
                path = Path(dist.locate_file(file)).resolve()
                return next(p for p in path.parents if p.name == name and p.parent.name == "pacer")
    return Path(sys.prefix) / "share" / "pacer" / name  # where a wheel would have put it; absent


def portable_path(path) -> str | None:
    """`path` as a record (a results file, a card) should name it: a shipped folder relative to pacer's data
    root (`heads/NAME`), else relative to the working folder when it lies inside it, else as given; never
    the absolute path of one machine's checkout or virtualenv when a relative one says the same."""
    if path is None:
        return None
    resolved = Path(path).expanduser().resolve()
    roots = []
    try:
        roots.append(data_folder("heads").parent.resolve())
    except DataNotInstalledError:
        pass
    roots.append(Path.cwd().resolve())
    for root in roots:
        if resolved.is_relative_to(root) and resolved.exists():
            return resolved.relative_to(root).as_posix()
    return str(path)


def write_json(path: Path, data) -> None:
    """Write `data` as JSON to `path` (its folder created) through a temporary file, so that a reader (another
    process sharing the cache) sees the old file or the new one, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def ensure_writable_folder(path: Path, flag: str = "--out") -> None:
    """Create `path` and write a probe file in it: a folder that cannot take a command's output should fail
    before the models load, not after a long run."""
    probe = path / ".pacer-write-probe"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("")
        probe.unlink()
    except OSError as error:
        raise ValueError(f"{flag} {path} is not a writable folder: {error}") from None
