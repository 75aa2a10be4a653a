"""diffusers: ``EMAModel`` with the API of ``diffusers.training_utils.EMAModel`` (diffusers 0.42), over
this library's fp32 EMA of each rank's own shards.

A diffusers training script (``train_text_to_image.py --use_ema`` and its siblings) switches by
changing one import::

    from functional_ema.integrations.diffusers import EMAModel   # was: from diffusers.training_utils import EMAModel

    ema_unet = EMAModel(ema_unet.parameters(), model_cls=UNet2DConditionModel, model_config=ema_unet.config)
    unet, optimizer, ... = accelerator.prepare(unet, optimizer, ...)
    ...
    if accelerator.sync_gradients:
        ema_unet.step(unet.parameters())        # unet: a DeepSpeed engine, an FSDP2 or DDP model, or the module

What differs from diffusers' class, and why:

* The EMA is :func:`functional_ema.update` over :func:`functional_ema.local_shards` of the model that
  is trained (found at the first :meth:`EMAModel.step` from the parameters it is given): fp32, taken from
  the fp32 masters (DeepSpeed's partitions, FSDP2's local shards, the parameters of a DDP or plain
  model), ``1 / world_size`` of the model per rank under ZeRO or FSDP2, and no communication per step.
  diffusers keeps a full copy on every rank and gathers every ZeRO-3 parameter at every step.
* The parameters given to the constructor (a separate copy of the model) are the EMA's starting
  values, as in diffusers. They are held by reference until they count (the first step's decay is 0 with
  ``optimization_step`` 0, so usually never: no full copy), and copied while still the values given:
  when ``optimization_step`` is set by hand, when read. Changed in place before that (an optimizer step, a
  load), they are refused where they count, naming the fix (see ``EMAModel._starting_values``).
* Some of one model's parameters (``[p for p in model.parameters() if p.requires_grad]``) are averaged
  by position as in diffusers; parameters of two models in one list are refused (one EMAModel per model).
* Under ZeRO-1/2/3 and FSDP2 the methods that need the whole EMA are collective: ``save_pretrained``
  (rank 0 writes), ``state_dict`` (a full fp32 copy on every rank), ``store`` / ``copy_to`` / ``restore``
  on the trained model (the EMA is swapped in with :func:`functional_ema.swapped`: under ZeRO-3 the
  forward gathers the EMA, and the trained weights, the fp32 masters and the optimizer state are
  untouched, so training after ``restore`` continues bitwise). Call them on every rank; a call on one
  rank alone fails after the library's timeout (``FUNCTIONAL_EMA_TIMEOUT``) naming this, and ranks in two
  different calls (``state_dict`` on one, ``save_pretrained`` on another) fail at once naming each.
* ``shadow_params`` under sharding is refused (each rank holds only its pieces): ``state_dict()``
  gathers them, ``save_pretrained`` writes them, :attr:`EMAModel.state` is this rank's state.
* Training between ``store`` and ``restore`` of the trained model is refused: diffusers' ``restore`` undoes
  it, and this one keeps no copy to undo it with. A parameter frozen at the first step and trained later
  joins the EMA from its current value (diffusers: from its value at the step before), with a warning.
* Arguments are checked where they enter (``TypeError`` / ``ValueError`` naming the argument);
  unknown keyword arguments are refused instead of ignored; ``update_after_step < 0`` is refused; the
  EMA stays fp32 (``to(dtype=...)`` with another dtype is refused).

The decay is diffusers' rule, bitwise (:meth:`EMAModel.get_decay`); the average differs from diffusers'
``s -= (1 - d) * (s - p)`` by fp32 rounding only (one ``lerp_``).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import inspect
import json
import os
import re
import types
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import diffusers  # noqa: F401 - the framework this module glues to
import torch

import functional_ema as fe
from functional_ema._api import state_pieces, training_refused
from functional_ema._args import check_bool, check_device, check_int, check_mapping, check_path, check_real
from functional_ema._checkpoint.collective import Job, agree_on, check_reachable, job_of
from functional_ema._checkpoint.errors import ForeignFileError
from functional_ema._export.foreign import read_json_object
from functional_ema._export.outdir import _alive
from functional_ema._io import atomic_write_bytes, fsync_dir
from functional_ema._selection import Selection, SelectionLike, make_selection
from functional_ema.engines import Reading, adapter_for, refuse_engine_internals, unwrap_compiled
from functional_ema.engines._base import read_for, select, unread_names
from functional_ema.engines.deepspeed import is_deepspeed_engine
from functional_ema.engines.module import is_ddp

from ._common import grown_state

__all__ = ["EMAModel"]

#: The EMA's settings, in the order diffusers' ``state_dict`` lists them (also the config fields
#: ``save_pretrained`` writes).
FIELDS = ("decay", "min_decay", "optimization_step", "update_after_step", "use_ema_warmup", "inv_gamma", "power")
_DEPRECATED = ("max_value", "min_value", "device")
#: The key in ``state_dict()`` of the include/exclude the EMA was made with: ``Selection.record()`` (as a
#: checkpoint's manifest records it) and ``mask``, one character per position (diffusers' values are by position):
#: ``"1"`` averaged, ``"0"`` left out by the selection, ``"."`` not read (frozen: the selection was not asked about
#: it). Only for an EMA with a selection, once its positions are known (its first step), so that a load with another
#: one is refused; diffusers' ``EMAModel.load_state_dict`` ignores keys it does not know.
SELECTION_KEY = "ema_selection"
#: The file ``save_pretrained`` writes that record to, beside the model's: the config stays diffusers' own (an
#: entry there would be kept in ``model.config`` by ``from_config``, re-saved by diffusers' EMA as if it were its
#: own, and logged as an unexpected config attribute by every ``from_pretrained`` of the folder).
SELECTION_FILE = "ema_selection.json"
#: What ``save_pretrained`` puts in ``SELECTION_FILE`` while it replaces weights whose record changes (see
#: ``_save_with_record``): the weights may be partly another EMA's than any record describes, so every load refuses it
#: until a save completes. Its one key (``_INCOMPLETE_KEY``) tells it from a record.
_INCOMPLETE_KEY = "incomplete"
_INCOMPLETE = types.MappingProxyType(
    {_INCOMPLETE_KEY: "EMAModel.save_pretrained into this folder did not finish: save again"}
)  # read-only: a constant, not state
_MASK = frozenset("10.")
_PARAMETERS_CODE = torch.nn.Module.parameters.__code__
_STORED_WHY = (
    "between EMAModel.store(parameters) and restore(parameters) of the trained model: store() keeps no copy "
    "of its weights (restore() leaves them as they are then), so training there would not be undone by "
    "restore() as diffusers' EMAModel undoes it. Call restore(parameters) first"
)


# ------------------------------------------------------------------------------------------ argument checks


def _check_fields(values: Mapping[str, Any], name: Any) -> dict[str, Any]:
    """The EMA settings, each checked (``name(field)`` is how a message names it): decays in [0, 1] with
    ``min_decay <= decay``, steps ints >= 0, ``inv_gamma`` and ``power`` finite and > 0 (as
    :func:`functional_ema.schedules.warmup` takes them), ``use_ema_warmup`` a bool."""
    out: dict[str, Any] = {}
    for f in ("decay", "min_decay"):
        out[f] = check_real(values[f], name(f), low=0.0, high=1.0)
    if out["min_decay"] > out["decay"]:
        raise ValueError(
            f"{name('min_decay')}={out['min_decay']} is larger than {name('decay')}={out['decay']}: the decay is "
            "clamped to [min_decay, decay]"
        )
    for f in ("optimization_step", "update_after_step"):
        out[f] = check_int(values[f], name(f))
    out["use_ema_warmup"] = check_bool(values["use_ema_warmup"], name("use_ema_warmup"))
    for f in ("inv_gamma", "power"):
        out[f] = check_real(values[f], name(f), low=0.0, low_open=True)
    return out


def _constructor_settings(parameters: Any, kwargs: dict[str, Any], **values: Any) -> dict[str, Any]:
    """The constructor's settings with diffusers' deprecated spellings applied (``max_value`` for ``decay``,
    ``min_value`` for ``min_decay``, each with its warning; a module as ``parameters`` turns the warm-up on),
    checked; any keyword diffusers does not know is refused rather than ignored."""
    unknown = sorted(set(kwargs) - set(_DEPRECATED))
    if unknown:
        raise TypeError(
            f"EMAModel got unexpected keyword argument(s) {unknown}; besides diffusers' arguments it accepts the "
            f"deprecated {list(_DEPRECATED)}"
        )
    if isinstance(parameters, torch.nn.Module):
        values["use_ema_warmup"] = True  # diffusers: a module passed turns the warm-up on (backwards compatibility)
    names = {"decay": "decay", "min_decay": "min_decay"}
    for old, new in (("max_value", "decay"), ("min_value", "min_decay")):
        if kwargs.get(old) is not None:
            warnings.warn(
                f"The `{old}` argument is deprecated. Please use `{new}` instead.", FutureWarning, stacklevel=3
            )
            values[new], names[new] = kwargs[old], old
    return _check_fields(values, lambda f: names.get(f, f))


def _check_model_cls(model_cls: Any, what: str, needs: tuple[str, ...]) -> Any:
    if model_cls is None:
        return None
    missing = [m for m in needs if not callable(getattr(model_cls, m, None))]
    if not inspect.isclass(model_cls) or missing:
        raise TypeError(
            f"{what} must be a diffusers model class (e.g. UNet2DConditionModel, with {', '.join(needs)}), got "
            f"{type(model_cls).__name__} {model_cls!r:.60}"
        )
    return model_cls


def _check_dtype(dtype: Any) -> None:
    """The EMA is fp32: ``None`` or ``torch.float32`` only."""
    if dtype is None or dtype is torch.float32:
        return
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or None, got {type(dtype).__name__} {dtype!r:.60}")
    raise ValueError(
        f"dtype={dtype}: this EMA stays fp32 (a 16-bit EMA stalls: the update falls below its resolution); cast "
        "when loading the saved folder instead, e.g. model_cls.from_pretrained(path, torch_dtype=...)"
    )


def _take(parameters: Any, what: str) -> tuple[list[torch.Tensor], Any]:
    """``parameters`` (an iterable of parameters, e.g. ``model.parameters()``; a module, deprecated in
    diffusers) as a list of floating tensors, and the module it came from when that is known without a
    search: the module itself, or the ``self`` of an unstarted ``module.parameters()`` generator."""
    hint: Any = None
    if isinstance(parameters, torch.nn.Module):
        warnings.warn(
            f"passing a torch.nn.Module as {what} is deprecated in diffusers: pass model.parameters()",
            FutureWarning,
            stacklevel=3,
        )
        hint, parameters = parameters, parameters.parameters()
    elif (
        inspect.isgenerator(parameters)
        and parameters.gi_code is _PARAMETERS_CODE
        and inspect.getgeneratorstate(parameters) == inspect.GEN_CREATED
        and parameters.gi_frame is not None
    ):
        local = parameters.gi_frame.f_locals  # the unstarted generator's arguments: (self, recurse)
        hint = local.get("self") if local.get("recurse", True) is True else None
    if isinstance(parameters, (torch.Tensor, str, bytes, Mapping)) or not isinstance(parameters, Iterable):
        raise TypeError(
            f"{what} must be an iterable of parameters (e.g. model.parameters()), got {type(parameters).__name__} "
            f"{parameters!r:.60}"
        )
    items = list(parameters)
    if not items:
        raise ValueError(f"{what} is empty: pass the model's parameters (model.parameters())")
    for i, p in enumerate(items):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{what}[{i}] must be a tensor (a parameter), got {type(p).__name__} {p!r:.60}")
        if not p.is_floating_point():
            raise TypeError(f"{what}[{i}] has dtype {p.dtype}; an EMA averages floating-point weights")
        if p.is_meta:
            raise ValueError(f"{what}[{i}] is on the meta device: it holds no values to start the EMA from")
    return items, hint


def _sharded(p: torch.Tensor) -> bool:
    """A parameter whose values another engine partitions: ZeRO-3 (``ds_id``), ZeRO-1/2 (``_hp_mapping``),
    a DTensor (FSDP2, tensor parallelism)."""
    if hasattr(p, "ds_id") or hasattr(p, "_hp_mapping"):
        return True
    from torch.distributed.tensor import DTensor

    return isinstance(p, DTensor)


def _full_shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


class _Among:
    """The selection predicate of an EMA over some of a model's parameters (diffusers' ``EMAModel(list)``): the
    names given (by position), and of those what the user's ``include=`` / ``exclude=`` pick. Compared by value,
    so the library's per-selection cache hits at every step."""

    def __init__(self, names: Iterable[str], user: Selection | None) -> None:
        self.names, self.user = frozenset(names), user

    def __call__(self, name: str) -> bool:
        if name not in self.names:
            return False
        return self.user is None or self.user.picks(name)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Among) and (self.names, self.user) == (other.names, other.user)

    def __hash__(self) -> int:
        return hash((self.names, self.user))


