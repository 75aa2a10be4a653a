"""PNG charts of the benchmarks' figures: horizontal bars in panels, stamped with machine and commit.

matplotlib is optional (the ``plot`` extra): it is imported when a chart is written, with the Agg
backend, and a missing matplotlib skips the chart with one printed line.
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Bar colours by kind: this library, the approaches it is compared with, and reference bars
# (a measurement of the method's own noise, a floor such as one copy_).
COLORS = {"ours": "#1f77b4", "peer": "#ff7f0e", "reference": "#9e9e9e"}
KIND_LABELS = {"ours": "functional_ema", "peer": "peer approach / plain baseline", "reference": "reference"}


@dataclass(frozen=True)
class Bar:
    """One bar: its label on the y axis, its value, and its kind (a key of ``COLORS``)."""

    label: str
    value: float
    kind: str = "peer"


@dataclass(frozen=True)
class Panel:
    """One subplot: a title and its bars, top to bottom."""

    title: str
    bars: Sequence[Bar]


def machine() -> str:
    """The CPU model, core count, OS and architecture of this machine, e.g. "AMD EPYC, 2 cores, Linux x86_64"."""
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:  # not Linux
        pass
    model = model or platform.processor() or "unknown CPU"
    return f"{model}, {os.cpu_count()} cores, {platform.system()} {platform.machine()}"


def git_commit(root: Path = ROOT) -> str:
    """The short hash of HEAD in ``root`` ("unknown" outside a git checkout), with "+changes" when
    tracked files differ from it (the figures then come from code no commit holds)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=False
        )
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(  # exit code 1: tracked files differ
            ["git", "diff", "--quiet", "HEAD", "--"], cwd=root, capture_output=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head.stdout.strip() + ("+changes" if dirty.returncode == 1 else "")


def stamp(device: str | None = None) -> str:
    """The line every chart carries under its title: machine (or ``device``, e.g. a GPU's name), commit
    and date. ``FE_COMMIT``, when set, names the commit (a copied tree whose git history is another's)."""
    commit = os.environ.get("FE_COMMIT") or git_commit()
    return f"{device or machine()} · commit {commit} · {datetime.date.today().isoformat()}"


def write_bar_chart(
    path: str | os.PathLike,
    panels: Sequence[Panel],
    *,
    title: str,
    xlabel: str,
    value_format: Callable[[float], str] = "{:.2f}".format,
    log: bool = False,
    reference: tuple[float, str] | None = None,
    note: str = "",
    device: str | None = None,
) -> Path | None:
    """Write ``panels`` as horizontal bar charts stacked in one PNG at ``path`` and print its path.

    Every bar is annotated with ``value_format(value)``, and a thin line separates the groups that each
    start with one of our bars (kind "ours") after other bars; ``reference`` = (x, label) draws a dashed
    vertical line across every panel; ``log`` uses a logarithmic x axis shared by the panels; ``note``
    is a line under the title, and the line after it names the machine (``device`` when given, e.g. the
    GPU the figures come from) and the commit. Returns the path, or
    ``None`` after printing one line when matplotlib is not installed.
    """
    path = Path(path)
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed, and none is touched
        import matplotlib.pyplot as plt
    except ImportError as e:
        print(f"chart {path} skipped: matplotlib is not installed ({e}); pip install 'functional-ema[plot]'")
        return None

    panels = [p for p in panels if p.bars]
    heights = [0.3 * len(p.bars) + 0.6 for p in panels]
    fig, axes = plt.subplots(
        len(panels),
        1,
        figsize=(10, sum(heights) + 1.6),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
        layout="constrained",
    )
    values = [b.value for p in panels for b in p.bars] + ([reference[0]] if reference else [])
    for ax, panel in zip(axes[:, 0], panels):
        y = list(range(len(panel.bars)))[::-1]  # first bar on top
        ax.barh(y, [b.value for b in panel.bars], color=[COLORS[b.kind] for b in panel.bars], height=0.7)
        ax.set_yticks(y, [b.label for b in panel.bars], fontsize=9)
        ax.set_ylim(-0.6, len(panel.bars) - 0.4)
        ax.set_title(panel.title, fontsize=10, loc="left")
        for yi, b in zip(y, panel.bars):
            # right of the reference line when the bar ends just short of it: the line would cross the text
            at = max(b.value, reference[0]) if reference else b.value
            ax.annotate(
                value_format(b.value), (at, yi), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8
            )
        for yi, before, b in zip(y[1:], panel.bars, panel.bars[1:]):
            if b.kind == "ours" and before.kind != "ours":  # our next operation starts a new group
                ax.axhline(yi + 0.5, color="#cccccc", linewidth=0.8)
        if reference:
            ax.axvline(reference[0], color="black", linestyle="--", linewidth=1)
        ax.grid(axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    last = axes[-1, 0]
    if log:
        last.set_xscale("log")
        # room on the right for the value labels of the longest bars
        last.set_xlim(min(values) / 1.5, max(values) * 4)
        from matplotlib.ticker import FuncFormatter, LogLocator

        if max(values) / min(values) < 1000:  # few decades: label 1, 2, 5 of each, not only the powers of 10
            last.xaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 5)))
        last.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    else:
        last.set_xlim(0, max(values) * 1.15)
    last.set_xlabel(xlabel)
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds = [k for k in COLORS if any(b.kind == k for p in panels for b in p.bars)]
    handles = [Patch(color=COLORS[k], label=KIND_LABELS[k]) for k in kinds]
    if reference:
        handles.append(Line2D([], [], color="black", linestyle="--", label=reference[1]))
    fig.legend(handles=handles, loc="outside lower right", fontsize=8, ncol=len(handles), frameon=False)
    # The stamp goes in the title block: a footer beside the legend would collide with long CPU names.
    fig.suptitle("\n".join([title, *([note] if note else []), stamp(device)]), fontsize=10, x=0.01, ha="left")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    _shrink_png(path)
    print(f"chart: {path}")
    return path


def _shrink_png(path: Path) -> None:
    """Re-encode the PNG with a 64-colour palette: a bar chart has few colours, and the antialiased
    text in 24-bit colour is most of the file (about 4x smaller, no visible change)."""
    try:
        from PIL import Image
    except ImportError:  # matplotlib depends on Pillow; keep the 24-bit file if it is somehow absent
        return
    with Image.open(path) as im:
        small = im.convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
    small.save(path, optimize=True)
