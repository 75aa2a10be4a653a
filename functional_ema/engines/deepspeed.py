"""DeepSpeed adapter: this rank's fp32 master partitions, and the eval swap per ZeRO stage.

Every function here takes a ``deepspeed.DeepSpeedEngine``. DeepSpeed itself is never imported, so
the package works without it. Internals relied on (DeepSpeed 0.19):

* ZeRO-3: each trainable parameter ``p`` owns ``[r*ps, (r+1)*ps)`` of its flattened values on rank
  ``r`` (``ps = p.partition_numel()``), stored in ``opt.fp32_partitioned_groups_flat[g]`` at
  ``opt.grad_position[id][1]``. The tail of the last piece is uninitialised padding and is cut off.
* ZeRO-1/2: ``p._hp_mapping.hp_fragment`` is a view into the flat fp32 partition, and
  ``p._hp_mapping.lp_fragment_address`` gives its offset and length in the flattened parameter.
* ZeRO-0: fp32 training updates the parameters themselves; 16-bit training keeps fp32 copies in
  the wrapper optimizer (``fp32_groups`` per parameter, or ``fp32_groups_flat``). A bf16 ``PipelineEngine``
  gets ``BF16_Optimizer`` even at ZeRO-0: it is read as at ZeRO-1 (its masters are cut over the
  data-parallel group, so the layout says stage 1 when that group has several ranks).
* MoE (``deepspeed.moe.layer.MoE``, ZeRO-1/2): the ``num_local_experts`` experts of expert-parallel
  rank ``ep`` are ``deepspeed_experts.0 .. L-1`` on every rank (global expert ``ep * L + i``, as
  DeepSpeed's own checkpoint names them); their fp32 masters are cut over the expert-data-parallel
  group (``opt.real_dp_process_group[g]`` of the ``moe`` param group), still reached through
  ``_hp_mapping``. The other parameters are cut over the whole data-parallel group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

from .._errors import SwappedTrainingError
from .._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from .._shards import shards_from_views
from .._state import finish
from .._tree import short_list
from ._base import (
    Adapter,
    Reading,
    SwapStats,
    any_requires_grad,
    gather_pieces,
    is_read,
    parameters_put_back,
    placeholder_form,
    warn_low_precision,
    world_of,
)

if TYPE_CHECKING:
    from .._state import EmaState

__all__ = [
    "DeepSpeedAdapter",
    "is_deepspeed_engine",
    "data_parallel_group",
    "unsupported_reason",
    "engine_module_reason",
]


def is_deepspeed_engine(x: Any) -> bool:
    """Whether ``x`` is a ``deepspeed.DeepSpeedEngine`` (without importing DeepSpeed)."""
    return any(c.__name__ == "DeepSpeedEngine" and c.__module__.startswith("deepspeed") for c in type(x).__mro__)


_PASS_ENGINE = (
    "pass the engine (the object deepspeed.initialize returned) to functional_ema instead (local_shards, init_ema, "
    "save, load, swapped, gather_full all take it)"
)


def engine_module_reason(module: torch.nn.Module) -> str | None:
    """Why ``module`` must not be read as a plain model because DeepSpeed manages its parameters, or ``None``.

    The markers (DeepSpeed 0.19.8) are the ones DeepSpeed itself sets on the parameters, never guessed from dtypes:

    * ``ds_id`` / ``ds_tensor``: a ZeRO-3 partitioned placeholder (``deepspeed.zero.Init`` or a ZeRO-3 engine);
      the parameter holds no values (0 elements) outside a gather;
    * ``_hp_mapping`` (set on every trained parameter by ``link_hp_params``, also ``None`` on a rank that owns
      none of it): a ZeRO-1/2 (or ``BF16_Optimizer``) parameter, a training copy of an fp32 master partition the
      optimizer owns, also in fp32 training (the masters are a separate flat partition);
    * a ``deepspeed.pipe.PipelineModule``: one pipeline stage's layers, placed by the ``PipelineEngine``.

    The module does not know its engine (DeepSpeed keeps no reference back), so the library cannot find the
    engine itself; the message says what to pass.
    """
    for name, m in module.named_modules():
        if any(c.__name__ == "PipelineModule" and c.__module__.startswith("deepspeed") for c in type(m).__mro__):
            where = f"its submodule {name!r} is" if name else "it is"
            return (
                f"{type(module).__qualname__} cannot be read as a plain model: {where} a DeepSpeed PipelineModule, one "
                f"pipeline stage's layers whose training weights the PipelineEngine's optimizer holds; {_PASS_ENGINE}"
            )
    for name, p in module.named_parameters():
        if hasattr(p, "ds_id") or hasattr(p, "ds_tensor"):
            return (
                f"{type(module).__qualname__} is the module of a DeepSpeed ZeRO-3 engine (or built under "
                f"deepspeed.zero.Init): parameter {name!r} is a partitioned placeholder (ds_id {getattr(p, 'ds_id', '?')}, "
                f"{p.numel()} elements here, full shape {tuple(getattr(p, 'ds_shape', p.shape))}), and its fp32 master "
                f"pieces live in the engine's optimizer; {_PASS_ENGINE}"
            )
        if hasattr(p, "_hp_mapping"):
            return (
                f"{type(module).__qualname__} is the module of a DeepSpeed engine whose optimizer keeps fp32 master "
                f"partitions (ZeRO-1/2, or BF16_Optimizer): parameter {name!r} "
                f"({p.dtype}) is the training copy of an fp32 master partition the engine's optimizer updates "
                f"(_hp_mapping), so averaging it would average {p.dtype} copies instead of the fp32 masters; {_PASS_ENGINE}"
            )
    return None


class DeepSpeedAdapter(Adapter):
    """A ``deepspeed.DeepSpeedEngine``: ZeRO stages 0-3, fp32/bf16/fp16, CPU offload, tensor/pipeline parallelism,
    MoE expert parallelism (ZeRO-1/2), Ulysses sequence parallelism."""

    name = "deepspeed"

    def module(self) -> torch.nn.Module:
        return self.target.module

    def default_tag(self, state: EmaState | None) -> str:
        """DeepSpeed's own default tag, ``f"global_step{engine.global_steps}"``."""
        return f"global_step{self.target.global_steps}"

    def _token(self, waiting: tuple = ()) -> tuple:
        opt = self.target.optimizer
        return (opt, tuple(map(_data_ptr, _master_buffers(opt, self.target.zero_optimization_stage()))), waiting)

    def _is_current(self, reading: Reading) -> bool:
        # DeepSpeed does not move its master buffers in normal training; if it ever does (or the
        # optimizer is replaced), everything is read again. `waiting`: ZeRO-0's parameters its optimizer holds but
        # left out as frozen, one C-level pass (unfreezing one makes DeepSpeed train it, so it is read in).
        opt, ptrs, waiting = reading.token
        return (
            self.target.optimizer is opt
            and not any_requires_grad(*waiting)
            and tuple(map(_data_ptr, _master_buffers(opt, reading.layout.stage))) == ptrs
        )

    def frozen_in_optimizer(self) -> tuple[torch.nn.Parameter, ...]:
        """The frozen parameters the engine's optimizer holds and the reading leaves out (ZeRO-0 only: in fp32 any
        the client optimizer holds, which DeepSpeed trains once unfrozen; in 16 bits those trainable at
        ``deepspeed.initialize`` and frozen before the first reading; none at stages 1-3, whose partitions are read
        whatever ``requires_grad`` says), and which then join an integration's EMA."""
        return self.read().token[2]

    def _read(self, previous: Reading | None = None) -> Reading:
        engine = self.target
        reason = unsupported_reason(engine)
        if reason:
            raise NotImplementedError(reason)
        stage = engine.zero_optimization_stage()
        group = data_parallel_group(engine)
        rank, world = world_of(group)
        named = _named_params(engine)
        cut = stage
        waiting: tuple[torch.nn.Parameter, ...] = ()
        if stage == 3:
            pieces = _zero3(engine, named, rank)
        elif stage in (1, 2) or _is_bf16_optimizer(engine.optimizer):
            # BF16_Optimizer (a bf16 PipelineEngine's at ZeRO-0 too) cuts its fp32 masters over the data-parallel
            # group like ZeRO-1, whatever the configured stage: pieces of a partition, not replicated parameters
            pieces = _zero12(engine, named)
            cut = stage or (1 if world > 1 else 0)
        else:
            pieces, waiting = _zero0(engine, named, previous, self.keep)
        token = self._token(waiting)
        if not pieces:
            _refuse_nothing_read(engine, named, stage)
        params = {n: p for n, p in named if n in pieces}
        experts = None
        if getattr(engine, "has_moe_layers", False):
            pieces, params, experts = place_experts(engine, pieces, params)
        shards = shards_from_views([(n, v) for n, (v, _) in pieces.items()])
        warn_low_precision(
            "a DeepSpeed engine's master weights",
            {n: v for n, (v, _) in pieces.items()},
            "DeepSpeed keeps 16-bit masters here (e.g. zero_optimization.bf16_master_weights_and_gradients); train "
            "with fp32 masters for an EMA of the fp32 weights",
        )
        part = model_part(engine)
        layout = ShardLayout(
            rank,
            world,
            cut,
            {n: s for n, (_, s) in pieces.items()},
            engine="deepspeed",
            part=part,
            tp_dims=tp_dims(engine, list(params.items()), part),
            experts=experts,
        )
        return Reading(shards, layout, params, group if world > 1 else None, token)

    @contextlib.contextmanager
    def swap(
        self, reading: Reading, pieces: Mapping[str, torch.Tensor], state: EmaState, index: int, changes: list[str]
    ) -> Iterator[SwapStats]:
        """The EMA in the forward (see the two swaps below). Innermost, the module's parameter registrations and
        memory are put back as they were on entry (``parameters_put_back``), before DeepSpeed's own structures
        (ZeRO-3's partition cache, ZeRO-1/2's flat buffers) are touched again; ZeRO-3 placeholders are compared by
        dtype and device only (their memory comes and goes with every gather)."""
        if reading.layout.stage == 3:
            with (
                _swap_zero3(self.target, reading, pieces) as stats,
                parameters_put_back(self.module(), changes, form=placeholder_form),
            ):
                yield stats
        else:
            with _swap_data(reading, pieces) as stats, parameters_put_back(self.module(), changes):
                yield stats

    def optimizer_steps(self) -> int:
        return int(self.target.global_steps)

    @contextlib.contextmanager
    def refuse_training(self, why: str) -> Iterator[None]:
        """``engine.backward`` / ``engine.step`` refused, and ``step()`` of every optimizer DeepSpeed steps for the
        engine (:func:`_engine_optimizers`): instance attributes shadowing the methods, so the call is refused before
        its body runs. DeepSpeed's wrapper (``FP16_UnfusedOptimizer``, ``BF16_Optimizer``, the ZeRO optimizers) is
        no ``torch.optim.Optimizer``, and the client optimizer it wraps holds fp32 copies, not the module's
        parameters: the torch step hook of ``training_refused`` sees neither. Each attribute is put back exactly as
        found (also on an exception); nested refusals (``EMAModel.store`` around a swap) each put back theirs."""
        engine = self.target
        # train_batch: a PipelineEngine's whole step
        targets = [(engine, verb, f"engine.{verb}()") for verb in ("backward", "step", "train_batch")]
        targets += [(opt, "step", f"{path}.step()") for path, opt in _engine_optimizers(engine)]
        found: list[tuple[Any, str, Any]] = []  # (object, attribute, the instance attribute it had: None if none)
        try:
            for obj, attr, call in targets:
                if callable(getattr(obj, attr, None)):
                    found.append((obj, attr, obj.__dict__.get(attr)))
                    obj.__dict__[attr] = _refuser(f"{call} {why}")
            yield
        finally:
            # Last set first (an object listed twice gets its own attribute back last); every one, also when an
            # exception (Ctrl-C) lands in the middle (finish), which is raised after.
            steps = ((_attribute_back, found[::-1]),)
            try:
                finish(*steps)
            except BaseException:  # one that landed before finish began: every step again, then raised
                finish(*steps)
                raise

    def write_weights(self, reading: Reading, pieces: Mapping[str, torch.Tensor]) -> None:
        """The fp32 masters, and the 16-bit copies the forward uses: ZeRO-3's partitions (the gathered
        cache emptied first), or ZeRO-0/1/2's module parameters (rebuilt from every rank's pieces: a
        collective, done before any rank writes)."""
        engine, stage = self.target, reading.layout.stage
        full = gather_pieces(reading, pieces) if stage != 3 else {}
        with torch.no_grad():
            for n, t in reading.shards.items():
                if t.numel():
                    t.copy_(pieces[n].reshape(t.shape))
            if stage == 3:
                engine.empty_partition_cache()
                placeholders: dict[str, Any] = dict(reading.params)  # with DeepSpeed's ds_* attributes
                for n, p in placeholders.items():
                    numel = reading.layout.specs[n].numel
                    if numel:
                        p.ds_tensor.data.view(-1)[:numel].copy_(pieces[n].reshape(-1))
                    # ZeRO++ hpZ: the release above built a secondary partition from the old gathered weights, and
                    # the next gather reads it whenever one exists; dropped as a step drops it
                    # (``invalidate_secondary_tensor``), so the next gather reads the new ``ds_tensor``.
                    if getattr(p, "ds_secondary_tensor", None) is not None:
                        p.ds_secondary_tensor = None
            else:
                for n, p in reading.params.items():
                    p.data.copy_(full[n].to(p.dtype))


