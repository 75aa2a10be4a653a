#!/usr/bin/env bash
# The oldest-dependency tier: a venv with the lower bound of pyproject's deepspeed range (and the torch
# build the suite uses), then the smoke subset listed in .ci/smoke-tests.txt. pyproject's lower bounds
# are what this tier ran on; moving one means running this tier at the new bound.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
VENV=.venv-oldest
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

# deepspeed>=X.Y.Z in pyproject.toml -> deepspeed==X.Y.Z
DS_OLDEST=$("$PYTHON" - <<'PY'
import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
spec = next(d for d in deps if re.match(r"deepspeed\b", d))
print(re.search(r">=\s*([\d.]+)", spec).group(1))
PY
)
if [ ! -f "$VENV/.installed-deepspeed-$DS_OLDEST" ]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet "$TORCH_SPEC"
    "$VENV/bin/python" -m pip install --quiet "deepspeed==$DS_OLDEST" -e ".[test]"
    touch "$VENV/.installed-deepspeed-$DS_OLDEST"
fi
"$VENV/bin/python" -c "import torch, deepspeed; print('oldest tier: torch', torch.__version__, 'deepspeed', deepspeed.__version__); \
assert deepspeed.__version__ == '$DS_OLDEST', deepspeed.__version__"
grep -v '^#' .ci/smoke-tests.txt | xargs "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=5
