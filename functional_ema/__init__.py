"""functional_ema: pure-function EMA of model weights over this rank's local shards.

The same verbs for a DeepSpeed engine, a torch FSDP2 model and a plain or DDP module::

    state = fe.init_ema(fe.local_shards(model))
    state = fe.update(state, fe.local_shards(model), step, decay=0.9999)
"""

from . import buffers, dcp, export, posthoc, schedules
from ._api import (
    StateMismatchError,
    SwappedParametersChangedError,
    SwappedTrainingError,
    gather_full,
    local_shards,
    process_group,
    shard_layout,
    swapped,
)
from ._core import NonFiniteError, UpdateInfo, ema_nbytes, init_ema, update, update_info, wait_update
from ._errors import LowPrecisionWeightsWarning, MismatchError, UnsyncedReplicasWarning
from ._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from ._offload import AsyncUpdateError
from ._shards import SegmentIndex, Shards
from ._state import EmaState
from ._tree import TreeMismatchError
from ._version import __version__ as __version__
from .checkpoint import (
    AsyncSaver,
    CheckpointError,
    SaveHandle,
    client_state_summary,
    consolidate,
    consolidate_to_file,
    load,
    save,
)
from .engines import SwapStats

__all__ = [
    "AsyncSaver",
    "AsyncUpdateError",
    "CheckpointError",
    "EmaState",
    "ExpertLayout",
    "LowPrecisionWeightsWarning",
    "MismatchError",
    "ModelPart",
    "NonFiniteError",
    "SaveHandle",
    "SegmentIndex",
    "ShardLayout",
    "ShardSpec",
    "Shards",
    "StateMismatchError",
    "SwapStats",
    "SwappedParametersChangedError",
    "SwappedTrainingError",
    "TreeMismatchError",
    "UnsyncedReplicasWarning",
    "UpdateInfo",
    "buffers",
    "client_state_summary",
    "consolidate",
    "consolidate_to_file",
    "dcp",
    "export",
    "ema_nbytes",
    "gather_full",
    "init_ema",
    "load",
    "local_shards",
    "posthoc",
    "process_group",
    "save",
    "schedules",
    "shard_layout",
    "swapped",
    "update",
    "update_info",
    "wait_update",
]