def _attribute_back(entry: tuple[Any, str, Any]) -> None:
    """An attribute ``refuse_training`` shadowed, as it was (none, or the instance attribute it had)."""
    obj, attr, before = entry
    if before is None:
        obj.__dict__.pop(attr, None)
    else:
        obj.__dict__[attr] = before


def _refuser(message: str) -> Any:
    def refuse(*_a: Any, **_k: Any) -> NoReturn:
        raise SwappedTrainingError(message)

    return refuse


def _engine_optimizers(engine: Any) -> list[tuple[str, Any]]:
    """Every optimizer object whose ``step()`` moves the engine's weights, once each (by identity), under the first
    name that reaches it: DeepSpeed's wrapper (``engine.optimizer``), the optimizer it steps over the fp32 masters
    (``engine.optimizer.optimizer``: the client's, or DeepSpeed's own), and the client's as DeepSpeed keeps it
    (``engine.basic_optimizer``, ``engine.client_optimizer``; a factory callable there has no ``step``)."""
    wrapper = getattr(engine, "optimizer", None)
    candidates = (
        ("engine.optimizer", wrapper),
        ("engine.optimizer.optimizer", getattr(wrapper, "optimizer", None)),
        ("engine.basic_optimizer", getattr(engine, "basic_optimizer", None)),
        ("engine.client_optimizer", getattr(engine, "client_optimizer", None)),
    )
    seen: set[int] = set()
    out = []
    for path, opt in candidates:
        if opt is None or isinstance(opt, type) or id(opt) in seen or not hasattr(opt, "__dict__"):
            continue
        if callable(getattr(opt, "step", None)):
            seen.add(id(opt))
            out.append((path, opt))
    return out


