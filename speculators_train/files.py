"""Atomic, checksummed file writes: a killed process or a full disk never leaves a half file in place."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
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


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary sibling, fsync, then rename over `path` (readers see old or new, never half)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            free = shutil.disk_usage(path.parent).free
            raise UserError(
                f"disk full while writing {path} ({len(data)} bytes needed, {free} free); "
                "everything written before is intact: free space and rerun the same command to resume"
            ) from exc
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def remove_stale_temporaries(directory: Path) -> int:
    """Delete `.name.tmp-PID` leftovers of a killed writer; returns how many were removed."""
    removed = 0
    if directory.is_dir():
        for tmp in directory.rglob(".*.tmp-*"):
            tmp.unlink(missing_ok=True)
            removed += 1
    return removed


def read_json(path: Path, what: str) -> Any:
    """Parse a JSON file we wrote earlier; damage (a hand edit, a disk fault) gets a message naming it."""
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: {what} is missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: {what} is not valid JSON ({exc}); delete it to start that part over") from None
