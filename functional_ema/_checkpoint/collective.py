"""How the ranks of a collective checkpoint verb agree: arrive within a timeout, run, and either
all succeed or all raise the same error (no rank is left hanging in a later collective)."""

from __future__ import annotations

import errno as _errno
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
import xxhash

from .. import _errors
from .._tree import TreeMismatchError
from . import errors
from .errors import CheckpointError, CheckpointIOError, CheckpointMismatchError, CheckpointTimeoutError

if TYPE_CHECKING:
    from .._layout import ShardLayout
    from ..engines._base import Reading

#: The library's error classes by name: a rank that learns of another rank's failure raises the same one.
_LIBRARY_ERRORS: Mapping[str, type[Exception]] = MappingProxyType(
    {name: getattr(module, name) for module in (errors, _errors) for name in module.__all__}
    | {"TreeMismatchError": TreeMismatchError}
)
_LIBRARY_BASES = (CheckpointError, _errors.MismatchError, _errors.SwappedTrainingError)


def exchange(obj: Any, group: dist.ProcessGroup | None, world: int) -> list[Any]:
    if world <= 1 or not dist.is_initialized():
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def io_error(e: OSError, rank: int, path: Path | str, doing: str = "write") -> CheckpointIOError:
    """An OSError as a :class:`CheckpointIOError` naming the rank, the file and the errno."""
    code = _errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "no errno"
    why = e.strerror or str(e)
    hints = {
        _errno.ENOSPC: "free space on that filesystem (or save elsewhere) and save again",
        _errno.EDQUOT: "free quota on that filesystem (or save elsewhere) and save again",
        _errno.EROFS: "the filesystem is mounted read-only: save to a writable directory",
        _errno.EACCES: "this process may not write there: fix the folder's permissions or save elsewhere",
        _errno.EPERM: "this process may not write there: fix the folder's permissions or save elsewhere",
    }
    hint = hints.get(e.errno, "see the error above") if e.errno is not None else "see the error above"
    err = CheckpointIOError(f"rank {rank} could not {doing} {path}: {why} (errno {e.errno}, {code}); {hint}")
    err.errno = e.errno  # only errno: with strerror/filename set, OSError.__str__ would drop the message
    return err


def agree(
    what: str,
    fn: Callable[[], Any],
    group: dist.ProcessGroup | None,
    world: int,
    rank: int,
    results: bool = True,
    fallback: type[Exception] = CheckpointError,
) -> list[Any]:
    """Run ``fn()`` on every rank; if it fails anywhere, raise on every rank (no rank is left hanging
    in a later collective). Returns every rank's result (``None`` each with ``results=False``: then
    a success costs one small all-reduce instead of exchanging objects).

    Every rank raises the same library error class (a :class:`CheckpointError` or a
    :class:`~functional_ema.MismatchError` subclass), naming the first failing rank: that rank
    re-raises its own error (an ``OSError`` becomes a :class:`CheckpointIOError`), the others raise
    the same class with that rank's message. Another error (e.g. a ``TypeError`` of the caller's own
    arguments) stays as it is on the rank that raised it, and the others raise ``fallback``.
    """
    if not results:
        # Unbounded: fn may be long work (a save's writes), however long one rank takes more than another
        agree_on(what, lambda: (fn(), {})[1], (), group, world, rank, fallback=fallback, bounded=False)
        return [None] * world
    payload, local_exc = run_local(fn, rank)
    return settle(what, payload, local_exc, group, world, rank, fallback)


