"""``examples/train_zero.py`` (what ``make demo`` runs), as a user would run it: it launches its own 2
gloo ranks of DeepSpeed ZeRO-3 on CPU, prints the held-out loss table, saves, consolidates, and with
matplotlib installed draws the loss curves into its run folder."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from functional_ema._testing.multirank import ROOT, extensions_dir

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_train_zero_demo_runs_and_plots(tmp_path):
    out = tmp_path / "demo"
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",
        TORCH_EXTENSIONS_DIR=extensions_dir(),
        TMPDIR=str(tmp_path),  # torchrun's agent leaves its (empty) torchelastic_* log folders there, not in /tmp
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "train_zero.py"),
            "--nproc",
            "2",
            "--stage",
            "3",
            "--steps",
            "20",
            "--eval-every",
            "10",
            "--out",
            str(out),
        ],
        cwd=str(ROOT),
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"{'step':>6} {'train loss':>11} {'val raw':>9} {'val EMA':>9}" in proc.stdout, proc.stdout[-3000:]
    assert "offline consolidate == online gather_full: True" in proc.stdout, proc.stdout[-3000:]
    png = out / "val_loss.png"
    if importlib.util.find_spec("matplotlib") is None:
        assert "validation loss plot skipped: matplotlib is not installed" in proc.stdout
        assert not png.exists()
        return
    assert f"validation loss curves: {png}" in proc.stdout, proc.stdout[-3000:]
    data = png.read_bytes()
    assert len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)
