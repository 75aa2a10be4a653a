"""File helpers the tests share (``tests/test_faults.py``, ``tests/test_hostile_files.py``,
``tests/test_checkpoint_index.py``) and ``benchmarks/bench_scale.py``."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from functional_ema._layout import ShardLayout


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


def write_simulated(
    save_dir: str | os.PathLike,
    tag: str,
    layouts: Iterable[ShardLayout],
    pieces: Callable[[ShardLayout], tuple[dict[str, torch.Tensor], ...]],
    after_rank: Callable[[], None] | None = None,
    **extra: object,
) -> dict:
    """Write the checkpoint that ranks of ``layouts`` would write (one process plays every rank), through
    the library's own writer: each rank's file from ``pieces(layout)`` (its EMAs' 1-D pieces), then the
    manifest (with ``extra``'s fields, e.g. an async save's ``save_id``). For tests and
    ``benchmarks/bench_scale.py``; returns the manifest."""
    from functional_ema import EmaState
    from functional_ema._checkpoint import writer
    from functional_ema._checkpoint.format import parse_dtype

    tag_dir = Path(save_dir) / tag
    tag_dir.mkdir(parents=True, exist_ok=True)
    records, first = [], None
    for lay in layouts:
        emas = pieces(lay)
        plan = writer.plan_save(EmaState(torch.tensor(10, dtype=torch.int64), emas), [0.999] * len(emas), lay, tag)
        first = first or plan
        record: dict = {"part": writer.part_record(lay, plan)}
        names = writer.save_files(lay, 0, False, lay.writes_pieces)
        if names:
            meta = writer.rank_file_meta(plan, lay, 0)
            record["file"] = writer.write_rank_file(
                tag_dir / names[0], lay, emas, parse_dtype(plan["dtype"], tag), meta
            )
        records.append(record)
        if after_rank is not None:
            after_rank()
    assert first is not None, "no layouts"
    manifest = writer.build_manifest(first, records, **extra)
    writer.commit_manifest(Path(save_dir), tag_dir, manifest)
    return manifest
