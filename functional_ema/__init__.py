"""functional_ema: pure-function EMA of model weights over this rank's ZeRO partitions."""

from . import posthoc, schedules
from ._core import ema_nbytes, init_ema, update
from ._layout import ShardLayout, ShardSpec
from ._state import EmaState
from ._tree import TreeMismatchError
from .checkpoint import AsyncSaver, CheckpointError, SaveHandle, client_state_summary, consolidate, consolidate_to_file, load, save
from .deepspeed import SwapStats, gather_full, local_shards, shard_layout, swapped

__version__ = "0.1.0"

__all__ = [
    "AsyncSaver",
    "CheckpointError",
    "EmaState",
    "ShardLayout",
    "ShardSpec",
    "SaveHandle",
    "SwapStats",
    "TreeMismatchError",
    "client_state_summary",
    "consolidate",
    "consolidate_to_file",
    "ema_nbytes",
    "gather_full",
    "init_ema",
    "load",
    "local_shards",
    "posthoc",
    "save",
    "schedules",
    "shard_layout",
    "swapped",
    "update",
]
