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

# The pytest plugin of every mutmut run (-p mutate_ranks). A test whose node id matches the module's
# ``rank_tests`` pattern may start ranks; any other test that would is skipped. mutmut learns which tests
# call a function from hits its trampolines record in its own process; a rank (or a forked writer) records
# them in another process, so there the hits are appended to files under FE_MUTATE_HITS (the
# sitecustomize.py below, on the ranks' PYTHONPATH) and merged into mutmut's record before the test's
# teardown. Without that, mutmut would never run a rank-only function's mutants against those tests.
PLUGIN = '''"""Rank-aware test selection for mutmut (written by .ci/mutate.py).

A test whose node id matches FE_MUTATE_RANK_TESTS starts its ranks for real, so a mutant runs in them too,
and their trampoline hits count for it. Any other ``run_ranks`` (the fixtures that build checkpoints for
single-process checks) is run once, unmutated, and replayed for every mutant from a cache: its folders'
files copied back into the new paths and its results with the old paths renamed. Other launches skip.
"""
import hashlib
import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

import mutate_hits

_current = {"nodeid": ""}
_started = []  # every rank process started, to kill at a timeout


def _allowed():
    return re.search(os.environ.get("FE_MUTATE_RANK_TESTS") or "(?!)", _current["nodeid"]) is not None


def _mutant():
    return os.environ.get("MUTANT_UNDER_TEST", "") not in ("", "stats", "fail")


def _drop_hits():
    for path in Path(os.environ["FE_MUTATE_HITS"]).glob("*.hits"):
        path.unlink()


def _cached(run):
    cache = Path(os.environ["FE_MUTATE_CACHE"])

    def run_ranks(target, world_size=2, timeout=600, env=None, **kwargs):
        if _allowed() and _mutant():
            return run(target, world_size, timeout, env, **kwargs)
        paths = [kwargs[k] for k in sorted(kwargs) if isinstance(kwargs[k], str) and os.path.isabs(kwargs[k])]
        dirs = list(dict.fromkeys(paths))  # by argument name: the same order in every run
        shape = {k: (f"<dir {dirs.index(v)}>" if v in dirs else v) for k, v in kwargs.items()}
        key = hashlib.sha256(json.dumps([target, world_size, env, shape], sort_keys=True, default=str).encode())
        entry = cache / key.hexdigest()[:24]
        if _mutant() and (entry / "results.json").exists():
            saved = json.loads((entry / "results.json").read_text())
            text = saved["results"]
            for i, new in enumerate(dirs):
                if (entry / str(i)).is_dir():
                    try:
                        shutil.copytree(entry / str(i), new, dirs_exist_ok=True, symlinks=True)
                    except OSError:  # a read-only or full folder of a fault fixture: as the ranks left it
                        pass
            for old, new in sorted(zip(saved["dirs"], dirs), key=lambda pair: -len(pair[0])):
                text = text.replace(old, new)
            return json.loads(text)
        results = run(target, world_size, timeout, env, **kwargs)
        if not _allowed():
            _drop_hits()  # replayed for the mutants: they never run in these ranks
        if not _mutant():  # the clean and the stats runs: kept for the mutants' replays
            entry.mkdir(parents=True, exist_ok=True)
            for i, d in enumerate(dirs):
                if os.path.isdir(d):
                    shutil.copytree(d, entry / str(i), symlinks=True, dirs_exist_ok=True)
            (entry / "results.json").write_text(json.dumps({"dirs": dirs, "results": json.dumps(results)}))
        return results

    return run_ranks


def pytest_configure(config):
    from functional_ema._testing import multirank

    spawn = multirank.spawn_ranks

    def spawn_or_skip(*args, **kwargs):
        if not _allowed() and not getattr(multirank, "_fe_replaying", False):
            pytest.skip("a test that starts ranks itself: not in this module's rank_tests")
        procs, logs = spawn(*args, **kwargs)
        _started.extend(procs)
        return procs, logs

    def timed_out(signum, frame):  # mutmut's timeout: the ranks (own sessions) must not outlive the test
        multirank.kill_ranks(_started)
        signal.signal(signal.SIGXCPU, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGXCPU)

    signal.signal(signal.SIGXCPU, timed_out)

    # Beside mutants/ (the working folder here): one module's run, removed with its folder.
    for var, name in (("FE_MUTATE_HITS", "rank_hits"), ("FE_MUTATE_CACHE", "rank_cache")):
        os.environ.setdefault(var, str(Path("..", name).resolve()))
    Path(os.environ["FE_MUTATE_HITS"]).mkdir(exist_ok=True)
    run = multirank.run_ranks

    def run_building(*args, **kwargs):
        multirank._fe_replaying = True  # a fixture's launch: its spawn is not a test's own
        try:
            return _cached(run)(*args, **kwargs)
        finally:
            multirank._fe_replaying = False

    multirank.spawn_ranks = spawn_or_skip
    multirank.run_ranks = run_building
    mutate_hits.install(main_pid=os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current["nodeid"] = item.nodeid
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    # mutmut times a test by its call phase only; a fixture that starts ranks spends its time in setup,
    # and the mutant's timeout, a multiple of that time, would then stop it while its ranks start.
    if call.when != "call" and os.environ.get("MUTANT_UNDER_TEST") == "stats":
        from mutmut.state import state

        state().duration_by_test[item.nodeid] += call.duration
    yield


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_teardown(item, nextitem):
    from mutmut.state import state

    for path in Path(os.environ["FE_MUTATE_HITS"]).glob("*.hits"):
        state()._stats.update(line for line in path.read_text().splitlines() if line)
        path.unlink()
    yield
'''