def _first(obj: Any, names: tuple[str, ...], default: int) -> int:
    for name in names:
        fn = getattr(obj, name, None)
        if callable(fn):
            return int(fn())
    return default


def model_part(engine: Any) -> ModelPart:
    """The tensor-parallel rank and pipeline stage an engine's rank holds, from its ``mpu`` (an ``mpu=``
    object, a PipelineEngine's grid, or DeepSpeed's own groups under AutoTP) and its pipeline stage."""
    mpu = getattr(engine, "mpu", None)
    if mpu is None:
        return ModelPart()
    tp_size = _first(
        mpu,
        ("get_tensor_model_parallel_world_size", "get_slice_parallel_world_size", "get_model_parallel_world_size"),
        1,
    )
    tp = (
        _first(mpu, ("get_tensor_model_parallel_rank", "get_slice_parallel_rank", "get_model_parallel_rank"), 0)
        if tp_size > 1
        else 0
    )
    if any(c.__name__ == "PipelineEngine" for c in type(engine).__mro__):
        pp, pp_size = int(engine.stage_id), int(engine.num_stages)
    else:
        pp_size = _first(mpu, ("get_pipeline_model_parallel_world_size", "get_pipe_parallel_world_size"), 1)
        pp = _first(mpu, ("get_pipeline_model_parallel_rank", "get_pipe_parallel_rank"), 0) if pp_size > 1 else 0
    return ModelPart(tp, tp_size, pp, pp_size)


