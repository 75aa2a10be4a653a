"""Engine adapters: one per kind of training object, the same verbs for all.

:func:`adapter_for` picks the adapter for an object: a DeepSpeed engine, a model with torch FSDP2
(``fully_shard``) applied or DTensor tensor parallelism, a ``torch.distributed.pipelining`` stage, a
``DistributedDataParallel`` model, or a plain ``nn.Module``. The
core (``init_ema``, ``update``, schedules) imports none of these modules.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch

from ._base import Adapter, Reading, SwapStats, known_adapter

__all__ = [
    "Adapter",
    "Reading",
    "SwapStats",
    "adapter_for",
    "ACCEPTED",
    "refuse_engine_internals",
    "unwrap_compiled",
]

ACCEPTED = (
    "a deepspeed.DeepSpeedEngine (ZeRO stages 0-3), a torch.nn.Module with FSDP2 (fully_shard) applied or with "
    "tensor-parallel DTensor parameters, a torch.distributed.pipelining stage, a "
    "torch.nn.parallel.DistributedDataParallel model, or a plain torch.nn.Module (each also inside torch.compile's "
    "wrapper)"
)


# The adapter modules, imported on first use (by adapter_for, or by the documented spellings such as
# functional_ema.engines.module.flatten_parameters right after `import functional_ema`), so importing the package
# loads none of them.
_SUBMODULES = frozenset({"deepspeed", "fsdp2", "module", "pipelining"})


def __getattr__(name: str) -> Any:
    """``functional_ema.engines.<adapter module>``, imported when first named (PEP 562)."""
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def unwrap_compiled(x: Any) -> Any:
    """``x`` without the ``torch.compile`` wrappers (``OptimizedModule``) around it: the model they compile, whose
    parameters they are. So ``torch.compile(DDP(m))`` (torch's documented order) is read as the DDP model and
    ``torch.compile(fully_shard(m))`` as the FSDP2 one, with the names of the model inside (no ``_orig_mod.``),
    and the compiled model and the model it wraps share one reading. Cheap: nothing is compiled, so nothing is
    unwrapped, until torch._dynamo is imported.

    A wrapper that ``fully_shard`` was applied to (``fully_shard(torch.compile(m))``) is kept: it is the FSDP2
    root, which owns the sharding state of the modules inside, and read inside it they would be refused as an
    FSDP-managed submodule. Its names keep ``_orig_mod.``, as its own ``state_dict`` does."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    wrapper = getattr(eval_frame, "OptimizedModule", None)
    # Looked up, not imported: FSDP2 was imported if fully_shard was applied to anything.
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    for _ in range(64):  # wrappers nest a few deep; bounded against a module that wraps itself
        if wrapper is None or not isinstance(x, wrapper):
            break
        if fsdp_module is not None and isinstance(x, fsdp_module):
            break
        x = x._orig_mod
    return x


def adapter_for(x: Any) -> Adapter:
    """The adapter for ``x`` (torch.compile's wrappers taken off, :func:`unwrap_compiled`); a ``TypeError`` that
    lists what is accepted for anything else."""
    x = unwrap_compiled(x)
    known = known_adapter(x)
    if known is not None:
        return known(x)
    from . import deepspeed, fsdp2, module, pipelining

    if deepspeed.is_deepspeed_engine(x):
        return deepspeed.DeepSpeedAdapter(x)
    if pipelining.is_pipeline_stage(x):
        return pipelining.PipelineStageAdapter(x)
    if isinstance(x, torch.nn.Module):
        if fsdp2.is_fsdp2(x):
            return fsdp2.FSDP2Adapter(x)
        return module.ModuleAdapter(x)
    hint = ""
    if isinstance(x, dict) or hasattr(x, "items"):
        hint = " (this looks like a tree of tensors: pass it to init_ema/update directly; local_shards reads a model)"
    elif isinstance(x, torch.optim.Optimizer):
        hint = " (an optimizer: pass the model or engine it trains)"
    raise TypeError(
        f"functional_ema cannot read a {type(x).__module__}.{type(x).__qualname__}{hint}; it accepts {ACCEPTED}"
    )


def refuse_engine_internals(module: torch.nn.Module) -> None:
    """Refuse (``TypeError``, naming the object to pass instead) a module whose parameters an engine manages
    from outside it: a DeepSpeed engine's ``engine.module`` (ZeRO-1/2/3, pipeline), torch FSDP1, or a submodule
    inside a ``fully_shard``-ed model. Called by the module and FSDP2 adapters whenever they read a module, so
    every verb refuses it (also a module read before ``deepspeed.initialize`` took it over).

    The library never looks for the owner itself: neither DeepSpeed nor FSDP keeps a reference from the module
    back to the engine or the enclosing module, and a search of the heap would be slow and could pick another
    engine holding the same module."""
    from . import deepspeed, fsdp2

    reason = deepspeed.engine_module_reason(module) or fsdp2.internal_module_reason(module)
    if reason:
        raise TypeError(f"functional_ema cannot read this module: {reason}")
