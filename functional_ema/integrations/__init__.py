"""Glue for training frameworks: PyTorch Lightning, the Hugging Face ``Trainer`` and Accelerate.

Each submodule imports its framework only when it is imported itself::

    from functional_ema.integrations.lightning import EMACallback      # needs `lightning`
    from functional_ema.integrations.transformers import EMACallback   # needs `transformers`
    from functional_ema.integrations.accelerate import AcceleratorEMA  # needs `accelerate`

All three drive one framework-free :class:`~functional_ema.integrations.EMAController`, which can
also be used directly from a hand-written loop.
"""

from ._common import EMAController

__all__ = ["EMAController"]
