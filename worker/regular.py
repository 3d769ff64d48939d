"""Reading a small file that must be a regular one, without waiting on what is not: a FIFO
put where a pid file, a note or a database is expected blocks an open() until a writer comes,
and a directory or a device is no file to read."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_regular(
    path: str | Path, most: int | None = None, *, follow: bool = False
) -> bytes | None:
    """Up to `most` bytes (all, when None) of `path` if it is a regular file, else None;
    opened without blocking and, unless `follow`, without following a symbolic link. OSError
    when it cannot be opened or read."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        if most is not None:
            return os.read(fd, most)
        os.set_blocking(fd, True)
        blocks = []
        while block := os.read(fd, 1 << 20):
            blocks.append(block)
        return b"".join(blocks)
    finally:
        os.close(fd)
