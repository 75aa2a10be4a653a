"""Print what the built wheel and sdist hold and check it: the wheel holds the package (with its
py.typed and the test support it ships, functional_ema/_testing) and its metadata, nothing else;
the sdist holds no virtual environments or build outputs. The wheel's version is the package's.

    python .ci/check_wheel.py dist/*.whl dist/*.tar.gz
"""

from __future__ import annotations

import re
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(wheel: str, sdist: str) -> None:
    version = re.search(r'^__version__ = "(.+)"$', (ROOT / "functional_ema" / "_version.py").read_text(), re.M)
    assert version is not None
    assert Path(wheel).name.startswith(f"functional_ema-{version.group(1)}-"), (wheel, version.group(1))
    with zipfile.ZipFile(wheel) as zf:
        names = sorted(zf.namelist())
    print(f"{Path(wheel).name}: {len(names)} files")
    for n in names:
        print("   ", n)
    dist_info = f"functional_ema-{version.group(1)}.dist-info/"
    stray = [n for n in names if not (n.startswith("functional_ema/") or n.startswith(dist_info))]
    assert stray == [], f"the wheel holds files outside the package: {stray}"
    for must in ("functional_ema/py.typed", "functional_ema/__init__.py", f"{dist_info}licenses/LICENSE"):
        assert must in names, f"the wheel lacks {must}"
    assert f"{dist_info}entry_points.txt" in names
    bad = [n for n in names if re.search(r"(^|/)(tests|benchmarks|docs|examples)/|__pycache__|\.pyc$", n)]
    assert bad == [], f"the wheel holds tests, benchmarks, docs, examples or bytecode: {bad}"
    with tarfile.open(sdist) as tf:
        members = tf.getnames()
    print(f"{Path(sdist).name}: {len(members)} files")
    junk = [n for n in members if re.search(r"/\.venv|/dist/|/build/|/site/|__pycache__|\.egg-info/.*\.pyc", n)]
    assert junk == [], f"the sdist holds venvs or build outputs: {junk[:10]}"
    assert any(n.endswith("/LICENSE") for n in members), "the sdist lacks LICENSE"
    print("wheel and sdist contents: ok")


if __name__ == "__main__":
    main(*sys.argv[1:])
