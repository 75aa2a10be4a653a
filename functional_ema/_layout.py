"""Where each rank's local pieces sit inside the full parameters.

The layout is plain data (no tensors), so it can be written into checkpoint metadata and read back
without a process group.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ShardSpec", "ShardLayout"]


class ShardSpec(NamedTuple):
    """One rank's piece of one parameter.

    The local shard is the 1-D slice ``full.reshape(-1)[offset : offset + numel]``.

    Attributes:
        shape: full shape of the parameter.
        offset: start of the local piece in the flattened parameter (elements).
        numel: length of the local piece; 0 when this rank holds none of the parameter.
    """

    shape: tuple[int, ...]
    offset: int
    numel: int

    @property
    def full_numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= int(d)
        return n


class ShardLayout(NamedTuple):
    """How a name-keyed tree of local shards maps onto full parameters.

    Attributes:
        rank: this rank in the data-parallel (ZeRO partitioning) group.
        world_size: size of that group.
        stage: how the pieces are cut: the ZeRO stage for DeepSpeed; 0 means replicated (every
            rank holds whole parameters: ZeRO-0, DDP, a plain module), 3 for FSDP2.
        specs: parameter name -> :class:`ShardSpec`, in the order of ``local_shards``.
        engine: what the pieces were read from: ``"deepspeed"``, ``"fsdp2"`` or ``"module"``
            (informational: the checkpoint format does not depend on it).
    """

    rank: int
    world_size: int
    stage: int
    specs: dict[str, ShardSpec]
    engine: str = "deepspeed"

    def to_json_dict(self) -> dict:
        return {
            "rank": self.rank,
            "world_size": self.world_size,
            "stage": self.stage,
            "engine": self.engine,
            "specs": {n: [list(s.shape), s.offset, s.numel] for n, s in self.specs.items()},
        }

    @classmethod
    def from_json_dict(cls, d: dict) -> "ShardLayout":
        specs = {n: ShardSpec(tuple(int(x) for x in v[0]), int(v[1]), int(v[2])) for n, v in d["specs"].items()}
        return cls(int(d["rank"]), int(d["world_size"]), int(d["stage"]), specs, str(d.get("engine", "deepspeed")))