def agree_on(
    what: str,
    fn: Callable[[], Mapping[str, Any]],
    fields: Sequence[str],
    group: dist.ProcessGroup | None,
    world: int,
    rank: int,
    *,
    fallback: type[Exception] = CheckpointError,
    mismatch: type[Exception] = CheckpointMismatchError,
    fix: str = "",
    timeout: float | None = None,
    bounded: bool = True,
    call: str = "",
    stalled: Callable[[float, float, Exception], Exception] | None = None,
) -> Mapping[str, Any]:
    """Run ``fn()`` on every rank (this rank's checks, returning its record ``{field: value}`` of what the
    verb is about to read: step, tag, save generation, number of EMAs, dtype, layout) and agree on it:
    raise on every rank when ``fn`` failed on any rank (as :func:`agree`) or when the ranks' records differ.

    It is also the verb's arrival, bounded like :func:`arrive`: the few ints are exchanged point to point
    through the group's first rank (:func:`bounded_max`, its own tags, one fixed-size message each way), so a
    verb called on some ranks only fails on each of them with :class:`CheckpointTimeoutError` after the
    timeout (``timeout``, else :data:`TIMEOUT_ENV`, else :data:`DEFAULT_TIMEOUT_S`) instead of blocking in
    an all-reduce, or crashing gloo when another rank's collective meets it. A digest of ``what`` (and ``call``)
    travels too: ranks in two different verbs (``swapped`` on one, ``gather_full`` on another), or in one verb with
    arguments that lead to other collectives (``gather_full(dst=0)`` on one, ``gather_full`` on another), raise
    ``mismatch`` naming each rank's call.
    ``bounded=False`` (:func:`agree` after a long ``fn``) all-reduces the same ints instead, with no bound.

    Cost: one round trip of :data:`AGREE_WORDS` int64 between each rank and the first (a verb digest, a failure
    flag and, per field, a 62-bit digest of the value and its negation: equal on every rank iff
    ``max == -max(-digest)``), on the gloo side group when the backend is NCCL. Only a failure or a disagreement
    exchanges the records, to name each rank's value: ``mismatch`` is raised on every rank, e.g. ``"gather_full:
    ranks disagree on step: rank 0: 6, rank 1: 5"`` (``fix`` appended).

    Args:
        what: the verb, as the message names it.
        fn: this rank's check; returns ``{field: value}`` for exactly ``fields`` (JSON-able values, or
            anything whose ``str`` identifies it, e.g. a dtype).
        fields: the fields every rank compares, in a fixed order (the same on every rank).
        timeout: the bound on the wait for the other ranks, in seconds (see above).
        bounded: whether the wait is bounded (see above).
        call: the arguments of this call that decide which collectives follow (``"dst=0"``), as the message shows
            them (``gather_full(dst=0)``); ``""`` when there are none, or they are the defaults.
        stalled: the error a bounded wait that ran out raises, made of (the limit, the seconds waited, gloo's
            error); default: a verb's ranks that did not all call it (:func:`_timed_out`). A step inside a commit
            (:func:`commit_step`) names what its ranks were doing instead.

    Returns:
        This rank's record (the same values on every rank).
    """
    if 3 + 2 * len(fields) > AGREE_WORDS:  # a caller's bug, the same on every rank of one call site
        raise ValueError(f"{what}: agree_on compares at most {(AGREE_WORDS - 3) // 2} fields, got {len(fields)}")
    alone = world <= 1 or not dist.is_initialized()
    # Read only where a bounded wait uses it (one process waits for nobody; bounded=False all-reduces), and
    # before fn runs, so a bad FUNCTIONAL_EMA_TIMEOUT is refused before anything is written.
    t = timeout_s(timeout) if bounded and not alone else None
    payload, local_exc = run_local(fn, rank)
    record = payload[1] if local_exc is None else None
    if alone:
        if local_exc is not None:
            raise local_exc
        return payload[1]  # this rank's record: fn succeeded
    if record is not None and sorted(record) != sorted(fields):  # a caller's bug: fail on every rank all the same
        local_exc = CheckpointError(f"{what}: record fields {sorted(record)} are not {sorted(fields)}")
        payload, record = ("error", "CheckpointError", str(local_exc), True, None), None
    digests = [value_digest(record[f]) if record is not None else -1 for f in fields]
    verb = value_digest(f"{what}({call})" if call else what)
    words = [verb, -verb, int(record is None)] + [v for d in digests for v in (d, -d)]
    set_by = "the environment variable" if timeout is None else "timeout= or the environment variable"
    reduced = (
        _agreement(what, words, (group, world, rank), t, set_by, stalled)
        if t is not None
        else all_reduce_max(words, group)
    )
    if reduced[0] != -reduced[1]:  # every rank sees it: each names the call the others made, then raises
        called = exchange((what, call), barrier_group(group, t if t is not None else timeout_s(timeout)), world)
        raise mismatch(_calls_differ(what, called))
    if (
        record is not None
        and not reduced[2]
        and all(reduced[3 + 2 * i] == -reduced[4 + 2 * i] for i in range(len(fields)))
    ):
        return record
    records = settle(what, payload, local_exc, group, world, rank, fallback)  # raises when a rank failed
    raise mismatch(disagreement(what, fields, records) + (f". {fix}" if fix else ""))


