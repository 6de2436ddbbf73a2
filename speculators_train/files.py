"""Atomic, checksummed file writes: a killed process or a full disk never leaves a half file in place."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from speculators_train.errors import UserError


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


# A write that fails while its filesystem has less than this free is reported as a full disk: torch and safetensors
# raise their own exception types on ENOSPC (RuntimeError, SafetensorError), not always an OSError.
FULL_DISK_BYTES = 64 << 20


def _free_bytes(path: Path) -> int:
    """Free space on the filesystem that holds `path` (its nearest existing folder)."""
    return shutil.disk_usage(next(p for p in (path, *path.parents, Path(".")) if p.is_dir())).free


def _disk_full(exc: BaseException, free: int) -> bool:
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    return "No space left on device" in str(exc) or free < FULL_DISK_BYTES


@contextlib.contextmanager
def writing(path: Path, cleanup: Path | None = None) -> Iterator[None]:
    """Run a write of `path`; a full disk becomes a one-line `UserError` (after removing the half-written
    `cleanup` file or directory), any other failure propagates."""
    try:
        yield
    except Exception as exc:
        if cleanup is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(cleanup) if cleanup.is_dir() else cleanup.unlink(missing_ok=True)
        free = _free_bytes(Path(path))
        if not _disk_full(exc, free):
            raise
        raise UserError(
            f"disk full while writing {path} ({free} bytes free); everything written before is intact: "
            "free space and rerun the same command to resume"
        ) from None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, then rename over `path` (readers see old or new, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with writing(path, cleanup=tmp):
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)


def finite(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-inf) replaced by None: JSON has no such numbers, and a reader
    other than Python's (jq, JavaScript, a dashboard) refuses the bare `NaN` Python would write."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [finite(v) for v in obj]
    return obj


def to_json(obj: Any, **kwargs: Any) -> str:
    """Strict JSON: a non-finite number is written as null (see `finite`), never as `NaN` or `Infinity`."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (to_json(obj, indent=2, sort_keys=True) + "\n").encode())


def append_line(path: Path, line: str, sync: bool = False) -> None:
    """Append one line to a run directory's log, never through a symbolic link planted there (O_NOFOLLOW): the
    toolkit writes only inside the run directory. `sync`: on disk before this returns."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UserError(
                f"{path} is a symbolic link: a run directory's files are written in place; remove it"
            ) from None
        raise
    with os.fdopen(fd, "a") as fh:
        fh.write(line)
        if sync:
            fh.flush()
            os.fsync(fh.fileno())


def refuse_links(directory: Path) -> None:
    """A stage directory may itself be a link (a run's states kept on another disk), and may hold links of its own
    that stay inside it (OSD's `current -> versions/vNNNN`), but no link that leads out of it: reading or rewriting
    a planted link would read or write outside the run."""
    if not directory.is_dir():
        return
    root = directory.resolve()
    for path in directory.rglob("*"):
        if path.is_symlink() and root not in path.resolve().parents:
            raise UserError(
                f"{path} is a symbolic link out of {directory}: a run directory's files are written in place; remove it"
            )


def remove_stale_temporaries(directory: Path) -> int:
    """Delete `.name.tmp-PID` leftovers of a killed writer; returns how many were removed."""
    removed = 0
    if directory.is_dir():
        for tmp in directory.rglob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed
