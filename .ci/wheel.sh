#!/usr/bin/env bash
# The package as it installs: build the sdist and the wheel, check what the wheel holds, install it
# into a fresh venv (no site packages, nothing from the checkout) and run it from a folder outside
# the checkout: import, the console script, and a 2-rank save / load / consolidate.
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
BUILD_VENV=.venv-build
WHEEL_VENV=.venv-wheel
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# build (pinned) in its own venv; setuptools comes in build's isolated environment
if [ ! -x "$BUILD_VENV/bin/python" ]; then
    "$PYTHON" -m venv "$BUILD_VENV"
    "$BUILD_VENV/bin/python" -m pip install --quiet "build==1.6.1"
fi
rm -rf dist
"$BUILD_VENV/bin/python" -m build --outdir dist . > /dev/null
ls -l dist
"$BUILD_VENV/bin/python" .ci/check_wheel.py dist/*.whl dist/*.tar.gz

# a fresh venv each run: the CPU torch first (else pip pulls a CUDA build), then the wheel and its deps
rm -rf "$WHEEL_VENV"
"$PYTHON" -m venv "$WHEEL_VENV"
"$WHEEL_VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
"$WHEEL_VENV/bin/python" -m pip install --quiet dist/*.whl
WHEEL_PY=$REPO/$WHEEL_VENV/bin/python

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
cp .ci/installed_smoke.py "$WORK/"
cd "$WORK"   # outside the checkout: nothing of it on sys.path
"$WHEEL_PY" - <<'PY'
import importlib.metadata as md
import sysconfig
from pathlib import Path

import functional_ema as fe

print("import functional_ema", fe.__version__, "from", fe.__file__)
assert Path(fe.__file__).is_relative_to(sysconfig.get_paths()["purelib"]), "not the installed copy"
assert fe.__version__ == md.version("functional-ema"), (fe.__version__, md.version("functional-ema"))
PY
"$REPO/$WHEEL_VENV/bin/functional-ema" --help > /dev/null && echo "functional-ema --help: ok"
timeout 600 "$WHEEL_PY" installed_smoke.py "$WORK/run"
