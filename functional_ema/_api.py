"""The verbs that take a training object: the same for DeepSpeed, FSDP2 and plain/DDP models.

Each verb asks :func:`functional_ema.engines.adapter_for` for the object's adapter and works on
what it returns (shards, layout, process group); nothing here knows an engine's internals.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ._args import check_bool, check_device, check_int, check_rank
from ._checkpoint.collective import agree_on, layout_record
from ._errors import StateMismatchError, SwappedParametersChangedError, SwappedTrainingError
from ._fit import state_problem
from ._layout import ShardLayout
from ._selection import SelectionLike, make_selection, selection_record
from ._shards import Shards
from ._state import EmaState, finish, marked_swapped
from .engines import Reading, SwapStats, adapter_for
from .engines._base import Adapter, gather_pieces, open_swaps, read_for, refuse_sparse, select
from .engines._base import join_parts as join_parts_of

__all__ = [
    "local_shards",
    "shard_layout",
    "gather_full",
    "swapped",
    "StateMismatchError",
    "SwappedTrainingError",
    "SwappedParametersChangedError",
]


def local_shards(x: Any, *, include: SelectionLike = None, exclude: SelectionLike = None) -> Shards:
    """This rank's pieces of the fp32 weights the optimizer updates, keyed by parameter name.

    Args:
        x: a DeepSpeed engine (ZeRO stages 0-3, fp32/bf16/fp16, CPU offload), a model with torch
            FSDP2 (``fully_shard``) applied, a ``DistributedDataParallel`` model, or a plain
            ``nn.Module``.
        include: which parameters to average: ``None`` (the default) every one read; a shell-style
            pattern (``"unet.*"``), a list of patterns, or a predicate ``(name) -> bool``.
        exclude: parameters to leave out, in the same forms; it wins over ``include``.
            The selection is carried by the returned ``Shards`` into ``init_ema``'s state, its checkpoints
            and exports; unselected parameters stay live under :func:`swapped` and ``copy_to_model``. A
            pattern that matches no name, a predicate that raises or returns a non-``bool``, and a
            selection of nothing are refused here (``TypeError``/``ValueError`` naming the argument). Pass
            the same predicate every step (a function, or a bound method of one object): the selection is
            cached by it (patterns by value), so the same ``Shards`` comes back and ``update`` stays fused.

    Returns:
        A read-only :class:`Shards` ``{name: view}``, no copy, in ``named_parameters()`` order, the
        same names on every rank: DeepSpeed's fp32 master pieces (1-D), FSDP2's local fp32 shards
        (dim-0 rows, the real unpadded length), or the whole trainable parameters of a plain/DDP
        model. A rank that owns none of a parameter gets an empty tensor. Parameters frozen
        (``requires_grad=False``) when ``x`` is first read are left out (they never change: they
        are their own EMA); one frozen later keeps its place, its EMA averaging its now-constant
        value (as DeepSpeed's fp32 masters, fixed at engine init, do), and one unfrozen later is
        read in (then :func:`update` refuses the state that lacks it, naming it). Tied parameters
        appear once, under their first name. ``shard_layout(x).specs[name]`` places each piece in
        the full parameter.

    The reading is kept on ``x`` and re-made only when the weights' memory moves or parameters
    are replaced, added or unfrozen, or a submodule is replaced, renamed or added (docs/core.md, "What is
    averaged"), so calling it every step costs microseconds and returns the
    same object, which :func:`update` recognises with one identity check.

    Example:
        >>> state = fe.init_ema(fe.local_shards(engine))            # doctest: +SKIP
        >>> state = fe.update(state, fe.local_shards(engine), engine.global_steps)  # doctest: +SKIP
    """
    adapter = adapter_for(x)
    reading = adapter.read()
    if not reading.params:  # nothing read: refused where that cannot be legitimate (a plain/DDP module)
        adapter.refuse_empty_reading()
    if include is None and exclude is None:  # every parameter: the reading's own Shards, no extra step
        shards = reading.shards
    else:
        shards = select(reading, make_selection(include, exclude), adapter.module()).shards
    if reading.sparse:  # only where the model has a sparse parameter
        refuse_sparse(reading, shards)
    return shards


def shard_layout(x: Any) -> ShardLayout:
    """Full shape, offset and length of each of this rank's pieces (see :func:`local_shards`)."""
    return adapter_for(x).read().layout


def process_group(x: Any) -> Any:  # a torch ProcessGroup, or None
    """The process group ``x``'s pieces are spread over (``None`` when there is none)."""
    return adapter_for(x).read().group


# ----------------------------------------------------------------------------------- state checks


#: What every rank of a verb that takes a state must hold alike (:func:`state_pieces`).
STATE_FIELDS = ("step", "num_emas", "index", "dtype", "selection", "layout")
# What every rank of a job shares when its parts (tensor-parallel slices, pipeline stages, replicas) hold different
# pieces: STATE_FIELDS but the part-specific layout.
JOB_FIELDS = ("step", "num_emas", "index", "selection")


def state_pieces(
    state: EmaState,
    reading: Reading,
    index: int,
    verb: str,
    call: str = "",
    arguments: Callable[[], object] | None = None,
) -> Mapping[str, torch.Tensor]:
    """``state.emas[index]`` once checked against this rank's layout, on every rank together.

    The check is local (:func:`functional_ema._fit.state_problem`: names, and each piece's length
    against this rank's); its outcome, and this rank's record of what the verb reads (:data:`STATE_FIELDS`:
    the state's step, number of EMAs, the index read, dtype, include/exclude selection, and the layout's world
    size, stage, part and parameter shapes), are agreed in one small all-reduce
    (:func:`~functional_ema._checkpoint.collective.agree_on`).
    So a state cut for another world size or model, or ranks at different steps (one rank skipped an
    update), fail on every rank with :class:`StateMismatchError` naming each rank's value, instead of
    leaving some ranks in a collective or mixing two states. ``call``: the verb's arguments that decide which
    collectives follow (``"dst=0"``), agreed with it (ranks that differ raise naming each rank's call).
    ``arguments``: the verb's checks of those arguments, run inside the agreement, so a rank passing a bad one
    raises its own error (``ValueError``) and the others :class:`StateMismatchError` naming its call, at once,
    instead of waiting for it until the timeout.
    """
    layout = reading.layout
    refused: list[Exception] = []  # this rank's argument error, raised in place of the ranks' disagreement

    def checked_arguments() -> None:
        try:
            if arguments is not None:
                arguments()
        except Exception as error:
            refused.append(error)
            raise

    def check() -> dict[str, Any]:
        checked_arguments()
        checked_index(index, state, in_range=True)  # ValueError here; StateMismatchError on the other ranks
        problem = state_problem(state, layout.specs, layout.rank, indices=(index,), shards=reading.shards)
        if problem:
            raise problem.error(
                StateMismatchError,
                f"{verb} on rank {layout.rank}",
                "Make the state with init_ema(local_shards(model)), or with fe.load(model, dir), which "
                "reshards a saved state",
            )
        return state_record(state, index, layout)

    def job_check() -> dict[str, Any]:
        checked_arguments()
        return _job_record(state, index, layout)

    def agree(fn: Callable[[], dict[str, Any]], fields: tuple[str, ...], where: tuple[Any, int, int]) -> None:
        fix = (
            "Every rank must hold the same EMA state (the same step: update every rank alike, or load every rank "
            "from one checkpoint) and pass the same index"
        )
        try:
            agree_on(
                verb, fn, fields, *where, fallback=StateMismatchError, mismatch=StateMismatchError, fix=fix, call=call
            )
        except StateMismatchError:
            if refused:  # a bad argument makes this rank's call differ: its own error says what is wrong
                raise refused[0] from None
            raise

    if layout.job_ranks > layout.world_size and dist.is_initialized() and dist.get_world_size() == layout.job_ranks:
        # Tensor-parallel slices, pipeline stages or HSDP replicas: the data-parallel group below is not the whole
        # model. Every rank of the job agrees first on what they share (the part-specific layout differs), so a state
        # one update ahead on another part, or a part that did not call the verb, fails here on every rank instead of
        # joining two EMAs' slices or waiting in the parts' collective without bound. Only where the model's mesh is
        # the whole job (WORLD), as save and load require; a mesh over some of the ranks agrees per group, as before.
        agree(job_check, JOB_FIELDS, (dist.group.WORLD, dist.get_world_size(), dist.get_rank()))
    agree(check, STATE_FIELDS, (reading.group, layout.world_size, layout.rank))
    return state.emas[index]


def _job_record(state: EmaState, index: int, layout: ShardLayout) -> dict[str, Any]:
    checked_index(index, state, in_range=True)  # ValueError here; StateMismatchError on the other ranks
    # JOB_FIELDS only: the dtype and the layout's digest of every shape are compared within each group, by check()
    record = {"step": int(state.step), "num_emas": state.num_emas, "index": index}
    return {**record, "selection": selection_record(state.emas[index])}


def carried(errors: list[Exception], check: Callable[[], Any], placeholder: Any) -> Any:
    """``check()``'s value; where it raises ``TypeError``/``ValueError``, ``placeholder``, the error appended to
    ``errors``: a verb raises it inside its ranks' agreement (:func:`state_pieces`' ``arguments``), so the other ranks
    fail at once naming this rank's call instead of waiting for it until the timeout."""
    try:
        return check()
    except (TypeError, ValueError) as error:
        errors.append(error)
        return placeholder


def raise_first(errors: list[Exception]) -> None:
    """Raise the first error :func:`carried` kept, if any (a verb's ``arguments`` check in :func:`state_pieces`)."""
    if errors:
        raise errors[0]


def checked_index(index: Any, state: Any, *, in_range: bool = False, of: str = "the state") -> int:
    """``index`` as an int (``TypeError``/``ValueError`` naming it and how many EMAs ``of`` holds), and with
    ``in_range`` one of them (``ValueError``). ``swapped``/``gather_full`` check the type at the call and the range in
    :func:`state_pieces`, whose outcome every rank agrees on (a state with fewer EMAs on one rank fails every rank)."""
    emas = getattr(state, "emas", None)
    count = len(emas) if isinstance(emas, tuple) else None
    held = f"{of} holds {count} EMA(s), index 0 to {count - 1}" if count else f"it picks {of}'s EMA (state.emas[index])"
    try:
        index = check_int(index, "index")
    except (TypeError, ValueError) as error:
        raise type(error)(f"{error}: {held}") from None
    if in_range and count is not None and index >= count:
        raise ValueError(f"index={index} is not one of the EMAs: {held}")
    return index


def state_record(state: EmaState, index: int, layout: ShardLayout) -> dict[str, Any]:
    """This rank's :data:`STATE_FIELDS`: the same on every rank of one model's group."""
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.emas[index].values()})
    return {
        "step": int(state.step),
        "num_emas": state.num_emas,
        # which EMA the verb reads: ranks passing other ones would join (or swap in) halves of two EMAs
        "index": index,
        "dtype": "/".join(dtypes) or "none",
        # the include/exclude it averages (None: every parameter): named when the ranks' selections differ
        "selection": selection_record(state.emas[index]),
        "layout": layout_record(layout),
    }