def _calls_differ(what: str, called: Sequence[tuple[str, str]]) -> str:
    """:func:`agree_on`'s message when the ranks' verbs (``what``) or their ``call`` arguments differ, naming each."""
    shown = ", ".join(f"rank {r}: {_shown(f'{v}({c})' if c else v)}" for r, (v, c) in enumerate(called))
    if len({v for v, _ in called}) > 1:
        return (
            f"{what}: the ranks called different collective verbs ({shown}); call each on every rank, in the same order"
        )
    return (
        f"{what}: the ranks called it with arguments that lead to different collectives ({shown}); make the same "
        "call on every rank"
    )


def layout_record(layout: ShardLayout, across_parts: bool = False) -> str:
    """What every rank of a group reads the model's layout as (a :class:`~functional_ema.ShardLayout`):
    world size, stage, model-parallel sizes, and a digest of the parameter names and full shapes, for
    :func:`agree_on`. ``across_parts``: the group spans model-parallel parts (each holds other
    parameters), so only the sizes are compared."""
    text = f"world_size={layout.world_size} stage={layout.stage}"
    if not layout.part.whole:
        text += f" tp_size={layout.part.tp_size} pp_size={layout.part.pp_size}"
    if across_parts:
        return text
    shapes = [(n, list(s.shape)) for n, s in layout.specs.items()]
    return f"{text}, {len(shapes)} parameters #{value_digest(shapes):016x}"


def value_digest(value: Any) -> int:
    """A 62-bit digest of ``value`` (its JSON, else its ``str``), whose negation also fits an int64."""
    try:
        text = json.dumps(value, sort_keys=True)
    except (TypeError, ValueError):
        text = str(value)
    return xxhash.xxh3_64_intdigest(text.encode()) >> 2


def disagreement(what: str, fields: Sequence[str], records: Sequence[Mapping[str, Any]]) -> str:
    """``"<what>: ranks disagree on step: rank 0: 6, rank 1: 5"`` for each field whose value differs."""
    parts = []
    for f in fields:
        values = [r[f] for r in records]
        if len({value_digest(v) for v in values}) > 1:
            name, values = _first_difference(f, values)
            parts.append(f"{name}: " + ", ".join(f"rank {r}: {_shown(v)}" for r, v in enumerate(values)))
    return f"{what}: ranks disagree on " + "; and on ".join(parts or ["nothing (a digest collided)"])


def _first_difference(name: str, values: list[Any]) -> tuple[str, list[Any]]:
    """The first entry where lists of one length (or dicts of the same keys) differ, named ``name[i]``: a long value
    cut for the message (``_shown``) would hide what differs (the second of two schedules)."""
    while True:
        first = values[0]
        if isinstance(first, (list, tuple)) and all(
            isinstance(v, (list, tuple)) and len(v) == len(first) for v in values
        ):
            keys: list[Any] = list(range(len(first)))
        elif isinstance(first, Mapping) and all(isinstance(v, Mapping) and v.keys() == first.keys() for v in values):
            keys = list(first)
        else:
            return name, values
        key = next((k for k in keys if len({value_digest(v[k]) for v in values}) > 1), None)
        if key is None:
            return name, values
        name, values = f"{name}[{key!r}]", [v[key] for v in values]


def _shown(value: Any) -> str:
    text = repr(value) if isinstance(value, str) else str(value)
    return text if len(text) <= 80 else text[:77] + "..."


def run_local(fn: Callable[[], Any], rank: int) -> tuple[tuple[Any, ...], Exception | None]:
    """``fn()`` on this rank, as the payload :func:`settle` exchanges: ``("ok", result)``, or the
    error's class, message, whether it is one of the library's error classes, and its errno."""
    try:
        return ("ok", fn()), None
    except Exception as e:  # noqa: BLE001 - re-raised by settle, on every rank
        if isinstance(e, OSError) and not isinstance(e, CheckpointError):
            e = io_error(e, rank, e.filename or "a checkpoint file", "access")
        return ("error", type(e).__name__, str(e), isinstance(e, _LIBRARY_BASES), getattr(e, "errno", None)), e


def gather_to_first(obj: Any, group: dist.ProcessGroup | None, world: int) -> list[Any] | None:
    """``obj`` of every rank of ``group`` (in rank order) on its first rank, None on the others: for what
    only rank 0 reads, such as the save's file records (O(parameters) each), which an all-gather would
    send to every rank (O(world size x parameters) each). On the gloo side group, like the agreements."""
    if world <= 1 or not dist.is_initialized():
        return [obj]
    g = barrier_group(group, DEFAULT_TIMEOUT_S)
    out: list[Any] | None = [None] * world if dist.get_rank(g) == 0 else None
    dist.gather_object(obj, out, dst=dist.get_global_rank(g, 0) if g is not None else 0, group=g)
    return out


