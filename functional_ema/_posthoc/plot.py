"""The synthesised averaging profile against the requested one, as a picture (matplotlib, imported on use)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from .. import _io
from .profiles import ProfileComparison, reconstruction_profile

#: Fewer dots per inch leave the labels' fonts no pixel to draw in (FreeType refuses them).
MIN_DPI = 20


def plot_profile(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    path: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    coeffs: Sequence[float] | None = None,
    num: int = 2000,
    dpi: int = 120,
) -> ProfileComparison:
    """Save a picture (PNG) of the synthesised averaging profile against the requested one.

    Top panel: weight given to each training step by the requested EMA (dashed) and by the
    combination of snapshots (solid), with the snapshot steps marked; the title carries the
    relative L2 error. Bottom panel: their difference. Needs matplotlib (``pip install
    functional-ema[plot]``); it is imported here only.

    Args:
        path: where to write it, atomically (a temporary sibling renamed over it): the file format is
            its extension (``.png``, ``.pdf``, ``.svg``, any matplotlib writes; another is refused before
            anything is drawn), and a name without one gets ``.png`` appended, as matplotlib names it.
        dpi: resolution of the PNG, ``>= 20``.
        others: as in :func:`reconstruction_profile` (no ``max_profile_error``: a poor fit is drawn,
            not refused).

    Returns:
        The :class:`ProfileComparison` drawn.

    Example:
        >>> plot_profile(gammas, steps, "profile.png", sigma_rel=0.15)   # doctest: +SKIP
    """
    return draw_profile(
        snapshot_gammas,
        snapshot_steps,
        path,
        sigma_rel=sigma_rel,
        gamma=gamma,
        step=step,
        coeffs=coeffs,
        num=num,
        dpi=dpi,
    )


def draw_profile(
    snapshot_gammas: Sequence[float],
    snapshot_steps: Sequence[float],
    path: str | os.PathLike,
    *,
    sigma_rel: float | None = None,
    gamma: float | None = None,
    step: float | None = None,
    coeffs: Sequence[float] | None = None,
    num: int = 2000,
    dpi: int = 120,
    replace: bool = True,
) -> ProfileComparison:
    """:func:`plot_profile`; ``replace=False`` (the CLI's ``--plot`` without ``--overwrite``) keeps a file at
    ``path``, even one that appears while the picture is drawn (``FileExistsError``, see ``_io.atomic_open``)."""
    from .._args import check_int

    out, fmt = plot_file(path)
    dpi = check_int(dpi, "dpi", minimum=MIN_DPI)
    plt = _pyplot()
    prof = reconstruction_profile(
        snapshot_gammas, snapshot_steps, sigma_rel=sigma_rel, gamma=gamma, step=step, coeffs=coeffs, num=num
    )
    t = np.asarray(snapshot_steps, dtype=np.float64).reshape(-1)
    fig, (ax, ax_d) = plt.subplots(
        2, 1, figsize=(8, 5.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}, constrained_layout=True
    )
    try:
        scale = prof.step  # density per unit of relative time: profiles of any length look alike
        ax.plot(
            prof.tau,
            prof.requested * scale,
            "k--",
            lw=2,
            label=f"requested: sigma_rel={prof.sigma_rel:.4g} (gamma={prof.gamma:.4g})",
        )
        ax.plot(
            prof.tau,
            prof.synthesized * scale,
            color="tab:orange",
            lw=1.3,
            label=f"synthesised from {int(np.count_nonzero(prof.coeffs))} snapshots",
        )
        used = np.unique(t[prof.coeffs != 0])
        ax.plot(used, np.zeros_like(used), "|", color="tab:blue", ms=8, label="snapshot steps")
        ax.set_ylabel("weight density \u00d7 step")
        ax.legend(loc="upper left", fontsize=9)
        ax.grid(alpha=0.3)
        ax.set_title(
            f"Post-hoc EMA at step {prof.step:g}: sigma_rel {prof.sigma_rel:.4g}, relative L2 error {prof.rel_error:.2e}",
            fontsize=11,
        )
        ax_d.plot(prof.tau, (prof.synthesized - prof.requested) * scale, color="tab:red", lw=1)
        ax_d.axhline(0.0, color="k", lw=0.5)
        ax_d.set_ylabel("difference")
        ax_d.set_xlabel("training step")
        ax_d.grid(alpha=0.3)
        with _io.atomic_open(out, replace=replace) as f:  # a failed drawing leaves an existing picture as it was
            fig.savefig(f, format=fmt, dpi=dpi)
    finally:
        plt.close(fig)
    return prof


def _pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (no display needed), or ``ImportError`` with the install line."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("plot_profile needs matplotlib: pip install matplotlib (or functional-ema[plot])") from e
    return plt


def plot_file(path: str | os.PathLike, what: str = "path") -> tuple[Path, str]:
    """The file :func:`plot_profile` writes for ``path``, and its format, checked before anything is drawn.

    ``path`` itself when its extension names a format matplotlib writes (``png``, ``pdf``, ``svg``, ...), or
    ``path`` with ``.png`` appended when it has no extension (as matplotlib would name it). ``ValueError``
    naming ``what`` for an extension matplotlib cannot write; ``ImportError`` without matplotlib.
    """
    from .._args import check_path

    out = check_path(path, what)
    _pyplot()
    from matplotlib.backend_bases import FigureCanvasBase

    formats = FigureCanvasBase.get_supported_filetypes()
    ext = out.suffix[1:].lower()
    if not ext:
        return out.with_name(out.name + ".png"), "png"
    if ext not in formats:
        raise ValueError(
            f"{what}={os.fspath(path)!r}: matplotlib writes no {ext!r} files; end the name with one of "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )
    return out, ext