#: DeepSpeed AutoTP's per-parameter layout record (``deepspeed.checkpoint.constants.DS_AUTOTP_UC_META``).
_AUTOTP_META = "ds_autotp_universal_checkpoint_meta"


def tp_dims(engine: Any, named: list[tuple[str, torch.nn.Parameter]], part: ModelPart) -> dict[str, int | None] | None:
    """How this engine's tensor-parallel slices join, per parameter (see ``ShardLayout.tp_dims``), when
    every parameter says so: AutoTP's layout record (``partition_dim``, or ``replicated``; parameters AutoTP
    left whole are replicated), or Megatron's attributes (``tensor_model_parallel``, ``partition_dim``).
    ``None`` when any parameter's split is unknown or is not a plain concatenation (fused sub-parameters)."""
    if part.tp_size == 1:
        return None
    autotp = False
    with contextlib.suppress(Exception):
        autotp = int(engine.autotp_size()) > 1
    dims: dict[str, int | None] = {}
    for name, p in named:
        meta = getattr(p, _AUTOTP_META, None)
        if isinstance(meta, dict):
            if meta.get("replicated"):
                dims[name] = None
            elif (
                meta.get("partition_dim") is None
                or meta.get("sub_param_shard_widths")
                or meta.get("sub_param_sizes")
                or (meta.get("conversion") or {}).get("unsupported_reason")
            ):
                return None
            else:
                dims[name] = int(meta["partition_dim"])
            continue
        marked = getattr(p, "tensor_model_parallel", None)
        if marked is True:
            dims[name] = int(getattr(p, "partition_dim", 0))
        elif marked is False or autotp:
            dims[name] = None
        else:
            return None
    return dims


