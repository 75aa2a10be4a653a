"""The stages of :func:`functional_ema.export.to_hf`: read ``--like`` (``like``, ``foreign``), the loader's view
(``loader``), the plan (``plan``, ``names``) and the output folder (``outdir``)."""