def _check_among(reading: Reading, module: torch.nn.Module, user: Selection, subset: list[str], verb: str) -> None:
    """Check the user's selection as ``local_shards`` checks it (each pattern against the model's names, frozen
    ones included; predicates on every name read; not everything left out), with its own messages, before it is
    folded into an ``_Among`` (whose messages would name the fold); then refuse one that leaves none of the
    parameters given."""
    names = list(reading.layout.specs)
    picked = set(user.apply(names, lambda: unread_names(module, reading.layout.specs)))
    if not any(n in picked for n in subset):
        raise ValueError(
            f"EMAModel.{verb}: the selection ({user.describe()}) leaves none of the {len(subset)} parameters given "
            f"(e.g. {', '.join(map(repr, subset[:4]))}): nothing would be averaged. Widen include or narrow "
            "exclude, or pass the parameters it selects"
        )


# ------------------------------------------------------------------------------------------- the owner


def _training_object(m: Any) -> Any:
    """What the library's verbs take for module ``m``: a DeepSpeed engine as it is, the module inside DDP
    (its EMA is replicated: every rank averages its own copy, with no collective, as diffusers does), an
    FSDP2 root or plain module; ``None`` for a module an engine manages from outside (ZeRO's
    ``engine.module``, a submodule of an FSDP2 model). torch.compile's wrappers are taken off first, as
    ``adapter_for`` does: ``torch.compile(DDP(m))`` (Accelerate's order) is DDP, so its EMA stays replicated and
    rank-local rather than becoming a two-rank job that a rank-0-only ``state_dict`` would wait on."""
    m = unwrap_compiled(m)
    if is_deepspeed_engine(m):
        return m
    if is_ddp(m):
        m = unwrap_compiled(m.module)
    if not isinstance(m, torch.nn.Module):
        return None
    try:
        refuse_engine_internals(m)
    except TypeError:
        return None
    return m


def _search_heap(params: list[torch.Tensor], verb: str) -> Any:
    """The training object whose module holds ``params`` (identity): the lowest module whose ``parameters()``
    include them all (all of its parameters, or some: diffusers' ``EMAModel([p for p in model.parameters() if
    p.requires_grad])``), found among the modules alive in this process, then lifted to what trains it (see
    ``_lift``). One pass over the heap (a fraction of a second), once per EMA."""
    # type(), not isinstance(): isinstance reads an object's __class__, and some objects on the heap warn when read
    # (torch.distributed.reduce_op: a FutureWarning in the user's training log).
    mods = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    ids = {id(p) for p in params}
    parents: dict[int, list[torch.nn.Module]] = {}
    holders: dict[int, list[torch.nn.Module]] = {}
    for m in mods:
        for c in m._modules.values():
            if c is not None:
                parents.setdefault(id(c), []).append(m)
        for v in m._parameters.values():
            if v is not None and id(v) in ids:
                holders.setdefault(id(v), []).append(m)
    fix = (
        "pass model.parameters() (the generator itself) or the model, where model is what accelerator.prepare returned"
    )
    loose = [i for i, p in enumerate(params) if id(p) not in holders]
    if loose:
        raise TypeError(f"EMAModel.{verb}: parameters[{loose[0]}] belongs to no module in this process; {fix}")
    matches = _lowest_holding(holders[id(params[0])], parents, ids)
    if not matches:
        raise TypeError(
            f"EMAModel.{verb}: the parameters belong to different models (no module in this process holds them "
            "all); an EMAModel averages one model's parameters: make one EMAModel per model, e.g. "
            "EMAModel(unet.parameters()) and EMAModel(text_encoder.parameters()), each stepped with its own"
        )
    if len(matches) != 1:
        found = ", ".join(type(m).__name__ for m in matches)
        raise TypeError(
            f"EMAModel.{verb}: {len(matches)} modules ({found}) in this process hold these parameters; {fix}"
        )
    x = _lift(matches[0], parents)
    if x is None:
        raise TypeError(
            f"EMAModel.{verb}: the parameters belong to a {type(matches[0]).__name__} that an engine manages; {fix}"
        )
    return x