def data_parallel_group(engine: Any) -> dist.ProcessGroup | None:
    """The process group ZeRO partitions over."""
    opt = engine.optimizer
    group = getattr(opt, "dp_process_group", None)
    if group is None:
        group = getattr(engine, "data_parallel_group", None)
    return group if group is not None else dist.group.WORLD


def unsupported_reason(engine: Any) -> str | None:
    """Why :func:`local_shards` cannot read this engine, or ``None`` when it can."""
    opt = engine.optimizer
    if getattr(engine, "has_moe_layers", False):
        reason = _moe_unsupported(engine)
        if reason:
            return reason
    if type(opt).__name__.startswith("MiCS"):  # DeepSpeed < 0.19.8 (later versions refuse the option themselves)
        return (
            "ZeRO-3 MiCS (zero_optimization.mics_shard_size) replicates each partition over shard groups, which "
            "functional_ema does not place yet; use plain ZeRO-3 (ZeRO++ hpZ, zero_hpz_partition_size, works)"
        )
    if engine.zero_optimization_stage() == 3 and getattr(opt, "params_in_nvme_and_cpu", False):
        return "ZeRO-3 with NVMe offload keeps the fp32 master on disk; functional_ema supports CPU offload only"
    if engine.zero_optimization_stage() == 3 and any(
        t.numel() == 0 for t in getattr(opt, "fp32_partitioned_groups_flat", [])
    ):
        return "ZeRO-3 optimizer state is swapped out (NVMe); functional_ema supports CPU offload only"
    return None


# ----------------------------------------------------------------------------- expert parallelism


#: Where DeepSpeed's ``MoE`` layer keeps its local experts (``MoE.deepspeed_moe.experts.deepspeed_experts``);
#: DeepSpeed's own checkpoint renames ``<prefix><local index>`` to ``<prefix><global index>`` the same way.
_EXPERTS = "deepspeed_moe.experts.deepspeed_experts"


def _moe_layers(module: torch.nn.Module) -> list[tuple[str, Any]]:
    """``(name, layer)`` of every ``deepspeed.moe.layer.MoE`` in ``module`` (DeepSpeed's class, typed ``Any``)."""
    return [
        (n, m)
        for n, m in module.named_modules()
        if type(m).__name__ == "MoE" and type(m).__module__.startswith("deepspeed.moe")
    ]


def _moe_unsupported(engine: Any) -> str | None:
    """Why an engine with MoE layers cannot be read, or ``None``."""
    layers = _moe_layers(engine.module)
    autoep = [n for n, m in engine.module.named_modules() if type(m).__name__ == "AutoEPMoELayer"]
    if autoep or not layers:
        return (
            f"DeepSpeed AutoEP expert parallelism (AutoEPMoELayer {short_list(autoep, 4)}) is not placed by functional_ema (only "
            "deepspeed.moe.layer.MoE is): the EMA of one expert could be taken for another's"
        )
    stage = engine.zero_optimization_stage()
    if stage not in (1, 2):
        return (
            f"DeepSpeed MoE with ZeRO stage {stage}: functional_ema places expert parameters on ZeRO stages 1 and 2 "
            "(stage 0 keeps replicated expert copies it does not place; DeepSpeed refuses native MoE on stage 3)"
        )
    sizes = sorted({int(m.ep_size) for _, m in layers})
    if len(sizes) > 1:
        return (
            f"DeepSpeed MoE layers with different expert-parallel sizes {sizes} (layers "
            f"{short_list([n for n, _ in layers], 4)}): functional_ema places one expert-parallel size per model"
        )
    tensor = [n for n, m in layers if getattr(m, "enable_expert_tensor_parallelism", False)]
    if tensor:
        return f"DeepSpeed MoE with expert tensor parallelism (enable_expert_tensor_parallelism, layers {short_list(tensor, 4)}) is not placed"
    if not model_part(engine).whole:
        return (
            "DeepSpeed MoE combined with tensor or pipeline parallelism (an mpu) is not placed by functional_ema yet "
            f"({model_part(engine).describe()})"
        )
    return None


