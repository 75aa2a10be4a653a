"""Post-hoc EMA: choose the EMA length after training (Karras et al. 2024, "EDM2", section 3).

Train once while tracking a few power-function EMAs (e.g. ``sigma_rel`` 0.05 and 0.10), save
snapshots of them every so often, and afterwards synthesise the EMA of *any* ``sigma_rel`` (or
``gamma``) at any snapshot step as a linear combination of the snapshots.

The math, implemented here from the paper's formulas:

* **Profile.** A power EMA with exponent ``gamma`` read at time ``t`` averages the trajectory with
  the normalised weight density ::

      p_{gamma,t}(tau) = (gamma + 1) * tau**gamma / t**(gamma + 1)      for 0 < tau <= t (else 0)

  With the per-step decay ``beta(t) = (1 - 1/t)**(gamma + 1)`` of
  :func:`functional_ema.schedules.power`, the discrete EMA at step ``t`` weighs the weights of step
  ``u`` by exactly ``integral_{u-1}^{u} p_{gamma,t} = (u**(g+1) - (u-1)**(g+1)) / t**(g+1)``, and when
  updated every N steps (decays compounded, ``((u-N)/u)**(g+1)``) by the integral over ``(u-N, u]``.
  So the EMA is ``integral p_{gamma,t}(tau) x(tau) dtau`` for the piecewise-constant trajectory ``x``,
  and snapshot times are simply training steps.

* **Inner product** (closed form, in ratios so it stays finite for large ``t`` and ``gamma``)::

      <p_a, p_b> = integral_0^{min(t_a, t_b)} p_a p_b
                 = (g_a + 1)(g_b + 1) / ((g_a + g_b + 1) * t_max) * (t_min / t_max)**g_max

  where ``t_max = max(t_a, t_b)``, ``t_min = min(t_a, t_b)`` and ``g_max`` is the exponent of the
  profile that ends at ``t_max``.

* **Coefficients.** For a target profile ``p*`` and snapshot profiles ``p_i`` the least-squares
  fit ``min_x || sum_i x_i p_i - p* ||_2`` solves ``A x = b`` with ``A_ij = <p_i, p_j>`` and
  ``b_i = <p_i, p*>`` (float64, :func:`numpy.linalg.lstsq`, minimum-norm solution). Because the EMA
  is linear in the trajectory, ``sum_i x_i snapshot_i`` is the EMA of ``p*`` up to the profile
  error. The relative L2 error of the profile, ``||sum_i x_i p_i - p*|| / ||p*||``, is computed
  in closed form (``x^T A x - 2 x^T b + <p*, p*>``) and requests it cannot meet are refused.

* **Per rank.** Reconstruction is linear and elementwise, so reconstructing each rank's shards and
  then gathering equals gathering and then reconstructing; no process group is needed.

Example:
    >>> import numpy as np
    >>> from functional_ema import posthoc, schedules
    >>> g = [schedules.sigma_rel_to_gamma(s) for s in (0.05, 0.10)]
    >>> steps = [s for s in range(1000, 64001, 1000) for _ in g]     # 64 snapshots of each EMA
    >>> gammas = g * 64
    >>> x = posthoc.solve_coefficients(gammas, steps, sigma_rel=0.15, step=64000)
    >>> x.shape
    (128,)
    >>> float(posthoc.profile_error(gammas, steps, x, sigma_rel=0.15, step=64000)) < 1e-3
    True

In a training loop, in memory (small models, tests)::

    scheds = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    state = fe.init_ema(shards, num_emas=2)
    snaps = []
    for step in range(1, total + 1):
        ...
        state = fe.update(state, shards, step, decay=scheds)
        if step % 1000 == 0:
            snaps.append(posthoc.snapshot(state, scheds))
    ema_015 = posthoc.reconstruct(snaps, sigma_rel=0.15)

or on disk, one safetensors file per rank per snapshot (DeepSpeed, any ZeRO stage)::

    if step % 1000 == 0:
        posthoc.save_snapshot(state, engine, "snapshots", scheds)       # collective
    ...
    weights = posthoc.posthoc_offline("snapshots", sigma_rel=0.15)      # later, anywhere, no GPU
    pieces = posthoc.posthoc_local("snapshots", engine, sigma_rel=0.15) # this rank's pieces
    posthoc.plot_profile(gammas, steps, "profile.png", sigma_rel=0.15)  # how faithful it is

Memory of the synthesis: float64 accumulators (of the whole tree in memory; of one group of at most
``buffer_bytes`` from files) plus one parameter and 4 MiB of scratch; see :func:`posthoc_offline`.

Snapshots can be saved to and read from an fsspec URL (``s3://bucket/run/snapshots``): every verb that
takes ``snapshot_dir`` takes a URL with ``storage_options=`` (fsspec's arguments; ``None``: its configuration).

Command line: ``python -m functional_ema posthoc SNAPSHOT_DIR --sigma-rel 0.15 OUT.safetensors
[--step S] [--plot profile.png] [--storage-options JSON]`` (:func:`posthoc_to_file` from Python).
"""

from __future__ import annotations

from ._posthoc.files import (
    SNAPSHOT_PREFIX,
    SnapshotInfo,
    list_snapshots,
    posthoc_local,
    posthoc_offline,
    posthoc_to_file,
    save_snapshot,
    snapshot_tag,
)
from ._posthoc.plot import plot_profile
from ._posthoc.profiles import (
    DEFAULT_MAX_PROFILE_ERROR,
    ProfileComparison,
    ReconstructionError,
    expressible_range,
    power_profile,
    profile_error,
    profile_inner,
    reconstruction_profile,
    solve_coefficients,
)
from ._posthoc.synthesis import Snapshot, reconstruct, snapshot, snapshot_gammas, synthesize
from .schedules import SIGMA_REL_MAX

__all__ = [
    "DEFAULT_MAX_PROFILE_ERROR",
    "SIGMA_REL_MAX",
    "SNAPSHOT_PREFIX",
    "ProfileComparison",
    "ReconstructionError",
    "Snapshot",
    "SnapshotInfo",
    "expressible_range",
    "list_snapshots",
    "plot_profile",
    "posthoc_local",
    "posthoc_offline",
    "posthoc_to_file",
    "power_profile",
    "profile_error",
    "profile_inner",
    "reconstruct",
    "reconstruction_profile",
    "save_snapshot",
    "snapshot",
    "snapshot_gammas",
    "snapshot_tag",
    "solve_coefficients",
    "synthesize",
]
