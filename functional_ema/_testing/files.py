"""File helpers the hostile-file tests share (``tests/test_faults.py``, ``tests/test_hostile_files.py``)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def hashes(root: str | os.PathLike) -> dict[str, str]:
    """Path -> sha256 of every file (and ``link:`` + target of every symlink) under ``root``: compared before
    and after a refused read, it shows that nothing on disk changed."""
    out = {}
    for p in sorted(Path(root).rglob("*")):
        if p.is_symlink():
            out[str(p)] = "link:" + os.readlink(p)
        elif p.is_file():
            out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out
