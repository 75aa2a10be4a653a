"""The torch versions whose internals the FSDP2 adapter knows, and the check before it reads them.

FSDP2 has a public API (``fully_shard``, ``FSDPModule``, ``DTensor``), but where a parameter's
pieces live is only in its private records (``torch.distributed.fsdp._fully_shard``: ``FSDPParam``,
the mesh infos, the training and sharded states) and FSDP2 replaces local tensors only in
``FSDPParam.reset_sharded_param``. The adapter was written against, and tested on, the torch
versions in :data:`KNOWN_TORCH`. On those it reads the records directly and counts replacements by
wrapping ``reset_sharded_param``. On any other torch it first checks that every internal it reads
is there: a missing one is a ``NotImplementedError`` naming it, the torch version and the versions
known; if all are there it warns (once per call site, by Python's warning filter) that the version
is untested, and compares each parameter's local tensor instead of wrapping a private method whose
contract it cannot vouch for.

A leaf: it imports only torch.
"""

from __future__ import annotations

import importlib
import re
import warnings

import torch

__all__ = ["KNOWN_TORCH", "check_fsdp2_internals", "is_known_torch", "missing_fsdp2_internals", "torch_minor"]

#: The oldest and newest torch (major, minor) the FSDP2 adapter was tested on: the suite on 2.13
#: (CPU, gloo), the GPU check on 2.11 (one H200). pyproject's ``torch`` range is the same.
KNOWN_TORCH = ((2, 11), (2, 13))

_FSDP = "torch.distributed.fsdp._fully_shard"
#: Every torch internal the FSDP2 adapter reads: (module, dotted attribute).
FSDP2_INTERNALS = (
    (f"{_FSDP}._fsdp_common", "FSDPMeshInfo"),
    (f"{_FSDP}._fsdp_common", "HSDPMeshInfo"),
    (f"{_FSDP}._fsdp_common", "TrainingState.IDLE"),
    (f"{_FSDP}._fsdp_param", "ShardedState.SHARDED"),
    (f"{_FSDP}._fsdp_param", "FSDPParam.reset_sharded_param"),
    ("torch.distributed.fsdp", "FSDPModule._get_fsdp_state"),
)


def torch_minor(version: str | None = None) -> tuple[int, int]:
    """``(major, minor)`` of ``version`` (default: the installed ``torch.__version__``), e.g. ``(2, 13)``
    for ``"2.13.0+cpu"``; ``(0, 0)`` for a string that does not start with two numbers."""
    m = re.match(r"(\d+)\.(\d+)", str(torch.__version__ if version is None else version))
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def is_known_torch(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed torch) lies in :data:`KNOWN_TORCH`."""
    return KNOWN_TORCH[0] <= torch_minor(version) <= KNOWN_TORCH[1]


def _known() -> str:
    (a, b), (c, d) = KNOWN_TORCH
    return f"{a}.{b} to {c}.{d}"


def missing_fsdp2_internals() -> list[str]:
    """The entries of :data:`FSDP2_INTERNALS` this torch lacks, as ``module.attribute`` strings."""
    missing = []
    for module, dotted in FSDP2_INTERNALS:
        try:
            obj: object = importlib.import_module(module)
            for part in dotted.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{dotted}")
    return missing


def check_fsdp2_internals() -> None:
    """Return quietly on a known torch; otherwise refuse one that lacks an internal the FSDP2 adapter
    reads, or warn that this torch is untested.

    Raises:
        NotImplementedError: naming the missing internals, this torch's version and the versions known.
    """
    if is_known_torch():
        return
    missing = missing_fsdp2_internals()
    if missing:
        raise NotImplementedError(
            f"functional_ema reads FSDP2's internal records, and torch {torch.__version__} lacks {missing}; "
            f"the FSDP2 adapter knows torch {_known()}: install torch>={KNOWN_TORCH[0][0]}.{KNOWN_TORCH[0][1]},"
            f"<{KNOWN_TORCH[1][0]}.{KNOWN_TORCH[1][1] + 1}"
        )
    warnings.warn(
        f"functional_ema's FSDP2 adapter was tested on torch {_known()}, not {torch.__version__}; every internal "
        "it reads is there, so it goes on, comparing each parameter's local tensor on every reading",
        RuntimeWarning,
        stacklevel=3,
    )
