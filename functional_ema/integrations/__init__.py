"""Glue for training frameworks: PyTorch Lightning, the Hugging Face ``Trainer`` and Accelerate.

Each submodule imports its framework only when it is imported itself::

    from functional_ema.integrations.lightning import EMACallback      # needs `lightning`
    from functional_ema.integrations.transformers import EMACallback   # needs `transformers`
    from functional_ema.integrations.accelerate import AcceleratorEMA  # needs `accelerate`
    from functional_ema.integrations.diffusers import EMAModel         # needs `diffusers`

The first three drive one framework-free :class:`~functional_ema.integrations.EMAController`, which can
also be used directly from a hand-written loop; ``EMAModel`` is diffusers' ``EMAModel`` API (a drop-in
for its training scripts) over the same EMA.
"""

from ._common import EMAController

__all__ = ["EMAController"]