# ------------------------------------------------------------------------------------ gather_full


def gather_full(
    state: EmaState,
    x: Any,
    *,
    index: int = 0,
    dst: int | None = None,
    device: torch.device | str | None = None,
    bucket_bytes: int = 256 << 20,
    join_parts: bool = False,
) -> dict[str, torch.Tensor]:
    """Full-shape EMA weights from every rank's pieces. A collective: call it on all ranks.

    Each tensor has the shape the model's parameter reports. So with DTensor parameters (FSDP2 over
    tensor parallelism, tensor parallelism alone, HSDP over it) the tensor-parallel slices are joined:
    the global shape, which ``model.load_state_dict`` takes back (``torch.distributed.checkpoint`` or
    ``distribute_tensor`` re-cut it). DeepSpeed's model-parallel parameters (tensor parallelism by
    ``mpu`` or AutoTP, pipeline stages: ``shard_layout(x).part``) are plain per-rank tensors reporting
    the slice's shape, so there the result is this rank's part, whole over its data-parallel group (its
    slices, its stage's parameters), which is what this rank's module loads. ``join_parts=True`` returns
    the whole model's tensors in both cases, every part's joined (stages merged, slices concatenated
    along their recorded split), a collective over every rank of the job.

    Args:
        state: this rank's state (from :func:`functional_ema.init_ema` over ``local_shards(x)``).
        x: the engine or model the shards came from (see :func:`local_shards`).
        index: which tracked EMA (``state.emas[index]``).
        dst: ``None`` returns the full weights on every rank; a rank number (of the data-parallel
            group) returns them on that rank only (the others get ``{}``), which saves memory on the
            others. Under HSDP the data-parallel group is a shard group (``shard_layout(x).rank``), and
            ``dst`` is that rank of replica 0 (the shard group on the row of the ``(replicate, shard)`` mesh that
            holds its lowest rank, so ``dst=0`` is that rank: global rank 0 on a mesh over the whole job; on a 2-D
            ``init_device_mesh``, global rank ``dst``): the other replicas hold the same EMA and skip the gather. With DTensor tensor parallelism, every tensor-parallel rank at that data-parallel
            rank gets them (the join is a collective over its tensor-parallel group).
        device: where the result goes (default: the EMA's device).
        bucket_bytes: pieces are exchanged in buckets of about this size per rank, so the
            transient memory is ``world_size * bucket_bytes`` plus the result; a piece larger than
            ``bucket_bytes`` is sent whole, in a bucket of its own (the bound is then ``world_size`` times
            the largest piece).
        join_parts: join the model-parallel parts into the whole model (see above; ``dst`` is then a
            rank of the job, and every part's tensors pass through CPU memory there).

    Returns:
        ``{name: tensor of the parameter's full shape}``, dtype of the EMA, names as in
        ``named_parameters()``; load it with ``model.load_state_dict(full, strict=False)``.

    Raises:
        StateMismatchError: on every rank, when the state does not fit ``x`` on some rank, or the ranks pass other
            ``dst``, ``join_parts`` or ``bucket_bytes`` (they decide the collectives: each rank's call is named).
        TypeError, ValueError: ``index`` not one of the state's EMAs (naming it and their number), ``dst`` not
            ``None`` or a rank of the group (of the job when joining parts), ``bucket_bytes`` not a positive int,
            ``join_parts`` not a bool; raised before any data moves. Where only some ranks pass a bad ``index``
            (its type or range), ``dst``, ``bucket_bytes``, ``device`` or ``join_parts``, those raise it and the
            others :class:`StateMismatchError` naming them, at once. Ranks passing different ``index`` raise
            :class:`StateMismatchError` naming each rank's (they would join halves of two EMAs).
    """
    # A bad join_parts or index is raised inside the ranks' agreement (below), so the other ranks learn of it at once
    errors: list[Exception] = []
    join_parts = carried(errors, lambda: check_bool(join_parts, "join_parts"), False)
    index = carried(errors, lambda: checked_index(index, state), 0)  # its range: checked by state_pieces
    adapter = adapter_for(x)
    reading = read_for(adapter, state)  # the state's selection: the parameters it averages
    joining = join_parts and not reading.layout.part.whole
    # dst: a rank of the job when joining parts, else of the data-parallel group
    ranks = dist.get_world_size() if joining and dist.is_initialized() else reading.layout.world_size

    def arguments() -> tuple[int | None, int, torch.device | None]:
        raise_first(errors)
        ranked = None if dst is None else check_rank(dst, "dst", ranks)
        return ranked, check_int(bucket_bytes, "bucket_bytes", minimum=1), check_device(device, "device")

    # dst, joining and the buckets decide the collectives that follow (an all_gather meeting a gather would block
    # both ranks): agreed with the state, so ranks that pass other ones fail at once, naming each rank's call; and
    # checked inside that agreement, so a bad one on one rank fails the others at once too, not at the timeout
    call = _gather_call(dst, joining, bucket_bytes)
    pieces = state_pieces(state, reading, index, "gather_full", call, arguments)
    dst, bucket_bytes, device = arguments()  # valid on every rank by now: only their values
    if dst is not None and not joining and reading.layout.replica != 0:
        # HSDP: every replica holds replica 0's EMA, so only replica 0's shard group gathers it (onto its rank dst);
        # a shard group is one replica (a row of the mesh), so all of a group's ranks skip its collectives together
        return {}
    if joining:
        part = gather_pieces(reading, pieces, device="cpu", bucket_bytes=bucket_bytes)
        return join_parts_of(reading, part, dst=dst, device=device)
    if adapter.joins_slices(reading):  # DTensor parameters: the global shape they report
        part = gather_pieces(reading, pieces, dst=dst, bucket_bytes=bucket_bytes)
        return adapter.join_slices(reading, part, device)
    return gather_pieces(reading, pieces, dst=dst, device=device, bucket_bytes=bucket_bytes)