def all_reduce_max(values: list[int], group: dist.ProcessGroup | None) -> list[int]:
    """The elementwise maximum over the ranks of ``group`` of a few ints (one small all-reduce on the
    gloo side group, cheaper than exchanging objects)."""
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(
        t, op=dist.ReduceOp.MAX, group=barrier_group(group, DEFAULT_TIMEOUT_S)
    )  # CPU tensor: the gloo group
    return t.tolist()


def settle(
    what: str,
    payload: tuple[Any, ...],
    local_exc: Exception | None,
    group: dist.ProcessGroup | None,
    world: int,
    rank: int,
    fallback: type[Exception] = CheckpointError,
) -> list[Any]:
    """Exchange the ranks' :func:`run_local` payloads; raise on every rank if any failed (see
    :func:`agree`), else return every rank's result."""
    gathered = exchange(payload, group, world)
    failed = [(r, p) for r, p in enumerate(gathered) if p[0] == "error"]
    if failed:
        r, (_, cls_name, msg, is_library, code) = failed[0]
        if local_exc is not None and (r == rank or not isinstance(local_exc, _LIBRARY_BASES)):
            raise local_exc
        cls = _LIBRARY_ERRORS.get(cls_name, CheckpointError) if is_library else fallback
        err = cls(f"{what} failed on rank {r} of {world} ({cls_name}): {msg}")
        if code is not None and isinstance(err, OSError):
            err.errno = code
        raise err from local_exc
    return [p[1] for p in gathered]


#: Default bound, in seconds, on how long :func:`save` and :func:`load` wait for every rank of the
#: data-parallel group to call them (a rank that never does would otherwise block the others forever).
DEFAULT_TIMEOUT_S = 600.0
#: Environment variable that sets that bound (seconds) when ``timeout=`` is not passed.
TIMEOUT_ENV = "FUNCTIONAL_EMA_TIMEOUT"


def timeout_s(timeout: float | None) -> float:
    where = "timeout="
    given: float | str = timeout if timeout is not None else ""
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV)
        if not env:
            return DEFAULT_TIMEOUT_S
        given, where = env, f"environment variable {TIMEOUT_ENV}"
    try:
        t = math.nan if isinstance(given, bool) else float(given)
    except (TypeError, ValueError, RuntimeError):
        t = math.nan
    if not (math.isfinite(t) and t > 0):
        raise ValueError(f"{where} must be a positive number of seconds, got {given!r}")
    return t


_SIDE_GROUPS: dict[
    tuple[int, ...], dist.ProcessGroup
] = {}  # reason: a gloo side group costs a rendezvous to make, so one is kept per group


def barrier_group(group: dist.ProcessGroup | None, timeout: float) -> dist.ProcessGroup | None:
    g = group if group is not None else dist.group.WORLD
    if dist.get_backend(g) == "gloo":
        return g
    ranks = tuple(dist.get_process_group_ranks(g))
    side = _SIDE_GROUPS.get(ranks)
    if side is None:
        side = dist.new_group(
            list(ranks), backend="gloo", timeout=timedelta(seconds=timeout), use_local_synchronization=True
        )
        _SIDE_GROUPS[ranks] = side
    return side


def check_reachable(what: str, group: dist.ProcessGroup | None, world: int) -> None:
    """Refuse a collective verb whose group cannot be reached, before any file is touched: a layout of
    several ranks with no process group (destroyed, or never made in this process), or a group that is
    gone or has another size. Otherwise the verb would run on this rank alone, e.g. rank 0 committing a
    checkpoint without the other ranks' files."""
    if world <= 1:
        return
    fix = (
        f"functional_ema.{what} is collective: call it on every rank while the process group that trains the "
        "model is up (before destroy_process_group)"
    )
    if not dist.is_available() or not dist.is_initialized():
        raise CheckpointError(
            f"functional_ema.{what}: the model's layout spans {world} ranks but torch.distributed is not "
            f"initialized in this process (destroy_process_group called?). {fix}"
        )
    try:
        size = dist.get_world_size(group)
    except (ValueError, RuntimeError) as e:
        raise CheckpointError(
            f"functional_ema.{what}: the model's process group of {world} ranks is no longer usable "
            f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}). {fix}"
        ) from None
    if size != world:
        raise CheckpointError(
            f"functional_ema.{what}: the model's layout spans {world} ranks but its process group has {size}. {fix}"
        )


