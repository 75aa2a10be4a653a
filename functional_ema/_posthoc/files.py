"""Snapshot checkpoints on disk (one safetensors file per rank per snapshot) and reconstruction
streamed from them, a few parameters at a time."""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import optree
import torch

from .. import _io, checkpoint
from .._api import shard_layout
from .._args import (
    check_bool,
    check_int,
    check_location,
    check_optional_int,
    check_optional_real,
    check_path,
    check_state,
    check_storage_options,
    check_str,
)
from .._checkpoint.errors import CheckpointNotFoundError
from .._checkpoint.format import FORMAT_VERSION, MANIFEST_NAME, check_out_folder, check_output, short_list
from .._checkpoint.reader import Location, StoragePath, open_checkpoint, open_joined
from .._core import check_ema_dtype
from .._layout import ModelPart, ShardLayout
from .._shards import Shards
from .._state import EmaState
from .._storage import storage_for
from .._tree import TreeMismatchError
from ..schedules import Schedule, gamma_to_sigma_rel, power
from .profiles import (
    DEFAULT_MAX_PROFILE_ERROR,
    GAMMA_MAX,
    ReconstructionError,
    profile_error,
    resolve_step,
    solve_coefficients,
    target_gamma,
)
from .synthesis import add_scaled, copied, gammas_and_step

# ----------------------------------------------------------------------------------- snapshot files

#: Tag prefix of snapshot folders written by :func:`save_snapshot`.
SNAPSHOT_PREFIX = "snapshot_"


def snapshot_tag(step: int) -> str:
    """``f"snapshot_{step:09d}"``: sorts by step as text up to a billion steps."""
    return f"{SNAPSHOT_PREFIX}{check_int(step, 'step'):09d}"


def save_snapshot(
    state: EmaState,
    engine: Any,
    snapshot_dir: str | os.PathLike,
    schedules: Sequence[Schedule | float],
    *,
    tag: str | None = None,
    dtype: torch.dtype = torch.float32,
    storage_options: dict[str, Any] | None = None,
) -> Path | str:
    """Write this rank's pieces of every tracked power EMA as a snapshot checkpoint. Collective.

    Call it on every rank every N steps (e.g. ``if step % 1000 == 0``). It is
    :func:`functional_ema.save` into ``snapshot_dir/snapshot_<step:09d>/``, with the power schedules
    recorded (so the files carry each EMA's ``gamma`` and the step, all that reconstruction needs).
    Each snapshot is one safetensors file per rank in ``dtype`` (fp32 by default, as :func:`snapshot`:
    a bf16 or fp16 EMA is written as fp32, since 16-bit snapshots cost accuracy) plus a manifest
    written last, so an interrupted save leaves an incomplete tag that the readers skip. Use a
    directory of its own or DeepSpeed's checkpoint directory: the tags never collide with ``global_step<N>``.

    Args:
        state: this rank's state tracking ``K`` power EMAs over ``local_shards(engine)``.
        engine: the engine or model the state's pieces come from (see :func:`functional_ema.local_shards`).
        snapshot_dir: directory shared by all ranks.
        schedules: the ``K`` schedules passed to :func:`functional_ema.update` (``schedules.power``)
            or their ``sigma_rel`` floats, in the state's order.
        tag: folder name; default :func:`snapshot_tag` of ``state.step``. A ``str`` starting with
            :data:`SNAPSHOT_PREFIX` (``"snapshot_"``, e.g. ``"snapshot_final"``): the readers list only such
            folders, so any other name is refused here rather than never read.
        dtype: dtype of the snapshot files (``torch.float32``; ``torch.float64`` keeps more, the 16-bit
            ones cost accuracy, see :func:`snapshot`). An EMA of another dtype is cast on a copy first
            (memory: one copy of this rank's EMAs in ``dtype``); the state is not changed.
        storage_options: for a URL ``snapshot_dir`` (``s3://bucket/run/snapshots``), fsspec's arguments
            (``key``, ``secret``, ``endpoint_url``, ...) as for :func:`functional_ema.save`; ``None``: fsspec's
            configuration. Refused with a local folder. The readers (:func:`list_snapshots`,
            :func:`posthoc_offline`, ...) take the URL and the same options.

    Returns:
        The snapshot folder (its URL, a ``str``, for a URL ``snapshot_dir``: see :func:`functional_ema.save`).

    Example:
        >>> scheds = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]       # doctest: +SKIP
        >>> state = fe.update(state, fe.local_shards(engine), step, decay=scheds)  # doctest: +SKIP
        >>> if step % 1000 == 0:                                                 # doctest: +SKIP
        ...     posthoc.save_snapshot(state, engine, "snapshots", scheds)
    """
    check_state(state)
    location = check_location(snapshot_dir, "snapshot_dir")  # a URL too: fe.save writes there
    check_storage_options(storage_options, location, "save_snapshot(storage_options=...)")
    dtype = check_ema_dtype(dtype)
    tag = _check_snapshot_tag(tag)
    gammas, step = gammas_and_step(state, schedules)
    tag = snapshot_tag(step) if tag is None else tag
    decays = [power(gamma=g) for g in gammas]
    return checkpoint._save(  # errors name save_snapshot (and its storage_options), not save
        _cast(state, dtype),
        engine,
        snapshot_dir,
        tag,
        decay=decays,
        buffers=None,
        extra=None,
        timeout=None,
        shared=True,
        storage_options=storage_options,
        what="save_snapshot",
    )