def _gather_call(dst: int | None, joining: bool, bucket_bytes: int) -> str:
    """The arguments of a :func:`gather_full` call that decide its collectives, those not at their defaults."""
    shown = [f"dst={dst}"] if dst is not None else []
    shown += ["join_parts=True"] if joining else []
    shown += [f"bucket_bytes={bucket_bytes}"] if bucket_bytes != 256 << 20 else []
    return ", ".join(shown)


# ----------------------------------------------------------------------------------- eval swap


@contextlib.contextmanager
def swapped(x: Any, state: EmaState, *, index: int = 0) -> Iterator[SwapStats]:
    """Run the model's ordinary forward with EMA weights; the live weights come back on exit.

    Inside the block ``x(inputs)`` computes with ``state.emas[index]`` cast to the parameters'
    dtype, exactly as a plain model loaded with those weights would. Restored on exit, also when
    the body raises; the trained weights and the optimizer state are untouched, so training after
    the block continues bitwise as if it never ran. Call it on every rank.

    Training inside the block is refused (:class:`SwappedTrainingError`, before anything changes):
    a backward through a forward made inside it (the model's, or any submodule's: also a loss the
    forward stored on a module), ``engine.backward``/``engine.step`` of a DeepSpeed engine, and
    ``step()`` of any ``torch.optim`` optimizer over these parameters. A backward through a loss
    built from the parameters without any forward (``model.weight.sum()``) is not refused, though
    the step that would apply it is. So is :func:`update` of ``state`` itself, whatever weights it is given
    (``local_shards(x)``, a dict of the model's parameters, also one read before the block: the parameters hold
    this EMA here, so it would be averaged into itself while its step advanced), and of ``Shards`` read from
    the model into any state. Use the block for evaluation and sampling, under ``torch.no_grad()``.

    How, per engine:
        * DeepSpeed ZeRO-3: each parameter's local partition (``ds_tensor``) is replaced by the EMA
          piece cast to the partition dtype; DeepSpeed's gathered-parameter cache is emptied on
          entry and exit. Extra memory: one copy of the local partition, never the full model.
        * DeepSpeed ZeRO-0/1/2: the parameters' ``.data`` point at the full EMA (gathered once).
        * FSDP2: the EMA pieces are copied into the local shards (the live ones kept aside) and the
          model is resharded on entry and exit, so the forward all-gathers the EMA and no EMA
          weights stay unsharded afterwards. Extra memory: one copy of the local shards.
        * plain / DDP: the EMA is copied into the parameters, the live values kept aside.
    Frozen parameters keep their live weights, which never change: they are their own EMA; so do the
    parameters a selection left out (``local_shards(x, include=..., exclude=...)``), which are trained.

    Whatever the block does to the parameters, the model does not keep the EMA: a block that re-types
    (``model.to(dtype)``), re-creates or re-assigns them (``load_state_dict(..., assign=True)``, a new
    ``nn.Parameter`` set on a module), or replaces a submodule holding them (``model[2] = copy.deepcopy(model[2])``),
    has them put back on exit (plain, DDP, DeepSpeed: the objects, submodules and memory they had on entry; FSDP2:
    its own sharded parameters, cast back to their dtype), the trained values copied into them bitwise, and then :class:`SwappedParametersChangedError` names what it had changed (on an
    exception from the block, that exception, with a note). Re-typed or replaced buffers are put back too; values
    a forward writes into them in place (BatchNorm statistics in training mode) stay, and so do buffers the block
    registers (a cache a first forward makes).

    Raises:
        TypeError, ValueError: ``index`` not one of the state's EMAs (naming it and their number), before anything
            changes; where only some ranks pass a bad one, those raise it and the others :class:`StateMismatchError`
            naming them, at once.
        StateMismatchError: on every rank, when the state does not fit ``x`` on some rank, or the ranks pass other
            ``index`` (naming each rank's: the forward would run with halves of two EMAs).

    Yields:
        :class:`SwapStats` with the number of swapped parameters and the temporary bytes held.

    Example:
        >>> with fe.swapped(engine, state), torch.no_grad():   # doctest: +SKIP
        ...     val_loss = loss_fn(engine(x_val), y_val)
    """
    errors: list[Exception] = []  # a bad index is raised inside the ranks' agreement: the others learn of it at once
    index = carried(errors, lambda: checked_index(index, state), 0)  # its range: checked by state_pieces
    adapter = adapter_for(x)
    reading = read_for(adapter, state)  # a selection's state swaps its parameters; the others stay live
    pieces = state_pieces(state, reading, index, "swapped", arguments=lambda: raise_first(errors))
    where = f"fe.swapped(...) on rank {reading.layout.rank}"
    with (
        marked_swapped(state),  # update(state, ...) is refused in the block, whatever weights it is given
        changes_reported(where) as changes,  # what the block replaced or re-typed, put back by the adapter on exit
        training_refused(adapter, reading, outer=x),
        updates_refused(adapter.module()),
        adapter.swap(reading, pieces, state, index, changes) as stats,
    ):
        yield stats