def _ep_rank(layer: Any) -> int:
    group = layer.deepspeed_moe.ep_group
    return dist.get_rank(group) if group is not None and dist.is_initialized() else 0


def place_experts(
    engine: Any, pieces: dict[str, tuple[torch.Tensor, ShardSpec]], params: dict[str, torch.nn.Parameter]
) -> tuple[dict[str, tuple[torch.Tensor, ShardSpec]], dict[str, torch.nn.Parameter], ExpertLayout]:
    """Expert parameters renamed from their local to their global expert index, and every other
    expert-parallel rank's experts added with an empty piece (in expert order, where the layer's experts
    are): so one name is one tensor on every rank, and the pieces of each expert tile it over the
    data-parallel group. Returns (pieces, params, :class:`ExpertLayout`), the views untouched."""
    layers = _moe_layers(engine.module)
    ep_size = int(layers[0][1].ep_size)
    ep = _ep_rank(layers[0][1])
    local: dict[str, tuple[str, int, int, str]] = {}  # local name -> (layer prefix, local index, L, rest)
    for prefix, m in layers:
        if _ep_rank(m) != ep:
            raise NotImplementedError(
                f"DeepSpeed MoE layer {prefix!r}: its expert-parallel rank differs from the other layers'"
            )
        base = f"{prefix}.{_EXPERTS}." if prefix else f"{_EXPERTS}."
        n_local = int(m.num_local_experts)
        for i, expert in enumerate(m.deepspeed_moe.experts.deepspeed_experts):
            for rest, _ in expert.named_parameters():
                local[f"{base}{i}.{rest}"] = (base, i, n_local, rest)
    out: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    out_params: dict[str, torch.nn.Parameter] = {}
    owners: dict[str, int] = {}
    done: set[str] = set()  # layers (prefixes) whose experts are placed
    for name, (view, spec) in pieces.items():
        where = local.get(name)
        if where is None:
            out[name] = (view, spec)
            out_params[name] = params[name]
            continue
        base, _, n_local, _ = where
        if base in done:
            continue
        done.add(base)
        # every expert of the layer, in global order: this rank's from its pieces, the others' empty
        mine = {n: pieces[n] for n, w in local.items() if w[0] == base and n in pieces}
        rests = [w[3] for n, w in local.items() if w[0] == base and w[1] == 0 and n in pieces]
        empty = view.narrow(0, 0, 0)
        for g in range(ep_size * n_local):
            owner, i = divmod(g, n_local)
            for rest in rests:
                gname = f"{base}{g}.{rest}"
                owners[gname] = owner
                if owner == ep:
                    lname = f"{base}{i}.{rest}"
                    if lname not in mine:
                        raise NotImplementedError(
                            f"DeepSpeed MoE: expert parameter {lname!r} is not trained while "
                            f"{base}0.{rest} is; experts must train alike"
                        )
                    out[gname] = mine[lname]
                    out_params[gname] = params[lname]
                else:
                    out[gname] = (empty, ShardSpec(mine[f"{base}0.{rest}"][1].shape, 0, 0))
    return out, out_params, ExpertLayout(ep, ep_size, owners)


def _named_params(engine: Any) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out: list[tuple[str, torch.nn.Parameter]] = []
    for name, p in engine.module.named_parameters():
        if id(p) not in seen:  # tied weights: one entry, under the first name
            seen.add(id(p))
            out.append((name, p))
    return out


def _is_bf16_optimizer(opt: Any) -> bool:
    """Whether ``opt`` is DeepSpeed's ``BF16_Optimizer``: ZeRO-1 with bf16 and fp32 gradient accumulation, and a bf16
    ``PipelineEngine`` at ZeRO-0 (DeepSpeed 0.19.8 ``_do_optimizer_sanity_check``). Whatever the stage, it keeps
    the fp32 masters as one flat partition per group over its ``dp_process_group`` (``fp32_groups_flat_partition``),
    linked to the parameters by ``_hp_mapping``, exactly as at ZeRO-1."""
    return any(c.__name__ == "BF16_Optimizer" and c.__module__.startswith("deepspeed") for c in type(opt).__mro__)


