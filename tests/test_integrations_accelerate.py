"""Accelerate with its DeepSpeed plugin (ZeRO-3, gradient accumulation 2) at 2 real CPU ranks, run
through ``examples/accelerate_ema.py`` as written: a run stopped after its step-4 ``save_state`` and
resumed with ``load_state`` in fresh processes ends with the uninterrupted run's EMA, bitwise; the
EMA is checked against DeepSpeed's full fp32 weights at the save step; the export loads strictly.
"""

from __future__ import annotations

import runpy
import sys

import pytest
import torch

pytest.importorskip("accelerate")

from tests._multirank import ROOT, run_ranks  # noqa: E402

EXAMPLE = str(ROOT / "examples" / "accelerate_ema.py")


def example_worker(argv: list[str]) -> dict:
    from tests._integration_models import quiet

    quiet()
    sys.argv = [EXAMPLE, *argv]
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    return {"ok": True}


def test_accelerate_deepspeed_save_load_state_resume(tmp_path):
    from safetensors.torch import load_file
    from torch import nn

    import functional_ema as fe
    from functional_ema.checkpoint import read_manifest

    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    run_ranks("tests.test_integrations_accelerate:example_worker", world_size=2, timeout=600, argv=["--out", full])
    # The interrupted run writes its EMA in the background (async_save) and exits one step after
    # the save: the process waits for the write, and the resumed run ends bitwise as the full one.
    run_ranks("tests.test_integrations_accelerate:example_worker", world_size=2, timeout=600,
              argv=["--out", part, "--stop-at", "5", "--async-save"])
    assert not (tmp_path / "part" / "ema.safetensors").exists()  # stopped before the end
    assert read_manifest(tmp_path / "part" / "ckpt", "ema")["step"] == 4
    run_ranks("tests.test_integrations_accelerate:example_worker", world_size=2, timeout=600,
              argv=["--out", part, "--resume", "--async-save"])
    a, b = load_file(f"{full}/ema.safetensors"), load_file(f"{part}/ema.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    # strict load into the plain model (parameters and BatchNorm buffers)
    net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))
    assert str(net.load_state_dict(a, strict=True)) == "<All keys matched successfully>"
    # the step-4 checkpoint: every rank's pieces inside accelerate's folder, consolidated offline
    ckpt = tmp_path / "full" / "ckpt"
    names = sorted(p.name for p in (ckpt / "ema").iterdir())
    assert "ema_rank_00000_of_00002.safetensors" in names and "ema_rank_00001_of_00002.safetensors" in names
    m = read_manifest(ckpt, "ema")
    assert m["step"] == 4 and m["zero_stage"] == 3 and m["world_size"] == 2
    sd = fe.buffers.consolidate(ckpt, "ema")
    assert str(nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1)).load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