#: Point-to-point tags of :func:`bounded_barrier` (distinctive: a caller's own sends on the group use others).
ARRIVE_TAG, RELEASE_TAG = 0x454D4101, 0x454D4102
#: Those of :func:`agree_on`'s exchange: other tags than :func:`arrive`'s, so that a rank in one never takes the
#: other's message (gloo aborts the process when a message of another size meets a receive).
AGREE_TAG, AGREE_RELEASE_TAG = 0x454D4103, 0x454D4104
#: Length, in int64, of every message of :func:`agree_on` (padded with zeros): one size for every verb, so ranks
#: in two verbs exchange messages that fit and learn that the verbs differ.
AGREE_WORDS = 64


def _finished(work: dist.Work | None, deadline: float) -> bool:
    """Whether ``work`` completes before ``deadline`` (``time.monotonic()``), waiting at most until then.
    At least 1 ms: a zero timedelta would mean the group's own timeout to gloo."""
    try:
        return work is None or bool(work.wait(timeout=timedelta(seconds=max(deadline - time.monotonic(), 1e-3))))
    except RuntimeError:  # gloo reports a timeout, or a peer gone, as RuntimeError (DistError)
        return False


def bounded_barrier(g: dist.ProcessGroup | None, t: float) -> None:
    """Return once every rank of ``g`` (a gloo group) has called this; raise ``RuntimeError`` on any
    rank whose own wait reaches ``t`` seconds first.

    Why not ``dist.monitored_barrier``: it bounds only rank 0's wait. The other ranks wait for rank 0's
    reply with the group's own timeout (30 min by default), so a rank other than 0 called alone waited
    until rank 0 exited or broke the group, not ``t`` seconds. Here each rank sends rank 0 a token and
    waits, on its own clock, for rank 0's release, which rank 0 sends once every token has come.
    A timeout leaves the group unusable (gloo closes its connections), as with monitored_barrier."""
    bounded_max(g, t, torch.zeros(1, dtype=torch.int64), (ARRIVE_TAG, RELEASE_TAG))


def bounded_max(g: dist.ProcessGroup | None, t: float, mine: torch.Tensor, tags: tuple[int, int]) -> torch.Tensor:
    """The elementwise maximum of ``mine`` (a CPU int64 tensor of one size on every rank) over the ranks of ``g``
    (a gloo group), as :func:`bounded_barrier` exchanges its tokens: each rank sends its tensor to rank 0 with
    ``tags[0]``; rank 0, once all have come, sends the maximum back with ``tags[1]``. Raises ``RuntimeError`` on a
    rank whose own wait reaches ``t`` seconds first (a point-to-point wait can be bounded; a collective's cannot)."""
    deadline = time.monotonic() + t
    world, me = dist.get_world_size(g), dist.get_rank(g)
    if me != 0:
        sent = dist.isend(mine, group=g, group_dst=0, tag=tags[0])
        out = torch.zeros_like(mine)
        if not (_finished(dist.irecv(out, group=g, group_src=0, tag=tags[1]), deadline) and _finished(sent, deadline)):
            raise RuntimeError(f"no release from rank 0 of the group within {t:g} s")
        return out
    got = [torch.zeros_like(mine) for _ in range(world - 1)]
    arrivals = [dist.irecv(x, group=g, group_src=r, tag=tags[0]) for r, x in enumerate(got, 1)]
    missing = [r for r, w in enumerate(arrivals, 1) if not _finished(w, deadline)]
    if missing:
        raise RuntimeError(f"rank(s) {missing} of the group did not arrive within {t:g} s")
    out = torch.stack([mine, *got]).amax(dim=0) if got else mine
    releases = [dist.isend(out, group=g, group_dst=r, tag=tags[1]) for r in range(1, world)]
    late = [r for r, w in enumerate(releases, 1) if not _finished(w, deadline)]
    if late:
        raise RuntimeError(f"rank(s) {late} of the group took no release within {t:g} s")
    return out


def _agreement(
    what: str,
    words: list[int],
    where: tuple[dist.ProcessGroup | None, int, int],
    t: float,
    set_by: str,
    stalled: Callable[[float, float, Exception], Exception] | None = None,
) -> list[int]:
    """:func:`agree_on`'s exchange: the elementwise maximum of ``words`` over the group (:func:`bounded_max`, padded
    to :data:`AGREE_WORDS`), or, when a rank waits ``t`` seconds, ``stalled(t, waited, e)`` (default: the
    :class:`CheckpointTimeoutError` of a verb not called on every rank, naming ``what``)."""
    group, world, rank = where
    t0 = time.monotonic()
    try:
        return _max_words(words, AGREE_WORDS, group, t, (AGREE_TAG, AGREE_RELEASE_TAG))
    except RuntimeError as e:  # gloo reports a timeout or a vanished peer as RuntimeError (DistError)
        waited = time.monotonic() - t0
        raise (stalled(t, waited, e) if stalled else _timed_out(what, rank, world, t, waited, e, set_by)) from None