def _refuse_nothing_read(engine: Any, named: list[tuple[str, torch.nn.Parameter]], stage: int) -> None:
    """A reading that found no fp32 master for any parameter of a module that trains some is refused, naming the
    optimizer: an optimizer wrapper not understood would otherwise give an EMA of nothing (empty saves, exit 0)."""
    trained = [n for n, p in named if p.requires_grad]
    if not trained:
        return
    opt = engine.optimizer
    raise NotImplementedError(
        f"DeepSpeed engine at ZeRO stage {stage}: functional_ema found the fp32 master of none of the {len(trained)} "
        f"trained parameters of this rank's module ({short_list(trained, 4)}) in its optimizer "
        f"{type(opt).__module__}.{type(opt).__qualname__}, whose layout it does not know (or none of them is among "
        "the optimizer's parameters); averaging nothing would save empty EMAs, so this is refused: report the "
        "DeepSpeed version and configuration to functional_ema"
    )


def _master_buffers(opt: Any, stage: int) -> list[torch.Tensor]:
    """The tensors holding the fp32 master weights (a few flat buffers, per parameter at stage 0)."""
    if stage == 3:
        return opt.fp32_partitioned_groups_flat
    if stage in (1, 2) or _is_bf16_optimizer(opt):
        return getattr(opt, "single_partition_of_fp32_groups", None) or getattr(opt, "fp32_groups_flat_partition", [])
    if hasattr(opt, "fp32_groups_flat"):
        return opt.fp32_groups_flat
    if hasattr(opt, "fp32_groups"):
        return [t for g in opt.fp32_groups for t in g]
    return [p for g in opt.param_groups for p in g["params"]]


_data_ptr = torch.Tensor.data_ptr


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(-1)


def _zero3(
    engine: Any, named: list[tuple[str, torch.nn.Parameter]], rank: int
) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    opt = engine.optimizer
    trained = {id(p) for group in opt.fp16_groups for p in group}
    out: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    placeholders: list[tuple[str, Any]] = list(named)  # with DeepSpeed's ds_* attributes and partition_numel()
    for name, p in placeholders:
        if id(p) not in trained:
            continue
        group_idx, offset, _ = opt.grad_position[opt.get_param_id(p)]
        ps = p.partition_numel()
        prank = dist.get_rank(p.ds_process_group) if dist.is_initialized() else 0
        valid = max(0, min(p.ds_numel - prank * ps, ps))
        flat = opt.fp32_partitioned_groups_flat[group_idx]
        view = _flat(flat).narrow(0, offset, valid)
        out[name] = (view, ShardSpec(tuple(p.ds_shape), prank * ps if valid else 0, valid))
    return out


def _zero12(engine: Any, named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, tuple[torch.Tensor, ShardSpec]]:
    opt = engine.optimizer
    groups = getattr(opt, "bit16_groups", None) or getattr(opt, "bf16_groups", None)
    if groups is None:
        raise NotImplementedError(f"unknown ZeRO-1/2 optimizer {type(opt).__name__}: no bit16_groups/bf16_groups")
    flat_parts = getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    trained = {id(p) for group in groups for p in group}
    out: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    for name, p in named:
        if id(p) not in trained:
            continue
        hp = getattr(p, "_hp_mapping", None)
        if hp is None:  # this rank owns none of p
            empty = flat_parts[0].detach().narrow(0, 0, 0)
            out[name] = (empty, ShardSpec(tuple(p.shape), 0, 0))
            continue
        start, numel = int(hp.lp_fragment_address.start), int(hp.lp_fragment_address.numel)
        view = _flat(hp.hp_fragment)
        assert view.numel() == numel, (name, view.numel(), numel)
        out[name] = (view, ShardSpec(tuple(p.shape), start, numel))
    return out


def _zero0(
    engine: Any, named: list[tuple[str, torch.nn.Parameter]], previous: Reading | None, keep: frozenset[str]
) -> tuple[dict[str, tuple[torch.Tensor, ShardSpec]], tuple[torch.nn.Parameter, ...]]:
    """The pieces (whole parameters), and the parameters the optimizer holds but left out as frozen: ZeRO-0 steps
    whatever its optimizer holds that has a gradient, so one unfrozen later is trained (with fp32 parameters, the
    client optimizer holds every parameter passed to it, frozen ones too) and must be read in. Which parameters
    are read follows a module's reading (``_base.is_read``): one frozen after a reading stays in, and so does one
    in ``keep`` (``Adapter.read(keep=...)``: an EMA resumed with it, frozen again at the resume)."""
    opt = engine.optimizer
    pairs: dict[int, torch.Tensor] = {}  # id(module param) -> fp32 master
    if hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups"):  # FP16_UnfusedOptimizer
        for lp_group, hp_group in zip(opt.fp16_groups, opt.fp32_groups):
            for lp, hp in zip(lp_group, hp_group):
                pairs[id(lp)] = hp
    elif hasattr(opt, "fp16_groups") and hasattr(opt, "fp32_groups_flat"):  # FP16_Optimizer
        for lp_group, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            offset = 0
            for lp in lp_group:
                pairs[id(lp)] = flat.detach().narrow(0, offset, lp.numel())
                offset += lp.numel()
    else:  # fp32 training: the optimizer updates the module parameters themselves
        for group in opt.param_groups:
            for p in group["params"]:
                pairs[id(p)] = p
    out: dict[str, tuple[torch.Tensor, ShardSpec]] = {}
    waiting: list[torch.nn.Parameter] = []
    for name, p in named:
        hp = pairs.get(id(p))
        if hp is None:
            continue
        if not is_read(name, p, previous, keep):
            waiting.append(p)
            continue
        out[name] = (_flat(hp), ShardSpec(tuple(p.shape), 0, p.numel()))
    return out, tuple(waiting)


