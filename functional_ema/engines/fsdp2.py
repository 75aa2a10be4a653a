"""torch FSDP2 (``fully_shard``) adapter. (Being written; see engines/__init__.py.)"""

from __future__ import annotations

from typing import Any

import torch

from ._base import Adapter

__all__ = ["FSDP2Adapter", "is_fsdp2"]


def is_fsdp2(x: Any) -> bool:
    """Whether ``x`` or one of its submodules has FSDP2 applied."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return False
    return isinstance(x, torch.nn.Module) and any(isinstance(m, FSDPModule) for m in x.modules())


class FSDP2Adapter(Adapter):
    name = "fsdp2"