def _max_words(
    words: list[int], size: int, group: dist.ProcessGroup | None, t: float, tags: tuple[int, int]
) -> list[int]:
    """:func:`bounded_max` of ``words`` padded to ``size`` int64 (every message of one exchange has one length), on
    the gloo side group of ``group``, with ``tags``; ``RuntimeError`` when a rank waits ``t`` seconds."""
    mine = torch.zeros(size, dtype=torch.int64)
    mine[: len(words)] = torch.tensor(words, dtype=torch.int64)
    return bounded_max(barrier_group(group, t), t, mine, tags)[: len(words)].tolist()


def _timed_out(what: str, rank: int, world: int, t: float, waited: float, e: Exception, set_by: str) -> Exception:
    """The :class:`CheckpointTimeoutError` of a verb whose other ranks did not come within ``t`` seconds."""
    detail = error_detail(e)
    return CheckpointTimeoutError(
        f"functional_ema.{what}: rank {rank} waited {waited:.1f} s (limit {t:g} s) for the other ranks "
        f"of its process group (world size {world}) to call it too, and they did not ({detail}). {what}() is "
        f"collective: call it on every rank, with the same arguments. The wait is set by {set_by} "
        f"{TIMEOUT_ENV} (default {DEFAULT_TIMEOUT_S:g} s). The process group may be unusable after this"
    )


def arrive(what: str, group: dist.ProcessGroup | None, world: int, rank: int, timeout: float | None) -> None:
    """Wait, at most the timeout, until every rank of ``group`` has called ``what``; else raise
    :class:`CheckpointTimeoutError` (a verb called on one rank only fails instead of hanging), on every
    rank by its own clock (:func:`bounded_barrier`). A group that cannot be reached at all is refused
    at once (:func:`check_reachable`)."""
    check_reachable(what, group, world)
    if world <= 1:
        return
    t = timeout_s(timeout)
    t0 = time.monotonic()
    try:
        bounded_barrier(barrier_group(group, t), t)
    except RuntimeError as e:  # gloo reports a timeout or a vanished peer as RuntimeError (DistError)
        raise _timed_out(
            what, rank, world, t, time.monotonic() - t0, e, "timeout= or the environment variable"
        ) from None


class CommitRef(NamedTuple):
    """A save's commit, as its bounded steps (:func:`commit_step`) name it."""

    what: str  # the public verb ("save", "async save")
    tag: str
    where: str  # the tag's folder (this rank's) or URL
    save_id: str  # the save's token, the same on every rank (agreed with its plan)
    timeout: float  # the save's bound on each wait for the other ranks, seconds


def commit_step(
    ref: CommitRef,
    phase: str,
    fn: Callable[[], object],
    job: tuple[dist.ProcessGroup | None, int, int],
    state: Callable[[], str],
) -> None:
    """One step of a save's commit, after its ranks met (a private or URL save's manifests): ``fn()`` on every rank,
    then agree (:func:`agree_on`) that it succeeded everywhere (raising on every rank if not). ``job`` is (group,
    world, rank). Only for a step whose work decides the commit and is short (a manifest's write or rename): a
    long one (removing older generations) belongs after the last step, where no rank waits for it.

    Bounded: each rank waits at most ``ref.timeout`` for the others, so a rank that hangs or dies mid-commit makes the
    others raise :class:`CheckpointTimeoutError` (:func:`_commit_stalled`) instead of blocking until gloo's own
    timeout (30 minutes). ``ref.save_id`` and ``phase`` go into the exchange's verb digest: a late message of another
    step, or of an earlier save's step that timed out, is refused as another call (:class:`CheckpointMismatchError`),
    never taken for this one's. Cost: one round trip of :data:`AGREE_WORDS` int64 between each rank and the first."""
    group, world, rank = job
    stalled = _commit_stalled(ref, phase, job, state)
    what, call = f"{ref.what} ({phase})", f"save_id={ref.save_id}"
    agree_on(what, lambda: (fn(), {})[1], (), group, world, rank, timeout=ref.timeout, call=call, stalled=stalled)