@contextlib.contextmanager
def updates_refused(module: torch.nn.Module) -> Iterator[None]:
    """Count a ``swapped`` block into ``module``'s counter of open blocks (``open_swaps``: shared by every reading of
    the module, through any wrapper, and their selections, also ones made inside the block) for the block's duration:
    ``update`` refuses those ``Shards`` while it is open. Inside it a plain, DDP or FSDP2 model's parameters (and a
    ZeRO-0 fp32 engine's, its masters) hold the EMA, so an update would average the EMA into itself while its step
    advanced (elsewhere on DeepSpeed, whose fp32 masters stay live, the same call is refused too: one rule)."""
    counter = open_swaps(module)
    counter.count += 1
    try:
        yield
    finally:
        counter.count -= 1


@contextlib.contextmanager
def changes_reported(where: str) -> Iterator[list[str]]:
    """Yield a list that the block's put-back (``parameters_put_back``) fills with what it put back; on exit raise
    :class:`SwappedParametersChangedError` naming each (after an exception from the block: that one, with a note)."""
    changes: list[str] = []
    try:
        yield changes
    except BaseException as error:
        if changes and sys.version_info >= (3, 11):  # BaseException.add_note is 3.11+ (3.10: the error unchanged)
            error.add_note(
                f"{where} restored the trained values and put back what the block had changed; the block {_changed(changes)}"
            )
        raise
    if changes:
        raise SwappedParametersChangedError(
            f"the block of {where} {_changed(changes)}; the live (trained) values are back in the model's parameters and "
            "buffers (dtype, device and objects as on entry where the engine allows; see the list). Change the "
            "model outside the block (model.to(dtype), load_state_dict(..., assign=True), new nn.Parameter objects, "
            "replaced submodules); inside it, evaluate under torch.no_grad() or torch.autocast"
        )


