"""The machinery behind :mod:`functional_ema.posthoc`, one concern per module.

- :mod:`.profiles`: the math on averaging profiles (float64 numpy): inner products, the least-squares
  coefficients, the profile error, what a set of snapshots can express.
- :mod:`.synthesis`: combining snapshots (in memory) into the EMA of a requested profile.
- :mod:`.files`: snapshot checkpoints on disk, and streaming reconstruction from them.
- :mod:`.plot`: the picture of a synthesised profile against the requested one (matplotlib).
"""
