"""functional_ema/_checkpoint/collective.py: how the ranks of a collective verb agree.

One real launch of 4 ranks (plain torch.distributed, gloo: two groups of two side by side, then the
whole job) calls every function of the module directly and returns what happened, scenario by
scenario: the value, or the error's class, message and errno; the collectives each call made (a spy
records the group, peer, tag and message of each); and the seconds it took.
The parent asserts them exactly: which rank raised what, naming which rank, field, expected and got.
Waits that must time out use 0.5 s bounds on their own groups (a timeout closes its group's
connections), and a rank that must be absent stays alive in the next scenario meanwhile (a rank that
exits closes its connections, and the others' waits would end early).

A "NCCL" group is a gloo group whose ``dist.get_backend`` is patched to say "nccl": the module then makes
its gloo side group, which the spy sees (ranks, backend, timeout). The single-process tests cover the
pure helpers and the paths without a process group.
"""

from __future__ import annotations

import contextlib
import errno
import inspect
import json
import math
import os
import re
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import xxhash

from functional_ema import MismatchError
from functional_ema._checkpoint import collective as c
from functional_ema._checkpoint.errors import (
    CheckpointError,
    CheckpointIOError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    CheckpointTimeoutError,
    CheckpointVersionError,
    CorruptCheckpointError,
)
from functional_ema._errors import SwappedTrainingError
from functional_ema._layout import ModelPart, ShardLayout, ShardSpec
from functional_ema._testing.multirank import run_ranks
from functional_ema._tree import TreeMismatchError

#: The ranks' environment: plain torch.distributed (fast start), and a default wait that no call passes.
ENV = {"FE_DIST_INIT": "torch", c.TIMEOUT_ENV: "0.6"}
ARRIVE, RELEASE = 0x454D4101, 0x454D4102  # bounded_barrier's tags, written out
TOKEN = "torch.int64[1]"  # each of its messages: one int64
AGREE, AGREED = 0x454D4103, 0x454D4104  # agree_on's tags, written out
WORDS = "torch.int64[64]"  # each of agree_on's messages: 64 int64
FIX = (
    "is collective: call it on every rank while the process group that trains the model is up "
    "(before destroy_process_group)"
)
FIELDS = ("step", "tag", "dtype")


class LocalCheckpointError(CheckpointError):
    """A library-family error the module's table of classes does not know (raised by a caller's check)."""


class ErrnoError(Exception):
    """Not a library error, yet with an errno (what a foreign library might raise)."""

    errno = 5


class DistLikeError(RuntimeError):
    """Stands in for gloo's DistError (a RuntimeError) in arrive's message tests."""


class GoneGroup:
    """A process group whose size can no longer be read (what torch raises for one that is gone)."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    def size(self) -> int:
        raise self.error


# ------------------------------------------------------------------------------ inside the ranks


def _label(group: Any, names: dict[int, str]) -> str:
    if group is None:
        return "None"
    if group is dist.group.WORLD:
        return "WORLD"
    for ranks, side in c._SIDE_GROUPS.items():
        if side is group:
            return f"side{list(ranks)}"
    return names.get(id(group), "?")


def _seconds(value: Any) -> Any:
    return value.total_seconds() if isinstance(value, timedelta) else repr(value)


@contextlib.contextmanager
def _spy(calls: list[list[Any]], names: dict[int, str]) -> Iterator[None]:
    """Record each collective the module calls: its group (by label) and peer, tag or root."""
    saved = {n: getattr(dist, n) for n in ("all_gather_object", "all_reduce", "gather_object", "isend", "irecv")}
    saved["new_group"] = dist.new_group

    def describe(name: str, a: dict[str, Any]) -> list[Any]:
        if name == "new_group":
            return [name, a["ranks"], a["backend"], _seconds(a["timeout"]), a["use_local_synchronization"]]
        row = [name, _label(a.get("group"), names)]
        if name == "gather_object":
            row.append(a["dst"])
        if name in ("isend", "irecv"):  # and the message: its dtype and shape
            tensor = a["tensor"]
            row += [a["group_dst" if name == "isend" else "group_src"], a["tag"], f"{tensor.dtype}{list(tensor.shape)}"]
        return row

    def wrap(name: str) -> Callable[..., Any]:
        fn, sig = saved[name], inspect.signature(saved[name])

        def spied(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                calls.append(describe(name, dict(bound.arguments)))
            except TypeError:
                calls.append([name, "bad arguments"])
            return fn(*args, **kwargs)

        return spied

    for name in saved:
        setattr(dist, name, wrap(name))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _outcome(fn: Callable[[], Any], names: dict[int, str]) -> dict[str, Any]:
    """``fn()``'s value or error (class, message, errno, cause), its collectives and its seconds."""
    calls: list[list[Any]] = []
    t0 = time.monotonic()
    with _spy(calls, names):
        try:
            out: dict[str, Any] = {"value": fn()}
        except Exception as e:  # noqa: BLE001 - the parent asserts which error
            cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
            out = {"error": type(e).__name__, "msg": str(e), "errno": getattr(e, "errno", "-"), "cause": cause}
    out["calls"] = calls
    out["s"] = time.monotonic() - t0
    return out


def _failing(rank: int, on: int, exc: Exception, value: Any = None) -> Callable[[], Any]:
    def fn() -> Any:
        if rank == on:
            raise exc
        return rank if value is None else value

    return fn


def _agree_cases(rank: int, pair: Any, run: Callable[..., None]) -> None:
    """agree (and so run_local and settle) across two ranks: successes and every kind of failure."""
    called: list[int] = []
    run("agree", lambda: c.agree("save", lambda: {"rank": rank}, pair, 2, rank))
    run("agree_quiet", lambda: [c.agree("save", lambda: called.append(rank), pair, 2, rank, results=False), called])
    run(
        "agree_lib",
        lambda: c.agree("save", _failing(rank, 1, CheckpointMismatchError("rank 1 holds step 5")), pair, 2, rank),
    )
    enospc = OSError(errno.ENOSPC, "No space left on device", "/ckpt/ema_rank0.safetensors")
    run("agree_os", lambda: c.agree("save", _failing(rank, 0, enospc), pair, 2, rank))
    bad = TypeError("decay must be a float")
    run("agree_type", lambda: c.agree("save", _failing(rank, 1, bad), pair, 2, rank, fallback=RuntimeError))
    both = [TypeError("bad argument on 0"), CheckpointNotFoundError("no tag global_step7")][rank]
    run("agree_both", lambda: c.agree("save", _failing(rank, rank, both), pair, 2, rank, fallback=RuntimeError))
    both = [CorruptCheckpointError("crc of a.safetensors"), TypeError("bad argument on 1")][rank]
    run("agree_both_lib_first", lambda: c.agree("save", _failing(rank, rank, both), pair, 2, rank))
    local = LocalCheckpointError("a caller's own check")
    run("agree_unknown_lib", lambda: c.agree("save", _failing(rank, 0, local), pair, 2, rank, fallback=RuntimeError))
    flaky = ErrnoError("flaky device")
    run("agree_errno_attr", lambda: c.agree("save", _failing(rank, 1, flaky), pair, 2, rank, fallback=RuntimeError))
    gone = CheckpointNotFoundError("no tag global_step7")
    run(
        "agree_quiet_lib",
        lambda: c.agree("load", _failing(rank, 1, gone), pair, 2, rank, results=False, fallback=RuntimeError),
    )
    t0 = TypeError("bad argument on 0")
    run(
        "agree_quiet_type",
        lambda: c.agree("load", _failing(rank, 0, t0), pair, 2, rank, results=False, fallback=RuntimeError),
    )