def _changed(changes: list[str]) -> str:
    shown = "; ".join(changes[:20]) + (f"; and {len(changes) - 20} more" if len(changes) > 20 else "")
    return f"made {len(changes)} change(s) to the submodules, parameters or buffers: {shown}"


_SWAPPED_WHY = (
    "inside fe.swapped(...) the model computes with EMA weights, which are for evaluation; a gradient or "
    "optimizer step taken there would train the EMA copy (or be thrown away) while the optimizer state and "
    "step counter advance. Leave the block before training"
)


@contextlib.contextmanager
def training_refused(
    adapter: Adapter, reading: Reading, why: str = _SWAPPED_WHY, *, outer: Any = None
) -> Iterator[None]:
    """Refuse backward and optimizer steps (:class:`SwappedTrainingError`, the message ending with ``why``) while
    EMA weights are swapped in, or while the model must not train for another reason.

    A backward is refused through the output of any forward made meanwhile by the model or any of its submodules
    (forward hooks on each for the block's duration): so also a submodule called alone, or a loss the forward
    stored on the module (``self.aux = ...``), as long as it was computed from some submodule's output. A loss
    built from parameters without any forward (``model.weight.sum()``) is not refused here; the optimizer step
    that would apply its gradient is. ``outer``: the object the user passed, when it wraps the adapter's
    (``torch.compile``'s wrapper), hooked too."""
    params = {id(p) for p in reading.params.values()}

    def on_step(optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        if any(id(p) in params for g in optimizer.param_groups for p in g["params"]):
            raise SwappedTrainingError(f"optimizer.step() {why}")

    with _backward_refused(adapter, why, outer):
        hooks: list[Any] = []
        steps = ((_remove, hooks),)  # made before anything is registered: the finally below calls nothing first
        try:
            hooks.append(register_optimizer_step_pre_hook(on_step))
            with adapter.refuse_training(why):
                yield
        finally:
            try:  # every hook removed, also when an exception (Ctrl-C) lands in the middle (a hook left behind
                finish(*steps)  # would refuse every later optimizer step)
            except BaseException:  # one that landed before finish began: every removal again, then raised
                finish(*steps)
                raise


# Why input gradients are refused too, and what to do instead (a review of letting backwards that write no .grad
# through found parameter gradients written on paths the hooks cannot see: a single-root backward, a reentrant
# checkpoint, DeepSpeed's own backward on the engine's output).
_INPUT_GRADIENTS = (
    "Gradients for inputs only (torch.autograd.grad(out, x), out.backward(inputs=[x])) are refused as well: the "
    "block cannot tell every such backward from training on every engine. Take them outside the block from the "
    "EMA's full weights: torch.func.functional_call(model, fe.gather_full(state, model), (x,)) on a plain or DDP "
    "module, or a copy of the model holding them"
)


@contextlib.contextmanager
def _backward_refused(adapter: Adapter, why: str, outer: Any = None) -> Iterator[None]:
    """Forward hooks on the adapter's module, each of its submodules and the engine wrapping them, for the block's
    duration: each output that requires grad gets a gradient hook refusing the backward. A hook set on a leaf
    tensor (a forward returning a parameter) would outlive the graph: it is set once and removed on exit."""
    module = adapter.module()
    target = adapter.target
    leaves: dict[int, Any] = {}

    def refuse_backward(_grad: torch.Tensor) -> NoReturn:
        raise SwappedTrainingError(f"backward through a forward made {why}. {_INPUT_GRADIENTS}")

    def on_output(_mod: torch.nn.Module, inputs: Any, output: Any) -> Any:
        # The output's gradient hook runs before any parameter gradient of that forward in the backward, so a
        # refused backward leaves every .grad as it was. An input passed through as it is (Dropout in eval mode,
        # Identity) is no product of the forward: it may come from outside the block, and keeps no hook.
        if torch.is_grad_enabled():
            made = [t for t in _tensors(output) if t.requires_grad and id(t) not in leaves]
            passed = {id(t) for t in _tensors(inputs)} if made else set()
            for t in made:
                if id(t) not in passed:
                    handle = t.register_hook(refuse_backward)
                    if t.grad_fn is None:
                        leaves[id(t)] = handle
                        handles.append(handle)
        return output

    modules = list(module.modules())
    if target is not module and isinstance(target, torch.nn.Module):  # an engine wrapping the module
        modules.append(target)
    # torch.compile's wrapper: a compiled forward does not run hooks added to the modules inside after it was
    # compiled (dynamo traced them without), but the wrapper's own __call__ runs its hooks, outside the graph.
    if isinstance(outer, torch.nn.Module) and all(outer is not m for m in modules):
        modules.append(outer)
    handles: list[Any] = []  # the forward hooks and the leaves' gradient hooks, removed on exit
    steps = ((_remove, handles),)  # made before the block: the finally below calls nothing before its try
    try:
        handles.extend(m.register_forward_hook(on_output) for m in modules)
        yield
    finally:
        try:  # every hook removed, also when an exception (Ctrl-C) lands in the middle: one left behind would
            finish(*steps)  # refuse every later training backward
        except BaseException:  # one that landed before finish began: every removal again, then raised
            finish(*steps)
            raise


def _remove(handle: Any) -> None:
    handle.remove()  # RemovableHandle.remove may be called again: finish may repeat it


def _tensors(output: Any) -> list[torch.Tensor]:
    import optree

    return [t for t in optree.tree_leaves(output, none_is_leaf=False) if isinstance(t, torch.Tensor)]