# Records trampoline hits made outside mutmut's own process (imported by the plugin, and by every
# rank through sitecustomize.py).
HITS = '''"""Trampoline hits of other processes, as files (written by .ci/mutate.py)."""
import os
from pathlib import Path


def install(main_pid: int) -> None:
    from mutmut.mutation import trampoline

    record, seen = trampoline.record_trampoline_hit, set()

    def record_anywhere(name, caller=None):
        if os.getpid() == main_pid:
            return record(name, caller=caller)
        if name not in seen:  # append at once: a rank ends with os._exit, which runs no exit hook
            seen.add(name)
            with open(Path(os.environ["FE_MUTATE_HITS"]) / f"{os.getpid()}.hits", "a") as f:
                f.write(name + "\\n")

    trampoline.record_trampoline_hit = record_anywhere
'''

SITECUSTOMIZE = '''"""A rank started by a mutmut test reports its trampoline hits (written by .ci/mutate.py)."""
import os

if os.environ.get("FE_MUTATE_HITS") and os.environ.get("MUTANT_UNDER_TEST") == "stats":
    import mutate_hits

    mutate_hits.install(main_pid=-1)
'''


@dataclass(frozen=True)
class Module:
    path: str  # relative to the repository root
    tests: tuple[str, ...]  # pytest arguments: files, node ids, -k expressions
    rank_tests: str = ""  # a regex of the node ids that may start ranks (seconds each); others are skipped


# Slow single-process tests (seconds each) that a mutant would otherwise rerun; each module's own
# tests kill its mutants without them.
_SLOW = "not gpu_check and not module_level_registries and not bf16_stalls and not cuda"

# The single-process tests that save and load (the checkpoint tests' multi-rank fixtures are skipped).
_CHECKPOINT_TESTS = (
    "tests/test_format.py",
    "tests/test_checkpoint.py",
    "tests/test_checkpoint_index.py",
    "tests/test_io.py",
    "tests/test_module.py",
    "tests/test_faults.py",
    "-k",
    "not forked_child and not one_writer_per_tag and not quickstart",
)

# The export's fast tests: its stages one by one (tests/test_export_stages.py), then the end-to-end ones.
_EXPORT_TESTS = ("tests/test_export_stages.py", "tests/test_export.py")