def _lowest_holding(start: list[torch.nn.Module], parents: dict[int, list[torch.nn.Module]], ids: set[int]) -> list:
    """Upward from ``start``, breadth first: the lowest modules whose ``parameters()`` include every id in ``ids``."""
    queue, matches, seen = list(start), [], set()
    while queue:
        m = queue.pop(0)
        if id(m) in seen:
            continue
        seen.add(id(m))
        if ids <= {id(p) for p in m.parameters()}:
            matches.append(m)
        else:
            queue.extend(parents.get(id(m), []))
    return matches


def _lift(m: torch.nn.Module, parents: dict[int, list[torch.nn.Module]]) -> Any:
    """The training object of module ``m``: its DeepSpeed engine if one holds it, else ``m`` (see
    ``_training_object``); for a submodule an engine manages (some parameters of a ZeRO or FSDP2 model), the
    same for its parent, upward. ``None`` when the way up is not one parent."""
    while True:
        engines = [e for e in parents.get(id(m), []) if is_deepspeed_engine(e) and e.module is m]
        x = engines[0] if len(engines) == 1 else _training_object(m)
        if x is not None:
            return x
        ups = parents.get(id(m), [])
        if len(ups) != 1:
            return None
        m = ups[0]


def _owner(params: list[torch.Tensor], hint: Any, verb: str) -> Any:
    """The training object (engine, FSDP2 root, module) whose parameters ``params`` are."""
    x = _training_object(hint) if hint is not None else None
    if x is None:
        x = _search_heap(params, verb)
    opt = getattr(params[0], "_z3_optimizer", None)  # ZeRO-3 marks its parameters with their optimizer
    if opt is not None and getattr(x, "optimizer", None) is not opt:
        raise TypeError(
            f"EMAModel.{verb}: the parameters are ZeRO-3 parameters of another engine's optimizer than "
            f"{type(x).__name__}'s; pass the parameters of the engine accelerator.prepare returned"
        )
    return x


def _live_full(p: torch.Tensor) -> torch.Tensor:
    """The full value of a parameter outside the EMA (frozen: it is its own EMA). Collective for a ZeRO-3
    placeholder (gathered) and a DTensor (``full_tensor``); call it on every rank."""
    if hasattr(p, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([p], modifier_rank=None):
            return p.detach().clone()
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        return p.full_tensor().detach().clone()
    return p.detach().clone()


def _check_values(values: list[torch.Tensor], shapes: list[tuple[int, ...]], where: str, what: str) -> None:
    """``values`` (full tensors, one per position) against the model's full shapes, before anything is written."""
    if len(values) != len(shapes):
        raise ValueError(f"{where}: {what} hold {len(values)} tensors, the model has {len(shapes)} parameters")
    for i, (v, shape) in enumerate(zip(values, shapes)):
        if tuple(v.shape) != tuple(shape):
            raise ValueError(
                f"{where}: {what}[{i}] has shape {tuple(v.shape)}, the model's parameter {i} {tuple(shape)}"
            )


def _copy_into(targets: list[torch.Tensor], values: list[torch.Tensor], where: str, what: str) -> None:
    """Copy ``values`` (``what``) into the full tensors ``targets`` by position (as diffusers does), all checked
    first."""
    _check_values(values, [tuple(t.shape) for t in targets], where, what)
    if any(_sharded(t) for t in targets):
        raise ValueError(f"{where}: the parameters given are partitioned by an engine, and not those this EMA averages")
    with torch.no_grad():
        for t, v in zip(targets, values):
            t.data.copy_(v.to(t.device))


def _fill(state: fe.EmaState, layout: fe.ShardLayout, names: list[str | None], values: list[torch.Tensor]) -> None:
    """This rank's slice of each full value (by position) into the EMA; frozen positions (no name) are their
    own EMA and are skipped. Local: no communication."""
    ema = state.emas[0]
    with torch.no_grad():
        for n, v in zip(names, values):
            if n is None:
                continue
            spec, dst = layout.specs[n], ema[n]
            if dst.numel():
                dst.copy_(v.detach().reshape(-1)[spec.offset : spec.offset + spec.numel].reshape(dst.shape))


def _moved(state: fe.EmaState, x: Any, device: torch.device, pin: bool, non_blocking: bool) -> fe.EmaState:
    """``state`` on ``device`` (pinned when ``pin`` and CUDA is there): the same values, a new state."""
    segments = state.emas[0].segments if isinstance(state.emas[0], fe.Shards) else list(state.emas[0].values())
    here = segments[0].device if segments else None
    same = here is not None and here.type == device.type and device.index in (None, here.index)  # "cuda" = "cuda:0"
    if same and (not pin or segments[0].is_pinned()):
        return state
    shards = read_for(adapter_for(x), state).shards  # the state's selection, if any
    new = fe.init_ema(shards, device=device, pin_memory=pin, step=int(state.step))
    with torch.no_grad():
        for n, t in state.emas[0].items():
            new.emas[0][n].copy_(t, non_blocking=non_blocking)
    return new


def _checked_record(record: Any, what: str) -> dict[str, Any] | None:
    """A selection record (``SELECTION_KEY``) as ``_selection_record`` writes it, or ``None``; else refused (the mark
    of an unfinished ``save_pretrained``, ``_INCOMPLETE``, saying to save again). One without ``mask`` (none is written
    so now) is kept, and compared with nothing."""
    if record is None:
        return None
    if isinstance(record, Mapping) and _INCOMPLETE_KEY in record:
        raise ValueError(
            f"{what} marks an EMAModel.save_pretrained that did not finish (killed or failed while it replaced the "
            "weights): the weights beside it may be partly another EMA's, and are not loaded. Save again "
            "(EMAModel.save_pretrained into that folder), or load an earlier save"
        )
    ok = isinstance(record, Mapping) and {"include", "exclude"} <= set(record)
    mask = record.get("mask") if ok else None
    if mask is not None and not (isinstance(mask, str) and set(mask) <= _MASK):
        ok = False
    if not ok:
        raise ValueError(
            f"{what} must be the selection record EMAModel.state_dict() writes (a dict with 'include', 'exclude' "
            f"and 'mask', a str of '1', '0', '.' per parameter), got {type(record).__name__} {record!r:.80}"
        )
    return dict(record)


def _position_mask(
    adapter: Any, positions: list[torch.Tensor], averaged: Sequence[str | None]
) -> tuple[str, list[str]]:
    """The ``mask`` of ``SELECTION_KEY`` for ``positions`` (the bound model's; ``averaged``: each one's name in the
    EMA, ``None`` where it is not averaged), and their names. From what the steps decided alone: the selection is
    not asked again (a predicate is never called on a frozen name, which it may not expect); a position read but
    not averaged is one the selection left out."""
    module = adapter.module()
    read = {id(p): n for n, p in adapter.read().params.items()}
    named = {id(p): n for n, p in module.named_parameters()}
    mask = "".join("1" if a is not None else "0" if id(p) in read else "." for p, a in zip(positions, averaged))
    return mask, [a or named.get(id(p), f"parameters[{i}]") for i, (p, a) in enumerate(zip(positions, averaged))]


def _check_mask(saved: dict[str, Any], mine: tuple[str, list[str]], user: Selection | None, where: str) -> None:
    """Refuse values saved with a selection (``saved``: their record) that averaged other positions than this EMA
    does (``mine``: its mask and names): loaded by position, a parameter the save did not average would start from
    the live value it kept, and one it averaged would be dropped. Positions not read on either side (frozen) are not
    compared (neither selection was asked about them), nor are names (a submodule compiled in place renames its
    parameters); a record without ``mask`` is not compared. Values without a record (diffusers', or saved without a
    selection) are not checked at all: they say nothing of what was averaged, so an EMA with a selection takes them
    as they are (the positions it leaves out keep their live values)."""
    theirs, (mask, names) = saved.get("mask"), mine
    if theirs is None:
        return
    from functional_ema._checkpoint.errors import CheckpointMismatchError

    def shown(i: list[int]) -> str:  # the names by position (names may have changed since: the position counts)
        more = f" and {len(i) - 8} more" if len(i) > 8 else ""
        return ", ".join(f"{names[k]!r} (#{k})" for k in i[:8]) + more

    lines = [
        f"{where} were saved with the selection include={saved['include']!r}, exclude={saved['exclude']!r}, and "
        f"this EMAModel selects {'every parameter (no include/exclude)' if user is None else user.describe()}"
    ]
    if len(theirs) != len(mask):
        lines[0] += f": the save's record has {len(theirs)} positions, this EMA {len(mask)}"
    else:
        pairs = list(zip(theirs, mask))
        only_saved = [i for i, (a, b) in enumerate(pairs) if (a, b) == ("1", "0")]
        only_mine = [i for i, (a, b) in enumerate(pairs) if (a, b) == ("0", "1")]
        if not only_saved and not only_mine:
            return
        lines[0] += ", averaging other parameters (by position):"
        if only_saved:
            lines.append(f"  averaged by the save, not by this EMA: {shown(only_saved)}")
        if only_mine:
            lines.append(f"  averaged by this EMA, left out by the save (its values are live ones): {shown(only_mine)}")
    lines.append(
        "Construct the EMAModel (or EMAModel.from_pretrained(path, model_cls, include=..., exclude=...)) with the "
        "include=/exclude= the EMA was saved with; to average another selection, start a new EMAModel instead of "
        "loading these values"
    )
    raise CheckpointMismatchError("\n".join(lines))


def _record_json(path: Path, verb: str) -> Any:
    """The JSON object in ``path``'s ``SELECTION_FILE`` (``None``: no such file), read as a hostile file
    (:func:`read_json_object`: a regular file or a link to one, at most ``MAX_JSON_BYTES``, nesting refused). Anything
    else of that name (a folder, a dangling link, junk, JSON that is no object, ``null`` included) is refused naming
    it, never taken for no record: the values would then load without the selection check."""
    file = path / SELECTION_FILE
    if not os.path.lexists(file):
        return None
    if not file.is_file():
        what = "a folder" if file.is_dir() else "a link to nothing" if file.is_symlink() else "not a regular file"
        raise ValueError(
            f"{file} is {what}, not the selection record EMAModel.save_pretrained writes (a JSON file); remove or "
            "rename it"
        )
    try:
        return read_json_object(file, f"EMAModel.{verb}")
    except ForeignFileError as e:
        raise ValueError(
            f"{e}: not the selection record EMAModel.save_pretrained writes; remove or rename it"
        ) from None


def _read_record(path: Path) -> dict[str, Any] | None:
    """The selection record ``save_pretrained`` wrote beside the model in folder ``path`` (``None``: none). A link
    to a file is read (a hub download's folder holds links); a record that is not one is refused naming it, as is the
    mark of a save that did not finish (``_INCOMPLETE``): its weights may be another EMA's than any record says."""
    return _checked_record(_record_json(path, "from_pretrained"), str(path / SELECTION_FILE))


def _earlier_record(path: Path) -> Any:
    """What folder ``path`` holds of an earlier save's selection record, which ``save_pretrained`` replaces: ``None``
    (none), the record, or ``_INCOMPLETE`` (a save that did not finish; the next one finishes it). Checked before
    anything is written. Only a regular file that save_pretrained wrote is replaced: a link (its target is someone
    else's), a folder, a file that is not such a record, or one nested too deeply is refused, naming it."""
    file = path / SELECTION_FILE
    if file.is_symlink():
        raise ValueError(
            f"{file} is a symbolic link, not the selection record EMAModel.save_pretrained writes (a file), and is "
            "not replaced; nothing was written. Remove it, or save into another folder"
        )
    doc = _record_json(path, "save_pretrained")
    if isinstance(doc, dict) and _INCOMPLETE_KEY in doc:  # the mark of a save that did not finish: this one will
        if list(doc) == [_INCOMPLETE_KEY]:
            return _INCOMPLETE
        raise ValueError(
            f"{file} holds {_INCOMPLETE_KEY!r} beside other keys: not what EMAModel.save_pretrained writes, and is not "
            "replaced; nothing was written. Remove or rename it"
        )
    return _checked_record(doc, str(file))


def _save_with_record(model: Any, path: Path, record: str | None, earlier: Any) -> None:
    """``model.save_pretrained(path)`` beside its selection record ``record`` (None: the values have none), where
    ``earlier`` is what ``_earlier_record`` found there. Where the record stays as it is, only the weights are written
    (a kill leaves weights the record describes, or a partial weights file, which does not load). Else the record is
    first replaced by ``_INCOMPLETE``, which every load refuses ("save again"), then the weights are written, then the
    mark is replaced by the new record (or removed). Writing either record around the weights alone left, after a
    kill between them, weights of one selection beside the record of another, which loaded unrefused. A kill
    * while the mark is written: the earlier record and weights, as they were (and perhaps a temporary file, which
      the next save removes: ``_remove_dead_temporaries``);
    * after it, before the new record or the removal is done: the mark, refused at every load until a save completes.
    No temporary file is open while the weights are written: only for the instant each small record is renamed in.
    """
    _remove_dead_temporaries(path)
    new = None if record is None else json.loads(record)
    if new == earlier:  # the weights replaced are described by the record they get (also: none, none)
        model.save_pretrained(str(path))
        return
    path.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path / SELECTION_FILE, json.dumps(dict(_INCOMPLETE), indent=1).encode())
    model.save_pretrained(str(path))
    if record is not None:
        atomic_write_bytes(path / SELECTION_FILE, record.encode())
    else:
        (path / SELECTION_FILE).unlink()
        fsync_dir(path)


def _remove_dead_temporaries(path: Path) -> None:
    """Remove the temporary files of ``SELECTION_FILE`` (``_io.tmp_name``'s exact form) that a process killed while
    writing it left in ``path``, so that they are not shipped with the folder (``push_to_hub``): those of a pid that
    no longer runs on this host. (Another host's writer into the same folder at the same moment would lose its write
    and fail; two concurrent saves into one folder are not supported.)"""
    own = re.compile(re.escape(SELECTION_FILE) + r"\.tmp-([1-9][0-9]{0,8})-[0-9a-f]{12}")  # a pid os.kill takes
    try:
        names = [m for m in map(own.fullmatch, os.listdir(path)) if m is not None]
    except OSError:  # no folder yet
        return
    for m in names:
        tmp = path / m.group(0)
        if tmp.is_file() and not tmp.is_symlink() and not _alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _on_every_rank(what: str, fn: Callable[[], Any], job: Job, bounded: bool) -> None:
    """Run ``fn`` on every rank of ``job``; return on each once all succeeded, or raise on every rank when one
    failed (:func:`agree_on`: that rank its own error, the others the library's class of it, or ``RuntimeError``).
    ``bounded``: the wait for the others is bounded by ``FUNCTIONAL_EMA_TIMEOUT`` (``fn`` takes about as long on
    every rank); else by the process group's own timeout (``fn`` is one rank's long write, as in ``fe.save``)."""
    if job.world <= 1:  # its own error as it is
        fn()
        return

    def run() -> dict[str, Any]:
        fn()
        return {}

    agree_on(what, run, (), job.group, job.world, job.rank, fallback=RuntimeError, bounded=bounded)


def _taken_over(model: str, e: TypeError) -> str:
    """The refusal of a model an engine took over after an EMAModel bound itself to it."""
    return (
        f"EMAModel: this EMA bound itself to the {model} it was given at its first step() (or at construction, "
        f"given that model's sharded parameters), and an engine has taken that model over since: {e}. The EMA was "
        "laid out over that model as it was then, so it does not follow it into the engine. Make the first "
        "ema.step(...) after accelerator.prepare(...) (or deepspeed.initialize / fully_shard), with the prepared "
        "model's parameters; to keep values from before, take ema.state_dict() before the prepare, and "
        "load_state_dict it into a new EMAModel built from a copy of the model"
    )


# ------------------------------------------------------------------------------------------- the class


class EMAModel:
    """diffusers' ``EMAModel`` (0.42) over :func:`functional_ema.update`: an fp32 EMA of the fp32 weights
    of the model being trained, each rank keeping its own pieces (see the module's docstring).

    Args:
        parameters: the parameters whose values the EMA starts from, positionally: usually those of a
            separate copy of the model (``ema_unet.parameters()``), or of the trained model itself (all of
            them, or some, as ``step`` will be given them). A
            ``torch.nn.Module`` is accepted with diffusers' deprecation (and, as there, turns
            ``use_ema_warmup`` on).
        decay: the largest decay, in [0, 1].
        min_decay: the smallest decay, in [0, decay].
        update_after_step: the decay is 0 (the EMA is set to the weights) up to optimizer step
            ``update_after_step + 1``; an int >= 0.
        use_ema_warmup: ``1 - (1 + s / inv_gamma) ** -power`` (:func:`functional_ema.schedules.warmup`)
            instead of ``(1 + s) / (10 + s)``, ``s = optimization_step - update_after_step - 1``.
        inv_gamma: the warm-up's step scale, finite and > 0.
        power: the warm-up's exponent, finite and > 0.
        foreach: accepted for diffusers' signature (a bool); the update is always fused here.
        model_cls: the diffusers model class ``save_pretrained`` builds (``UNet2DConditionModel``).
        model_config: its config (``model.config``).
        include, exclude: not diffusers': which parameters are averaged, by name (as for
            :func:`functional_ema.local_shards`); the others are treated as frozen ones are: not averaged,
            their live values in ``state_dict``, ``save_pretrained`` and ``shadow_params``, left live by
            ``copy_to``. The names are checked at the first :meth:`step`, against every parameter name of
            the model (given some of its parameters too: a pattern may name one not given, e.g. frozen), with
            the messages of :func:`functional_ema.local_shards`. After the first step ``state_dict`` records the
            selection (``"ema_selection"``: the patterns and which positions are averaged; diffusers' ``EMAModel``
            ignores it) and ``save_pretrained`` writes it to ``ema_selection.json`` beside the model (the config
            stays diffusers'). Values saved with a selection that averaged other positions than this EMA's are
            refused, naming them: by ``load_state_dict`` after the first step, else at the first step (also for
            :meth:`from_pretrained`'s EMA); values without a record (diffusers', or saved without a selection) load
            as before.
        **kwargs: diffusers' deprecated ``max_value`` (for ``decay``), ``min_value`` (for ``min_decay``),
            ``device`` (for :meth:`to`), with its warning; any other keyword is refused.

    Attributes:
        optimization_step: the number of :meth:`step` calls (restored by :meth:`load_state_dict`).
        cur_decay_value: the decay of the last :meth:`step` (``None`` before the first).

    The arguments are kept as attributes of the same names (``decay``, ``min_decay``, ... ``model_config``;
    decays and warm-up constants as floats), as diffusers keeps them.
    """

    _pending: list[torch.Tensor] | None
    _owned: bool
    _versions: list[int]
    _subset: list[str] | None
    _x: Any
    _positions: list[torch.Tensor]
    _names: list[str | None]
    _state: fe.EmaState | None
    _device: torch.device | None
    _pin: bool
    _counted: int
    _stored: contextlib.ExitStack | None
    _swap: contextlib.ExitStack | None
    _warmup: tuple[tuple[float, float, float, float, int], fe.schedules.Schedule] | None
    _loaded_record: dict[str, Any] | None = None  # (a class default: an EMAModel pickled before it existed)

    def __init__(
        self,
        parameters: Iterable[torch.nn.Parameter],
        decay: float = 0.9999,
        min_decay: float = 0.0,
        update_after_step: int = 0,
        use_ema_warmup: bool = False,
        inv_gamma: float | int = 1.0,
        power: float | int = 2 / 3,
        foreach: bool = False,
        model_cls: Any | None = None,
        model_config: dict[str, Any] | None = None,
        *,
        include: SelectionLike = None,
        exclude: SelectionLike = None,
        **kwargs: Any,
    ) -> None:
        fields = _constructor_settings(
            parameters,
            kwargs,
            decay=decay,
            min_decay=min_decay,
            optimization_step=0,
            update_after_step=update_after_step,
            use_ema_warmup=use_ema_warmup,
            inv_gamma=inv_gamma,
            power=power,
        )
        self.foreach = check_bool(foreach, "foreach")
        self.model_cls = _check_model_cls(model_cls, "model_cls", ("from_config",))
        if model_config is not None and not isinstance(model_config, Mapping):
            raise TypeError(f"model_config must be a mapping (model.config) or None, got {type(model_config).__name__}")
        device = check_device(kwargs.get("device"), "device")
        if device is not None:
            warnings.warn("The `device` argument is deprecated. Please use `to` instead.", FutureWarning, stacklevel=2)
        params, hint = _take(parameters, "parameters")
        self.model_config = model_config
        self.decay, self.min_decay = fields["decay"], fields["min_decay"]
        self.update_after_step, self.use_ema_warmup = fields["update_after_step"], fields["use_ema_warmup"]
        self.inv_gamma, self.power = fields["inv_gamma"], fields["power"]
        self._init_private(device)
        self.optimization_step = 0
        self.cur_decay_value: float | None = None
        self.temp_stored_params: list[torch.Tensor] | None = None
        self._selection: Selection | None = make_selection(include, exclude)  # the types now; names at the first step
        if any(_sharded(p) for p in params):  # the trained model's own parameters: bind now, no full copy
            self._bind(params, hint, "EMAModel")
        else:  # references, copied only when they can matter (see _keep_start)
            self._pending = [p.detach() for p in params]
            self._versions = [p._version for p in params]

    def _init_private(self, device: torch.device | None) -> None:
        # Before the first step: the full starting values, one per position: references to the tensors given
        # (their versions then, and their ids for the optimizer hook), or our own copies (_owned). After it:
        # the training object, its parameters by position (the names of the positions when they are some of
        # its parameters), each position's name in the EMA (None: not averaged, frozen) and this rank's state.
        self._pending, self._owned, self._versions = None, False, []
        self._subset = None
        self._x = None
        self._positions = []
        self._names = []
        self._state = None
        self._device, self._pin = device, False
        self._counted = 0  # the state's step counter, as last set here (see step)
        self._stored = None  # store() was given the trained model: training refused until restore()
        self._swap = None  # copy_to() after store(): the EMA swapped in
        self._warmup = None  # (settings, fe.schedules.warmup of them)
        self._loaded_record = None  # the selection record that came with the values loaded (SELECTION_KEY)

    # ------------------------------------------------------------------------------- copies

    def __deepcopy__(self, memo: dict[int, Any]) -> EMAModel:
        """An independent EMA with copies of this one's values, averaging the same trained model (diffusers'
        deepcopy copies its own tensors; the trained model is no part of the EMA, so it is not copied)."""
        if self._stored is not None or self._swap is not None:
            raise RuntimeError(
                "EMAModel: copy.deepcopy between store(parameters) and restore(parameters) of the trained model; "
                "call restore(parameters) first"
            )
        pending = None if self._pending is None else self._starting_values("__deepcopy__")
        new = object.__new__(type(self))
        memo[id(self)] = new
        shared = ("_x", "_selection", "model_cls", "_warmup", "_pending")  # the model; immutable ones
        for k, v in self.__dict__.items():
            new.__dict__[k] = v if k in shared else copy.deepcopy(v, memo)
        new._positions = list(self._positions)
        if pending is not None:  # copies: the new EMA owns them
            new._pending, new._owned = [t.clone() for t in pending], True
        return new

    def __copy__(self) -> EMAModel:
        """A shallow copy sharing everything (as ``copy.copy`` of diffusers' class); pickling's refusal is not it."""
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__)
        return new

    def __getstate__(self) -> dict[str, Any]:
        """Pickling (``torch.save(ema)``): before the first step, the settings and copies of the starting values;
        after it the EMA is bound to the trained model (and under sharding holds this rank's pieces): refused,
        naming the ways to save it."""
        if self._x is not None:
            raise TypeError(
                "EMAModel after its first step is bound to the trained model (its parameters, this rank's pieces of "
                "the EMA) and is not picklable: save ema.state_dict() (torch.save(ema.state_dict(), path); resume "
                "with ema.load_state_dict(torch.load(path))) or ema.save_pretrained(path) (resume with "
                "EMAModel.from_pretrained(path, model_cls))"
            )
        state = dict(self.__dict__)
        state["_warmup"], state["_owned"] = None, True  # unpickled: its own copies
        if self._pending is not None:
            state["_pending"] = self._starting_values("__getstate__")
        return state

    # ------------------------------------------------------------------------------- starting values

    @property
    def optimization_step(self) -> int:
        return self._optimization_step

    @optimization_step.setter
    def optimization_step(self, value: int) -> None:
        # Set by hand before the first step (a resume), the first decay is not 0: the starting values count.
        if self._pending is not None and not (isinstance(value, int) and value == 0):
            self._keep_start()
        self._optimization_step = value

    def _changed(self) -> bool:
        """Whether the tensors given as the starting values were changed in place since (not when we own copies)."""
        return not self._owned and any(t._version != v for t, v in zip(self._pending or [], self._versions))

    def _keep_start(self) -> None:
        """Copy the starting values while they are still the values given: when ``optimization_step`` is set by
        hand, when they are read. Until then they are references: with ``optimization_step`` 0 the first step's
        decay is 0 and they never count, and no full copy is made (the tensors' version counters tell whether they
        changed since; a change through ``.data`` is not seen)."""
        if self._pending is None or self._owned or self._changed():
            return  # changed already: _starting_values refuses them where they count
        self._pending, self._owned = [t.clone() for t in self._pending], True

    def _starting_values(self, verb: str) -> list[torch.Tensor]:
        """The starting values, where they count; refused when the tensors given were changed in place before a
        copy was taken (diffusers would use the values of the constructor's time, which are gone)."""
        if self._changed():
            raise RuntimeError(
                f"EMAModel.{verb}: the parameters given to EMAModel(...) were changed in place after it was made "
                "(an optimizer step or a load before the EMA's first step), and it holds them by reference, not "
                "copied, until its starting values count. To start from the values at construction, pass copies: "
                "EMAModel([p.detach().clone() for p in model.parameters()], ...), or load_state_dict(...) the "
                "EMA to start from"
            )
        return list(self._pending or [])

    # ------------------------------------------------------------------------------- binding

    def _bind(self, params: list[torch.Tensor], hint: Any, verb: str, start_counts: bool = True) -> None:
        """Find the training object of ``params``, map positions to names, and start this rank's state from
        the starting values (this rank's slice of each), at ``optimization_step``. ``start_counts``: whether
        they do (not for a first step with decay 0, where the EMA becomes the weights)."""
        x = _owner(params, hint, verb)
        adapter = adapter_for(x)
        module = adapter.module()
        subset = self._subset_of(module, params, verb)
        selection = self._selection
        if subset is not None:  # some of the parameters: the user's selection among them
            if selection is not None:
                _check_among(adapter.read(), module, selection, subset, verb)
            selection = Selection(_Among(subset, selection), None)
        reading = select(adapter.read(), selection, module)  # positions left out: not averaged
        if not reading.layout.part.whole:
            raise NotImplementedError(
                f"EMAModel.{verb}: the model is split into model-parallel parts ({reading.layout.part.describe()}); "
                "EMAModel maps diffusers' whole-model positions, use functional_ema.integrations.accelerate instead"
            )
        by_id = {id(p): n for n, p in reading.params.items()}
        names = [by_id.get(id(p)) for p in params]
        if self._loaded_record is not None:  # values loaded before the positions were known: checked now
            _check_mask(
                self._loaded_record,
                _position_mask(adapter, params, names),
                self._selection,
                f"the values loaded into this EMAModel (load_state_dict, from_pretrained) before EMAModel.{verb}",
            )
        # Bound at construction (a sharded model's own parameters) there are no starting values: the weights are.
        pending = self._starting_values(verb) if start_counts and self._pending is not None else self._pending
        if pending is not None:
            shapes = [reading.layout.specs[n].shape if n else _full_shape(p) for n, p in zip(names, params)]
            _check_values(pending, shapes, f"EMAModel.{verb}", "the parameters given to EMAModel")
        step = check_int(self.optimization_step, "optimization_step")
        state = fe.init_ema(reading.shards, device=self._device, pin_memory=self._pin, step=step)
        if pending is not None:
            _fill(state, reading.layout, names, pending)
        self._x, self._positions, self._names, self._state, self._pending = x, list(params), names, state, None
        self._selection, self._subset, self._counted = selection, subset, step
        self._loaded_record = None  # the state's own selection is recorded from now

    @staticmethod
    def _subset_of(module: torch.nn.Module, params: list[torch.Tensor], verb: str) -> list[str] | None:
        """``None`` when ``params`` are ``module.parameters()``; else the names of the positions, when they are
        some of its parameters (diffusers' ``EMAModel([p for p in model.parameters() if p.requires_grad])``)."""
        all_params = list(module.parameters())
        if _same(params, all_params):
            return None
        named = {id(p): n for n, p in module.named_parameters()}
        first: dict[int, int] = {}
        for i, p in enumerate(params):
            if id(p) not in named:
                raise ValueError(
                    f"EMAModel.{verb}: parameters[{i}] is not a parameter of the {type(module).__name__} the others "
                    "belong to; pass that model's parameters() (or some of them)"
                )
            j = first.setdefault(id(p), i)
            if j != i:
                raise ValueError(f"EMAModel.{verb}: parameters[{i}] is parameters[{j}] again; pass each parameter once")
        return [named[id(p)] for p in params]

    def _grow(self) -> fe.Shards | None:
        """Add to the state the parameters that were frozen at the first step and are trained now, each starting
        from its current value (diffusers averages every position, frozen or not); leave it as it is when the
        model differs from it otherwise (the verbs then refuse it, naming the parameter). Before any method reads
        the state against the model. Returns the model's selected shards (``None`` before the first step)."""
        if self._state is None:
            return None
        # The module too: a pattern naming a parameter still frozen is checked against the model's names, as at
        # the first step (without it, a reading made anew after an unfreezing would take it for a typo)
        reading = select(self._read(), self._selection, adapter_for(self._x).module())
        shards, have = reading.shards, self._state.emas[0]
        if not isinstance(have, fe.Shards) or have.index == shards.index:
            return shards
        old, new = set(have.index.names), shards.index.names
        added = [n for n in new if n not in old]
        by_id = {id(p): n for n, p in reading.params.items()}
        names = [by_id.get(id(p)) for p in self._positions]
        was_frozen = {n for n, m in zip(names, self._names) if m is None and n is not None}
        if not added or not old <= set(new) or not set(added) <= was_frozen:
            return shards
        grown = grown_state(self._state, shards, self._counted, device=self._device, pin_memory=self._pin)
        warnings.warn(
            f"EMAModel: {added} were frozen when the EMA started and are trained now; their EMA starts from "
            "their current values (diffusers' EMAModel, which copies frozen parameters at every step, from their "
            "values at the step before)",
            UserWarning,
            stacklevel=3,
        )
        self._names, self._state = names, grown
        return shards

    def _read(self) -> Reading:
        """The bound model's reading. A model an engine took over after the EMA bound itself to it (its first
        :meth:`step` before ``accelerator.prepare``) is refused naming that binding, not the library's verbs."""
        try:
            return adapter_for(self._x).read()
        except TypeError as e:
            if is_deepspeed_engine(self._x):
                raise
            try:  # only the refusal of an engine's module is explained (checked again on the error path alone)
                refuse_engine_internals(self._x)
            except TypeError:
                raise TypeError(_taken_over(type(self._x).__name__, e)) from None
            raise

    def _job(self, verb: str, call: str = "") -> Job:
        """The ranks that hold this EMA together, once every one of them has called ``verb`` with the same
        ``call`` (what decides the collectives that follow). Bounded (:func:`agree_on`): a verb called on one
        rank alone fails naming itself, and ranks in two verbs (``state_dict`` on one, ``save_pretrained`` on
        another) fail at once naming each, instead of pairing their gathers and hanging. One small exchange."""
        job = job_of(self._read())
        if job.world > 1:
            what = f"EMAModel.{verb}"
            check_reachable(what, job.group, job.world)
            agree_on(what, dict, (), job.group, job.world, job.rank, mismatch=fe.StateMismatchError, call=call)
        return job

    def _full_values(self, dst: int | None, verb: str, call: str = "") -> list[torch.Tensor] | None:
        """The whole EMA by position (frozen positions: their live value), on rank ``dst`` of the EMA's group
        (``None``: every rank); ``None`` on the others. Collective when the EMA is sharded (``verb`` and ``call``
        agreed first, see :meth:`_job`)."""
        if self._x is None or self._state is None:  # the starting values, whole on every rank (ours from now)
            self._keep_start()
            return self._starting_values(verb)
        self._grow()
        job = self._job(verb, call)
        full = fe.gather_full(self._state, self._x, dst=dst)  # agrees on dst too (ranks in one verb here)
        frozen = {i: _live_full(p) for i, (n, p) in enumerate(zip(self._names, self._positions)) if n is None}
        if dst is not None and job.rank != dst:
            return None
        return [full[n] if n is not None else frozen[i] for i, n in enumerate(self._names)]

    def _is_model(self, params: list[torch.Tensor]) -> bool:
        """Whether ``params`` are the bound model's parameters: those of the first step, or the ones registered
        now (FSDP2 registers unsharded parameter objects while a forward's gathered weights stay, e.g. the root's
        after a ``no_grad`` forward)."""
        if _same(params, self._positions):  # the usual case: one identity pass, nothing walked
            return True
        module = adapter_for(self._x).module()
        if self._subset is None:
            return _same(params, list(module.parameters()))
        named = dict(module.named_parameters())
        return _same(params, [named[n] for n in self._subset if n in named])

    def _trained(self, params: list[torch.Tensor], hint: Any, verb: str) -> bool:
        """Whether ``params`` are the trained model's (binding to it first when they are partitioned)."""
        if self._x is not None:
            if self._is_model(params):
                self._grow()
                return True
            if any(_sharded(p) for p in params):
                raise ValueError(
                    f"EMAModel.{verb}: the parameters are partitioned by an engine but are not those this EMA averages "
                    f"({type(self._x).__name__}'s); pass the trained model's parameters()"
                )
            return False
        if any(_sharded(p) for p in params):
            self._bind(params, hint, verb)
            return True
        return False

    def _no_swap(self, verb: str) -> None:
        if self._swap is not None:
            raise RuntimeError(
                f"EMAModel.{verb}: the EMA weights are in the model (copy_to after store); call restore(parameters) first"
            )

    # ------------------------------------------------------------------------------ training

    def get_decay(self, optimization_step: int) -> float:
        """diffusers' decay at ``optimization_step`` (bitwise): 0 while ``s = optimization_step -
        update_after_step - 1 <= 0``, else the warm-up or ``(1 + s) / (10 + s)``, clamped to [min_decay, decay]."""
        optimization_step = check_int(optimization_step, "optimization_step")
        step = max(0, optimization_step - self.update_after_step - 1)
        if step <= 0:
            return 0.0
        if self.use_ema_warmup:  # the same formula and clamps (schedules.warmup is diffusers' warm-up)
            key = (self.inv_gamma, self.power, self.min_decay, self.decay, self.update_after_step)
            if self._warmup is None or self._warmup[0] != key:  # made (and checked) again when a setting changes
                self._warmup = (key, self._made_warmup(key))
            return self._warmup[1](optimization_step)
        value = (1 + step) / (10 + step)
        return max(min(value, self.decay), self.min_decay)

    def _made_warmup(self, key: tuple[float, float, float, float, int]) -> fe.schedules.Schedule:
        """The warm-up of settings ``key``, each checked first under the attribute's name (scripts set them by
        hand; the schedule's own messages would name its arguments, ``max_decay``, ``start_step``)."""
        values = {**{f: getattr(self, f) for f in FIELDS}, "optimization_step": 0, "use_ema_warmup": True}
        try:
            _check_fields(values, lambda f: f"EMAModel.{f}")
        except (TypeError, ValueError) as e:
            raise type(e)(f"{e}; the warm-up (EMAModel.use_ema_warmup=True) needs it so") from None
        return fe.schedules.warmup(*key)

    @torch.no_grad()
    def step(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """One EMA update with ``get_decay(optimization_step + 1)``, after an optimizer step; ``parameters``:
        the trained model's ``parameters()`` (an engine's, an FSDP2 or DDP model's, or the module's), the same
        every time. A parameter frozen since the first step is copied (diffusers' rule), one frozen from the
        start is its own EMA. No communication."""
        params, hint = _take(parameters, "parameters")
        self._no_swap("step")
        if self._stored is not None:
            raise RuntimeError(f"EMAModel.step: training {_STORED_WHY}")
        step = check_int(self.optimization_step, "optimization_step") + 1
        decay = self.get_decay(step)
        if self._x is None:  # with decay 0 the EMA becomes the weights: the starting values do not count
            self._bind(params, hint, "step", start_counts=decay != 0.0)
        elif not self._is_model(params):
            raise ValueError(
                f"EMAModel.step: these {len(params)} parameters are not the ones this EMA averages "
                f"({type(self._x).__name__}'s {len(self._positions)}); pass the same ones every step"
            )
        shards = self._grow()
        state = self._state
        assert shards is not None and state is not None
        if self._counted != step - 1:  # optimization_step set by hand (scripts do, on resume): one decay, as diffusers
            state.step.fill_(step - 1)
        state = fe.update(state, shards, step, decay=float(decay))
        for n, p in zip(self._names, self._positions):
            if n is not None and not p.requires_grad:  # frozen since: diffusers copies it
                state.emas[0][n].copy_(shards[n])
        self._state, self.optimization_step, self.cur_decay_value, self._counted = state, step, decay, step

    # ------------------------------------------------------------------------ evaluation swap

    def store(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Before :meth:`copy_to`: remember the weights to bring back. For the trained model nothing is copied
        (the swap keeps them); for another model, a CPU copy (as diffusers)."""
        params, hint = _take(parameters, "parameters")
        self._no_swap("store")
        if self._trained(params, hint, "store"):
            if self._stored is None:  # training refused until restore(), which does not undo it here
                assert self._state is not None
                adapter = adapter_for(self._x)
                stored = contextlib.ExitStack()
                stored.enter_context(training_refused(adapter, read_for(adapter, self._state), _STORED_WHY))
                self._stored = stored
            self.temp_stored_params = None
        else:
            self._leave_stored()
            self.temp_stored_params = [p.detach().cpu().clone() for p in params]

    def _leave_stored(self) -> None:
        stored, self._stored = self._stored, None
        if stored is not None:
            stored.close()

    def copy_to(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Put the EMA into ``parameters``.

        * The trained model after :meth:`store`: the EMA is swapped in (:func:`functional_ema.swapped`) until
          :meth:`restore`; training in between is refused. Collective when the EMA is sharded.
        * The trained model without :meth:`store` (end of training): its weights, fp32 masters included,
          become the EMA for good. Collective when sharded.
        * Another model's full parameters: the whole EMA is copied in (sharded: gathered on every rank,
          a collective holding a full fp32 copy of the model per rank while it runs).
        """
        params, hint = _take(parameters, "parameters")
        if self._trained(params, hint, "copy_to"):
            if self._swap is not None:
                return  # already in
            assert self._state is not None
            if self._stored is not None:
                self._job("copy_to", "the trained model, after store()")
                stack = contextlib.ExitStack()
                stack.enter_context(fe.swapped(self._x, self._state))
                self._swap = stack
                return
            job = self._job("copy_to", "the trained model, for good")
            adapter = adapter_for(self._x)
            reading = read_for(adapter, self._state)  # the selected parameters; the others keep their values
            pieces = state_pieces(self._state, reading, 0, "EMAModel.copy_to")
            # The weights are the EMA on every rank when any returns; a rank's failure raises on every rank
            _on_every_rank("EMAModel.copy_to", lambda: adapter.write_weights(reading, pieces), job, bounded=True)
            return
        values = self._full_values(None, "copy_to", "another model")
        assert values is not None
        _copy_into(params, values, "EMAModel.copy_to", "the EMA's values")

    def restore(self, parameters: Iterable[torch.nn.Parameter]) -> None:
        """Bring back the weights :meth:`store` kept: leave the swap (the trained model; bitwise as before), or
        copy the stored CPU copy back (another model)."""
        params, _ = _take(parameters, "parameters")
        if self._stored is not None or self._swap is not None:
            if not self._is_model(params):
                raise ValueError("EMAModel.restore: pass the parameters given to store() (the trained model's)")
            stack, self._swap = self._swap, None
            try:
                if stack is not None:
                    stack.close()  # may refuse (the model changed inside), with the trained values put back
            finally:
                self._leave_stored()
            return
        if self.temp_stored_params is None:
            raise RuntimeError("This ExponentialMovingAverage has no `store()`ed weights to `restore()`")
        _copy_into(params, self.temp_stored_params, "EMAModel.restore", "the values store() kept")
        self.temp_stored_params = None

    # --------------------------------------------------------------------------------- saving

    def _fields(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in FIELDS}

    def _user_selection(self) -> Selection | None:
        """The ``include=`` / ``exclude=`` given (bound to some parameters, it is folded into an ``_Among``)."""
        sel = self._selection
        return sel.include.user if sel is not None and isinstance(sel.include, _Among) else sel

    def _selection_record(self) -> dict[str, Any] | None:
        """What ``state_dict`` records of the selection (see ``SELECTION_KEY``): ``None`` without one (diffusers'
        dict as it is). Before the first step the positions are unknown: the record the values were loaded with
        (``from_pretrained``'s EMA passes it on), or none."""
        if self._x is None:
            return self._loaded_record
        user = self._user_selection()
        if user is None:
            return None
        mask, _ = _position_mask(adapter_for(self._x), self._positions, self._names)
        return {**user.record(), "mask": mask}

    def save_pretrained(self, path: str | Path) -> None:
        """Write ``model_cls.from_config(model_config)`` holding the EMA (fp32, bitwise) and the EMA's settings
        in its config, with the model's ``save_pretrained``: a folder ``model_cls.from_pretrained`` loads and
        :meth:`from_pretrained` resumes from. Sharded: collective, rank 0 of the EMA's group writes. Into a folder
        saved with another selection (or none), the folder is marked unfinished while the weights are replaced: a
        kill or an error there leaves it refused at every load ("save again"), never weights beside a record that is
        not theirs (``_save_with_record``)."""
        if self.model_cls is None:
            raise ValueError("`save_pretrained` can only be used if `model_cls` was defined at __init__.")
        if self.model_config is None:
            raise ValueError("`save_pretrained` can only be used if `model_config` was defined at __init__.")
        path = check_path(path, "path")
        if path.exists() and not path.is_dir():
            raise ValueError(f"path={str(path)!r} is a file: save_pretrained writes a folder")
        values = self._full_values(0, "save_pretrained")
        record = self._selection_record()

        def write() -> None:
            if values is not None:  # rank 0 of the EMA's group (every rank before the first step)
                earlier = _earlier_record(path)  # checked before anything is written (else refused, naming it)
                model = self.model_cls.from_config(self.model_config)
                model.register_to_config(**self._fields())
                _copy_into(list(model.parameters()), values, "EMAModel.save_pretrained", "the EMA's values")
                _save_with_record(model, path, None if record is None else json.dumps(record, indent=1), earlier)

        if self._x is None:
            write()
            return
        # The folder is complete when every rank returns, and rank 0's failure raises on every rank. Unbounded, as
        # fe.save's wait after its writes: a slow write on rank 0 must not make the others give up on a good save
        _on_every_rank("EMAModel.save_pretrained", write, job_of(self._read()), bounded=False)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        model_cls: Any,
        foreach: bool = False,
        *,
        include: SelectionLike = None,
        exclude: SelectionLike = None,
    ) -> EMAModel:
        """An EMA starting from a folder :meth:`save_pretrained` wrote (its weights and settings), whole on
        this rank until its first :meth:`step` or :meth:`load_state_dict` into another EMA (the resume hook:
        ``ema_unet.load_state_dict(EMAModel.from_pretrained(dir, UNet2DConditionModel).state_dict())``).
        ``include`` / ``exclude`` (not diffusers'): the EMA's selection, as for the constructor, for stepping this
        EMA itself; values saved with a selection averaging other positions are refused at its first step."""
        path = check_path(path, "path")
        model_cls = _check_model_cls(model_cls, "model_cls", ("from_pretrained", "load_config", "from_config"))
        if model_cls is None:
            raise TypeError("model_cls must be a diffusers model class (e.g. UNet2DConditionModel), got None")
        foreach = check_bool(foreach, "foreach")
        record = _read_record(path)  # before the model is loaded: a damaged record is refused, naming it
        config = model_cls.load_config(str(path))
        fields = {f: config[f] for f in FIELDS if f in config}  # what diffusers reads back (unused config kwargs)
        model = model_cls.from_pretrained(str(path))
        ema = cls(
            model.parameters(),
            model_cls=model_cls,
            model_config=model.config,
            foreach=foreach,
            include=include,
            exclude=exclude,
        )
        ema._owned = True  # no one else holds this model: its tensors are the EMA's own values
        ema.load_state_dict(fields)
        # Kept with the values (its state_dict() passes it on), checked where their positions are known
        ema._loaded_record = record
        return ema

    def state_dict(self) -> dict[str, Any]:
        """diffusers' dict: the settings and ``shadow_params``, the whole EMA by position. Sharded: a
        collective that gathers a full fp32 copy of the model onto every rank."""
        out = {**self._fields(), "shadow_params": self._full_values(None, "state_dict")}
        selected = self._selection_record()
        if selected is not None:  # diffusers' dict, with the selection (see SELECTION_KEY)
            out[SELECTION_KEY] = selected
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the settings and (if present) ``shadow_params`` (whole tensors by position, e.g. from
        :meth:`from_pretrained`'s EMA), copied as diffusers copies them: each rank keeps its slice. Everything
        is checked before anything changes; unknown keys are refused. Positions the EMA does not average
        (frozen parameters) keep their live value. Values saved with a selection (``"ema_selection"``) averaging
        other positions than this EMA's are refused, naming them; before the first step (the positions unknown)
        at the first step instead. No communication."""
        self._load(check_mapping(state_dict, "state_dict"), "state_dict['shadow_params']")

    def _load(self, sd: Mapping[str, Any], shadow_name: str) -> None:
        """:meth:`load_state_dict` of ``sd``; ``shadow_name``: how messages name its ``shadow_params``."""
        known = (*FIELDS, "shadow_params", SELECTION_KEY)
        unknown = sorted(str(k) for k in sd if k not in known)
        if unknown:
            raise ValueError(f"state_dict has unknown key(s) {unknown}; EMAModel's hold {list(known)}")
        fields = _check_fields({f: sd.get(f, getattr(self, f)) for f in FIELDS}, lambda f: f"state_dict[{f!r}]")
        where = "EMAModel.load_state_dict" if shadow_name.startswith("state_dict") else "EMAModel.shadow_params"
        self._no_swap(where.removeprefix("EMAModel."))
        self._grow()
        values = self._checked_shadow(sd.get("shadow_params"), shadow_name, where)
        record = _checked_record(sd.get(SELECTION_KEY), f"state_dict[{SELECTION_KEY!r}]")
        if record is not None and values is not None and self._x is not None:  # unbound: checked at the first step
            mine = _position_mask(adapter_for(self._x), self._positions, self._names)
            _check_mask(record, mine, self._user_selection(), f"the values given to {where}")
        if values is not None and self._state is not None:
            _fill(self._state, adapter_for(self._x).read().layout, self._names, values)
        elif values is not None:  # copies: diffusers deep-copies the state_dict (the source may change on)
            self._pending, self._owned = [t.detach().clone() for t in values], True
        for f, v in fields.items():
            setattr(self, f, v)
        if values is not None and self._x is None:  # the values' own selection (none known without a record)
            self._loaded_record = record
        if self._state is not None:
            self._state.step.fill_(fields["optimization_step"])
            self._counted = fields["optimization_step"]

    def _checked_shadow(self, shadow: Any, what: str, where: str) -> list[torch.Tensor] | None:
        if shadow is None:
            return None
        if not isinstance(shadow, (list, tuple)) or not all(isinstance(t, torch.Tensor) for t in shadow):
            raise TypeError(f"{what} must be a list of tensors (one per parameter), got {type(shadow).__name__}")
        values = list(shadow)
        for i, t in enumerate(values):
            if not t.is_floating_point():
                raise TypeError(f"{what}[{i}] has dtype {t.dtype}: {what} must hold floating-point tensors")
            if t.is_meta:
                raise ValueError(f"{what}[{i}] is on the meta device: it holds no values; load tensors with values")
        if self._x is not None:
            layout = adapter_for(self._x).read().layout
            shapes = [layout.specs[n].shape if n else _full_shape(p) for n, p in zip(self._names, self._positions)]
        else:
            shapes = [tuple(t.shape) for t in self._pending or []]
        _check_values(values, shapes, where, what)
        return values

    # ------------------------------------------------------------------------------ placement

    def to(
        self, device: torch.device | str | None = None, dtype: torch.dtype | None = None, non_blocking: bool = False
    ) -> None:
        """Keep this rank's EMA on ``device`` (before the first step: where it will be made). The EMA stays
        fp32: ``dtype`` may be ``None`` or ``torch.float32``."""
        device = check_device(device, "device")
        _check_dtype(dtype)
        non_blocking = check_bool(non_blocking, "non_blocking")
        self._no_swap("to")
        if device is None:
            return
        self._device = device
        self._grow()
        if self._state is not None:
            self._state = _moved(self._state, self._x, device, self._pin, non_blocking)

    def pin_memory(self) -> None:
        """Keep this rank's EMA in pinned CPU memory (where CUDA is; plain CPU memory otherwise)."""
        self._no_swap("pin_memory")
        self._device, self._pin = torch.device("cpu"), True
        self._grow()
        if self._state is not None:
            self._state = _moved(self._state, self._x, torch.device("cpu"), True, False)

    # ------------------------------------------------------------------------------- reading

    @property
    def state(self) -> fe.EmaState | None:
        """This rank's :class:`functional_ema.EmaState` (``None`` before the first step)."""
        return self._state

    @property
    def shadow_params(self) -> list[torch.Tensor]:
        """The EMA by position, whole: the starting values before the first step; the EMA's own tensors of a
        model every rank holds whole (DDP, one process), a copy of the live value for a position not averaged
        (frozen; as diffusers' copy, editing it leaves the model as it is). Refused when sharded (each rank holds
        its pieces)."""
        if self._x is None or self._state is None:
            self._keep_start()  # ours from now: an edit in place edits the EMA, as in diffusers
            return self._starting_values("shadow_params")
        self._grow()
        if adapter_for(self._x).read().layout.world_size > 1:
            raise RuntimeError(
                "EMAModel.shadow_params: the EMA is sharded over the ranks (each holds its pieces); use state_dict() "
                "(gathers it: collective, a full fp32 copy per rank), save_pretrained(path), or .state (this rank's)"
            )
        ema = self._state.emas[0]
        return [ema[n] if n is not None else _live_full(p) for n, p in zip(self._names, self._positions)]

    @shadow_params.setter
    def shadow_params(self, values: list[torch.Tensor]) -> None:
        """Scripts assign it (``ema.shadow_params = [p.clone().detach() for p in model.parameters()]``): the values
        are copied in, checked, as ``load_state_dict({"shadow_params": values})`` (diffusers keeps the list)."""
        self._load({"shadow_params": values}, "EMAModel.shadow_params")
