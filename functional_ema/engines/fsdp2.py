"""torch FSDP2 (``fully_shard``) adapter: each parameter's local fp32 shard, and the eval swap.

FSDP2 keeps every parameter it manages as a ``DTensor`` sharded ``Shard(0)`` over a 1-D device
mesh: rank ``r`` holds rows ``[r*c, min((r+1)*c, rows))`` of dim 0, ``c = ceil(rows / world)``
(``torch.chunk``), in its own padded buffer; the last ranks' pieces are short or empty. The piece
read here is ``p._local_tensor``, the unpadded view of that buffer that the optimizer updates (no
copy); its place in the flattened parameter is ``offset = first_row * prod(shape[1:])``,
``numel = local numel`` (``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``,
cross-checked against the local tensor). Internals relied on (torch 2.13):

* ``FSDPModule._get_fsdp_state()._fsdp_param_groups[*].fsdp_params``: one ``FSDPParam`` per managed
  parameter; ``fsdp_param.sharded_param`` is the ``DTensor`` parameter the optimizer holds, and
  ``fsdp_param._module_info`` names the module attribute(s) it is registered under. After a
  forward the root module's attributes hold *unsharded* plain tensors until ``reshard()``, so the
  parameters are looked up through the ``FSDPParam`` objects, never through the attributes.
* ``sharded_param._local_tensor`` is a view of ``fsdp_param._sharded_param_data`` (the padded 1-D
  buffer FSDP2 all-gathers from, casting to ``MixedPrecisionPolicy.param_dtype``), so writing the
  local tensor changes what the next forward gathers.
* FSDP2 replaces sharded parameters or their local tensors only in
  ``FSDPParam.reset_sharded_param`` (from ``module._apply``, lazy init and its own
  ``load_state_dict`` post-hook); see ``_Token`` for how a reading notices.

Decisions:

* ``Shard(0)`` on a 1-D mesh (plain ``fully_shard``) and HSDP, ``(Replicate(), Shard(0))`` on a 2-D
  ``(replicate, shard)`` mesh, are read. Under HSDP each replica is a data-parallel group of its own
  (the layout's rank and world are the shard dimension's) and the layout names the replica (the row
  of the mesh its shard group lies on, so each shard rank of a replica is one rank): the pieces of
  replica ``r`` equal replica 0's, so only replica 0 writes checkpoint files and the checkpoint is
  that of one shard group (loadable at any layout). A mesh whose replicate groups hold different
  shards (FSDP2 trains it wrong) is refused, see ``_check_replicate_groups``. ``Shard(d>0)`` from
  ``shard_placement_fn`` raises, naming the parameter.
* Tensor parallelism (``parallelize_module`` over a 1-D mesh, with ``fully_shard`` over the rest of a
  2-D or 3-D mesh, or alone): the layout's part is the tensor-parallel rank and ``tp_dims`` each
  parameter's split (``Shard(d)`` there: ``d``; ``Replicate()`` and plain parameters: ``None``). FSDP2
  shards dim 0 of the rank's tensor-parallel slice (``FSDPParam._orig_size``, its DTensor spec before
  sharding in ``_unsharded_dtensor_spec``), so each piece is a contiguous run of that slice, placed by
  the same ``torch.chunk`` arithmetic, read from FSDP2's own record (``FSDPParam.mesh_info``: the shard
  group, and HSDP's replicate group) rather than from the composed placements
  (``_StridedShard``). Without ``fully_shard`` the whole local slice is the piece (data-parallel world 1).
* A trainable parameter outside every ``fully_shard``-ed module (a plain tensor) is *replicated*:
  every rank's piece is the whole parameter (offset 0), as for DDP. FSDP2 does not reduce its
  gradients; keeping the copies equal across ranks is the training loop's job (``gather_full``
  takes the last rank's copy, ``consolidate`` rank 0's).
* A submodule or parameter added, replaced or renamed after a reading was made is seen (torch's global
  registration hooks count it, see ``_watch_registrations``) and the model is read again: ``update`` then
  averages the new weights under the same names, or refuses a state that no longer fits, naming the parameter.
  A tensor set over a parameter ``fully_shard`` manages is refused, naming it: FSDP2 would put its own back at
  the next forward. So is a plain tensor where the last reading had a managed parameter (its module replaced
  after ``fully_shard``: FSDP2 neither shards nor reduces the new one). A submodule removed (``del``) is seen by
  its parent's submodule count.
* Parameters frozen (``requires_grad=False``) when the model is first read are left out; one frozen
  later keeps its place (``_base.is_read``). Tied parameters appear once, under the first name
  ``named_parameters()`` gives them.
"""

from __future__ import annotations

import contextlib
import functools
import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist

from .._layout import ModelPart, ShardLayout, ShardSpec
from .._shards import shards_from_views
from .._state import finish
from ._base import (
    _ONCE,
    Adapter,
    Reading,
    any_requires_grad,
    is_read,
    parameters_put_back,
    swap_by_copy,
    unmoved,
    warn_low_precision,
    world_of,
)
from ._torch_compat import check_fsdp2_internals, is_known_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from ._base import SwapStats

__all__ = ["FSDP2Adapter", "is_fsdp2", "fsdp_modules", "flatten_local_shards", "internal_module_reason"]

_local_tensor_of = operator.attrgetter("_local_tensor")


def is_fsdp2(x: Any) -> bool:
    """Whether ``x`` or one of its submodules has FSDP2 applied, or ``x`` has ``DTensor`` parameters
    (tensor parallelism without ``fully_shard``, read by the same adapter)."""
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(x, torch.nn.Module) and (
        any(isinstance(m, FSDPModule) for m in x.modules()) or any(isinstance(p, DTensor) for p in x.parameters())
    )