def _agree_on_cases(rank: int, pair: Any, solo: Any, run: Callable[..., None]) -> None:
    """agree_on across two ranks: equal records, each field differing, failures, a caller's wrong fields."""

    def on(record: dict[str, Any], **kw: Any) -> Any:
        got = c.agree_on("load", lambda: record, FIELDS, pair, 2, rank, **kw)
        return {k: str(v) if isinstance(v, torch.dtype) else v for k, v in got.items()}

    def rec(step: int, tag: str, dtype: torch.dtype) -> dict[str, Any]:
        return {"step": step, "tag": tag, "dtype": dtype}

    bf16 = [torch.float32, torch.bfloat16][rank]
    run("on_equal", lambda: on(rec(6, "global_step6", torch.float32)))
    run("on_tag", lambda: on(rec(6, f"global_step{6 - rank}", torch.float32)))
    fix = "Load the same tag on every rank"
    run("on_two", lambda: on(rec(6 - rank, "global_step6", bf16), fix=fix, mismatch=CorruptCheckpointError))
    run("on_dtype", lambda: on(rec(6, "global_step6", bf16)))
    newer = CheckpointVersionError("format 9 is newer than this functional_ema")
    fine = rec(6, "global_step6", torch.float32)
    run("on_fail", lambda: c.agree_on("load", _failing(rank, 1, newer, fine), FIELDS, pair, 2, rank))
    wrong = [{"step": 6, "tag": "t", "x": 1}, rec(6, "t", torch.float32)][rank]
    run("on_fields", lambda: on(wrong, fallback=RuntimeError))
    bad = TypeError("tag must be a str")
    run(
        "on_type",
        lambda: c.agree_on("load", _failing(rank, 1, bad, fine), FIELDS, pair, 2, rank, fallback=RuntimeError),
    )
    run("on_solo", lambda: c.agree_on("load", lambda: {"step": rank}, ("step",), solo, 1, 0))
    run(
        "agree_solo", lambda: [c.agree("save", lambda: rank, solo, 1, 0), c.agree("save", lambda: 1, solo, 1, 0, False)]
    )


def _side_cases(
    rank: int, fake_pair: Any, fake_solo: Any, pair: Any, real_backend: Callable[..., str], run: Any
) -> None:
    """barrier_group's gloo side group of an "NCCL" group: made once per ranks, with the caller's timeout."""

    def fresh(fn: Callable[[], Any]) -> Callable[[], Any]:
        def call() -> Any:
            c._SIDE_GROUPS.clear()
            return fn()

        return call

    def facts() -> list[Any]:
        a, b = c.barrier_group(fake_solo, 7.0), c.barrier_group(fake_solo, 9.0)
        return [
            a is not fake_solo,
            a is b,
            real_backend(a),
            dist.get_process_group_ranks(a),
            [list(k) for k in c._SIDE_GROUPS],
            c.barrier_group(pair, 1.0) is pair,
            c.barrier_group(None, 1.0) is dist.group.WORLD,
        ]

    run("side_gather", fresh(lambda: c.gather_to_first(rank * 3, fake_pair, 2)))
    run("side_reduce", fresh(lambda: c.all_reduce_max([rank, 5 - rank], fake_pair)))
    run("side_arrive", fresh(lambda: c.arrive("save", fake_pair, 2, rank, 4.0)))
    run("barrier_group", fresh(facts))


def _reach_cases(r: int, pair: Any, solo: Any, other: Any, run: Callable[..., None]) -> None:
    """check_reachable: a group of the layout's size passes; another size, a group this rank is not in
    (``other``), one whose size cannot be read, are refused, naming the verb and both sizes or the error."""
    reach = c.check_reachable
    run("reach", lambda: [reach("save", pair, 2), reach("save", None, 4), reach("save", solo, 1)])
    run("reach_size", lambda: reach("save", pair, 3))
    run("reach_solo", lambda: reach("load", solo, 2))
    run("reach_outside", lambda: reach("load", other, 2))
    long = "x" * 250 + "\nsecond line"
    run("reach_gone", lambda: reach("load", GoneGroup(RuntimeError(long)), 2))
    run("reach_gone_empty", lambda: reach("load", GoneGroup(ValueError()), 2))


