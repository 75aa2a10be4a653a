"""functional_ema: pure-function EMA of model weights over this rank's ZeRO partitions."""

from . import schedules
from ._core import ema_nbytes, init_ema, update
from ._layout import ShardLayout, ShardSpec
from ._state import EmaState
from ._tree import TreeMismatchError
from .deepspeed import SwapStats, gather_full, local_shards, shard_layout, swapped

__version__ = "0.1.0"

__all__ = [
    "EmaState",
    "ShardLayout",
    "ShardSpec",
    "SwapStats",
    "TreeMismatchError",
    "ema_nbytes",
    "gather_full",
    "init_ema",
    "local_shards",
    "schedules",
    "shard_layout",
    "swapped",
    "update",
]
