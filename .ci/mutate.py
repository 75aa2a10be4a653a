"""`make mutate`: mutation testing of the modules below with mutmut 3, one module at a time.

Each module runs in its own scratch folder, .mutate/<name>/ (git-ignored): a copy of functional_ema/
and tests/ taken at the start (so edits made meanwhile in the working tree do not leak into a run),
a setup.cfg naming the one file to mutate and its test selection, and mutmut's own output (mutants/).
mutmut runs each mutant only against the selected tests that called the mutated function when the
clean tests ran; tests that would launch ranks (``run_ranks``) are skipped by a small pytest plugin
(multi-rank launches take seconds each, and mutmut cannot see which functions a rank calls).

Usage: ``python .ci/mutate.py [name ...]`` (default: every module, export last); MUTATE_JOBS sets the
number of mutants run at once (default 2), MUTATE_KEEP=1 keeps the previous results of a module and
reruns only its survivors (after tests were added; a changed test selection makes mutmut forget every
earlier result, so run afresh then). Prints a table per module; the survivors' diffs
are in .mutate/<name>/survivors.diff. Equivalent mutants are listed in .ci/mutate_equivalent.txt.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / ".mutate"
EQUIVALENT_FILE = ROOT / ".ci" / "mutate_equivalent.txt"

# Skips any test that would start ranks: imported by pytest in each mutmut run (-p mutate_skip_ranks).
PLUGIN = '''"""Skips tests that start ranks (written by .ci/mutate.py)."""
import pytest


def pytest_configure(config):
    from functional_ema._testing import multirank

    def refuse(*args, **kwargs):
        pytest.skip("multi-rank test: not run by make mutate")

    multirank.spawn_ranks = refuse
'''


@dataclass(frozen=True)
class Module:
    path: str  # relative to the repository root
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions


# Slow single-process tests (seconds each) that a mutant would otherwise rerun; each module's own
# tests kill its mutants without them.
_SLOW = "not gpu_check and not module_level_registries and not bf16_stalls and not cuda"

# The single-process tests that save and load (the checkpoint tests' multi-rank fixtures are skipped).
_CHECKPOINT_TESTS = (
    "tests/test_checkpoint.py",
    "tests/test_checkpoint_index.py",
    "tests/test_io.py",
    "tests/test_module.py",
    "tests/test_faults.py",
    "-k",
    "not forked_child and not one_writer_per_tag and not quickstart",
)

MODULES: dict[str, Module] = {
    "schedules": Module("functional_ema/schedules.py", ("tests/test_schedules.py",)),
    "_args": Module("functional_ema/_args.py", ("tests/test_args.py",)),
    "_core": Module("functional_ema/_core.py", ("tests/test_core.py", "tests/test_offload.py", "-k", _SLOW)),
    "_checkpoint/index": Module("functional_ema/_checkpoint/index.py", ("tests/test_checkpoint_index.py",)),
    "_offload": Module("functional_ema/_offload.py", ("tests/test_offload.py",)),
    "_io": Module(
        "functional_ema/_io.py",
        ("tests/test_io.py", "tests/test_checkpoint_index.py", "tests/test_checkpoint.py"),
    ),
    "_checkpoint/errors": Module("functional_ema/_checkpoint/errors.py", _CHECKPOINT_TESTS),
    "_checkpoint/collective": Module("functional_ema/_checkpoint/collective.py", _CHECKPOINT_TESTS),
    "_checkpoint/format": Module("functional_ema/_checkpoint/format.py", _CHECKPOINT_TESTS),
    "_checkpoint/writer": Module("functional_ema/_checkpoint/writer.py", _CHECKPOINT_TESTS),
    "_checkpoint/reader": Module("functional_ema/_checkpoint/reader.py", _CHECKPOINT_TESTS),
    "_async": Module(
        "functional_ema/_async.py", ("tests/test_async_save.py", "tests/test_offload.py", "tests/test_checkpoint.py")
    ),
    # Last: being rewritten (issue 36); configured, run it once the rewrite has landed.
    "export": Module("functional_ema/export.py", ("tests/test_export.py",)),
}


@dataclass
class Result:
    name: str
    counts: dict[str, int] = field(default_factory=dict)
    equivalent: int = 0
    survivors: list[str] = field(default_factory=list)
    minutes: float = 0.0
    failed: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def killed(self) -> int:  # a timeout or a type-check failure also detects the mutant
        return sum(self.counts.get(s, 0) for s in ("killed", "timeout", "caught by type check"))

    @property
    def score(self) -> str:
        if self.total == self.equivalent:
            return "-"  # nothing to kill (a module without function bodies has no mutants)
        return f"{100.0 * self.killed / (self.total - self.equivalent):.1f}%"


def equivalents() -> dict[str, str]:
    """``mutant name -> reason`` from .ci/mutate_equivalent.txt (``name<TAB>reason`` lines, # comments)."""
    out: dict[str, str] = {}
    for line in EQUIVALENT_FILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, reason = line.partition("\t")
            out[name.strip()] = reason.strip()
    return out


def prepare(name: str, module: Module, keep: bool) -> Path:
    """The scratch folder of ``name``: fresh copies of the package and the tests, and mutmut's config."""
    work = WORK / name.replace("/", ".")
    if not keep and work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for sub in ("functional_ema", "tests"):
        shutil.rmtree(work / sub, ignore_errors=True)
        shutil.copytree(ROOT / sub, work / sub, ignore=ignore)  # copy2: mutmut compares mtimes
    shutil.copy2(ROOT / "pyproject.toml", work / "pyproject.toml")  # pytest's settings; no [tool.mutmut] there
    (work / "mutate_skip_ranks.py").write_text(PLUGIN)
    tests = "\n    ".join(module.tests)
    (work / "setup.cfg").write_text(
        "[mutmut]\nsource_paths = functional_ema\n"
        f"only_mutate = {module.path}\n"
        f"pytest_add_cli_args_test_selection =\n    {tests}\n"
        "pytest_add_cli_args =\n    -p\n    mutate_skip_ranks\n    -p\n    no:cacheprovider\n"
        "also_copy = mutate_skip_ranks.py\n"
        # A mutant that loops is stopped after (its tests' time + 1 s) x 5 x 2 CPU seconds (mutmut's default
        # factor 15 spent minutes per module on such mutants; they count as detected either way).
        "timeout_multiplier = 5.0\n"
    )
    return work


def statuses(work: Path, module: Module) -> dict[str, str]:
    """``mutant name -> status`` from mutmut's record of the module (its .meta file)."""
    from mutmut.stats import status_by_exit_code

    meta = json.loads((work / "mutants" / f"{module.path}.meta").read_text())
    return {k: status_by_exit_code[v] for k, v in meta["exit_code_by_key"].items()}


def mutmut(work: Path, args: list[str], log: Path) -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1")
    with open(log, "ab") as out:
        return subprocess.run(
            [sys.executable, "-m", "mutmut", *args],
            cwd=work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=False,
        ).returncode


def run_module(name: str, module: Module, jobs: int, keep: bool, known: dict[str, str]) -> Result:
    t0 = time.monotonic()
    again = keep and (WORK / name.replace("/", ".") / "mutants").exists()
    work = prepare(name, module, keep)
    log = work / "run.log"
    previous = [n for n, s in statuses(work, module).items() if s != "killed" and n not in known] if again else []
    rc = mutmut(work, ["run", "--max-children", str(jobs), *previous], log)
    result = Result(name, minutes=(time.monotonic() - t0) / 60)
    meta = work / "mutants" / f"{module.path}.meta"
    if rc != 0 and meta.exists() and not json.loads(meta.read_text())["exit_code_by_key"]:
        return result  # nothing to mutate (mutmut mutates function bodies: e.g. a module of exception classes)
    if rc != 0:
        result.failed = f"mutmut failed (exit {rc}); see {log}"
        return result
    for mutant, found in sorted(statuses(work, module).items()):
        status = found
        if mutant in known:
            result.equivalent += 1
            status = "equivalent" if found == "survived" else f"listed as equivalent but {found}"
        result.counts[status] = result.counts.get(status, 0) + 1
        if status in ("survived", "no tests"):
            result.survivors.append(mutant)
    # One process for every diff (``mutmut show`` would start one per mutant).
    show = "import sys\nfrom mutmut.__main__ import find_mutant, get_diff_for_mutant as d\n"
    show += "for n in sys.argv[1:]:\n    print('#', n)\n    print(d(n, path=find_mutant(n).path))"
    with open(work / "survivors.diff", "wb") as out:
        subprocess.run([sys.executable, "-c", show, *result.survivors], cwd=work, stdout=out, check=False)
    return result


def report(results: list[Result]) -> str:
    head = "| module | mutants | killed | equivalent | survived | no tests | other | score | minutes |"
    lines = [head, "|" + "---|" * 9]
    for r in results:
        if r.failed:
            lines.append(f"| {r.name} | {r.failed} |" + " |" * 7)
            continue
        survived, no_tests = r.counts.get("survived", 0), r.counts.get("no tests", 0)
        other = r.total - r.killed - r.equivalent - survived - no_tests
        lines.append(
            f"| {r.name} | {r.total} | {r.killed} | {r.equivalent} | {survived} | {no_tests} | {other} "
            f"| {r.score} | {r.minutes:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    names = argv or list(MODULES)
    unknown = [n for n in names if n not in MODULES]
    if unknown:
        raise SystemExit(f"unknown module(s) {unknown}; known: {' '.join(MODULES)}")
    jobs, keep = int(os.environ.get("MUTATE_JOBS", "2")), os.environ.get("MUTATE_KEEP") == "1"
    known, results = equivalents(), []
    for name in names:
        print(f"== {name}: mutating {MODULES[name].path} against {' '.join(MODULES[name].tests)}", flush=True)
        results.append(run_module(name, MODULES[name], jobs, keep, known))
        r = results[-1]
        if r.failed:
            print(f"   {r.failed}")
            continue
        print(f"   {r.killed}/{r.total} killed, {r.equivalent} equivalent, score {r.score}, {r.minutes:.1f} min")
        for s in r.survivors:
            print(f"   left: {s}")
    table = report(results)
    print(table)
    (WORK / "summary.md").write_text(table + "\n")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