def commit_exchange(
    ref: CommitRef,
    phase: str,
    exchange: Callable[[], Any],
    job: tuple[dist.ProcessGroup | None, int, int],
    state: Callable[[], str],
) -> Any:
    """A save's commit's first step, its exchange of the file records, entered by every rank right after they agreed
    that every rank's files are written (nothing runs between, so no rank is left waiting there: no bound of its
    own, and no extra round trip to meet first); returns what ``exchange()`` returns. A peer that vanished since
    makes gloo fail it: reported as :func:`commit_step` reports a stalled step."""
    t0 = time.monotonic()
    try:
        return exchange()
    except RuntimeError as e:  # gloo: a peer that vanished after agreeing (its closed connection)
        raise _commit_stalled(ref, phase, job, state)(ref.timeout, time.monotonic() - t0, e) from None


def _commit_stalled(
    ref: CommitRef, phase: str, job: tuple[dist.ProcessGroup | None, int, int], state: Callable[[], str]
) -> Callable[[float, float, Exception], Exception]:
    """The error of a commit step (:func:`commit_step`, :func:`commit_exchange`) whose peers did not finish it: names
    the save, ``phase``, the rank(s) missing (as this rank knows them: the first rank knows which; the others that
    the first did not answer), the limit and ``state()`` (what the checkpoint is left as, as this rank knows it)."""
    _, world, rank = job

    def stalled(t: float, waited: float, e: Exception) -> Exception:
        who = "rank 0, which gathers the others, did not answer: " if rank else ""
        return CheckpointTimeoutError(
            f"functional_ema.{ref.what}: the commit of tag {ref.tag!r} ({ref.where}) stopped at its step '{phase}': "
            f"rank {rank} waited {waited:.1f} s (limit {t:g} s) for the other ranks of its process group (world size "
            f"{world}) to finish that step, and they did not ({who}{error_detail(e)}): a rank hung or died "
            f"mid-commit. {state()} The limit is the save's timeout (timeout=, else {TIMEOUT_ENV}, default "
            f"{DEFAULT_TIMEOUT_S:g} s). The process group may be unusable after this"
        )

    return stalled


def check_distinct_writers(
    what: str, tag_dir: Path | str, names: list[str], group_world: int, timeout: float | None
) -> None:
    """Refuse, on every rank of the job, a save in which two ranks would write the same file.

    Decided from what each rank would write (the real paths of its files; a URL's tag as named), so any layout where the
    ranks that save are not one data-parallel group is covered: model-parallel ranks with the same
    data-parallel coordinate, several groups saving into one folder. Free when the data-parallel group
    is the whole job (its file names differ by rank, and by model-parallel part; under HSDP only replica 0
    writes, and the FSDP2 adapter makes a replica one row of the mesh, so its shard ranks are distinct; it
    refuses a mesh whose replicate groups hold different shards); otherwise one exchange
    over the whole job, which every rank of the job must then join. A model read as a world of its own
    (a plain module, not DDP-wrapped) may be saved by one rank alone, so it is not checked: two such
    savers of one tag take turns (the tag's lock), each writing a complete checkpoint.
    """
    if not dist.is_available() or not dist.is_initialized():
        return
    job = dist.get_world_size()
    if job == group_world or group_world == 1:
        return
    me = dist.get_rank()
    arrive(f"{what} (every rank of the job: {job} ranks)", None, job, me, timeout)
    # a local folder by its real path (two mounts of one disk are one folder); a URL (str) as it is named
    paths = [os.path.realpath(tag_dir / n) if isinstance(tag_dir, Path) else f"{tag_dir}/{n}" for n in names]
    gathered = exchange(paths, barrier_group(None, timeout_s(timeout)), job)
    owners: dict[str, list[int]] = {}
    for r, ps in enumerate(gathered):
        for p in ps:
            owners.setdefault(p, []).append(r)
    clashes = [(p, rs) for p, rs in owners.items() if len(rs) > 1]
    if clashes:
        path, ranks = clashes[0]
        more = f" ({len(clashes) - 1} more files likewise)" if len(clashes) > 1 else ""
        raise CheckpointError(
            f"functional_ema.{what}: ranks {ranks} of the job (world size {job}) would all write {path}{more}: each would "
            f"overwrite the others' EMA. The model's pieces are spread over data-parallel groups of {group_world} rank(s), "
            f"and {job // max(group_world, 1)} such groups save into one folder: save each group's EMA into its own "
            "folder (or tag). Nothing was written"
        )


