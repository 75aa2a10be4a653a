"""The exceptions of EMA checkpoints: one family under :class:`CheckpointError` (a ``ValueError``)."""

from __future__ import annotations

from .._errors import MismatchError

__all__ = [
    "CheckpointError",
    "CheckpointNotFoundError",
    "IncompleteCheckpointError",
    "CorruptCheckpointError",
    "CheckpointVersionError",
    "CheckpointMismatchError",
    "InvalidTagError",
    "CheckpointIOError",
    "CheckpointTimeoutError",
    "OutputPathError",
    "ForeignFileError",
]


class CheckpointError(ValueError):
    """Base class: an EMA checkpoint cannot be saved or read. The message says what and how to fix."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint directory, the tag, or ``latest`` does not exist."""


class IncompleteCheckpointError(CheckpointError):
    """The tag has no manifest (the save did not finish) or files listed in it are missing."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, fails its checksum, is not safetensors (e.g. a pickle), or disagrees
    with the manifest."""


class CheckpointVersionError(CheckpointError):
    """Written by a newer functional_ema (a format version this one cannot read)."""


class CheckpointMismatchError(CheckpointError, MismatchError):
    """The checkpoint does not fit the model or the request: parameter names, shapes, dtype, index.
    Also a :class:`functional_ema.MismatchError`."""


class InvalidTagError(CheckpointError):
    """A tag that is not one plain folder name (separators, ``..``, whitespace, control characters),
    or one that collides with DeepSpeed's or functional_ema's own files (``latest``, ...)."""


class CheckpointIOError(CheckpointError, OSError):
    """A file could not be written or read (full disk, read-only folder, no permission). Raised on
    every rank of a collective verb; the message names the rank, the file and the errno."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """Not every rank of the data-parallel group called a collective verb (:func:`~functional_ema.save`,
    :func:`~functional_ema.load`) within the timeout (see :data:`functional_ema.checkpoint.TIMEOUT_ENV`)."""


class OutputPathError(CheckpointError):
    """An output path inside the checkpoint being read, or an existing file without ``overwrite``."""


class ForeignFileError(CheckpointError):
    """A file another tool wrote, read as input (a ``--like`` model folder's ``config.json``, weight index,
    weight files or ``adapter_config.json``), is malformed, unreadable or inconsistent with the rest of its
    folder. The message names the file and the field."""
