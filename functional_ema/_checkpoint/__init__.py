"""The machinery behind :mod:`functional_ema.checkpoint`, one concern per module.

- :mod:`.errors`: the exception family every checkpoint verb raises.
- :mod:`.format`: what is on disk (names, constants, the manifest) and the checks of what is read back.
- :mod:`.collective`: how the ranks of a collective verb agree, arrive and fail together.
- :mod:`.writer`: writing one save (plan, rank files, manifest commit, cleanup); used by ``save``
  and :class:`functional_ema.AsyncSaver`.
- :mod:`.reader`: :class:`.reader.CheckpointReader`, the validated view of a saved checkpoint that
  ``load``, ``consolidate`` and post-hoc EMA read through.
"""
