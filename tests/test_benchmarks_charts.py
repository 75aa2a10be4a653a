"""The benchmarks' PNG charts (``benchmarks/_charts.py`` and the scripts' ``--plot``), on small fake figures."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from benchmarks import _charts
from benchmarks._charts import Bar, Panel, write_bar_chart

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        data = f.read()
    return len(data) > len(PNG_MAGIC) and data.startswith(PNG_MAGIC)


PANELS = [
    Panel("engine A", [Bar("ours", 1.02, "ours"), Bar("peer", 310.0, "peer"), Bar("noise check", 0.98, "reference")]),
    Panel("engine B", [Bar("ours", 1.4, "ours"), Bar("peer", 1.1, "peer")]),
    Panel("nothing measured", []),
]


@pytest.mark.parametrize("log", [True, False])
def test_bar_chart_writes_a_png(tmp_path, capsys, log):
    pytest.importorskip("matplotlib")
    path = tmp_path / "sub" / "chart.png"
    got = write_bar_chart(path, PANELS, title="t", xlabel="x roofline", log=log, reference=(1.0, "roofline"), note="n")
    assert got == path and _is_png(path)
    assert capsys.readouterr().out == f"chart: {path}\n"


def test_missing_matplotlib_skips_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    path = tmp_path / "chart.png"
    assert write_bar_chart(path, PANELS, title="t", xlabel="x") is None
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and out.startswith(f"chart {path} skipped: matplotlib is not installed")
    assert not path.exists()


def test_stamp_names_machine_and_commit(tmp_path):
    assert f"{os.cpu_count()} cores" in _charts.machine()
    assert _charts.git_commit(tmp_path) == "unknown"  # not a git checkout
    commit = _charts.git_commit()
    assert commit == "unknown" or len(commit.split("+")[0]) >= 4
    assert f"commit {commit}" in _charts.stamp() and _charts.machine() in _charts.stamp()


def test_bench_update_chart_from_fake_results(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import bench_update as b

    def rep(stage, rank, keys):
        return {
            "stage": stage,
            "model": "transformer",
            "world_size": 2,
            "rank": rank,
            "tensors": 516,
            "params": 11.2e6,
            "rounds": {k: [[1.1, 1.0], [1.3, 1.0], [1.2, 1.0]] for k in keys},
        }

    # one world size: per rank, its reports of the configurations
    results = [[[rep(3, r, b.LABELS), rep(2, r, b.LABELS), rep("fsdp2", r, b.FSDP2_LABELS)] for r in (0, 1)]]
    plain = {"tensors": 516, "params": 11.2e6, "x_roofline": {"lib": 1.4, "lib_flat": 1.03, "foreach": 1.13}}
    panels = b.chart_panels(results, plain)
    assert [p.title.split(",")[0] for p in panels] == ["DeepSpeed ZeRO-3", "DeepSpeed ZeRO-2", "FSDP2", "plain module"]
    assert panels[0].bars[0].value == pytest.approx(1.2)  # the median over rounds
    path = tmp_path / "update.png"
    assert b.write_chart(str(path), results, plain, rounds=3) == path and _is_png(path)


def test_bench_checkpoint_chart_from_fake_results(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks import bench_checkpoint as b

    keys = {k for row in b.ROWS for k in row[2:4]} | {"async_block", "copy"}
    run = {
        "times": {k: 0.1 for k in keys},
        "medians": {k: 0.2 for k in keys},
        "local_bytes": 10**8,
        "full_bytes": 2 * 10**8,
    }
    results = [{"params": 5e7, "world": 2, "runs": {"1": run, "2": run}} for _ in range(2)]
    panels = b.chart_panels(results)
    assert len(panels) == 2
    labels = [bar.label for bar in panels[0].bars]
    assert len(labels) == len(set(labels))  # each baseline once per panel
    assert panels[0].bars[0].value == pytest.approx(2e8 / 0.1 / 1e9)  # both ranks' bytes over the slowest time
    args = argparse.Namespace(world_size=2, stage=2, repeat=8)
    path = tmp_path / "checkpoint.png"
    assert b.write_chart(str(path), results, args) == path and _is_png(path)
