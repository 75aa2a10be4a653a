"""functional_ema: pure-function EMA of model weights over this rank's local shards.

The same verbs for a DeepSpeed engine, a torch FSDP2 model and a plain or DDP module::

    state = fe.init_ema(fe.local_shards(model))
    state = fe.update(state, fe.local_shards(model), step, decay=0.9999)
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version

from . import buffers, dcp, posthoc, schedules
from ._api import (
    StateMismatchError,
    SwappedTrainingError,
    gather_full,
    local_shards,
    process_group,
    shard_layout,
    swapped,
)
from ._core import NonFiniteError, UpdateInfo, ema_nbytes, init_ema, update, update_info, wait_update
from ._errors import MismatchError
from ._offload import AsyncUpdateError
from ._layout import ExpertLayout, ModelPart, ShardLayout, ShardSpec
from ._shards import SegmentIndex, Shards
from ._state import EmaState
from ._tree import TreeMismatchError
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

try:
    __version__ = _version("functional-ema")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = [
    "AsyncSaver",
    "AsyncUpdateError",
    "CheckpointError",
    "EmaState",
    "ExpertLayout",
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
    "SwappedTrainingError",
    "TreeMismatchError",
    "UpdateInfo",
    "buffers",
    "client_state_summary",
    "consolidate",
    "consolidate_to_file",
    "dcp",
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
