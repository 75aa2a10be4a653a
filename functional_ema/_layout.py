"""Where each rank's local pieces sit inside the full parameters.

The layout is plain data (no tensors), so it can be written into checkpoint metadata and read back
without a process group.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["ShardSpec", "ShardLayout", "ModelPart", "ExpertLayout"]


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


class ModelPart(NamedTuple):
    """Which model-parallel slice of the model a rank holds, besides its data-parallel piece.

    The ranks of one part hold the same parameters (names and, under tensor parallelism, the same
    slices) and split them over their data-parallel group; different parts hold other parameters
    (pipeline stages) or other slices of the same ones (tensor-parallel ranks).

    Attributes:
        tp: tensor-parallel rank, in ``[0, tp_size)``.
        tp_size: tensor-parallel degree (1: none).
        pp: pipeline stage, in ``[0, pp_size)``.
        pp_size: number of pipeline stages (1: none).
    """

    tp: int = 0
    tp_size: int = 1
    pp: int = 0
    pp_size: int = 1

    @property
    def whole(self) -> bool:
        """No model parallelism: the part is the whole model."""
        return self.tp_size == 1 and self.pp_size == 1

    def describe(self) -> str:
        """``"tensor-parallel rank 1 of 2, pipeline stage 0 of 2"`` (for messages)."""
        parts = []
        if self.tp_size > 1:
            parts.append(f"tensor-parallel rank {self.tp} of {self.tp_size}")
        if self.pp_size > 1:
            parts.append(f"pipeline stage {self.pp} of {self.pp_size}")
        return ", ".join(parts) or "the whole model"

    def to_json_dict(self) -> dict:
        return {"tp": self.tp, "tp_size": self.tp_size, "pp": self.pp, "pp_size": self.pp_size}


class ExpertLayout(NamedTuple):
    """Expert parallelism (mixture of experts): which experts this rank holds.

    Expert parameters are named by their *global* expert index (the same name on every rank that holds
    a piece of that expert, another name for every other expert), and every rank lists every expert:
    the ones held by another expert-parallel rank with an empty piece. So the pieces of each expert
    tile it over the data-parallel group like any other parameter's, and ``gather_full``, ``save``,
    ``consolidate`` need nothing else; this record is what a checkpoint is checked against.

    Attributes:
        ep: this rank's expert-parallel rank, in ``[0, ep_size)``.
        ep_size: the expert-parallel degree (every MoE layer's).
        owners: expert parameter name (global index) -> the expert-parallel rank that holds it; only
            ranks of that expert-parallel rank may hold (non-empty) pieces of it.
    """

    ep: int
    ep_size: int
    owners: dict[str, int]

    def to_json_dict(self) -> dict:
        return {"ep": self.ep, "ep_size": self.ep_size, "owners": dict(self.owners)}


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
        part: the model-parallel slice this rank holds (:class:`ModelPart`; the whole model when
            there is no tensor or pipeline parallelism). ``specs`` then describe that slice: under
            tensor parallelism a parameter's "full" shape is this tensor-parallel rank's slice.
        tp_dims: how tensor-parallel slices join into full parameters, when the engine knows it:
            ``{name: dim}`` (the slices concatenate along ``dim`` in tensor-parallel rank order) or
            ``{name: None}`` (the parameter is replicated across tensor-parallel ranks). ``None``:
            unknown (the consolidation then keeps one file per tensor-parallel rank).
        replica: which copy of the sharded model this rank holds, in ``[0, replicas)``: FSDP2's HSDP
            keeps ``replicas`` identical data-parallel groups (the replicate dimension of its mesh).
            Only replica 0 writes checkpoint files; every replica reads them. Not part of the
            checkpoint format: an HSDP checkpoint is the checkpoint of one of its groups.
        replicas: the number of such copies (1: no replication across data-parallel groups).
        experts: where this rank sits in expert parallelism (:class:`ExpertLayout`), or ``None``
            without mixture-of-experts layers.
    """

    rank: int
    world_size: int
    stage: int
    specs: dict[str, ShardSpec]
    engine: str = "deepspeed"
    part: ModelPart = ModelPart()
    tp_dims: dict[str, int | None] | None = None
    replica: int = 0
    replicas: int = 1
    experts: ExpertLayout | None = None

    @property
    def writes_pieces(self) -> bool:
        """Whether a save writes this rank's EMA pieces: not when another rank holds the same ones
        (a later rank of a replicated stage-0 model, a replica other than 0)."""
        return self.replica == 0 and (self.stage != 0 or self.rank == 0)

    @property
    def job_ranks(self) -> int:
        """How many ranks hold the whole model together: data-parallel size x replicas x model-parallel parts."""
        return self.world_size * self.replicas * self.part.tp_size * self.part.pp_size

    def to_json_dict(self) -> dict:
        d = {
            "rank": self.rank,
            "world_size": self.world_size,
            "stage": self.stage,
            "engine": self.engine,
            "specs": {n: [list(s.shape), s.offset, s.numel] for n, s in self.specs.items()},
        }
        if not self.part.whole:
            d["part"] = self.part.to_json_dict()
        if self.tp_dims is not None:
            d["tp_dims"] = dict(self.tp_dims)
        if self.experts is not None:
            d["experts"] = self.experts.to_json_dict()
        return d

    @classmethod
    def from_json_dict(cls, d: dict) -> ShardLayout:
        specs = {n: ShardSpec(tuple(int(x) for x in v[0]), int(v[1]), int(v[2])) for n, v in d["specs"].items()}
        part = ModelPart(**{k: int(v) for k, v in d["part"].items()}) if d.get("part") else ModelPart()
        e = d.get("experts")
        experts = (
            ExpertLayout(int(e["ep"]), int(e["ep_size"]), {n: int(o) for n, o in e["owners"].items()}) if e else None
        )
        return cls(
            int(d["rank"]),
            int(d["world_size"]),
            int(d["stage"]),
            specs,
            str(d.get("engine", "deepspeed")),
            part,
            d.get("tp_dims"),
            experts=experts,
        )
