"""How many post-hoc snapshots a sigma_rel range needs: measured with functional_ema.posthoc.

A synthetic run (a 4096-element random walk with drift, 4096 steps) tracks two power EMAs
(sigma_rel 0.05 and 0.10) and, for comparison, each target sigma_rel directly. Snapshots of the two
are taken N times, evenly spaced; each target is then reconstructed at the last step
(``posthoc.reconstruct``) and compared with the directly tracked EMA of that sigma_rel:

    error = ||reconstructed - direct|| / ||direct - live weights||

(relative to how far the EMA is from the weights, so it reads as "fraction of the averaging effect
that is wrong"). Also printed: the sigma_rel range ``posthoc.expressible_range`` admits at the
default profile-error limit (0.02) for each N.

    python benchmarks/posthoc_snapshots.py
"""

import torch

import functional_ema as fe
from functional_ema import posthoc, schedules

STEPS = 4096
TARGETS = (0.02, 0.03, 0.05, 0.08, 0.12, 0.15, 0.20, 0.25)
COUNTS = (2, 4, 8, 16, 32, 64)
TRACKED = (0.05, 0.10)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.zeros(4096)
    drift = torch.randn(4096, generator=g) * 0.01
    tracked = [schedules.power(sigma_rel=s) for s in TRACKED]
    direct = [schedules.power(sigma_rel=s) for s in TARGETS]
    st = fe.init_ema({"w": w}, num_emas=len(tracked))
    sd = fe.init_ema({"w": w}, num_emas=len(direct))
    every_step = {n: set(round(STEPS * (i + 1) / n) for i in range(n)) for n in COUNTS}
    snaps = {n: [] for n in COUNTS}
    for step in range(1, STEPS + 1):
        w = w + drift + torch.randn(4096, generator=g) * 0.1
        st = fe.update(st, {"w": w}, step, decay=tracked)
        sd = fe.update(sd, {"w": w}, step, decay=direct)
        for n in COUNTS:
            if step in every_step[n]:
                snaps[n].append(posthoc.snapshot(st, tracked))
    gammas = [schedules.sigma_rel_to_gamma(s) for s in TRACKED]
    head = (
        "| snapshots (x2 EMAs) | expressible sigma_rel (profile error <= 0.02) | "
        + " | ".join(f"{t:g}" for t in TARGETS)
        + " |"
    )
    print(head)
    print("|" + "---|" * (2 + len(TARGETS)))
    for n in COUNTS:
        steps = sorted(every_step[n])
        rng = posthoc.expressible_range(gammas * n, [s for s in steps for _ in gammas])
        cells = []
        for k, t in enumerate(TARGETS):
            try:
                rec = posthoc.reconstruct(snaps[n], sigma_rel=t)["w"]
            except posthoc.ReconstructionError:
                cells.append("refused")
                continue
            d = sd.emas[k]["w"]
            err = (rec - d).norm().item() / (d - w).norm().item()
            cells.append(f"{err:.1e}")
        r = "none" if rng is None else f"{rng[0]:.3f} - {rng[1]:.3f}"
        print(f"| {n} | {r} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