def _check_snapshot_tag(tag: Any) -> str | None:
    """``tag`` if the readers would list it (``None``, or a ``str`` starting with :data:`SNAPSHOT_PREFIX`)."""
    if tag is None:
        return None
    if not isinstance(tag, str):
        raise TypeError(
            f"save_snapshot(tag=...) must be a str starting with {SNAPSHOT_PREFIX!r} (or None: snapshot_tag(step)), "
            f"got {type(tag).__name__} {tag!r:.60}"
        )
    if not tag.startswith(SNAPSHOT_PREFIX):
        raise ValueError(
            f"save_snapshot(tag={tag!r:.80}): the readers (list_snapshots, posthoc_offline, ...) list only folders "
            f"whose names start with {SNAPSHOT_PREFIX!r}, so this snapshot would never be used; name it "
            f"{SNAPSHOT_PREFIX + tag!r:.80} or leave tag=None (snapshot_tag(step))"
        )
    return tag


def _cast(state: EmaState, dtype: torch.dtype) -> EmaState:
    """``state`` with its EMAs in ``dtype``: itself when they are, else copies (a ``Shards`` keeps its layout
    and selection, which the save reads)."""
    trees: Any = state.emas  # optree types a tree as its own PyTree class, which a tuple of dicts is not to mypy
    if all(t.dtype == dtype for t in optree.tree_leaves(trees, none_is_leaf=False)):
        return state
    with torch.no_grad():
        emas = tuple(
            ema.mirror(dtype, fill=True) if isinstance(ema, Shards) else copied(ema, None, dtype) for ema in state.emas
        )
    return EmaState(state.step, emas)


class SnapshotInfo(NamedTuple):
    """One complete snapshot checkpoint on disk.

    Attributes:
        tag: its folder name.
        step: training step of the EMAs in it.
        gammas: exponent of each EMA in it (``emas.<k>.*`` tensors).
        shapes: parameter name -> full shape.
    """

    tag: str
    step: int
    gammas: tuple[float, ...]
    shapes: dict[str, tuple[int, ...]]


def _snapshot_root(snapshot_dir: Any, storage_options: Any, verb: str) -> Location:
    """``snapshot_dir`` (of ``verb``) checked where it enters: a local folder (a ``Path``), or a URL opened through
    the storage seam with ``storage_options`` (fsspec and the filesystem's package imported now); options with a
    local folder are refused naming ``verb``'s ``storage_options``."""
    location = check_location(snapshot_dir, "snapshot_dir")
    options = check_storage_options(storage_options, location, f"{verb}(storage_options=...)")
    if isinstance(location, StoragePath) and not options:
        return location  # already opened (with its own filesystem and options)
    return StoragePath(storage_for(location, **options)) if isinstance(location, str) else location


def _url_access(root: Location, verb: str) -> contextlib.AbstractContextManager[None]:
    """A storage refusing access (a wrong secret) re-raised naming the URL and ``verb``'s ``storage_options``."""
    return checkpoint.url_access(root if isinstance(root, StoragePath) else None, verb)