def _job_cases(rank: int, pair: Any, solo: Any, run: Callable[..., None]) -> None:
    """job_of in a job of 4: a whole model's data-parallel group, else the whole job (HSDP, model parallel)."""
    names = {id(pair): "pair", id(solo): "solo"}

    def job(layout: ShardLayout, group: Any) -> list[Any]:
        got = c.job_of(SimpleNamespace(layout=layout, group=group))  # type: ignore[arg-type]
        return [_label(got.group, names), got.rank, got.world]

    r, specs = rank % 2, {"w": ShardSpec((4,), 2 * (rank % 2), 2)}
    run("job_whole", lambda: job(ShardLayout(r, 2, 3, specs), pair))
    run("job_one", lambda: job(ShardLayout(0, 1, 0, specs), pair))
    run("job_hsdp", lambda: job(ShardLayout(r, 2, 3, specs, replica=rank // 2, replicas=2), pair))
    run("job_tp", lambda: job(ShardLayout(r, 2, 3, specs, part=ModelPart(tp=0, tp_size=2, pp_size=2)), pair))
    run("job_tp_whole_job", lambda: job(ShardLayout(r, 2, 0, specs, part=ModelPart(tp=rank // 2, tp_size=2)), solo))


def _barrier_cases(r: int, g: dict[str, Any], run: Callable[..., None]) -> None:
    """bounded_barrier and arrive: on time, late within the bound, a rank absent, a release not taken."""
    run("bb_solo", lambda: c.bounded_barrier(g["solo"], 1.0))
    run("bb_pair", lambda: c.bounded_barrier(g["pair"], 5.0))
    run("arrive", lambda: c.arrive("save", g["pair"], 2, r, 5.0))
    run("arrive_solo", lambda: c.arrive("save", g["solo"], 1, 0, 5.0))
    for late in (1, 0):
        dist.barrier(group=g["pair"])  # both start together: the late rank's sleep is the only delay
        if r == late:
            time.sleep(0.3)
        run(f"arrive_late{late}", lambda: c.arrive("load", g[f"late{late}"], 2, r, 5.0))
    # One rank calls alone; the other goes on to the next scenario, which waits for it (alive meanwhile).
    if r == 0:
        run("arrive_absent1", lambda: c.arrive("load", g["absent1"], 2, 0, 0.5))
    else:
        run("arrive_absent0", lambda: c.arrive("load", g["absent0"], 2, 1, None))  # the environment's 0.6 s
    dist.barrier(group=g["pair"])
    if r == 0:
        run("bb_norel", lambda: c.bounded_barrier(g["norel"], 0.5))
    else:  # arrives by hand, and never takes the release
        with contextlib.suppress(RuntimeError):
            dist.isend(torch.zeros(1, dtype=torch.int64), group=g["norel"], group_dst=0, tag=ARRIVE).wait(
                timeout=timedelta(seconds=5)
            )
    real = c.bounded_barrier
    for name, error in (
        ("arrive_detail", DistLikeError(" gloo: " + "z" * 400 + "\nat pair.cc:553")),
        ("arrive_detail_empty", DistLikeError(" \n ")),
    ):

        def raiser(group: Any, t: float, error: Exception = error) -> None:
            raise error

        c.bounded_barrier = raiser  # type: ignore[assignment]
        try:
            run(name, lambda: c.arrive("save", g["pair"], 2, r, 3.0))
        finally:
            c.bounded_barrier = real  # type: ignore[assignment]
    _finished_cases(r, g, run)


def _finished_cases(r: int, g: dict[str, Any], run: Callable[..., None]) -> None:
    x = torch.zeros(1, dtype=torch.int64)
    if r == 0:
        run(
            "finished",
            lambda: [
                c._finished(None, time.monotonic() - 10),
                c._finished(dist.irecv(x, group=g["fin_ok"], group_src=1, tag=11), time.monotonic() + 5),
                x.tolist(),
            ],
        )
    else:
        run(
            "finished",
            lambda: [c._finished(dist.isend(x + 42, group=g["fin_ok"], group_dst=0, tag=11), time.monotonic() + 5)],
        )
    dist.barrier(group=g["fin_late"])
    if r == 0:  # the send comes 0.8 s later: a deadline already passed waits 1 ms, not until then
        run(
            "finished_late",
            lambda: [c._finished(dist.irecv(x, group=g["fin_late"], group_src=1, tag=12), time.monotonic() - 10)],
        )
    else:
        time.sleep(0.8)
        with contextlib.suppress(RuntimeError):  # rank 0 gave up: gloo closed the pair
            dist.isend(x, group=g["fin_late"], group_dst=0, tag=12).wait(timeout=timedelta(seconds=5))


def _pair_cases(r: int, g: dict[str, Any], fake: dict[str, Any], run: Callable[..., None]) -> None:
    """Every function on a group of two ranks (``r``: this rank's rank in it), the same on both pairs."""
    pair, solo = g["pair"], g["solo"]
    run("exchange", lambda: c.exchange({"rank": r, "x": [r] * (r + 1)}, pair, 2))
    run("exchange_solo", lambda: c.exchange("mine", solo, 1))
    run("reduce", lambda: c.all_reduce_max([r, -r, 2**62 - 1 - r, 7], pair))
    run("gather", lambda: c.gather_to_first({"rank": r}, pair, 2))
    run("gather_solo", lambda: c.gather_to_first("mine", solo, 1))
    _agree_cases(r, pair, run)
    _agree_on_cases(r, pair, solo, run)
    _side_cases(r, fake["pair"], fake["solo"], pair, fake["backend"], run)
    _barrier_cases(r, g, run)
    _agree_on_bounded_cases(r, g, run)
    _commit_step_cases(r, g, run)


def _agree_on_bounded_cases(r: int, g: dict[str, Any], run: Callable[..., None]) -> None:
    """agree_on as an arrival: two ranks in two verbs learn it at once; a rank alone waits the environment's 0.6 s."""
    record = {"step": 6, "tag": "t", "dtype": "f32"}
    dist.barrier(group=g["pair"])  # both start together (rank 1 may still be in the last scenario's sleep)
    run("on_verbs", lambda: c.agree_on(["swapped", "gather_full"][r], lambda: record, FIELDS, g["pair"], 2, r))
    dist.barrier(group=g["pair"])
    # one verb, with arguments that lead to other collectives (an all_gather would meet a gather), then alike
    run("on_calls", lambda: c.agree_on("gather_full", lambda: record, FIELDS, g["pair"], 2, r, call=["", "dst=0"][r]))
    run("on_calls_alike", lambda: c.agree_on("gather_full", lambda: record, FIELDS, g["pair"], 2, r, call="dst=0"))
    dist.barrier(group=g["pair"])
    if r == 0:  # rank 1 never calls; it waits, alive, at the barrier below meanwhile
        run("on_absent", lambda: c.agree_on("swapped", lambda: record, FIELDS, g["on_absent"], 2, 0, timeout=None))
    dist.barrier(group=g["pair"])


def _commit_step_cases(r: int, g: dict[str, Any], run: Callable[..., None]) -> None:
    """commit_step then commit_exchange: a step of a save's commit, then an exchange (no round trip of its own); ranks
    in steps of two saves (a late message of an earlier save's round) learn it at once; a rank that stopped
    mid-commit: the other waits the step's 0.6 s."""
    ref = c.CommitRef("save", "t", "/ck/t", "a" * 16, 0.6)
    pair = (g["pair"], 2, r)
    dist.barrier(group=g["pair"])
    exchange = lambda: c.exchange(r, g["pair"], 2)  # noqa: E731
    run(
        "step",
        lambda: (c.commit_step(ref, "x", lambda: None, pair, str), c.commit_exchange(ref, "y", exchange, pair, str))[1],
    )
    other = ref._replace(save_id="ab"[r] * 16)
    run("step_rounds", lambda: c.commit_step(other, "x", lambda: None, pair, lambda: "-"))
    dist.barrier(group=g["pair"])
    if r == 0:  # rank 1 never comes; it waits, alive, at the barrier below meanwhile
        left = lambda: "Left as it was."  # noqa: E731
        run("step_stalled", lambda: c.commit_step(ref, "x", lambda: None, (g["stalled"], 2, 0), left))
    dist.barrier(group=g["pair"])


def _job_wide_cases(rank: int, tag: str, link: str, run: Callable[..., None]) -> None:
    """check_distinct_writers over a job of two data-parallel groups of 2 saving into one folder."""

    def check(names: list[str], folder: str = tag, group_world: int = 2, timeout: float | None = 5.0) -> None:
        c.check_distinct_writers("save", Path(folder), names, group_world, timeout)

    run("cdw_whole", lambda: check(["ema_rank0.safetensors"], group_world=4))  # the data-parallel group is the job
    run("cdw_one", lambda: check(["ema_rank0.safetensors"], group_world=1))  # a plain module: saved alone
    run("clash4", lambda: check([f"ema_rank{rank % 2}.safetensors", f"ema_buffers_rank{rank % 2}.json"]))
    one = ["ema_rank0.safetensors", "ema_rank1.safetensors", "ema_rank0.safetensors", "ema_rank3.safetensors"]
    run("clash1", lambda: check([one[rank]], link if rank == 2 else tag))
    run("clash2", lambda: check([f"ema_rank{rank % 2}.safetensors"]))

    def distinct() -> None:
        os.environ[c.TIMEOUT_ENV] = "soon"  # a bad default wait: the explicit timeout= must be the one read
        try:
            check([f"ema_rank{rank}.safetensors"])
        finally:
            os.environ[c.TIMEOUT_ENV] = ENV[c.TIMEOUT_ENV]

    run("distinct", distinct)
    if rank != 3:  # rank 3 never calls: the others time out (last: it leaves the default group unusable)
        run("absent", lambda: check([f"ema_rank{rank}.safetensors"], timeout=0.5))


def four_ranks(tag: str, link: str) -> dict[str, Any]:
    """Every function of the module in one launch of 4 ranks: on two groups of two side by side (the second,
    ranks 2 and 3, has a first rank that is not rank 0 of the job), then over the whole job. ``link`` is a
    symlink to the folder ``tag``. Returns each scenario's outcome on this rank."""
    rank, names = dist.get_rank(), {}

    def groups(label: str, members: list[list[int]]) -> Any:
        """Every rank makes every group (in the same order); this rank keeps its own."""
        mine = None
        for ranks in members:
            made = dist.new_group(ranks, timeout=timedelta(seconds=20))
            if rank in ranks:
                names[id(made)], mine = label, made
        return mine

    two, one = [[0, 1], [2, 3]], [[0], [1], [2], [3]]
    g = {
        k: groups(k, two)
        for k in ("pair", "late1", "late0", "absent1", "absent0", "norel", "fin_ok", "fin_late", "on_absent", "stalled")
    }
    g["solo"] = groups("solo", one)
    fake = {"pair": groups("fake_pair", two), "solo": groups("fake_solo", one), "backend": dist.get_backend}
    other = dist.new_group([(rank + 1) % 4])  # a group this rank is not in
    post = dist.new_group([0, 1, 2, 3], timeout=timedelta(seconds=20))
    dist.get_backend = lambda group=None: (  # type: ignore[assignment]
        "nccl" if group is fake["pair"] or group is fake["solo"] else fake["backend"](group)
    )
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Any]) -> None:
        out[name] = _outcome(fn, names)

    _pair_cases(rank % 2, g, fake, run)
    _reach_cases(rank % 2, g["pair"], g["solo"], other, run)
    _job_cases(rank, g["pair"], g["solo"], run)
    dist.barrier(group=post)
    _job_wide_cases(rank, tag, link, run)
    dist.barrier(group=post)  # rank 3 waits here, alive, meanwhile
    return out


# --------------------------------------------------------------------------------- the parent's side


def _err(cls: str, msg: str, errno_: Any = "-", cause: str | None = None) -> dict[str, Any]:
    return {"error": cls, "msg": msg, "errno": errno_, "cause": cause}


def _ok(value: Any = None) -> dict[str, Any]:
    return {"value": value}


def _check(got: dict[str, Any], name: str, want: dict[str, Any], calls: list[list[Any]] | None = None) -> None:
    """``got[name]`` is ``want`` (and made exactly ``calls``, when given)."""
    seen = {k: v for k, v in got[name].items() if k != "s" and (calls is not None or k != "calls")}
    expected = dict(want, **({"calls": calls} if calls is not None else {}))
    assert seen == expected, f"{name}: {json.dumps(seen)[:3000]}"


def _p2p(label: str, rank: int, others: list[int] | None = None) -> list[list[Any]]:
    """The point-to-point calls of a bounded_barrier that completes, on ``rank`` of a group."""
    if rank != 0:
        return [["isend", label, 0, ARRIVE, TOKEN], ["irecv", label, 0, RELEASE, TOKEN]]
    peers = others or [1]
    return [["irecv", label, r, ARRIVE, TOKEN] for r in peers] + [["isend", label, r, RELEASE, TOKEN] for r in peers]


def _agreed(label: str, rank: int) -> list[list[Any]]:
    """The point-to-point calls of agree_on's bounded exchange that completes, on ``rank`` of a group of two."""
    if rank != 0:
        return [["isend", label, 0, AGREE, WORDS], ["irecv", label, 0, AGREED, WORDS]]
    return [["irecv", label, 1, AGREE, WORDS], ["isend", label, 1, AGREED, WORDS]]


def _timed_out(
    got: dict[str, Any],
    what: str,
    rank: int,
    world: int,
    limit: str,
    detail: str,
    waits: bool = True,
    set_by: str = "timeout= or the environment variable",
) -> None:
    """arrive's CheckpointTimeoutError on ``rank``: the exact message, and the wait it reports and took
    (about ``limit`` when ``waits``, else none: the failure came at once)."""
    assert got["error"] == "CheckpointTimeoutError", got
    waited = re.search(r"rank \d+ waited (\d+\.\d) s", got["msg"])
    assert waited is not None, got["msg"]
    low, high = (float(limit) - 0.2, float(limit) + 3) if waits else (0.0, 1.0)
    assert low <= float(waited.group(1)) <= high and low <= got["s"] <= high + 2, (got["msg"], got["s"])
    assert got["msg"] == (
        f"functional_ema.{what}: rank {rank} waited {waited.group(1)} s (limit {limit} s) for the other ranks of its "
        f"process group (world size {world}) to call it too, and they did not ({detail}). {what}() is collective: "
        f"call it on every rank, with the same arguments. The wait is set by {set_by} "
        "FUNCTIONAL_EMA_TIMEOUT (default 600 s). The process group may be unusable after this"
    )


def _assert_agree(res: list[dict[str, Any]]) -> None:
    both = [["all_gather_object", "pair"]]
    for r in (0, 1):
        _check(res[r], "agree", _ok([{"rank": 0}, {"rank": 1}]), both)
        _check(res[r], "agree_quiet", _ok([[None, None], [r]]), [["all_reduce", "pair"]])
    _check(res[1], "agree_lib", _err("CheckpointMismatchError", "rank 1 holds step 5"), both)
    _check(
        res[0],
        "agree_lib",
        _err("CheckpointMismatchError", "save failed on rank 1 of 2 (CheckpointMismatchError): rank 1 holds step 5"),
        both,
    )
    io = "rank 0 could not access /ckpt/ema_rank0.safetensors: No space left on device (errno 28, ENOSPC); "
    io += "free space on that filesystem (or save elsewhere) and save again"
    _check(res[0], "agree_os", _err("CheckpointIOError", io, 28))
    _check(res[1], "agree_os", _err("CheckpointIOError", f"save failed on rank 0 of 2 (CheckpointIOError): {io}", 28))
    _check(res[1], "agree_type", _err("TypeError", "decay must be a float"))
    _check(res[0], "agree_type", _err("RuntimeError", "save failed on rank 1 of 2 (TypeError): decay must be a float"))
    _check(res[0], "agree_both", _err("TypeError", "bad argument on 0"))
    msg = "save failed on rank 0 of 2 (TypeError): bad argument on 0"
    _check(res[1], "agree_both", _err("RuntimeError", msg, cause="CheckpointNotFoundError"))
    _check(res[0], "agree_both_lib_first", _err("CorruptCheckpointError", "crc of a.safetensors"))
    _check(res[1], "agree_both_lib_first", _err("TypeError", "bad argument on 1"))
    _check(res[0], "agree_unknown_lib", _err("LocalCheckpointError", "a caller's own check"))
    msg = "save failed on rank 0 of 2 (LocalCheckpointError): a caller's own check"
    _check(res[1], "agree_unknown_lib", _err("CheckpointError", msg))
    _check(res[1], "agree_errno_attr", _err("ErrnoError", "flaky device", 5))
    _check(res[0], "agree_errno_attr", _err("RuntimeError", "save failed on rank 1 of 2 (ErrnoError): flaky device"))
    quiet = [["all_reduce", "pair"], ["all_gather_object", "pair"]]
    _check(res[1], "agree_quiet_lib", _err("CheckpointNotFoundError", "no tag global_step7", None), quiet)
    msg = "load failed on rank 1 of 2 (CheckpointNotFoundError): no tag global_step7"
    _check(res[0], "agree_quiet_lib", _err("CheckpointNotFoundError", msg, None), quiet)
    _check(res[0], "agree_quiet_type", _err("TypeError", "bad argument on 0"), quiet)
    _check(
        res[1],
        "agree_quiet_type",
        _err("RuntimeError", "load failed on rank 0 of 2 (TypeError): bad argument on 0"),
        quiet,
    )


def _assert_agree_on(res: list[dict[str, Any]]) -> None:
    fields = "['dtype', 'step', 'tag']"
    for r in (0, 1):
        one = _agreed("pair", r)
        both = [*one, ["all_gather_object", "pair"]]
        _check(res[r], "on_equal", _ok({"step": 6, "tag": "global_step6", "dtype": "torch.float32"}), one)
        msg = "load: ranks disagree on tag: rank 0: 'global_step6', rank 1: 'global_step5'"
        _check(res[r], "on_tag", _err("CheckpointMismatchError", msg), both)
        msg = "load: ranks disagree on step: rank 0: 6, rank 1: 5; and on dtype: rank 0: torch.float32, rank 1: "
        _check(
            res[r], "on_two", _err("CorruptCheckpointError", msg + "torch.bfloat16. Load the same tag on every rank")
        )
        msg = "load: ranks disagree on dtype: rank 0: torch.float32, rank 1: torch.bfloat16"
        _check(res[r], "on_dtype", _err("CheckpointMismatchError", msg))
        _check(res[r], "on_solo", _ok({"step": r}), [])
        _check(res[r], "agree_solo", _ok([[r], [None]]), [])
    both = {r: [*_agreed("pair", r), ["all_gather_object", "pair"]] for r in (0, 1)}
    newer = "format 9 is newer than this functional_ema"
    _check(res[1], "on_fail", _err("CheckpointVersionError", newer), both[1])
    _check(
        res[0],
        "on_fail",
        _err("CheckpointVersionError", f"load failed on rank 1 of 2 (CheckpointVersionError): {newer}"),
    )
    wrong = f"load: record fields ['step', 'tag', 'x'] are not {fields}"
    _check(res[0], "on_fields", _err("CheckpointError", wrong), both[0])
    _check(
        res[1], "on_fields", _err("CheckpointError", f"load failed on rank 0 of 2 (CheckpointError): {wrong}"), both[1]
    )
    _check(res[1], "on_type", _err("TypeError", "tag must be a str"))
    _check(res[0], "on_type", _err("RuntimeError", "load failed on rank 1 of 2 (TypeError): tag must be a str"))


def _assert_agree_on_bounded(res: list[dict[str, Any]], rank: int) -> None:
    """Two verbs: both ranks raise at once naming each rank's verb. One rank alone: it waits the environment's 0.6 s
    in its irecv (not an all-reduce, which would wait for gloo's own timeout) and raises, naming verb, rank, limit."""
    r = rank % 2
    verbs = "the ranks called different collective verbs (rank 0: 'swapped', rank 1: 'gather_full'); call each on "
    msg = f"{['swapped', 'gather_full'][r]}: {verbs}every rank, in the same order"
    _check(
        res[rank],
        "on_verbs",
        _err("CheckpointMismatchError", msg),
        [*_agreed("pair", r), ["all_gather_object", "pair"]],
    )
    calls = "the ranks called it with arguments that lead to different collectives (rank 0: 'gather_full', rank 1: "
    _check(
        res[rank],
        "on_calls",
        _err("CheckpointMismatchError", f"gather_full: {calls}'gather_full(dst=0)'); make the same call on every rank"),
        [*_agreed("pair", r), ["all_gather_object", "pair"]],
    )
    _check(res[rank], "on_calls_alike", _ok({"step": 6, "tag": "t", "dtype": "f32"}), _agreed("pair", r))
    if r == 0:
        got = res[rank]["on_absent"]
        assert got["calls"] == [["irecv", "on_absent", 1, AGREE, WORDS]], got
        detail = "rank(s) [1] of the group did not arrive within 0.6 s"
        _timed_out(got, "swapped", 0, 2, "0.6", detail, set_by="the environment variable")
    else:
        assert "on_absent" not in res[rank], res[rank]


def _assert_commit_step(res: list[dict[str, Any]], rank: int) -> None:
    """A step that completes: agree_on's bounded exchange; the exchange after it: the exchange alone. Steps of two saves: a mismatch naming each
    rank's save id. A rank that never comes: the other raises after 0.6 s naming the commit, the step, the rank
    missing, the limit and what the checkpoint is left as."""
    r = rank % 2
    _check(res[rank], "step", _ok([0, 1]), [*_agreed("pair", r), ["all_gather_object", "pair"]])
    calls = "the ranks called it with arguments that lead to different collectives (rank 0: "
    msg = f"save (x): {calls}'save (x)(save_id={'a' * 16})', rank 1: 'save (x)(save_id={'b' * 16})'); make the same "
    _check(res[rank], "step_rounds", _err("CheckpointMismatchError", msg + "call on every rank"))
    if r == 1:
        assert "step_stalled" not in res[rank], res[rank]
        return
    got = res[rank]["step_stalled"]
    waited = re.search(r"rank 0 waited (\d+\.\d) s", got["msg"])
    assert got["error"] == "CheckpointTimeoutError" and waited is not None, got
    assert 0.4 <= float(waited.group(1)) <= 3 and 0.4 <= got["s"] <= 5, got
    assert got["msg"] == (
        f"functional_ema.save: the commit of tag 't' (/ck/t) stopped at its step 'x': rank 0 waited {waited.group(1)} s "
        "(limit 0.6 s) for the other ranks of its process group (world size 2) to finish that step, and they did not "
        "(rank(s) [1] of the group did not arrive within 0.6 s): a rank hung or died mid-commit. Left as it was. The "
        "limit is the save's timeout (timeout=, else FUNCTIONAL_EMA_TIMEOUT, default 600 s). The process group may "
        "be unusable after this"
    )


def _assert_sides(res: list[dict[str, Any]], rank: int) -> None:
    """The gloo side group of an "NCCL" pair: asked of torch once per ranks, with the caller's timeout."""
    r, ranks = rank % 2, [rank - rank % 2, rank - rank % 2 + 1]
    side = f"side{ranks}"
    made = ["new_group", ranks, "gloo", 600.0, True]
    _check(res[rank], "side_gather", _ok(None if r else [0, 3]), [made, ["gather_object", side, ranks[0]]])
    _check(res[rank], "side_reduce", _ok([1, 5]), [made, ["all_reduce", side]])
    _check(res[rank], "side_arrive", _ok(None), [["new_group", ranks, "gloo", 4.0, True], *_p2p(side, r)])
    facts = [True, True, "gloo", [rank], [[rank]], True, True]
    _check(res[rank], "barrier_group", _ok(facts), [["new_group", [rank], "gloo", 7.0, True]])


def _assert_reach_and_job(res: list[dict[str, Any]], rank: int) -> None:
    r = rank % 2
    _check(res[rank], "reach", _ok([None, None, None]), [])
    msg = (
        f"functional_ema.save: the model's layout spans 3 ranks but its process group has 2. functional_ema.save {FIX}"
    )
    _check(res[rank], "reach_size", _err("CheckpointError", msg))
    msg = (
        f"functional_ema.load: the model's layout spans 2 ranks but its process group has 1. functional_ema.load {FIX}"
    )
    _check(res[rank], "reach_solo", _err("CheckpointError", msg))
    _check(res[rank], "reach_outside", _err("CheckpointError", msg.replace("has 1", "has -1")))
    gone = "functional_ema.load: the model's process group of 2 ranks is no longer usable ({}). functional_ema.load "
    _check(res[rank], "reach_gone", _err("CheckpointError", gone.format("x" * 200) + FIX))
    _check(res[rank], "reach_gone_empty", _err("CheckpointError", gone.format("ValueError") + FIX))
    _check(res[rank], "job_whole", _ok(["pair", r, 2]), [])
    _check(res[rank], "job_one", _ok(["None", 0, 1]))
    _check(res[rank], "job_hsdp", _ok(["None", rank, 4]))
    _check(res[rank], "job_tp_whole_job", _ok(["None", rank, 4]))
    msg = (
        "the model's layout (data parallel 2 x 1 replica(s) x tensor parallel 2 x 2 pipeline stage(s)) spans 8 "
        "ranks, but the job has 4; functional_ema saves and loads HSDP and model-parallel layouts whose mesh spans "
        "every rank of the job"
    )
    _check(res[rank], "job_tp", _err("NotImplementedError", msg))


def _assert_barriers(res: list[dict[str, Any]], rank: int) -> None:
    r, pair = rank % 2, res[rank - rank % 2 : rank - rank % 2 + 2]
    _check(res[rank], "bb_solo", _ok(), [])
    _check(res[rank], "bb_pair", _ok(), _p2p("pair", r))
    _check(res[rank], "arrive", _ok(), _p2p("pair", r))
    _check(res[rank], "arrive_solo", _ok(), [])
    for late in (1, 0):
        _check(res[rank], f"arrive_late{late}", _ok(), _p2p(f"late{late}", r))
    assert pair[0]["arrive_late1"]["s"] >= 0.25 and pair[1]["arrive_late0"]["s"] >= 0.25, pair
    detail = (" gloo: " + "z" * 400).strip()[:300]
    _timed_out(res[rank]["arrive_detail"], "save", r, 2, "3", detail, waits=False)
    _timed_out(res[rank]["arrive_detail_empty"], "save", r, 2, "3", "DistLikeError", waits=False)
    if r == 0:
        got = res[rank]["arrive_absent1"]
        assert got["calls"] == [["irecv", "absent1", 1, ARRIVE, TOKEN]] and "arrive_absent0" not in res[rank], got
        _timed_out(got, "load", 0, 2, "0.5", "rank(s) [1] of the group did not arrive within 0.5 s")
        msg = "rank(s) [1] of the group took no release within 0.5 s"
        _check(res[rank], "bb_norel", _err("RuntimeError", msg), _p2p("norel", 0))
        assert 0.45 <= res[rank]["bb_norel"]["s"] <= 5, res[rank]["bb_norel"]
        _check(res[rank], "finished", _ok([True, True, [42]]), [["irecv", "fin_ok", 1, 11, TOKEN]])
        _check(res[rank], "finished_late", _ok([False]), [["irecv", "fin_late", 1, 12, TOKEN]])
    else:
        got = res[rank]["arrive_absent0"]
        assert got["calls"] == [["isend", "absent0", 0, ARRIVE, TOKEN], ["irecv", "absent0", 0, RELEASE, TOKEN]], got
        assert "arrive_absent1" not in res[rank] and "bb_norel" not in res[rank], res[rank]
        _timed_out(got, "load", 1, 2, "0.6", "no release from rank 0 of the group within 0.6 s")
        _check(res[rank], "finished", _ok([True]), [["isend", "fin_ok", 0, 11, TOKEN]])


def _assert_pair_basics(res: list[dict[str, Any]], rank: int) -> None:
    r, first = rank % 2, rank - rank % 2
    _check(
        res[rank], "exchange", _ok([{"rank": 0, "x": [0]}, {"rank": 1, "x": [1, 1]}]), [["all_gather_object", "pair"]]
    )
    _check(res[rank], "exchange_solo", _ok(["mine"]), [])
    _check(res[rank], "reduce", _ok([1, 0, 2**62 - 1, 7]), [["all_reduce", "pair"]])
    _check(res[rank], "gather", _ok(None if r else [{"rank": 0}, {"rank": 1}]), [["gather_object", "pair", first]])
    _check(res[rank], "gather_solo", _ok(["mine"]), [])


def _assert_job_wide(res: list[dict[str, Any]], tag: Path) -> None:
    def clash(ranks: list[int], name: str, more: str) -> dict[str, Any]:
        path = os.path.realpath(tag / name)
        return _err(
            "CheckpointError",
            f"functional_ema.save: ranks {ranks} of the job (world size 4) would all write {path}{more}: each would "
            "overwrite the others' EMA. The model's pieces are spread over data-parallel groups of 2 rank(s), and 2 "
            "such groups save into one folder: save each group's EMA into its own folder (or tag). Nothing was written",
        )

    for r in range(4):
        _check(res[r], "cdw_whole", _ok(), [])
        _check(res[r], "cdw_one", _ok(), [])
        _check(res[r], "clash4", clash([0, 2], "ema_rank0.safetensors", " (3 more files likewise)"))
        _check(res[r], "clash1", clash([0, 2], "ema_rank0.safetensors", ""))
        _check(res[r], "clash2", clash([0, 2], "ema_rank0.safetensors", " (1 more files likewise)"))
        _check(res[r], "distinct", _ok(), [*_p2p("WORLD", r, [1, 2, 3]), ["all_gather_object", "WORLD"]])
    what = "save (every rank of the job: 4 ranks)"
    _timed_out(res[0]["absent"], what, 0, 4, "0.5", "rank(s) [3] of the group did not arrive within 0.5 s")
    for r in (1, 2):
        _timed_out(res[r]["absent"], what, r, 4, "0.5", "no release from rank 0 of the group within 0.5 s")
    assert "absent" not in res[3]


def test_collective_ranks(tmp_path: Path) -> None:
    """Every function of collective.py in one launch of 4 real ranks: on two groups of two side by side,
    then over the job. Each rank's values, errors (class, message naming the rank, field, expected and got,
    errno, cause) and collectives (group, peer, tag, root) are asserted exactly."""
    tag = tmp_path / "global_step5"
    tag.mkdir()
    (tmp_path / "link").symlink_to(tag)
    res = run_ranks(
        "tests.test_collective:four_ranks", world_size=4, timeout=90, env=ENV, tag=str(tag), link=str(tmp_path / "link")
    )
    for pair in (0, 1):
        _assert_agree(res[2 * pair : 2 * pair + 2])
        _assert_agree_on(res[2 * pair : 2 * pair + 2])
    for rank in range(4):
        _assert_pair_basics(res, rank)
        _assert_sides(res, rank)
        _assert_reach_and_job(res, rank)
        _assert_barriers(res, rank)
        _assert_agree_on_bounded(res, rank)
        _assert_commit_step(res, rank)
    _assert_job_wide(res, tag)


# ------------------------------------------------------------------------------ single process


@pytest.fixture
def no_group() -> None:
    assert not dist.is_initialized(), "these checks need a process without a process group"


def _digest(text: str) -> int:
    return xxhash.xxh3_64_intdigest(text.encode()) >> 2


def test_value_digest_is_62_bits_of_the_sorted_json_else_the_str() -> None:
    """The digest of a value's JSON (keys sorted), else of its str; 62 bits, so its negation fits an int64."""
    assert c.value_digest({"b": 1, "a": [2, 3]}) == _digest('{"a": [2, 3], "b": 1}')
    assert c.value_digest({"b": 1, "a": [2, 3]}) == c.value_digest({"a": [2, 3], "b": 1})
    assert c.value_digest("global_step6") == _digest('"global_step6"')
    assert c.value_digest(6) == _digest("6") != c.value_digest("6")
    assert c.value_digest(torch.bfloat16) == _digest("torch.bfloat16")  # not JSON: its str
    loop: list[Any] = [1]
    loop.append(loop)  # json raises ValueError (a circular reference): its str
    assert c.value_digest(loop) == _digest("[1, [...]]")
    values = [c.value_digest(v) for v in ([], None, "x" * 1000, {"k": list(range(50))}, 2**70)]
    assert all(0 <= v < 2**62 for v in values) and len(set(values)) == len(values)
    assert max(c.value_digest(i) for i in range(2000)) >= 2**61  # the whole 62 bits are used


def test_disagreement_names_each_differing_field_and_every_ranks_value() -> None:
    """Only the fields whose values differ, each with every rank's value (strings quoted, long ones cut)."""
    records = [
        {"step": 6, "tag": "a", "dtype": torch.float32},
        {"step": 6, "tag": "b", "dtype": torch.float32},
        {"step": 5, "tag": "a", "dtype": torch.float32},
    ]
    assert c.disagreement("load", ["step", "tag", "dtype"], records) == (
        "load: ranks disagree on step: rank 0: 6, rank 1: 6, rank 2: 5; and on tag: rank 0: 'a', rank 1: 'b', rank 2: 'a'"
    )
    assert c.disagreement("save", ["dtype"], records) == "save: ranks disagree on nothing (a digest collided)"
    long = "t" * 100
    assert c.disagreement("load", ["tag"], [{"tag": long}, {"tag": "u"}]) == (
        f"load: ranks disagree on tag: rank 0: '{long[:76]}..., rank 1: 'u'"
    )


def test_shown_cuts_at_80_characters() -> None:
    assert c._shown("ab") == "'ab'" and c._shown(5) == "5" and c._shown(torch.float32) == "torch.float32"
    assert c._shown(Path("/ckpt/global_step6")) == "/ckpt/global_step6"  # its str, not its repr
    eighty = [1] * 25 + [100]
    assert len(str(eighty)) == 80 and c._shown(eighty) == str(eighty)  # kept
    eighty_one = [1] * 25 + [1000]
    assert len(str(eighty_one)) == 81 and c._shown(eighty_one) == str(eighty_one)[:77] + "..."
    assert c._shown("q" * 78) == "'" + "q" * 78 + "'"  # its repr is 80 characters
    assert c._shown("q" * 79) == "'" + "q" * 76 + "..."


def test_layout_record_compares_sizes_and_a_digest_of_names_and_shapes() -> None:
    specs = {"a.w": ShardSpec((2, 3), 0, 3), "b": ShardSpec((4,), 2, 2)}
    digest = _digest('[["a.w", [2, 3]], ["b", [4]]]')
    assert c.layout_record(ShardLayout(1, 2, 3, specs)) == f"world_size=2 stage=3, 2 parameters #{digest:016x}"
    assert c.layout_record(ShardLayout(1, 2, 3, specs), across_parts=True) == "world_size=2 stage=3"
    tp = ShardLayout(0, 4, 0, specs, part=ModelPart(tp=1, tp_size=2, pp=0, pp_size=3))
    assert c.layout_record(tp) == f"world_size=4 stage=0 tp_size=2 pp_size=3, 2 parameters #{digest:016x}"
    assert c.layout_record(tp, across_parts=True) == "world_size=4 stage=0 tp_size=2 pp_size=3"


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (errno.ENOSPC, "free space on that filesystem (or save elsewhere) and save again"),
        (errno.EDQUOT, "free quota on that filesystem (or save elsewhere) and save again"),
        (errno.EROFS, "the filesystem is mounted read-only: save to a writable directory"),
        (errno.EACCES, "this process may not write there: fix the folder's permissions or save elsewhere"),
        (errno.EPERM, "this process may not write there: fix the folder's permissions or save elsewhere"),
        (errno.EIO, "see the error above"),
    ],
)
def test_io_error_names_rank_file_errno_and_a_fix(code: int, hint: str) -> None:
    e = OSError(code, os.strerror(code), "/x")
    err = c.io_error(e, 3, "/ckpt/ema_rank3.safetensors")
    name = errno.errorcode[code]
    assert (
        str(err)
        == f"rank 3 could not write /ckpt/ema_rank3.safetensors: {os.strerror(code)} (errno {code}, {name}); {hint}"
    )
    assert isinstance(err, CheckpointIOError) and isinstance(err, OSError) and err.errno == code


def test_io_error_without_a_known_errno() -> None:
    """An errno Python has no name for shows as its number; none at all shows as such, with the plain message."""
    err = c.io_error(OSError(99999, "odd device"), 0, Path("/m/a.json"), "read")
    assert str(err) == "rank 0 could not read /m/a.json: odd device (errno 99999, 99999); see the error above"
    assert err.errno == 99999
    err = c.io_error(OSError("the mount went away"), 1, "/m/b.json", "rename")
    assert (
        str(err) == "rank 1 could not rename /m/b.json: the mount went away (errno None, no errno); see the error above"
    )
    assert err.errno is None


def test_run_local_payloads() -> None:
    """The payload settle exchanges: ok and the value, or the error's class, message, family and errno.
    An OSError becomes a CheckpointIOError naming the rank and file; a library error is kept as it is."""
    assert c.run_local(lambda: {"a": 1}, 0) == (("ok", {"a": 1}), None)
    missing = FileNotFoundError(errno.ENOENT, "No such file or directory", "/ckpt/latest")
    payload, exc = c.run_local(_raise(missing), 2)
    msg = "rank 2 could not access /ckpt/latest: No such file or directory (errno 2, ENOENT); see the error above"
    assert payload == ("error", "CheckpointIOError", msg, True, errno.ENOENT)
    assert isinstance(exc, CheckpointIOError) and str(exc) == msg
    payload, exc = c.run_local(_raise(PermissionError(errno.EACCES, "Permission denied")), 1)
    msg = "rank 1 could not access a checkpoint file: Permission denied (errno 13, EACCES); this process may not "
    msg += "write there: fix the folder's permissions or save elsewhere"
    assert payload == ("error", "CheckpointIOError", msg, True, errno.EACCES) and str(exc) == msg
    for error, family in [
        (CheckpointNotFoundError("no tag"), True),  # a CheckpointError and an OSError: kept
        (MismatchError("shapes differ"), True),
        (TreeMismatchError("names differ"), True),
        (SwappedTrainingError("training while swapped"), True),
        (TypeError("decay must be a float"), False),
        (ErrnoError("flaky"), False),
    ]:
        payload, exc = c.run_local(_raise(error), 0)
        assert exc is error and payload == (
            "error",
            type(error).__name__,
            str(error),
            family,
            getattr(error, "errno", None),
        )


def _raise(error: Exception) -> Callable[[], Any]:
    def fn() -> Any:
        raise error

    return fn


def test_settle_in_a_world_of_one() -> None:
    """One rank: its value, or its own error; a failed payload without the error raises its class by name
    (or the fallback for a foreign one), with the errno of an I/O error."""
    assert c.settle("save", ("ok", 5), None, None, 1, 0) == [5]
    own = CheckpointMismatchError("mine")
    with pytest.raises(CheckpointMismatchError) as info:
        c.settle("save", ("error", "CheckpointMismatchError", "mine", True, None), own, None, 1, 0)
    assert info.value is own
    with pytest.raises(CheckpointVersionError, match=r"^save failed on rank 0 of 1 \(CheckpointVersionError\): v9$"):
        c.settle("save", ("error", "CheckpointVersionError", "v9", True, None), None, None, 1, 0)
    with pytest.raises(CheckpointIOError) as io:
        c.settle("save", ("error", "CheckpointIOError", "disk", True, 28), None, None, 1, 0)
    assert io.value.errno == 28 and str(io.value) == "save failed on rank 0 of 1 (CheckpointIOError): disk"
    with pytest.raises(CheckpointError) as unknown:
        c.settle("save", ("error", "LocalCheckpointError", "own", True, None), None, None, 1, 0)
    assert (
        type(unknown.value) is CheckpointError
        and str(unknown.value) == "save failed on rank 0 of 1 (LocalCheckpointError): own"
    )
    with pytest.raises(KeyError) as foreign:
        c.settle("load", ("error", "TypeError", "t", False, 7), None, None, 1, 0, fallback=KeyError)
    assert foreign.value.args == ("load failed on rank 0 of 1 (TypeError): t",) and not hasattr(foreign.value, "errno")


def test_one_rank_without_a_process_group(no_group: None, tmp_path: Path) -> None:
    """A world of one runs fn alone: agree returns its value (None each without results), agree_on its record
    (no field check: nothing to compare with), a failure raises the rank's own error; the gathers return
    the object; check_reachable, arrive and check_distinct_writers pass without a group."""
    assert c.agree("save", lambda: 3, None, 1, 0) == [3]
    ran: list[int] = []
    assert c.agree("save", lambda: ran.append(1), None, 1, 0, results=False) == [None] and ran == [1]
    assert c.agree_on("load", lambda: {"step": 1, "x": 2}, ("step",), None, 1, 0) == {"step": 1, "x": 2}
    with pytest.raises(CheckpointIOError, match=r"^rank 0 could not access /a: gone \(errno 2, ENOENT\)"):
        c.agree("load", _raise(FileNotFoundError(errno.ENOENT, "gone", "/a")), None, 1, 0)
    with pytest.raises(CheckpointIOError, match=r"^rank 0 could not access /b: gone"):
        c.agree_on("load", _raise(FileNotFoundError(errno.ENOENT, "gone", "/b")), ("step",), None, 1, 0)
    with pytest.raises(TypeError, match=r"^quiet$"):
        c.agree("load", _raise(TypeError("quiet")), None, 1, 0, results=False)
    assert c.exchange({"a": 1}, None, 1) == [{"a": 1}] and c.exchange(7, None, 4) == [7]
    assert c.gather_to_first({"a": 1}, None, 1) == [{"a": 1}] and c.gather_to_first(7, None, 4) == [7]
    assert c.check_reachable("save", None, 1) is None and c.arrive("save", None, 1, 0, 0.1) is None
    assert c.check_distinct_writers("save", tmp_path, ["same"], 2, 0.1) is None
    assert c._finished(None, time.monotonic() - 10) is True


def test_a_layout_of_several_ranks_without_a_process_group_is_refused(no_group: None) -> None:
    msg = (
        "functional_ema.{0}: the model's layout spans 2 ranks but torch.distributed is not initialized in this process "
        "(destroy_process_group called?). functional_ema.{0} " + FIX
    )
    with pytest.raises(CheckpointError) as info:
        c.check_reachable("save", None, 2)
    assert str(info.value) == msg.format("save")
    with pytest.raises(CheckpointError) as info:
        c.arrive("load", None, 2, 1, 5.0)
    assert str(info.value) == msg.format("load")


def test_job_of_without_a_process_group(no_group: None) -> None:
    """Without a process group a layout is its own job, model-parallel or not (nothing to span)."""
    specs = {"w": ShardSpec((4,), 0, 2)}
    tp = ShardLayout(1, 2, 3, specs, part=ModelPart(tp=1, tp_size=2))
    for layout in (ShardLayout(1, 2, 3, specs), tp, ShardLayout(0, 2, 3, specs, replicas=2)):
        job = c.job_of(SimpleNamespace(layout=layout, group="a group"))  # type: ignore[arg-type]
        assert job == c.Job(None, layout.rank, 2)


def test_timeout_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """timeout= wins; else FUNCTIONAL_EMA_TIMEOUT; else 600 s. Anything not a positive finite number of
    seconds is refused, naming where it came from and the value."""
    monkeypatch.delenv(c.TIMEOUT_ENV, raising=False)
    assert c.timeout_s(None) == 600.0
    assert c.timeout_s(2.5) == 2.5 and c.timeout_s(0.25) == 0.25 and c.timeout_s(3) == 3.0
    for bad in (0, -1, 0.0, math.inf, math.nan, True, "soon", [1.0]):
        with pytest.raises(ValueError) as info:
            c.timeout_s(bad)  # type: ignore[arg-type]
        assert str(info.value) == f"timeout= must be a positive number of seconds, got {bad!r}"
    monkeypatch.setenv(c.TIMEOUT_ENV, "")
    assert c.timeout_s(None) == 600.0
    monkeypatch.setenv(c.TIMEOUT_ENV, "1.5")
    assert c.timeout_s(None) == 1.5 and c.timeout_s(4.0) == 4.0
    monkeypatch.setenv(c.TIMEOUT_ENV, "0.5")
    assert c.timeout_s(None) == 0.5
    for bad in ("abc", "0", "-2", "nan", "inf"):
        monkeypatch.setenv(c.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError) as info:
            c.timeout_s(None)
        assert (
            str(info.value)
            == f"environment variable FUNCTIONAL_EMA_TIMEOUT must be a positive number of seconds, got {bad!r}"
        )


def test_a_bad_timeout_env_is_not_read_by_one_process(no_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """One process waits for nobody, so a bad FUNCTIONAL_EMA_TIMEOUT does not break its swapped/gather_full
    (agree_on returns before reading it)."""
    import functional_ema as fe

    monkeypatch.setenv(c.TIMEOUT_ENV, "10s")
    assert c.agree_on("swapped", lambda: {"step": 3}, ("step",), None, 1, 0) == {"step": 3}
    model = torch.nn.Linear(3, 2)
    state = fe.update(fe.init_ema(fe.local_shards(model)), fe.local_shards(model), 1, decay=0.9)
    assert set(fe.gather_full(state, model)) == {"weight", "bias"}
    with fe.swapped(model, state):
        pass


def test_commit_exchange_reports_a_vanished_peer_as_a_stalled_commit_step() -> None:
    """commit_exchange: what the exchange returns; gloo's error of a peer that vanished (a RuntimeError) as the
    CheckpointTimeoutError of a commit stopped at that step, naming what the checkpoint is left as; other errors as
    they are."""
    ref = c.CommitRef("save", "t", "/ck/t", "a" * 16, 0.6)
    assert c.commit_exchange(ref, "x", lambda: [1, 2], (None, 2, 1), lambda: "-") == [1, 2]
    closed = _raise(RuntimeError("[/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:41\nmore"))
    with pytest.raises(CheckpointTimeoutError) as info:
        c.commit_exchange(ref, "exchanging the file records", closed, (None, 2, 1), lambda: "Left as it was.")
    waited = re.search(r"rank 1 waited (\d+\.\d) s", str(info.value))
    assert waited is not None and float(waited.group(1)) < 1, info.value
    assert str(info.value) == (
        "functional_ema.save: the commit of tag 't' (/ck/t) stopped at its step 'exchanging the file records': rank 1 "
        f"waited {waited.group(1)} s (limit 0.6 s) for the other ranks of its process group (world size 2) to finish "
        "that step, and they did not (rank 0, which gathers the others, did not answer: [/gloo/transport/tcp/pair.cc:"
        "534] Connection closed by peer [10.0.0.2]:41): a rank hung or died mid-commit. Left as it was. The limit is "
        "the save's timeout (timeout=, else FUNCTIONAL_EMA_TIMEOUT, default 600 s). The process group may be unusable "
        "after this"
    )
    with pytest.raises(ValueError, match=r"^mine$"):
        c.commit_exchange(ref, "x", _raise(ValueError("mine")), (None, 2, 0), lambda: "-")
