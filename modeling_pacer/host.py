"""What pacer knows of the machine it runs on, and the rules for what it keeps there.

- `cpuinfo_field`: a field of /proc/cpuinfo (the CPU's name and flags decide kernels, row ranges and cost curves);
- `cache_root`: pacer's cache folder (`$PACER_CACHE`, else `~/.cache/pacer`);
- `build_once`: a cache entry built once and shared by processes (the assembled GGUF, the converted model, the
  compiled kernels): built under a cross-process lock (`filelock`), checked again once the lock is held, so two
  processes starting on a fresh cache make it once, and a process that waits says what it waits for;
- `remove_stale_partials`: the `<name>.<pid>.partial` files and folders of processes that died mid-build (killed,
  out of memory, a stopped container) are removed by the next run instead of filling the disk;
- `trusted`: an entry that runs code (a compiled library) or decides exactness (a row-range file) is read only when
  this user owns it and its folders and nobody else can write to them; otherwise it is rebuilt in a private place;
- `sha256_file`: a file's hash, for everything pinned;
- `disk_error`: a full or read-only disk as one clear line instead of a traceback.

It imports nothing of pacer: everything that asks the host sits above it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from filelock import FileLock, Timeout


def cpuinfo_field(name: str) -> str | None:
    """The first `name : value` line's value in /proc/cpuinfo (e.g. "model name", "flags"); None where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cache_root(pacer_cache: str | os.PathLike | None = None) -> Path:
    """The pacer cache folder: `pacer_cache`, else `$PACER_CACHE`, else `~/.cache/pacer`."""
    return Path(pacer_cache or os.environ.get("PACER_CACHE") or Path.home() / ".cache" / "pacer").expanduser()


@contextlib.contextmanager
def build_once(path: str | os.PathLike, what: str, *, log=None):
    """Hold the cross-process lock of the cache entry `path` (`.locks/<name>.lock` beside it) for the block: the caller checks again
    whether the entry is there once inside, and builds it only if not. A process that finds the lock taken says what
    it waits for (on stderr, or through `log`) and waits. Stale partial files of dead processes beside the entry are
    removed once the lock is held."""
    path = Path(path)
    locks = path.parent / LOCKS
    locks.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(locks / f"{path.name}.lock"))  # kept: removing a lock file others may wait on is unsafe
    try:
        lock.acquire(timeout=0)
    except Timeout:
        (log or (lambda line: print(line, file=sys.stderr, flush=True)))(
            f"pacer: another process is building {what} ({path}); waiting for it")
        lock.acquire()
    try:
        remove_stale_partials(path.parent, path.name)
        yield path
    finally:
        lock.release()


LOCKS = ".locks"  # the folder beside the entries that holds their lock files
_PARTIAL = re.compile(r"^(?P<name>.+)\.(?P<pid>\d+)\.partial$")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: alive
    return True


def remove_stale_partials(folder: str | os.PathLike, name: str | None = None) -> list[Path]:
    """Remove `<name>.<pid>.partial` files and folders in `folder` whose process is gone (all names, or `name`'s).
    A partial of a live process (this one's included) is left alone. Returns what was removed."""
    removed = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return removed
    for entry in entries:
        match = _PARTIAL.match(entry.name)
        if not match or (name is not None and match["name"] != name) or _alive(int(match["pid"])):
            continue
        with contextlib.suppress(OSError):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def trusted(path: str | os.PathLike, root: str | os.PathLike | None = None) -> bool:
    """True when `path` (a file, not a symbolic link) and every folder from it up to `root` (default: its own
    folder) belong to this user and no other user can write to them: what such a folder holds is what this user
    (or root) put there. A planted file in a shared cache is not."""
    path = Path(path)
    uid = os.getuid()
    try:
        info = path.lstat()
    except OSError:
        return False
    if stat.S_ISLNK(info.st_mode) or info.st_uid != uid or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return False
    folder, top = path.parent, Path(root) if root is not None else path.parent
    while True:
        try:
            info = folder.lstat()
        except OSError:
            return False
        if info.st_uid != uid or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
        if folder == top or folder.parent == folder:
            return True
        folder = folder.parent


def private_folder(name: str) -> Path:
    """A folder only this user can read and write (0700), for entries that cannot be trusted where they are."""
    folder = Path(tempfile.gettempdir()) / f"pacer-{os.getuid()}" / name
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder.parent, 0o700)
    os.chmod(folder, 0o700)
    return folder


def sha256_file(path: str | os.PathLike, chunk_bytes: int = 16 << 20) -> str:
    """Hex sha256 of a file, read in `chunk_bytes` blocks (constant memory): how every pinned file is checked."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def disk_error(error: OSError, where: str | os.PathLike) -> str | None:
    """One line for a full or read-only disk (None for any other error)."""
    if error.errno == errno.ENOSPC:
        return f"no space left on the disk holding {where}: free some, or point $PACER_CACHE at a larger disk"
    if error.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        return f"cannot write to {where} ({os.strerror(error.errno)}): point $PACER_CACHE at a writable folder"
    return None