def _snapshot_tags(root: Location, prefix: str) -> tuple[list[str], list[str]]:
    """(every snapshot tag folder in ``root`` whose name starts with ``prefix``, sorted; those without a manifest).

    A URL is listed once (its folder's names); each name is then asked by its exact name whether it is a file
    (not a tag folder) and whether its manifest is there, as :func:`functional_ema.load` reads a tag."""
    if isinstance(root, StoragePath):
        every = root.store.listdir(root.rel)
        if not every:  # an object store has no empty folders: nothing under the prefix is no folder
            raise CheckpointNotFoundError(f"snapshot directory {root} does not exist (nothing is stored under it)")
        names = [n for n in every if n.startswith(prefix)]
        tags = [n for n in names if (root / n).size() is None]  # a file of that name is no tag folder
        return tags, [t for t in tags if (root / t / MANIFEST_NAME).size() is None]
    if root.exists() and not root.is_dir():  # e.g. SNAPSHOT_DIR/ema_latest given: it exists, as a file
        raise CheckpointNotFoundError(
            f"snapshot directory {root} is a file, not a folder: give the folder holding the snapshot_<step> folders "
            f"(here perhaps {root.parent})"
        )
    if not root.is_dir():
        raise CheckpointNotFoundError(f"snapshot directory {root} does not exist")
    tags = sorted(d.name for d in root.iterdir() if d.is_dir() and d.name.startswith(prefix))
    return tags, [t for t in tags if not (root / t / MANIFEST_NAME).is_file()]


def list_snapshots(
    snapshot_dir: str | os.PathLike,
    *,
    prefix: str = SNAPSHOT_PREFIX,
    part: ModelPart | None = None,
    storage_options: dict[str, Any] | None = None,
) -> list[SnapshotInfo]:
    """Complete snapshot checkpoints in ``snapshot_dir`` (tags starting with ``prefix``), by step.

    Each is validated (manifest, every rank file's header and checksum, coverage of every
    parameter) without reading tensor data. Tags without a manifest (an interrupted save) are
    skipped with a warning. A folder whose data is the same as an earlier-named one's at the same step (a
    ``tag="snapshot_final"`` save at the last periodic step) is listed once, under the earlier name; other
    data at the same step is refused. ``shapes`` are the full shapes of the whole model (every model-parallel
    part joined), or of one ``part``'s parameters.

    ``snapshot_dir`` may be an fsspec URL (``s3://bucket/run/snapshots``), read in place (one listing
    of the folder, then each tag's manifest and rank files' headers by their exact names), with
    ``storage_options`` as for :func:`functional_ema.load` (``None``: fsspec's configuration; refused
    with a local folder).

    Raises:
        ReconstructionError: no complete snapshot, an EMA that is not a power EMA, or snapshots of
            different models.
        functional_ema.CheckpointError: a damaged snapshot.
        PermissionError: the storage at the URL refused access, naming the URL and ``storage_options``.
    """
    check_str(prefix, "prefix")
    if part is not None and not isinstance(part, ModelPart):
        raise TypeError(f"part must be a ModelPart (or None: the whole model), got {type(part).__name__}")
    root = _snapshot_root(snapshot_dir, storage_options, "list_snapshots")
    with _url_access(root, "list_snapshots"):
        return _list(root, prefix, part)


def _list(root: Location, prefix: str, part: ModelPart | None) -> list[SnapshotInfo]:
    """:func:`list_snapshots` of an opened ``root`` (a local folder or a storage's)."""
    tags, incomplete = _snapshot_tags(root, prefix)
    if incomplete:
        warnings.warn(
            f"skipping {len(incomplete)} incomplete snapshot tag(s) without a manifest (interrupted saves?): "
            f"{incomplete[:4]}{' ...' if len(incomplete) > 4 else ''}",
            stacklevel=3,
        )
    out: list[SnapshotInfo] = []
    prints: dict[str, Any] = {}
    for tag in tags:
        if tag in incomplete:
            continue
        if part is None:
            with open_joined(root, tag, verify=True) as joined:
                m, shapes = joined.manifest, dict(joined.shapes)
        else:
            with open_checkpoint(root, tag, verify=True, layout=None, part=part) as ckpt:
                m, shapes = ckpt.manifest, dict(ckpt.shapes)
        out.append(_info(root, tag, m, shapes))
        prints[tag] = _data_print(m)
    if not out:
        raise ReconstructionError(
            f"no complete snapshot (tags prefix={prefix!r}*) in {root}; write them with posthoc.save_snapshot during training"
        )
    out.sort(key=lambda s: (s.step, s.tag))
    same = _check_distinct(root, out, prints)
    out = [s for s in out if s.tag not in same]  # a copy of one save is one snapshot (the first tag kept)
    first = out[0]
    for s in out[1:]:
        if s.shapes != first.shapes:
            diff = sorted(set(s.shapes).symmetric_difference(first.shapes)) or sorted(
                n for n in s.shapes if s.shapes[n] != first.shapes.get(n)
            )
            grew = set(first.shapes) < set(s.shapes) and all(s.shapes[n] == t for n, t in first.shapes.items())
            why = (
                f"parameters that joined the EMA at a step after {first.step} (unfrozen mid-run: docs/integrations.md, "
                "'Progressive unfreezing'); the snapshots before they joined lack them, so synthesise from the ones "
                "after: move the earlier ones to another directory"
                if grew
                else "they come from different models; keep one run's snapshots per directory"
            )
            raise ReconstructionError(
                f"snapshots {first.tag!r} and {s.tag!r} hold different parameters ({short_list(diff)}): {why}"
            )
    return out


def _info(root: Location, tag: str, m: dict[str, Any], shapes: dict[str, tuple[int, ...]]) -> SnapshotInfo:
    """The :class:`SnapshotInfo` of the tag folder ``tag`` from its manifest ``m``: a snapshot that no reconstruction
    can use (not power EMAs, step 0, a gamma out of range) or that is another folder's copy is refused, naming it."""
    if m.get("tag") != tag:  # a folder copied or renamed: it may be another run's snapshot of the same step
        raise ReconstructionError(
            f"snapshot folder {tag!r} in {root} holds the snapshot saved as {m.get('tag')!r} (its manifest's tag): a copied "
            "or renamed folder, perhaps from another run. Keep one run's snapshots per directory, under the names "
            "save_snapshot gave them; move this folder out"
        )
    scheds = m.get("schedules") or []
    if len(scheds) != int(m["num_emas"]):
        raise ReconstructionError(
            f"snapshot {tag!r} in {root} does not record its EMAs' schedules (was it written by functional_ema.save "
            "without decay=?). Post-hoc EMA needs power EMAs: write snapshots with posthoc.save_snapshot"
        )
    gammas = []
    for k, d in enumerate(scheds):
        if not isinstance(d, dict) or d.get("kind") != "power" or not isinstance(d.get("gamma"), (int, float)):
            raise ReconstructionError(
                f"snapshot {tag!r}: EMA {k} has schedule {d!r}, not a power EMA; post-hoc EMA synthesises only from "
                "power EMAs (schedules.power(sigma_rel=...))"
            )
        if not -0.5 < float(d["gamma"]) <= GAMMA_MAX:
            raise ReconstructionError(
                f"snapshot {tag!r} in {root}: EMA {k} has gamma {d['gamma']!r}, outside (-0.5, {GAMMA_MAX:g}] where "
                "post-hoc EMA synthesises; move this folder out of the snapshot directory"
            )
        gammas.append(float(d["gamma"]))
    if int(m["step"]) < 1:  # refused, not skipped: save_snapshot never writes one, so it is no snapshot of this run
        raise ReconstructionError(
            f"snapshot {tag!r} in {root} is at step {m['step']}: a power EMA has no profile before its first update, "
            "and posthoc.save_snapshot refuses such a state. It was written by another tool (functional_ema.save of a "
            "fresh state?); move it out of the snapshot directory"
        )
    return SnapshotInfo(tag, int(m["step"]), tuple(gammas), shapes)


def _check_distinct(root: Location, infos: list[SnapshotInfo], prints: dict[str, Any]) -> dict[str, str]:
    """Two snapshot folders holding an EMA of the same exponent at the same step (``infos`` sorted by step): the
    least-squares fit would average them. Copies of one save (a final snapshot at the last periodic step: their
    manifests' data checksums, ``prints``, agree) are one snapshot: returns ``{later tag: the tag kept}`` for the
    caller to drop. Different data is another run's: refused, naming both."""
    seen: dict[tuple[int, float], str] = {}
    same: dict[str, str] = {}
    for info in infos:
        for g in info.gammas:
            other = seen.setdefault((info.step, g), info.tag)
            if other == info.tag or same.get(info.tag) == other:
                continue
            if prints[info.tag] is not None and prints[info.tag] == prints[other]:
                same[info.tag] = other
                continue
            raise ReconstructionError(
                f"snapshot folders {other!r} and {info.tag!r} in {root} both hold an EMA of gamma {g:.6g} at step "
                f"{info.step} with different data: one step is snapshotted once per run, so one of them is a copy "
                "or another run's. Keep one run's snapshots per directory: move one out"
            )
    return same


def _data_print(m: dict[str, Any]) -> Any:
    """What a snapshot's manifest says of its data: everything but its name, save count, start time, note and
    extra, and its files' names, sizes and header checksums (the header names the tag; a re-save of a step names its
    files with a generation suffix, ``...gen1.safetensors``); the chunk checksums, shapes, dtype, step and schedules
    stay.
    ``None`` for a manifest without files."""

    def strip(x: Any) -> Any:
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("file", "bytes", "header_checksum")}
        return [strip(v) for v in x] if isinstance(x, list) else x

    if not m.get("files") and not m.get("parts"):
        return None
    skipped = ("tag", "generation", "started_ns", "note", "library", "extra")
    return strip({k: v for k, v in m.items() if k not in skipped})


class _FilePlan(NamedTuple):
    root: Location  # a local folder, or a storage's (a URL)
    terms: list[tuple[str, int, float]]  # (tag, EMA index, coefficient), nonzero only, by step
    shapes: dict[str, tuple[int, ...]]
    step: int
    gamma: float
    profile_error: float
    num_snapshots: int  # snapshot folders the fit combined (those at or before step)


class _Reading(NamedTuple):
    """The checked arguments of a post-hoc verb that reads snapshot files."""

    sigma_rel: float | None
    gamma: float | None
    step: int | None
    max_profile_error: float | None
    dtype: torch.dtype
    verify: bool
    prefix: str
    buffer_bytes: int

    def plan(self, root: Location, part: ModelPart | None = None) -> _FilePlan:
        return _plan_files(root, self.sigma_rel, self.gamma, self.step, self.max_profile_error, self.prefix, part)

    def stream(
        self,
        plan: _FilePlan,
        ranges: dict[str, tuple[int, int, tuple[int, ...]]],
        layout: ShardLayout | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        return _stream(
            plan, ranges, verify=self.verify, dtype=self.dtype, buffer_bytes=self.buffer_bytes, layout=layout
        )


def _check_reading(
    verify: Any,
    dtype: Any,
    buffer_bytes: Any,
    sigma_rel: Any = None,
    gamma: Any = None,
    step: Any = None,
    max_profile_error: Any = None,
    prefix: Any = SNAPSHOT_PREFIX,
) -> _Reading:
    """The arguments of the post-hoc verbs that read snapshot files, checked before any snapshot is opened."""
    target_gamma(sigma_rel, gamma)
    check_optional_int(step, "step", minimum=1)
    check_optional_real(max_profile_error, "max_profile_error", low=0.0)
    check_str(prefix, "prefix")
    check_bool(verify, "verify")
    check_ema_dtype(dtype)
    check_int(buffer_bytes, "buffer_bytes", minimum=1)
    return _Reading(sigma_rel, gamma, step, max_profile_error, dtype, verify, prefix, buffer_bytes)


def _plan_files(
    root: Location,
    sigma_rel: float | None,
    gamma: float | None,
    step: int | None,
    max_profile_error: float | None,
    prefix: str,
    part: ModelPart | None = None,
) -> _FilePlan:
    infos = _list(root, prefix, part)
    gammas: list[float] = []
    steps: list[int] = []
    refs: list[tuple[str, int]] = []
    for info in infos:
        for k, g in enumerate(info.gammas):
            gammas.append(g)
            steps.append(info.step)
            refs.append((info.tag, k))
    x = solve_coefficients(
        gammas, steps, sigma_rel=sigma_rel, gamma=gamma, step=step, max_profile_error=max_profile_error
    )
    target = target_gamma(sigma_rel, gamma)
    s = int(resolve_step(np.asarray(steps, dtype=np.float64), step))
    err = profile_error(gammas, steps, x, gamma=target, step=s)
    terms = [(tag, k, float(c)) for (tag, k), c in zip(refs, x) if c != 0.0]
    used = sum(1 for info in infos if info.step <= s)  # later snapshots take no part in the fit
    return _FilePlan(root, terms, infos[0].shapes, s, target, err, used)


def _stream(
    plan: _FilePlan,
    ranges: dict[str, tuple[int, int, tuple[int, ...]]],
    *,
    verify: bool,
    dtype: torch.dtype,
    buffer_bytes: int,
    layout: ShardLayout | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for each name of ``ranges`` (``name -> (start, numel, out shape)``
    of the flattened parameter): ``sum_terms c * piece`` accumulated in float64.

    Parameters are taken in groups whose float64 accumulators fit ``buffer_bytes`` (at least one
    parameter a group); each snapshot checkpoint is opened once per group. With ``layout`` (this
    rank's), a snapshot saved with that layout is read from this rank's file alone. Beside the group's
    accumulators, one piece is held at a time (the readers fill whole pieces) and scaled through
    :func:`add_scaled`'s bounded scratch; each accumulator is freed once cast.
    """
    names = list(ranges)
    groups: list[list[str]] = []
    size = 0
    for n in names:
        nbytes = 8 * ranges[n][1]
        if not groups or size + nbytes > buffer_bytes:
            groups.append([])
            size = 0
        groups[-1].append(n)
        size += nbytes
    by_tag: dict[str, list[tuple[int, float]]] = {}
    for tag, k, c in plan.terms:
        by_tag.setdefault(tag, []).append((k, c))
    for group in groups:
        acc = {n: torch.zeros(ranges[n][1], dtype=torch.float64) for n in group}
        for tag, ks in by_tag.items():
            with (
                open_checkpoint(plan.root, tag, verify, layout)
                if layout is not None
                else open_joined(plan.root, tag, verify)
            ) as ckpt:
                for k, c in ks:
                    for n in group:
                        start, numel, _ = ranges[n]
                        piece = torch.empty(numel, dtype=ckpt.dtype)
                        ckpt.fill(piece, k, n, start, numel, verify)
                        add_scaled(acc[n], piece, c)
                        del piece  # one piece at a time, never two (the next one is allocated before this is rebound)
        for n in group:
            yield n, acc.pop(n).to(dtype).view(ranges[n][2])  # the float64 accumulator is freed once cast


def posthoc_offline(
    snapshot_dir: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """Full post-hoc EMA weights from the per-rank snapshot files: no process group, no GPU.

    ``EMA(sigma_rel, step) ~ sum_{snapshot j, EMA k} x_jk * full_jk`` with ``x`` from
    :func:`solve_coefficients` over every complete snapshot in ``snapshot_dir``; each full
    parameter is assembled from the ranks' pieces (any world size and ZeRO stage) and accumulated
    in float64, parameter by parameter (groups of at most ``buffer_bytes`` of accumulators), reading
    only the snapshots with a nonzero coefficient.

    Memory at the peak, beyond the process's own: the float64 accumulators of one group (at most
    ``buffer_bytes``, and at least the largest parameter's: 8 bytes an element), one parameter read in the
    snapshots' dtype (or, while an accumulator is cast, that parameter in ``dtype``: each accumulator is
    freed once cast), 4 MiB of scratch (pieces are scaled 512Ki elements at a time), and the result built so
    far; a parameter split across model-parallel parts adds one part's slice while it is joined. Measured
    (``benchmarks/bench_posthoc_memory.py``, a 160.5 MiB fp32 model whose largest parameter is 62.5 MiB):
    192 MiB with ``buffer_bytes=32 << 20``, 388 MiB with the default.

    Args:
        snapshot_dir: the directory :func:`save_snapshot` wrote into, or its fsspec URL
            (``s3://bucket/run/snapshots``): read in place, with ranged reads of the pieces needed.
        sigma_rel, gamma, step, max_profile_error: as in :func:`solve_coefficients` (``step``
            defaults to the last snapshot).
        dtype: result dtype.
        verify: check the checksums of every byte read.
        prefix: tag prefix of the snapshot folders.
        buffer_bytes: memory for float64 accumulators (8 bytes an element; a parameter larger than it is
            a group of its own); smaller opens each snapshot more often. The peak is stated above.
        storage_options: for a URL ``snapshot_dir``, fsspec's arguments (``key``, ``secret``,
            ``endpoint_url``, ...) as for :func:`functional_ema.load`; ``None``: fsspec's configuration.
            Refused with a local folder. A storage refusing access raises ``PermissionError`` naming the
            URL and this verb's ``storage_options``.

    Returns:
        ``{parameter name: tensor of its full shape}``; equal (bitwise) to reconstructing each
        rank's pieces (:func:`reconstruct`, :func:`posthoc_local`) and then gathering them.

    Example:
        >>> weights = posthoc.posthoc_offline("snapshots", sigma_rel=0.15)   # doctest: +SKIP
        >>> model.load_state_dict(weights, strict=False)                     # doctest: +SKIP
    """
    reading = _check_reading(verify, dtype, buffer_bytes, sigma_rel, gamma, step, max_profile_error, prefix)
    root = _snapshot_root(snapshot_dir, storage_options, "posthoc_offline")
    with _url_access(root, "posthoc_offline"):
        plan = reading.plan(root)
        return dict(reading.stream(plan, {n: (0, math.prod(s), s) for n, s in plan.shapes.items()}))


def posthoc_local(
    snapshot_dir: str | os.PathLike,
    layout: Any,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, torch.Tensor]:
    """This rank's pieces of the post-hoc EMA, from the snapshot files; never communicates.

    Args:
        snapshot_dir: the directory :func:`save_snapshot` wrote into, or its fsspec URL.
        layout: a :class:`functional_ema.ShardLayout` (e.g. ``fe.shard_layout(engine)``), or a
            DeepSpeed engine. Any world size and ZeRO stage: each piece is read from the saved
            pieces that overlap it.
        others: as in :func:`posthoc_offline` (``storage_options`` for a URL ``snapshot_dir``).

    Memory: as :func:`posthoc_offline`'s, of this rank's pieces (accumulators of one group of pieces, one
    piece in the snapshots' dtype, 4 MiB of scratch, and the pieces done so far; pieces cut otherwise than the
    saved ones, after a change of world size, also read their range widened to the 4 MiB checksum chunks when
    verifying: up to one more piece).

    Returns:
        ``{name: 1-D tensor}`` shaped like ``local_shards(engine)``; e.g. wrap it as
        ``EmaState(torch.tensor(step), (pieces,))`` for :func:`functional_ema.gather_full` or
        :func:`functional_ema.swapped`.
    """
    if isinstance(layout, ShardLayout):
        mine = layout
    else:
        try:
            mine = shard_layout(layout)
        except TypeError as e:
            raise TypeError(f"layout: not a ShardLayout, and {e}") from None
    reading = _check_reading(verify, dtype, buffer_bytes, sigma_rel, gamma, step, max_profile_error, prefix)
    root = _snapshot_root(snapshot_dir, storage_options, "posthoc_local")
    with _url_access(root, "posthoc_local"):
        return _local(root, mine, reading)


def _local(root: Location, mine: ShardLayout, reading: _Reading) -> dict[str, torch.Tensor]:
    """:func:`posthoc_local` of an opened snapshot folder, its arguments checked."""
    plan = reading.plan(root, mine.part)
    missing = [n for n in mine.specs if n not in plan.shapes]
    bad = [n for n, s in mine.specs.items() if n in plan.shapes and tuple(s.shape) != plan.shapes[n]]
    if missing or bad:
        raise TreeMismatchError(
            f"the snapshots in {plan.root} do not fit this layout: not in the snapshots {short_list(missing)}; "
            f"other shapes {short_list(bad)}"
        )
    ranges: dict[str, tuple[int, int, tuple[int, ...]]] = {
        n: (s.offset, s.numel, (s.numel,)) for n, s in mine.specs.items()
    }
    return dict(reading.stream(plan, ranges, layout=mine))


def posthoc_to_file(
    snapshot_dir: str | os.PathLike,
    out_path: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: int | None = None,
    max_profile_error: float | None = DEFAULT_MAX_PROFILE_ERROR,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    prefix: str = SNAPSHOT_PREFIX,
    buffer_bytes: int = 1 << 30,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Path:
    """Stream the post-hoc EMA (as :func:`posthoc_offline`) into one safetensors file, atomically.

    The file's names are the module's parameter names; its metadata records ``sigma_rel``,
    ``gamma``, ``step``, the profile error and ``num_snapshots``, the number of snapshot folders the fit
    combined (those at or before ``step``).

    Memory at the peak: the float64 accumulators of one group (at most ``buffer_bytes``, at least the largest
    parameter's: 8 bytes an element), plus one parameter in the snapshots' dtype (or in ``dtype`` while it is
    cast), plus 4 MiB of scratch: :func:`posthoc_offline`'s without the result, each parameter written and freed
    before the next group is read. Measured (``benchmarks/bench_posthoc_memory.py``, a 160.5 MiB fp32 model
    whose largest parameter is 62.5 MiB, 2 EMAs, 2 snapshots): 192 MiB with ``buffer_bytes=32 << 20``
    (125 + 62.5 + 4), 388 MiB with the default (321 + 62.5 + 4).

    ``out_path`` inside the snapshot directory's folders is refused (``checkpoint.OutputPathError``), and so
    are an ``out_path`` whose folder does not exist (or is not writable) and an existing file unless
    ``overwrite=True`` (replaced atomically; the default refuses, as the command line without ``--overwrite``), these
    before any snapshot is read; without ``overwrite``, a file that appears at ``out_path`` while this runs is kept
    too (``FileExistsError``, nothing written). ``snapshot_dir`` may be an fsspec URL, with
    ``storage_options`` (see :func:`posthoc_offline`); ``out_path`` is a local file (a URL is refused).

    Command line: ``python -m functional_ema posthoc SNAPSHOT_DIR --sigma-rel 0.15 OUT.safetensors``.
    """
    reading = _check_reading(verify, dtype, buffer_bytes, sigma_rel, gamma, step, max_profile_error, prefix)
    out_path = check_path(out_path, "out_path")
    overwrite = check_bool(overwrite, "overwrite")
    check_out_folder(out_path, "out_path")
    root = _snapshot_root(snapshot_dir, storage_options, "posthoc_to_file")
    # Refused before any snapshot is read (_to_file checks again against the tag folders it reads): an output inside
    # the snapshot folders first (a snapshot's rank file is never a file to replace, whatever overwrite says), then a
    # directory or an existing file unless overwrite.
    check_output(out_path, root if isinstance(root, Path) else str(root), [], overwrite)
    with _url_access(root, "posthoc_to_file"):
        return _to_file(root, out_path, reading, overwrite)


def _to_file(root: Location, out_path: Path, reading: _Reading, overwrite: bool) -> Path:
    """:func:`posthoc_to_file` from an opened snapshot folder, its arguments checked."""
    plan = reading.plan(root)
    # snapshots at a URL: nothing local to keep the output out of (the output is a local file)
    local = [plan.root / tag for tag, _, _ in plan.terms] if isinstance(plan.root, Path) else []
    check_output(out_path, plan.root, local, overwrite)
    meta = {
        "format": "functional_ema.posthoc",
        "format_version": str(FORMAT_VERSION),
        "sigma_rel": repr(gamma_to_sigma_rel(plan.gamma)),
        "gamma": repr(plan.gamma),
        "step": str(plan.step),
        "profile_error": repr(plan.profile_error),
        "num_snapshots": str(plan.num_snapshots),
    }
    ranges = {n: (0, math.prod(s), s) for n, s in plan.shapes.items()}
    entries = [(n, reading.dtype, s) for n, s in plan.shapes.items()]
    # the file checks itself; without overwrite, a file that appears at out_path while this runs is kept
    with _io.StreamingWriter(out_path, entries, meta, self_checksums=True, replace=overwrite) as w:
        for name, t in reading.stream(plan, ranges):
            w.write(name, t)
            del t  # written: not held while the next group's accumulators are filled
        w.commit()
    return out_path