def internal_module_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` must not be read because torch FSDP manages its parameters from outside it, or ``None``.

    * torch FSDP1 (``FullyShardedDataParallel``, its ``FlatParameter``): not read (its flat, padded shards are not
      the parameters' layout); use FSDP2 (``fully_shard``).
    * a submodule inside a ``fully_shard``-ed module that ``fully_shard`` was not applied to itself (FSDP2 marks
      every module it manages ``_is_fsdp_managed_module``; those that are not ``FSDPModule`` are managed by an
      enclosing one): its parameters are sharded DTensors (or, after a forward, gathered copies) whose state
      lives in the enclosing module, so read alone they would be taken for tensor-parallel slices or for whole
      weights. A module ``fully_shard`` was applied to is read as a model of its own (its parameters, names
      relative to it), also when it sits inside a larger ``fully_shard``-ed model.

    The enclosing module cannot be found from the submodule (no reference back), so the message says what to pass.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return None
    fsdp1 = _fsdp1_class()
    for name, m in module.named_modules():
        if fsdp1 is not None and isinstance(m, fsdp1):
            where = f"its submodule {name!r} is" if name else "it is"
            return (
                f"{type(module).__qualname__}: {where} torch FSDP1 (FullyShardedDataParallel), whose flat sharded "
                "parameters functional_ema does not read; apply FSDP2 (torch.distributed.fsdp.fully_shard) instead"
            )
    for name, p in module.named_parameters():
        if getattr(p, "_is_flat_param", False):
            return (
                f"{type(module).__qualname__}: parameter {name!r} is a torch FSDP1 FlatParameter (this is the module "
                "inside a FullyShardedDataParallel wrapper); functional_ema does not read FSDP1: apply FSDP2 "
                "(torch.distributed.fsdp.fully_shard) and pass that model"
            )
    # the module's own attribute: a torch.compile wrapper (OptimizedModule) forwards attribute reads to the model it
    # wraps, so getattr would take the wrapper of a fully_shard-ed root for a submodule inside it
    if vars(module).get("_is_fsdp_managed_module", False) and not isinstance(module, FSDPModule):
        return (
            f"{type(module).__qualname__} is a submodule inside a module that torch FSDP manages (fully_shard, or "
            "FSDP1's FullyShardedDataParallel, was applied to an enclosing module, not to this one): its parameters "
            "are sharded, gathered and updated "
            "through the enclosing module's FSDP state. Pass the model fully_shard was applied to (the root), or "
            "apply fully_shard to this submodule too"
        )
    return None


def _fsdp1_class() -> type | None:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # pragma: no cover
        return None
    return FullyShardedDataParallel


def fsdp_modules(model: torch.nn.Module) -> list[FSDPModule]:
    """Every module of ``model`` that ``fully_shard`` was applied to, in ``modules()`` order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _param_groups(module: FSDPModule) -> list[Any]:
    state = module._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is None:  # torch < 2.11: at most one group per module
        group = state._fsdp_param_group
        groups = [group] if group is not None else []
    return list(groups)


def _managed(model: torch.nn.Module) -> dict[tuple[int, str], Any]:
    """``(id(module), attribute name) -> FSDPParam`` for every registration of a managed parameter."""
    out = {}
    for m in fsdp_modules(model):
        for group in _param_groups(m):
            for fp in group.fsdp_params:
                info = fp._module_info
                out[(id(info.module), info.param_name)] = fp
                for mod, attr in zip(info.shared_modules, info.shared_param_names):
                    out[(id(mod), attr)] = fp
    return out


def _walk(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, Any, torch.nn.Module, str]]:
    """``(name, param, fsdp_param or None, module, attr)`` per parameter, each once (first name).

    Like ``named_parameters()``, but a managed parameter is its sharded ``DTensor`` even while the
    module attribute holds the unsharded tensor (after a forward, before ``reshard()``).
    """
    managed = _managed(model)
    seen: set[int] = set()
    for prefix, mod in model.named_modules():
        for attr, t in mod._parameters.items():
            if t is None:
                continue
            fp = managed.get((id(mod), attr))
            param = fp.sharded_param if fp is not None else t
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{prefix}.{attr}" if prefix else attr), param, fp, mod, attr


class _Placement(NamedTuple):
    """Where one FSDP2 parameter's pieces live: its data-parallel mesh (shard group and HSDP replicas)
    and, under tensor parallelism, its tensor-parallel mesh and split dimension."""

    dp_mesh: DeviceMesh | None
    shard_group: dist.ProcessGroup | None
    replica: int
    replicas: int
    tp_mesh: DeviceMesh | None  # None: not a tensor-parallel DTensor
    tp_dim: int | None  # Shard(d) over the tensor-parallel mesh; None: replicated there (or no TP)


def _refuse_unsharded_replacement(name: str, previous: Reading | None) -> None:
    """Refuse plain parameter ``name`` where the last reading had one that ``fully_shard`` manages: its module was
    replaced after ``fully_shard`` (FSDP2 leaves the new one alone: not sharded, its gradients not reduced)."""
    from torch.distributed.tensor import DTensor

    if previous is not None and previous.layout.engine == "fsdp2" and isinstance(previous.params.get(name), DTensor):
        raise RuntimeError(
            f"parameter {name!r} was sharded by fully_shard when the model was last read and is now a plain tensor: "
            "its module was replaced after fully_shard, and FSDP2 neither shards the new one nor reduces its "
            "gradients over the ranks. Call fully_shard on the new module before training it (or replace the "
            "module before fully_shard)"
        )


def _placement(name: str, fp: Any) -> _Placement:
    """Read from FSDP2's own record of the parameter (``FSDPParam.mesh_info``, ``fsdp_placement`` and,
    for a tensor-parallel DTensor, ``_unsharded_dtensor_spec``); refuse, naming the parameter, what the
    layout cannot place."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo
    from torch.distributed.tensor import Replicate, Shard

    info = fp.mesh_info
    placements = tuple(fp.sharded_param.placements)
    if not isinstance(info, FSDPMeshInfo):
        raise NotImplementedError(
            f"parameter {name!r} is replicated by FSDP2 without sharding ({type(info).__name__}, placed {placements}); "
            "functional_ema reads parameters that fully_shard shards (1-D mesh, or HSDP's 2-D mesh)"
        )
    if fp.fsdp_placement.dim != 0:
        raise NotImplementedError(
            f"parameter {name!r} is a DTensor placed {placements}: FSDP2 shards it along dim {fp.fsdp_placement.dim} "
            "(shard_placement_fn with Shard(dim>0)); functional_ema reads FSDP2 parameters sharded along dim 0"
        )
    # HSDP: the replica is the row of the (replicate, shard) mesh this rank's shard group lies on, not FSDP2's
    # replicate_mesh_rank (its place in the replicate group, ascending): on a mesh in another rank order that number
    # can differ within one shard group, and two ranks of one shard rank then both count as replica 0. Replica 0 is the
    # row holding the mesh's lowest rank (rows 0 and that one trade numbers), so that shard rank 0 of replica 0 is that
    # rank (global rank 0 on a whole-job mesh): where the integrations' rank-0 writers expect gather_full(dst=0).
    replica, replicas = 0, 1
    if isinstance(info, HSDPMeshInfo):  # this rank holds the parameter's shard: it is on the mesh
        dim = info.replicate_mesh_dim or 0
        row = list(info.mesh.get_coordinate() or ())[dim]
        grid = info.mesh.mesh
        lowest = int((grid == grid.min()).nonzero()[0][dim])
        replica = lowest if row == 0 else 0 if row == lowest else row
        replicas = info.replicate_mesh_size
    tp_mesh, tp_dim = None, None
    spec = getattr(fp, "_unsharded_dtensor_spec", None) if fp.is_dtensor else None
    if fp.is_dtensor:
        tp = tuple(spec.placements) if spec is not None else ()
        if spec is None or spec.mesh.ndim != 1 or len(tp) != 1 or type(tp[0]) not in (Shard, Replicate):
            raise NotImplementedError(
                f"parameter {name!r} is a DTensor placed {placements} (before fully_shard: {tp}); functional_ema reads "
                "FSDP2 over a 1-D tensor-parallel mesh whose parameters are Shard(d) or Replicate() there "
                "(ColwiseParallel, RowwiseParallel, SequenceParallel)"
            )
        tp_mesh = spec.mesh
        tp_dim = tp[0].dim % fp.sharded_param.ndim if type(tp[0]) is Shard else None
    return _Placement(info.mesh, info.shard_process_group, replica, replicas, tp_mesh, tp_dim)


def _fsdp_piece(name: str, fp: Any, where: _Placement) -> tuple[torch.Tensor, ShardSpec]:
    """The local piece of a managed parameter and where it sits in the parameter FSDP2 shards: the whole
    parameter, or under tensor parallelism this rank's tensor-parallel slice (``FSDPParam._orig_size``).

    FSDP2 cuts dim 0 of that tensor like ``torch.chunk``: rank ``r`` of the shard group holds rows
    ``[r*c, min((r+1)*c, rows))``, ``c = ceil(rows / shard world)``; checked against the local tensor."""
    local = fp.sharded_param._local_tensor
    shape = tuple(int(d) for d in fp._orig_size)
    size, rank = dist.get_world_size(where.shard_group), dist.get_rank(where.shard_group)
    chunk = -(-shape[0] // size) if shape else 0
    first = rank * chunk
    rows = max(0, min(chunk, shape[0] - first)) if shape else 0
    if tuple(local.shape) != (rows, *shape[1:]) or local.numel() != fp.sharded_param.to_local().numel():
        raise RuntimeError(
            f"parameter {name!r}: FSDP2's local shard has shape {tuple(local.shape)}, but rank {rank} of {size} holds "
            f"rows [{first}, {first + rows}) of {shape}; the torch FSDP2 internals differ from the ones functional_ema "
            "was written for"
        )
    if not local.is_contiguous():
        raise RuntimeError(f"parameter {name!r}: FSDP2's local shard is not contiguous (stride {local.stride()})")
    numel = local.numel()
    return local.detach(), ShardSpec(shape, first * math.prod(shape[1:]) if numel else 0, numel)


def _check_replicate_groups(name: str, where: _Placement) -> None:
    """Refuse an HSDP mesh whose replicate groups hold different shards; plain arithmetic on the mesh (no exchange),
    the same on every rank of it, so every rank refuses it when the model is read, before anything is saved.

    torch numbers each process group's ranks in ascending order, and FSDP2 cuts each parameter by that number in
    the shard group (``shard_mesh_rank``), whatever the mesh's order. On a mesh such as ``[[3, 1], [0, 2]]`` the
    replicate group ``[3, 0]`` then holds shards 1 and 0: FSDP2 all-reduces different shards' gradients (its
    replicas train apart), and no replica's EMA is the model's."""
    if where.replicas == 1 or where.dp_mesh is None:
        return
    grid = where.dp_mesh.mesh.reshape(where.replicas, -1)  # FSDP2's HSDP mesh: (replicate, shard), 2-D
    shard = grid.argsort(dim=1).argsort(dim=1)  # each rank's number in its shard group (a row), as torch gives it
    mixed = (shard != shard[:1]).any(dim=0).nonzero().flatten().tolist()
    if not mixed:
        return
    ranks, shards = grid[:, mixed[0]].tolist(), shard[:, mixed[0]].tolist()
    listed = ", ".join(str(s) for s in shards[:-1]) + f" and {shards[-1]}"
    raise ValueError(
        f"parameter {name!r} is sharded by FSDP2 over the HSDP mesh {grid.tolist()} (replicate, shard), whose "
        f"replicate group {ranks} holds shards {listed}: torch numbers a shard group's ranks in ascending order "
        "and FSDP2 cuts each parameter by that number, so this group all-reduces different shards' gradients and "
        "its replicas train apart (no replica's EMA would be the model's). Build the mesh so that each column's "
        "ranks have the same place in their rows' ascending order (init_device_mesh's ranks in order do)"
    )


def _sharding_group(first: tuple[str, _Placement] | None, tp_only: bool) -> tuple[Any, int, int]:
    """(the group the EMA is sharded over, this rank's replica index, the number of replicas), from the first managed
    parameter's placement (every other was checked the same)."""
    if first is not None:
        return first[1].shard_group, first[1].replica, first[1].replicas
    if tp_only:  # tensor parallelism without fully_shard: no data-parallel sharding
        return None, 0, 1
    # no managed parameter at all (fully_shard on parameter-free modules): replicated
    return (dist.group.WORLD if dist.is_available() and dist.is_initialized() else None), 0, 1


def _check_same(name: str, first: tuple[str, _Placement], where: _Placement) -> None:
    """Every managed parameter on one data-parallel mesh, and every tensor-parallel one on one TP mesh."""
    other, seen = first
    if where.dp_mesh != seen.dp_mesh:
        raise NotImplementedError(
            f"parameter {name!r} is sharded over mesh {where.dp_mesh}, {other!r} over {seen.dp_mesh}; functional_ema "
            "reads FSDP2 models whose parameters share one data-parallel mesh"
        )


def _model_part(read: dict[str, _Placement], names: list[str]) -> tuple[ModelPart, dict | None]:
    """The tensor-parallel part this rank holds and each parameter's split (``None``: replicated over the
    tensor-parallel ranks, as every parameter that is not a tensor-parallel DTensor is)."""
    meshes = [w.tp_mesh for w in read.values() if w.tp_mesh is not None]
    if not meshes:
        return ModelPart(), None
    tp_mesh = meshes[0]
    for n, w in read.items():
        if w.tp_mesh is not None and w.tp_mesh != tp_mesh:
            raise NotImplementedError(
                f"parameter {n!r} is split over tensor-parallel mesh {w.tp_mesh}, others over {tp_mesh}; functional_ema "
                "reads models with one tensor-parallel mesh"
            )
    dims = {n: (read[n].tp_dim if n in read else None) for n in names}
    return ModelPart(tp=tp_mesh.get_local_rank(), tp_size=tp_mesh.size()), dims


def _tensor_parallel_only(name: str, param: DTensor) -> tuple[torch.Tensor, ShardSpec, _Placement]:
    """A tensor-parallel DTensor of a model without ``fully_shard``: the whole local slice is this rank's
    piece (no data-parallel sharding), its split read from the placement."""
    from torch.distributed.tensor import Replicate, Shard

    placements = tuple(param.placements)
    if param.device_mesh.ndim != 1 or type(placements[0]) not in (Shard, Replicate):
        raise NotImplementedError(
            f"parameter {name!r} is a DTensor placed {placements} on a {param.device_mesh.ndim}-D mesh; without "
            "fully_shard, functional_ema reads tensor-parallel DTensors placed Shard(d) or Replicate() on a 1-D mesh"
        )
    local = param._local_tensor
    if not local.is_contiguous():
        raise RuntimeError(f"parameter {name!r}: its local tensor is not contiguous (stride {local.stride()})")
    tp_dim = placements[0].dim % param.ndim if type(placements[0]) is Shard else None
    return (
        local.detach(),
        ShardSpec(tuple(local.shape), 0, local.numel()),
        _Placement(None, None, 0, 1, param.device_mesh, tp_dim),
    )


class FSDP2Adapter(Adapter):
    """A model with torch FSDP2 (``fully_shard``) applied to it or to some of its submodules."""

    name = "fsdp2"
    keeps_frozen = True

    def _read(self, previous: Reading | None = None) -> Reading:
        from . import refuse_engine_internals

        check_fsdp2_internals()  # the torch internals read below are there (see _torch_compat)
        model = self.target
        refuse_engine_internals(model)
        entries = list(_walk(model))
        where = {name: _placement(name, fp) for name, _, fp, _, _ in entries if fp is not None}
        first = next(iter(where.items()), None)
        if first is not None:
            for name, w in where.items():
                _check_same(name, first, w)
            _check_replicate_groups(*first)  # one mesh for all (checked): once per reading
        from torch.distributed.tensor import DTensor

        tp_only = first is None and any(isinstance(p, DTensor) for _, p, _, _, _ in entries)
        group, replica, replicas = _sharding_group(first, tp_only)
        rank, world = world_of(group) if not tp_only else (0, 1)

        named_views, specs, params = [], {}, {}
        managed, plain, frozen = [], [], []  # what _is_current compares (see _Token)
        for name, param, fp, mod, attr in entries:
            if fp is not None:
                _check_registered(name, fp, mod._parameters[attr])
                managed.append(fp)
            elif tp_only or not isinstance(param, DTensor):
                plain.append((mod, attr, param))
            if not is_read(name, param, previous, self.keep):
                frozen.append(param)
                continue
            if fp is not None:
                view, spec = _fsdp_piece(name, fp, where[name])
                setattr(fp, _SEEN, fp.sharded_param._local_tensor)  # what a later replacement is compared with
            elif tp_only and isinstance(param, DTensor):
                view, spec, where[name] = _tensor_parallel_only(name, param)
            elif isinstance(param, DTensor):
                raise NotImplementedError(
                    f"parameter {name!r} is a DTensor placed {tuple(param.placements)} that FSDP2 does not manage "
                    "(tensor parallelism without fully_shard over it?); functional_ema reads parameters that fully_shard "
                    "manages (tensor-parallel DTensors too) and plain tensors"
                )
            else:  # outside every fully_shard-ed module: replicated, the whole tensor on every rank
                _refuse_unsharded_replacement(name, previous)
                view, spec = param.detach(), ShardSpec(tuple(param.shape), 0, param.numel())
            named_views.append((name, view))
            specs[name] = spec
            params[name] = param
        shards = shards_from_views(named_views)
        warn_low_precision(
            "FSDP2 sharded parameters" if first is not None else "tensor-parallel DTensor parameters",
            dict(named_views),
            "Keep the sharded parameters in fp32 and gather them in 16 bits with fully_shard(..., "
            "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))",
        )
        part, tp_dims = _model_part({n: where[n] for n in specs if n in where}, list(specs))
        layout = ShardLayout(
            rank,
            world,
            0 if tp_only else 3,
            specs,
            engine="dtensor" if tp_only else "fsdp2",
            part=part,
            tp_dims=tp_dims,
            replica=replica,
            replicas=replicas,
        )
        _count_replacements()
        _watch_registrations(model)
        token = _Token([p for p in params.values() if isinstance(p, DTensor)], managed, plain, frozen, model)
        token.tp_mesh = next((w.tp_mesh for n, w in where.items() if n in specs and w.tp_mesh is not None), None)
        return Reading(shards, layout, params, group if world > 1 else None, token)

    def _is_current(self, reading: Reading) -> bool:
        return reading.token.current()

    def joins_slices(self, reading: Reading) -> bool:
        """DTensor parameters report their global shape, so ``gather_full`` returns that shape: joined."""
        return reading.token.tp_mesh is not None and reading.layout.part.tp_size > 1

    def join_slices(
        self, reading: Reading, part: dict[str, torch.Tensor], device: torch.device | str | None
    ) -> dict[str, torch.Tensor]:
        """Each ``Shard(d)`` parameter's slices all-gathered over the tensor-parallel mesh (DTensor's own
        ``full_tensor``, which also joins uneven ``torch.chunk`` splits) into the shape the parameter reports;
        ``Replicate()`` ones are whole already. One collective per split parameter, in name order, over the
        tensor-parallel group only; ``part`` is ``{}`` on every rank of a group, or on none (``dst``)."""
        from torch.distributed.tensor import DTensor, Shard

        mesh, dims = reading.token.tp_mesh, reading.layout.tp_dims or {}
        out = {}
        for name, piece in part.items():
            d = dims.get(name)
            t = piece
            if d is not None:
                shape = reading.params[name].shape  # a DTensor parameter: the global shape
                stride = tuple(math.prod(shape[i + 1 :]) for i in range(len(shape)))
                t = DTensor.from_local(piece, mesh, [Shard(d)], run_check=False, shape=shape, stride=stride)
                t = t.full_tensor()
            out[name] = t if device is None else t.to(device)
        return out

    @contextlib.contextmanager
    def swap(
        self, reading: Reading, pieces: Mapping[str, torch.Tensor], state: Any, index: int, changes: list[str]
    ) -> Iterator[SwapStats]:
        with _swap(self, reading, pieces, changes) as stats:
            yield stats

    def write_weights(self, reading: Reading, pieces: Mapping[str, torch.Tensor]) -> None:
        # A forward without a backward (validation, sampling) leaves the root's gathered weights, and those of
        # modules that do not reshard after forward, in place: the next forward would reuse them and compute with
        # the trained weights. Resharding first makes it all-gather the shards written here.
        _reshard(fsdp_modules(self.target))
        super().write_weights(reading, pieces)


# How many times FSDP2 has replaced a sharded parameter or its local tensor in this process (see
# _count_replacements); None until counting is installed (then readings compare each parameter).
_REPLACEMENTS: list[int | None] = [
    None
]  # reason: one process-wide count (an int, holds no object) of FSDP2's replacements
_SEEN = "_functional_ema_local"  # FSDPParam attribute: the local tensor last seen by a reading or a reset


# How many parameters and submodules were registered (added, replaced, renamed) on modules of FSDP2 models read in
# this process; None until the hooks counting them are installed (see _watch_registrations).
_REGISTRATIONS: list[int | None] = [None]  # reason: one process-wide count (an int, holds no object) of registrations
_WATCHED = "_functional_ema_watched"  # module attribute: a module of an FSDP2 model read here (its registrations count)


def _watch_registrations(model: torch.nn.Module) -> None:
    """Count every parameter or submodule registered on a module of ``model`` from now on.

    A submodule replaced under its name (``model.norm = nn.LayerNorm(d)``, ``model.block = fully_shard(new)``,
    ``model.block[2] = nn.Linear(...)``), renamed, or a parameter or module added, after a reading was made changes
    no local tensor FSDP2 holds: the old FSDP2 parameters live on in the FSDP state (and the old plain ones in the
    detached module), so without this count the reading stayed current and ``update`` silently went on averaging
    the dead weights (or left the new ones out). torch's global registration hooks (``nn.Module.__setattr__``,
    ``register_parameter``, ``add_module``), installed once per process, see each such change; they count it, one
    integer, only when the module registered on carries the mark set here, so modules built elsewhere in the process
    (an eval model, compiled graphs) do not make readings stale. The mark is a flag in the module's own ``__dict__``
    (no registry of modules is kept). FSDP2's own swaps of sharded and unsharded parameters set ``_parameters``
    directly and are not counted. Removing a submodule (``del model.head``) registers nothing; the reading's token
    sees it by its parent's submodule count instead (``_Token.parents``).
    """
    if _REGISTRATIONS[0] is None:
        from torch.nn.modules.module import (
            register_module_module_registration_hook,
            register_module_parameter_registration_hook,
        )

        register_module_module_registration_hook(_registered)  # the handles are dropped: hooks for the process
        register_module_parameter_registration_hook(_registered)
        _REGISTRATIONS[0] = 0
    for m in model.modules():
        m.__dict__[_WATCHED] = True  # not setattr: nn.Module.__setattr__ would be a registration itself


def _registered(module: torch.nn.Module, name: str, value: Any) -> None:
    """Global registration hook (see ``_watch_registrations``): returns ``None``, so the value is registered as is."""
    count = _REGISTRATIONS[0]
    if count is not None and module.__dict__.get(_WATCHED, False):
        _REGISTRATIONS[0] = count + 1


def _count_replacements() -> None:
    """Count, once per process, FSDP2's replacements of sharded parameters and local tensors.

    FSDP2 replaces them only in ``FSDPParam.reset_sharded_param`` (from ``module._apply``, lazy init and
    its ``load_state_dict`` post-hook); wrapping that method to count the calls that did replace
    something lets a reading check one integer instead of every parameter's local tensor, which on a
    model of hundreds of parameters is most of what ``local_shards`` costs right after an update has
    flushed the caches. Left as it is (each parameter compared) if the method is not there."""
    if _REPLACEMENTS[0] is not None or not is_known_torch():  # another torch: compare each parameter
        return
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    except ImportError:  # pragma: no cover - another torch layout
        return
    original = getattr(FSDPParam, "reset_sharded_param", None)
    if original is None:  # pragma: no cover
        return
    if not getattr(original, "_functional_ema_counts", False):

        @functools.wraps(original)
        def reset_sharded_param(self: FSDPParam, *args: Any, **kwargs: Any) -> Any:
            # ``_apply`` swaps local tensors before it calls this, so compare with the local tensor a
            # reading (or the last call) saw, as well as across the call itself
            seen = getattr(self, _SEEN, None)
            before = (self.sharded_param, getattr(self.sharded_param, "_local_tensor", None))
            try:
                return original(self, *args, **kwargs)
            finally:
                after = (self.sharded_param, getattr(self.sharded_param, "_local_tensor", None))
                if (
                    after[0] is not before[0]
                    or after[1] is not before[1]
                    or (seen is not None and before[1] is not seen)
                ):
                    _REPLACEMENTS[0] = (_REPLACEMENTS[0] or 0) + 1
                setattr(self, _SEEN, after[1])

        reset_sharded_param._functional_ema_counts = True  # type: ignore[attr-defined]  # reason: the wrapper's own marker, read back above
        FSDPParam.reset_sharded_param = reset_sharded_param  # type: ignore[method-assign]  # reason: the counting patch (see docstring)
    _REPLACEMENTS[0] = 0


class _Token:
    """Cheap re-validation of a reading, no module walk.

    Current when no ``load_state_dict`` ran on a module that owns a managed parameter since the
    reading was made, no parameter or submodule was registered on a module of a model read since
    (one integer, counted by ``_watch_registrations``: a submodule or parameter added, replaced or
    renamed, in a ``fully_shard``-ed block or outside every one), FSDP2 replaced no sharded
    parameter or local tensor since (one integer, counted by ``_count_replacements``; where counting
    could not be installed, each managed parameter read must still hold the local tensor object the
    reading's views were made from),
    each parameter outside FSDP2 (tensor-parallel DTensors without ``fully_shard`` too) is still the module attribute
    with the same memory, and no parameter left out as frozen requires grad now (unfreezing one
    is seen; freezing a parameter read changes nothing, see ``_base.is_read``).

    Why these catch every replacement: FSDP2 swaps in new parameters or local tensors only in
    ``FSDPParam.reset_sharded_param``, which runs from ``module._apply`` (``.to()`` and the like:
    ``swap_tensors`` gives the same parameter object a new local tensor), from lazy init (a local
    tensor re-padded: a new local tensor object) and from a ``load_state_dict`` post-hook
    (``assign=True`` installs new parameter objects, the old ones keep their local tensors). The
    first two change a local tensor object, counted (or compared per parameter); the third is seen by
    post-hooks the reading registers on the owning modules, beside FSDP2's own, and removes when
    a newer reading replaces it. (FSDP2 never moves a sharded local tensor's memory in place, so
    its data pointer is not compared.)

    The replacement count is what keeps a reading's check to one integer comparison per call rather
    than a pass over every parameter (docs/performance.md has the figures).
    """

    __slots__ = (
        "read",
        "locals",
        "plain_mods",
        "plain_attrs",
        "plain_params",
        "views",
        "parents",
        "child_counts",
        "frozen",
        "loaded",
        "hooks",
        "replacements",
        "registrations",
        "tp_mesh",
    )

    def __init__(
        self,
        read: Sequence[DTensor],
        managed: Sequence[Any],
        plain: Sequence[tuple[torch.nn.Module, str, torch.Tensor]],
        frozen: Sequence[torch.Tensor],
        model: torch.nn.Module,
    ) -> None:
        """``read``: the DTensor parameters read; ``managed``: every ``FSDPParam`` (frozen ones too);
        ``plain``: ``(module, attribute, parameter)`` outside FSDP2; ``frozen``: the ones left out; ``model``: the
        model read (the submodule counts of its modules that have submodules are kept)."""
        self.read = tuple(read)
        self.locals = tuple(map(_local_tensor_of, self.read))
        # Kept as three tuples so current() compares them in C-level passes (no Python loop per parameter).
        self.plain_mods = tuple(mod for mod, _, _ in plain)
        self.plain_attrs = tuple(attr for _, attr, _ in plain)
        self.plain_params = tuple(p for _, _, p in plain)
        self.views = tuple(map(_view_of, self.plain_params))
        self.frozen = tuple(frozen)
        # A submodule removed (`del model.norm`) registers nothing (the hooks above do not see it), but shrinks its
        # parent's `_modules`: one `len` per module that has submodules (34 of 293 modules in bench_update's model).
        self.parents = tuple(m._modules for m in model.modules() if m._modules)
        self.child_counts = tuple(map(len, self.parents))
        self.loaded = False  # set by the load_state_dict post-hooks below
        self.replacements = _REPLACEMENTS[0]  # None: compare each parameter's local tensor instead
        self.registrations = _REGISTRATIONS[0]
        self.tp_mesh: Any = None  # the tensor-parallel mesh (gather_full joins the slices over it), if any
        owners: dict[int, torch.nn.Module] = {}
        for fp in managed:
            info = fp._module_info
            for mod in (info.module, *info.shared_modules):
                owners[id(mod)] = mod
        self.hooks = [mod.register_load_state_dict_post_hook(_LoadSeen(self)) for mod in owners.values()]

    def current(self) -> bool:
        return (
            not self.loaded
            and _REGISTRATIONS[0] == self.registrations
            and (
                _REPLACEMENTS[0] == self.replacements
                if self.replacements is not None
                else all(map(operator.is_, map(_local_tensor_of, self.read), self.locals))
            )
            and all(
                map(operator.is_, map(dict.get, map(_PARAMETERS, self.plain_mods), self.plain_attrs), self.plain_params)
            )
            and unmoved(map(_local_of, self.plain_params), self.views)
            and not any_requires_grad(*self.frozen)
            and tuple(map(len, self.parents)) == self.child_counts
        )

    def close(self) -> None:
        """Remove the post-hooks (the reading was replaced)."""
        for handle in self.hooks:
            handle.remove()
        self.hooks = []


_PARAMETERS = operator.attrgetter("_parameters")  # a module's registry, read at each check (it may be replaced)


def _local_of(p: torch.Tensor) -> torch.Tensor:
    """What a parameter outside FSDP2 holds its values in (a tensor-parallel DTensor: its local tensor)."""
    return getattr(p, "_local_tensor", p)


def _view_of(p: torch.Tensor) -> torch.Tensor:
    """A view of :func:`_local_of` taken at the reading, for ``_base.unmoved``."""
    return _local_of(p).detach()


class _LoadSeen:
    """``load_state_dict`` post-hook: marks a reading stale. Copies and pickles of the model get
    a hook that does nothing (the reading belongs to this process's model)."""

    __slots__ = ("token",)

    def __init__(self, token: _Token | None) -> None:
        self.token = token

    def __call__(self, module: torch.nn.Module, incompatible_keys: Any) -> None:
        if self.token is not None:
            self.token.loaded = True

    def __deepcopy__(self, memo: dict[int, Any]) -> _LoadSeen:
        return _LoadSeen(None)

    def __reduce__(self) -> tuple[type[_LoadSeen], tuple[None]]:
        return (_LoadSeen, (None,))


def _reshard(modules: list[FSDPModule]) -> None:
    for m in modules:
        m.reshard()


def _busy(modules: list[FSDPModule]) -> list[bool]:
    """Per module: whether FSDP2 is inside a forward or backward (its state is not IDLE)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    return [m._get_fsdp_state()._training_state != TrainingState.IDLE for m in modules]


def _recover(modules: list[FSDPModule], busy_before: list[bool]) -> None:
    """Reset FSDP2's iteration state when a backward was aborted inside the block.

    ``swapped`` refuses a backward from a gradient hook on the model's output, which runs after
    the root's own pre-backward hook (FSDP2 registers it first): the root is left in
    ``PRE_BACKWARD``, and its next forward would then be taken for an activation-checkpointing
    recompute and skip the all-gather, computing silently with stale weights. FSDP2's recovery
    API for an aborted backward, ``reset_iter_state()`` on the root, restores it. Only called
    when a module left IDLE during the block, so gradient accumulation outside it is untouched.
    """
    busy = _busy(modules)
    if not any(now and not before for now, before in zip(busy, busy_before)):
        return
    for m in modules:
        if m._get_fsdp_state()._is_root:
            m.reset_iter_state()


@contextlib.contextmanager
def _swap(
    adapter: FSDP2Adapter, reading: Reading, pieces: Mapping[str, torch.Tensor], changes: list[str]
) -> Iterator[SwapStats]:
    """Copy the EMA pieces into the local shards between two reshards of every FSDP module.

    A forward leaves the root module's parameters unsharded (gathered live weights) until
    ``reshard()``: resharding first makes the next forward all-gather the swapped shards, and
    resharding on exit drops the gathered EMA weights before the live shards come back. With a
    ``MixedPrecisionPolicy`` the all-gather casts the fp32 EMA shards to ``param_dtype``, as it
    casts the live ones. Extra memory: one copy of the local shards (``swap_by_copy``).

    On exit the live values go, by name, into the local shards the model holds *then*
    (``_after_block``): a block that re-typed the model (``model.to(dtype)``: FSDP2 gives the same
    parameter objects new local tensors) or loaded with ``assign=True`` (new parameter objects) does
    not keep the EMA. Parameters outside FSDP2 are put back as on entry (``parameters_put_back``).
    """
    model = adapter.target
    modules = fsdp_modules(model)
    _reshard(modules)
    busy_before = _busy(modules)
    managed = _managed(model)
    # every managed parameter's object and local tensor on entry (references, no copy): a block that re-types or
    # re-assigns gives FSDP2 new local tensors, and the frozen parameters' values, never swapped, come from these
    entry = {id(fp): (fp.sharded_param, fp.sharded_param._local_tensor) for fp in managed.values()}

    def current() -> Mapping[str, torch.Tensor]:
        return _after_block(adapter, model, modules, managed, entry, changes)

    with swap_by_copy(reading, pieces, current=current) as stats:
        try:
            with parameters_put_back(model, changes, skip=lambda mod, attr: (id(mod), attr) in managed):
                yield stats
        finally:
            # Each step also when an exception (Ctrl-C) lands in another (finish); the registrations before reshard,
            # which would overwrite them silently.
            steps = (
                (lambda _: _registered_back(model, managed, changes), _ONCE),
                (lambda _: _recover(modules, busy_before), _ONCE),
                (lambda _: _reshard(modules), _ONCE),
            )
            try:
                finish(*steps)
            except BaseException:  # one that landed before finish began: every step again, then raised
                finish(*steps)
                raise


def _expected_registration(fp: Any) -> torch.Tensor | None:
    """The tensor FSDP2 keeps registered for ``fp`` in its present state: the sharded parameter, or while gathered
    the unsharded one (``None``: a state not known here, nothing to compare)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    return {
        ShardedState.SHARDED: fp.sharded_param,
        ShardedState.UNSHARDED: getattr(fp, "_unsharded_param", None),
        ShardedState.SHARDED_POST_FORWARD: getattr(fp, "_sharded_post_forward_param", None),
    }.get(fp.sharded_state)


def _check_registered(name: str, fp: Any, registered: torch.Tensor | None) -> None:
    """Refuse, naming it, a parameter set on its module after ``fully_shard`` managed that attribute.

    FSDP2 does not manage the new tensor: its next forward registers FSDP2's own (gathered, then sharded) parameter
    there again, silently, so the new values are never used and an optimizer built over the new tensor trains nothing.
    Reading FSDP2's parameter would average weights the user meant to replace; reading the new tensor would average
    weights the model never computes with. Neither is the EMA the user wants, so say what happened."""
    expected = _expected_registration(fp)
    if expected is not None and registered is not None and registered is not expected:
        raise RuntimeError(
            f"parameter {name!r}: a new tensor ({type(registered).__name__} of shape {tuple(registered.shape)}) was "
            "set on its module after fully_shard, which manages that attribute; FSDP2 does not manage the new tensor "
            "and puts its own sharded parameter back at the next forward, so the new values would never be used. "
            "Load values into FSDP2's parameter instead (model.load_state_dict, "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict, or copy_ under torch.no_grad()), or set "
            "a new submodule and apply fully_shard to it"
        )


def _registered_back(model: torch.nn.Module, managed: dict[tuple[int, str], Any], changes: list[str]) -> None:
    """Each managed registration is the tensor FSDP2 expects there now (its sharded parameter, or while
    gathered its unsharded one); one the block set is put back and named in ``changes``."""
    for prefix, mod in model.named_modules():
        for attr, t in list(mod._parameters.items()):
            fp = managed.get((id(mod), attr))
            if fp is None:
                continue
            expected = _expected_registration(fp)
            if expected is not None and t is not expected:
                name = f"{prefix}.{attr}" if prefix else attr
                changes.append(f"{name!r} replaced on its module (FSDP2's own parameter set back)")
                mod._parameters[attr] = expected


def _after_block(
    adapter: FSDP2Adapter,
    model: torch.nn.Module,
    modules: list[FSDPModule],
    managed: dict[tuple[int, str], Any],
    entry: dict[int, tuple[torch.Tensor, torch.Tensor]],
    changes: list[str],
) -> Mapping[str, torch.Tensor]:
    """After a ``swapped`` block, resharded: the managed registrations are FSDP2's sharded parameters again, a
    parameter the block re-typed is cast back to its dtype on entry (as ``module._apply`` does it: the same object,
    ``swap_tensors``, then ``FSDPParam.reset_sharded_param``), and the local shards the model now holds are
    returned by name (a new reading) for the live values to be copied into."""
    _registered_back(model, managed, changes)
    grad = torch.is_grad_enabled()
    try:
        # Not torch.no_grad(): an exception (Ctrl-C) landing in its __enter__ or __exit__ (this runs in swapped's
        # exit) would leave gradients off for the rest of the training; one C call each way cannot be cut.
        torch._C._set_grad_enabled(False)
        seen: set[int] = set()
        for fp in managed.values():
            if id(fp) in seen:
                continue
            seen.add(id(fp))
            param, local = entry[id(fp)]
            name = fp._param_fqn or fp._module_info.param_name
            if fp.sharded_param is not param:
                changes.append(
                    f"{name!r} replaced by a new parameter object (load_state_dict(assign=True)?): the model holds it, "
                    "with the trained values, but an optimizer built before still updates the old one"
                )
            now = fp.sharded_param
            if now._local_tensor.dtype != local.dtype:
                changes.append(f"{name!r} re-typed ({now._local_tensor.dtype} -> back to {local.dtype})")
                torch.utils.swap_tensors(now, torch.nn.Parameter(now.to(local.dtype), requires_grad=now.requires_grad))
                fp.reset_sharded_param()
            current = fp.sharded_param._local_tensor
            if current is not local and current.shape == local.shape:
                current.copy_(local)  # the values on entry (the EMA for swapped ones, restored by the caller next)
    finally:
        torch._C._set_grad_enabled(grad)
    _reshard(modules)
    return adapter.read().shards


def flatten_local_shards(model: torch.nn.Module) -> int:
    """Opt-in: move every FSDP2 parameter's local shard into one flat buffer (per device and dtype).

    FSDP2 keeps each parameter's shard in its own padded buffer, so ``update`` over FSDP2 shards is
    one ``_foreach_lerp_`` over as many tensors as the model has, which on CPU costs a dispatch per
    tensor (docs/performance.md has the figures). After this call ``local_shards(model)`` finds one
    segment and ``update`` is one ``lerp_``.

    It copies each padded shard buffer (``FSDPParam._sharded_param_data``, what the all-gather
    reads) into the flat buffer and points that buffer and the ``DTensor``'s local tensor (what the
    optimizer updates) at it: values, optimizer references and training are unchanged (tested
    bitwise against an untouched twin). Call it after ``fully_shard`` and outside a forward or
    backward (every parameter sharded); optimizer state may already exist. Parameters with CPU
    offload keep their pinning. Relies on FSDP2 internals (torch 2.13): see the module docstring.

    Returns:
        The number of parameter shards moved.
    """
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    fps = [fp for m in fsdp_modules(model) for g in _param_groups(m) for fp in g.fsdp_params]
    for m in fsdp_modules(model):
        if m._get_fsdp_state()._training_state != TrainingState.IDLE:
            raise RuntimeError("flatten_local_shards: call it outside a forward or backward")
    for fp in fps:
        if fp.sharded_state != ShardedState.SHARDED:
            raise RuntimeError(
                f"flatten_local_shards: parameter {fp._param_fqn or fp._module_info.param_name!r} is not sharded "
                "(a forward left it gathered): call model.reshard() first"
            )
    by_kind: dict[tuple, list] = {}
    for fp in fps:
        data = fp._sharded_param_data
        by_kind.setdefault((data.device, data.dtype, data.is_pinned()), []).append(fp)
    with torch.no_grad():
        for (device, dtype, pinned), group in by_kind.items():
            flat = torch.empty(
                sum(fp._sharded_param_data.numel() for fp in group), dtype=dtype, device=device, pin_memory=pinned
            )
            cursor = 0
            for fp in group:
                old = fp._sharded_param_data
                new = flat.narrow(0, cursor, old.numel())
                new.copy_(old)
                cursor += old.numel()
                rows = fp.sharded_param._local_tensor.shape[0]
                fp._sharded_param_data = new
                fp.sharded_param._local_tensor = new.view(fp.padded_sharded_param_size).narrow(0, 0, rows)
    if _REPLACEMENTS[0] is not None:  # local tensors replaced here, not by FSDP2: readings must see it
        _REPLACEMENTS[0] += 1
    return len(fps)
