"""Plain ``nn.Module`` and ``DistributedDataParallel`` adapter.

Every rank holds whole parameters (DDP keeps them identical on every rank), so the layout is the
replicated one, as for ZeRO-0: each piece is a whole parameter, rank ``r`` of the DDP group, stage 0.
The pieces are the trainable parameters themselves (``requires_grad``), no copy.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.distributed as dist

from .._layout import ShardLayout, ShardSpec
from .._shards import shards_from_views
from ._base import Adapter, Reading, world_of

__all__ = ["ModuleAdapter", "is_ddp"]

_data_ptr = torch.Tensor.data_ptr


def is_ddp(x: Any) -> bool:
    return isinstance(x, torch.nn.parallel.DistributedDataParallel)


class ModuleAdapter(Adapter):
    """A plain ``nn.Module`` (world of one) or a DDP-wrapped one (replicated over its group)."""

    name = "module"

    def module(self) -> torch.nn.Module:
        return self.target.module if is_ddp(self.target) else self.target

    def _params(self) -> list[tuple[str, torch.nn.Parameter]]:
        seen: set[int] = set()
        out = []
        for name, p in self.module().named_parameters():  # tied weights: once, under the first name
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                out.append((name, p))
        return out

    def _is_current(self, reading: Reading) -> bool:
        # The pieces are detached views of the parameters: read again when the trainable
        # parameters are not the same objects (replaced, frozen, added) or a parameter's memory
        # moved (module.to(...), load_state_dict(assign=True)).
        trainable = [p for p in self.module().parameters() if p.requires_grad]
        held = reading.params.values()
        return (
            len(trainable) == len(held)
            and all(map(operator.is_, trainable, held))
            and tuple(map(_data_ptr, trainable)) == reading.token
        )

    def _read(self) -> Reading:
        named = self._params()
        group = getattr(self.target, "process_group", None) if is_ddp(self.target) else None
        if is_ddp(self.target) and group is None and dist.is_initialized():
            group = dist.group.WORLD
        rank, world = world_of(group) if group is not None else (0, 1)
        specs = {n: ShardSpec(tuple(p.shape), 0, p.numel()) for n, p in named}
        shards = shards_from_views([(n, p) for n, p in named])
        params = dict(named)
        token = tuple(map(_data_ptr, params.values()))
        return Reading(shards, ShardLayout(rank, world, 0, specs, engine="module"), params, group if world > 1 else None, token)
