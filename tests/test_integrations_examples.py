"""The README's integration snippets, run as written (``examples/*.py``) at 2 real CPU ranks."""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

from functional_ema._testing.multirank import ROOT, run_ranks


def example_worker(name: str, argv: list[str]) -> dict:
    from tests._integration_models import quiet

    quiet()
    path = str(ROOT / "examples" / name)
    sys.argv = [path, *argv]
    g = runpy.run_path(path, run_name="__main__")
    keep = {k: g[k] for k in ("live", "post", "raw", "ema_loss", "metrics") if k in g}
    return {k: (v if isinstance(v, (int, float, str, dict)) else str(v)) for k, v in keep.items()}


def test_lightning_example(tmp_path):
    pytest.importorskip("lightning")
    from safetensors.torch import load_file

    import functional_ema as fe

    out = str(tmp_path)
    r = run_ranks(
        "tests.test_integrations_examples:example_worker",
        world_size=2,
        timeout=600,
        name="lightning_ema.py",
        argv=["--out", out],
    )
    snaps = fe.posthoc.list_snapshots(f"{out}/snapshots")
    assert [s.step for s in snaps] == list(range(2, 33, 2))  # 32 optimizer steps, every 2
    assert r[0]["live"] != r[0]["post"]
    from torch import nn

    net = nn.Module()  # the example's LightningModule holds this network as `net`
    net.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))
    assert (
        str(net.load_state_dict(load_file(f"{out}/ema.safetensors"), strict=True)) == "<All keys matched successfully>"
    )
    # the post-hoc EMA evaluated in place equals the offline synthesis
    full = fe.posthoc.posthoc_offline(f"{out}/snapshots", sigma_rel=0.08)
    net.load_state_dict(full, strict=False)
    assert all(torch.equal(dict(net.named_parameters())[n].detach(), t) for n, t in full.items())
    # the README's CLI line with the `plot` extra
    import subprocess

    pytest.importorskip("matplotlib")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "functional_ema",
            "posthoc",
            f"{out}/snapshots",
            "--sigma-rel",
            "0.08",
            f"{out}/ema_008.safetensors",
            "--plot",
            f"{out}/profile.png",
        ],
        check=True,
        cwd=str(ROOT),
        timeout=300,
    )
    assert (tmp_path / "profile.png").stat().st_size > 0
    cli = load_file(f"{out}/ema_008.safetensors")
    assert all(torch.equal(cli[n], full[n]) for n in full)


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    out = str(tmp_path)
    r = run_ranks(
        "tests.test_integrations_examples:example_worker",
        world_size=2,
        timeout=600,
        name="hf_trainer_ema.py",
        argv=["--out", out],
    )
    m = r[0]["metrics"]
    assert "eval_ema_loss" in m and "eval_loss" in m and m["eval_ema_loss"] != m["eval_loss"]
