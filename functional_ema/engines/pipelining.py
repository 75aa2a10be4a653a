"""``torch.distributed.pipelining`` stages: a stage's module read by its own adapter, placed as a pipeline part.

Pass the ``PipelineStage`` itself (``fe.local_shards(stage)``, ``fe.save(state, stage, ...)``): its
``submod`` is read as any other model (FSDP2, HSDP, FSDP2 over tensor parallelism, or a plain
module), and the layout's part gets the stage's place (``ModelPart.pp = stage.stage_index``,
``pp_size = stage.num_stages``). Files are then named by stage, the manifest lists every stage
(checkpoint format 4) and ``consolidate`` joins the stages' parameters into one model offline, as for
DeepSpeed's ``PipelineEngine``. Stage modules keep their parameters' names from the whole model
(``torchtitan``'s way of cutting a model: copy it and delete what another stage holds), so the names
of different stages never clash.

Decisions: one stage per rank (schedules that put several stages on one rank, e.g. interleaved 1F1B,
are not supported: every verb is collective, once per rank); the stages' ranks must make up the whole
job with the stage module's data-parallel and tensor-parallel ranks (checked, else refused).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ._base import Adapter, Reading, select

__all__ = ["PipelineStageAdapter", "is_pipeline_stage"]


def is_pipeline_stage(x: Any) -> bool:
    """Whether ``x`` is a ``torch.distributed.pipelining`` stage (``PipelineStage`` and the like)."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # pragma: no cover - torch without pipelining
        return False
    return isinstance(x, _PipelineStageBase)


class PipelineStageAdapter(Adapter):
    """One stage of a ``torch.distributed.pipelining`` pipeline; its module read by the module's adapter."""

    name = "pipelining"

    def _inner(self) -> Adapter:
        from . import adapter_for

        return adapter_for(self.target.submod)

    def _read(self, previous: Reading | None = None) -> Reading:
        stage = self.target
        inner = self._inner()
        reading = inner.read()
        layout = reading.layout
        if layout.part.pp_size != 1:
            raise NotImplementedError(
                f"the module of pipeline stage {stage.stage_index} is itself split into pipeline "
                "stages; functional_ema reads one pipeline split"
            )
        part = layout.part._replace(pp=int(stage.stage_index), pp_size=int(stage.num_stages))
        staged = layout._replace(part=part)
        if dist.is_initialized():
            ranks = staged.job_ranks
            if ranks != dist.get_world_size():
                raise NotImplementedError(
                    f"pipeline stage {stage.stage_index} of {stage.num_stages}: its module is read as data parallel "
                    f"{layout.world_size} x {layout.replicas} replica(s) x tensor parallel {part.tp_size}, which with the "
                    f"stages makes {ranks} ranks, but the job has {dist.get_world_size()}; functional_ema reads one stage "
                    "per rank, each stage's ranks sharding its module (fully_shard) or holding it alone"
                )
        return Reading(reading.shards, staged, reading.params, reading.group, (inner, reading))

    def _is_current(self, reading: Reading) -> bool:
        inner, seen = reading.token
        return inner.read() is seen

    def module(self) -> torch.nn.Module:
        return self.target.submod

    @staticmethod
    def _select(reading: Reading) -> Reading:
        """The module's own reading of ``reading``'s selection. Its layout is the module's (one stage), but the
        selection describes the whole pipeline: a pattern for another stage's parameters, or one leaving this stage
        nothing, is no error here either (as ``select`` of the staged reading accepted it)."""
        _, seen = reading.token
        return select(seen, reading.shards.selection, partial=reading.layout.part.pp_size > 1)

    def swap(
        self, reading: Reading, pieces: Mapping[str, torch.Tensor], state: Any, index: int, changes: list[str]
    ) -> Any:
        inner, _ = reading.token
        return inner.swap(self._select(reading), pieces, state, index, changes)

    def joins_slices(self, reading: Reading) -> bool:
        inner, seen = reading.token
        return inner.joins_slices(seen)

    def join_slices(
        self, reading: Reading, part: Mapping[str, torch.Tensor], device: torch.device | str | None
    ) -> dict[str, torch.Tensor]:
        inner, seen = reading.token
        return inner.join_slices(seen, part, device)

    def write_weights(self, reading: Reading, pieces: Mapping[str, torch.Tensor]) -> None:
        inner, _ = reading.token
        inner.write_weights(self._select(reading), pieces)  # the selection's parameters only

    def refuse_training(self, why: str) -> Any:  # the inner adapter's context manager
        return self._inner().refuse_training(why)