class Job(NamedTuple):
    """The ranks that save and load one model together: the data-parallel group for a whole model; every
    rank of the job (its default group) when the model is split into model-parallel parts, or held by
    several replicas of one data-parallel group (HSDP: replica 0 writes, every replica agrees)."""

    group: dist.ProcessGroup | None  # None for the default group / no process group
    rank: int
    world: int


def job_of(reading: Reading) -> Job:
    """The :class:`Job` of a training object's reading (plain data: its layout and group)."""
    layout = reading.layout
    if (layout.part.whole and layout.replicas == 1) or not dist.is_initialized():
        group = reading.group if layout.world_size > 1 and dist.is_initialized() else None
        return Job(group, layout.rank, layout.world_size)
    if layout.job_ranks != dist.get_world_size():  # replicas and parts save together: they must be the whole job
        raise NotImplementedError(
            f"the model's layout (data parallel {layout.world_size} x {layout.replicas} replica(s) x tensor parallel "
            f"{layout.part.tp_size} x {layout.part.pp_size} pipeline stage(s)) spans {layout.job_ranks} ranks, but the "
            f"job has {dist.get_world_size()}; functional_ema saves and loads HSDP and model-parallel layouts whose mesh "
            "spans every rank of the job"
        )
    return Job(None, dist.get_rank(), dist.get_world_size())


#: Point-to-point tags of :func:`update_exchange` (``update(..., nonfinite=...)`` over a group): others than
#: :func:`arrive`'s and :func:`agree_on`'s, so an update's message never meets a verb's receive, nor a verb's the
#: update's (gloo aborts the process when a message of another size meets a receive); the slots of collectives (a
#: training step's all-reduces, DeepSpeed's) never match a point-to-point tag either.
#: Tags of :func:`update_exchange`'s messages: its own, so an update's exchange never pairs with a verb's agreement.
UPDATE_TAG, UPDATE_RELEASE_TAG = 0x454D4105, 0x454D4106
#: Length, in int64, of every message of :func:`update_exchange` (padded with zeros).
UPDATE_WORDS = 8


def update_exchange(mode: str, words: list[int], group: dist.ProcessGroup | None, world: int, rank: int) -> list[int]:
    """The elementwise maximum of ``words`` (at most :data:`UPDATE_WORDS` int64) over the ranks of ``group``, for
    ``update(..., nonfinite=mode)``: one round trip between each rank and the group's first
    (:func:`bounded_max`, tags :data:`UPDATE_TAG`), bounded by :data:`TIMEOUT_ENV` (else
    :data:`DEFAULT_TIMEOUT_S`): a rank whose wait reaches it raises :class:`CheckpointTimeoutError` naming the
    update and what the other ranks were likely doing, instead of blocking in an all-reduce (or crashing gloo when
    the other ranks' next collective, e.g. a training step's, meets it). On the gloo side group under NCCL."""
    t = timeout_s(None)
    t0 = time.monotonic()
    try:
        return _max_words(words, UPDATE_WORDS, group, t, (UPDATE_TAG, UPDATE_RELEASE_TAG))
    except RuntimeError as e:  # gloo reports a timeout or a vanished peer as RuntimeError (DistError)
        raise _update_timed_out(mode, rank, world, t, time.monotonic() - t0, e) from None


def error_detail(e: BaseException) -> str:
    """The first line of ``e``'s message (at most 300 characters), or its class name: what a timed-out exchange's error
    quotes of gloo's."""
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _update_timed_out(mode: str, rank: int, world: int, t: float, waited: float, e: Exception) -> Exception:
    """The :class:`CheckpointTimeoutError` of an ``update(nonfinite=mode)`` whose other ranks made no exchange."""
    detail = error_detail(e)
    return CheckpointTimeoutError(
        f"functional_ema.update(nonfinite={mode!r}): rank {rank} waited {waited:.1f} s (limit {t:g} s) for the other "
        f"ranks of the shards' process group (world size {world}) to decide with it whether any saw a NaN or inf, "
        f"and they did not ({detail}). With nonfinite= on, update is collective over the group: call it on every "
        "rank, with the same nonfinite=. A rank that called update without nonfinite= makes no exchange, nor does a "
        "rank already in the training step's collectives or in another functional_ema verb. This rank left its EMA "
        f"unchanged. The wait is set by the environment variable {TIMEOUT_ENV} (default {DEFAULT_TIMEOUT_S:g} s). "
        "The process group may be unusable after this"
    )