MODULES: dict[str, Module] = {
    "schedules": Module("functional_ema/schedules.py", ("tests/test_schedules.py",)),
    "_args": Module("functional_ema/_args.py", ("tests/test_args.py",)),
    "_core": Module(
        "functional_ema/_core.py",
        ("tests/test_core.py", "tests/test_offload.py", "-k", _SLOW),
        rank_tests="test_core.py::test_core_ranks_decide_nonfinite_together",
    ),
    "_checkpoint/index": Module("functional_ema/_checkpoint/index.py", ("tests/test_checkpoint_index.py",)),
    "_offload": Module("functional_ema/_offload.py", ("tests/test_offload.py",)),
    "_io": Module(
        "functional_ema/_io.py",
        ("tests/test_io.py", "tests/test_checkpoint_index.py", "tests/test_checkpoint.py"),
    ),
    "_checkpoint/errors": Module("functional_ema/_checkpoint/errors.py", _CHECKPOINT_TESTS),
    "_checkpoint/collective": Module(
        "functional_ema/_checkpoint/collective.py", ("tests/test_collective.py",), rank_tests="test_collective.py"
    ),
    "_checkpoint/format": Module("functional_ema/_checkpoint/format.py", _CHECKPOINT_TESTS),
    "_checkpoint/writer": Module(
        "functional_ema/_checkpoint/writer.py",
        ("tests/test_writer.py", *_CHECKPOINT_TESTS),
        rank_tests="test_writer.py",
    ),
    "_checkpoint/reader": Module(
        "functional_ema/_checkpoint/reader.py",
        ("tests/test_reader.py", *_CHECKPOINT_TESTS),
        rank_tests="test_reader.py",
    ),
    "_async": Module(
        "functional_ema/_async.py",
        ("tests/test_async_save.py", "tests/test_offload.py", "tests/test_checkpoint.py"),
        rank_tests="test_async_save.py::test_async_ranks",
    ),
    "export": Module("functional_ema/export.py", _EXPORT_TESTS),
    "_export/foreign": Module("functional_ema/_export/foreign.py", _EXPORT_TESTS),
    "_export/like": Module("functional_ema/_export/like.py", _EXPORT_TESTS),
    "_export/loader": Module("functional_ema/_export/loader.py", _EXPORT_TESTS),
    "_export/names": Module("functional_ema/_export/names.py", _EXPORT_TESTS),
    "_export/outdir": Module("functional_ema/_export/outdir.py", _EXPORT_TESTS),
    "_export/plan": Module("functional_ema/_export/plan.py", _EXPORT_TESTS),
}


@dataclass
class Result:
    name: str
    counts: dict[str, int] = field(default_factory=dict)
    equivalent: int = 0
    survivors: list[str] = field(default_factory=list)
    stale: list[str] = field(default_factory=list)  # listed as equivalent, but not a survivor
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
    (work / "mutate_ranks.py").write_text(PLUGIN)
    (work / "mutate_hits.py").write_text(HITS)
    (work / "sitecustomize.py").write_text(SITECUSTOMIZE)
    tests = "\n    ".join(module.tests)
    (work / "setup.cfg").write_text(
        "[mutmut]\nsource_paths = functional_ema\n"
        f"only_mutate = {module.path}\n"
        f"pytest_add_cli_args_test_selection =\n    {tests}\n"
        "pytest_add_cli_args =\n    -p\n    mutate_ranks\n    -p\n    no:cacheprovider\n"
        "also_copy =\n    mutate_ranks.py\n    mutate_hits.py\n    sitecustomize.py\n"
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


def mutmut(work: Path, args: list[str], log: Path, rank_tests: str = "") -> int:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONDONTWRITEBYTECODE="1", FE_MUTATE_RANK_TESTS=rank_tests)
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
    rc = mutmut(work, ["run", "--max-children", str(jobs), *previous], log, module.rank_tests)
    result = Result(name, minutes=(time.monotonic() - t0) / 60)
    meta = work / "mutants" / f"{module.path}.meta"
    if rc != 0 and meta.exists() and not json.loads(meta.read_text())["exit_code_by_key"]:
        return result  # nothing to mutate (mutmut mutates function bodies: e.g. a module of exception classes)
    if rc != 0:
        result.failed = f"mutmut failed (exit {rc}); see {log}"
        return result
    for mutant, found in sorted(statuses(work, module).items()):
        status = found
        if mutant in known and found == "survived":
            result.equivalent += 1
            status = "equivalent"
        elif mutant in known:  # counted as what it is: a stale entry (its function changed: mutants renumbered)
            result.stale.append(f"{mutant} ({found})")
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
        for entry in r.stale:
            print(f"   STALE in {EQUIVALENT_FILE.name}: {entry}; check its number against the survivors' diffs")
        for s in r.survivors:
            print(f"   left: {s}")
    table = report(results)
    print(table)
    (WORK / "summary.md").write_text(table + "\n")
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
