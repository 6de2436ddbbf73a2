"""One process at a time per run directory a stage writes (hidden states, training, OSD, an export).

Two `train` processes on one run delete each other's checkpoints mid-write; two ingestors store lines twice. The
lock is `filelock`'s: an OS lock on a file beside the directory itself (its resolved path: two runs whose stage
directories are links to one directory share one lock), which the kernel releases when its holder dies, so a lock
left by a killed process never blocks the rerun. In a distributed launch rank 0 holds it for every rank: the
process group decides which process that is (a stray `RANK` in one process's environment does not). The holder
writes who it is beside the lock, and a second process is refused with one line naming that process, since when,
and what to do. The holder also refuses a stage directory holding a symbolic link (`files.refuse_links`).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

from speculators_train.errors import UserError
from speculators_train.files import atomic_write_json, refuse_links


def _holder(info: Path) -> str:
    try:
        held = json.loads(info.read_text())
        return f"process {held['pid']} on {held['host']} ({held['command']}, since {held['since']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (which one is not written yet)"


def _secondary_rank() -> bool:
    """Whether this process is a rank other than 0 of an initialised process group."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_rank() != 0


@contextlib.contextmanager
def exclusive(directory: Path, command: str) -> Iterator[None]:
    """Hold `directory` (a run's stage directory, or an export's) for this process while the block runs. Ranks
    of a distributed launch other than rank 0 take no lock: rank 0 holds it for the launch. Enter it after the
    process group is up (a stage's first collective), so the group, not the environment, says which rank this is."""
    if _secondary_rank():
        yield
        return
    directory = Path(directory)
    real = directory.resolve()
    real.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(real.parent / f".{real.name}.lock")
    info = real.parent / f".{real.name}.lock.json"
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise UserError(
            f"{directory} is in use by {_holder(info)}: wait for it to finish or stop it, then rerun "
            f"(two {command} processes on one directory would overwrite each other's files)"
        ) from None
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
        atomic_write_json(info, {"pid": os.getpid(), "host": socket.gethostname(), "since": since, "command": command})
        refuse_links(directory)
        yield
    finally:
        info.unlink(missing_ok=True)
        lock.release()