# ----------------------------------------------------------------------------------- eval swap


@contextlib.contextmanager
def _swap_zero3(engine: Any, reading: Reading, ema: Mapping[str, torch.Tensor]) -> Iterator[SwapStats]:
    """ZeRO-3: the EMA piece, cast to the partition dtype, replaces each parameter's local partition
    (``ds_tensor``); DeepSpeed's gathered-parameter cache is emptied on entry and on exit (a
    ``no_grad`` forward leaves parameters gathered, and replacing the partition alone would then be
    silently ignored). Extra memory: one 16-bit copy of this rank's partition."""
    engine.empty_partition_cache()  # drop gathered live weights (persistent ones included)
    placeholders: dict[str, Any] = dict(reading.params)  # with DeepSpeed's ds_* attributes
    saved: list[tuple[Any, torch.Tensor, torch.Tensor | None]] = []
    extra = 0
    try:
        for name, p in placeholders.items():
            part = p.ds_tensor
            piece = ema[name]
            swap = torch.empty_like(part.data)
            n = piece.numel()
            swap[:n].copy_(piece.reshape(-1))
            if n < swap.numel():  # padding tail: keep whatever DeepSpeed had there
                swap[n:].copy_(part.data[n:])
            extra += swap.numel() * swap.element_size()
            saved.append((p, part.data, getattr(p, "ds_secondary_tensor", None)))
            part.data = swap
            if getattr(p, "ds_secondary_tensor", None) is not None:  # ZeRO++ hpZ gathers from here
                p.ds_secondary_tensor = None
        yield SwapStats(len(saved), extra)
    finally:
        # Drop gathered EMA weights before training resumes, then each live partition back: every one also when an
        # exception (Ctrl-C) lands in the middle (finish), which is raised after.
        steps = ((_emptied, (engine,)), (_partition_back, saved))
        try:
            finish(*steps)
        except BaseException:  # one that landed before finish began: every step again, then raised
            finish(*steps)
            raise


def _emptied(engine: Any) -> None:
    engine.empty_partition_cache()


def _partition_back(entry: tuple[Any, torch.Tensor, torch.Tensor | None]) -> None:
    p, data, secondary = entry
    p.ds_tensor.data = data
    # ZeRO++ hpZ: the release before built a secondary partition from the gathered EMA, and the next gather reads it
    # whenever one exists. Put back the one held on entry, or none (as a step leaves it, ``invalidate_secondary_tensor``:
    # the next gather then reads ``ds_tensor`` over the whole group).
    if hasattr(p, "ds_secondary_tensor"):
        p.ds_secondary_tensor = secondary


@contextlib.contextmanager
def _swap_data(reading: Reading, pieces: Mapping[str, torch.Tensor]) -> Iterator[SwapStats]:
    """ZeRO-0/1/2 with 16-bit parameters: the parameters' ``.data`` point at the full EMA (gathered
    once on ZeRO-1/2; the memory the forward needs anyway)."""
    full = gather_pieces(reading, pieces)
    saved: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
    extra = 0
    try:
        for name, p in reading.params.items():
            w = full[name].to(device=p.device, dtype=p.dtype).view(p.shape)
            extra += w.numel() * w.element_size()
            saved.append((p, p.data))
            p.data = w
        del full
        yield SwapStats(len(saved), extra)
    finally:
        # Every one, also when an exception (Ctrl-C) lands in the middle, then that one raised.
        steps = ((_data_back, saved),)
        try:
            finish(*steps)
        except BaseException:  # one that landed before finish began: every step again, then raised
            finish(*steps)
            raise


def _data_back(entry: tuple[torch.nn.Parameter, torch.Tensor]) -> None:
    p, data = entry
    p.data = data
