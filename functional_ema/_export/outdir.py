"""Where an export is written, and what it may replace: never what the library did not write.

* ``out_dir`` must name a folder that does not exist, is empty, or (with ``overwrite``) holds a
  previous export: its ``ema_export.json`` says so and the folder holds no file that export did not
  write. Never the current folder, one of its parents, the home folder or ``/``; never inside or
  above what the export reads.
* ``out_dir`` may not be a mount point: the export is renamed into place, and a mount point can be neither
  renamed nor removed; the refusal comes before anything is written and suggests a subfolder.
* The export is built in ``.<name>.tmp-<id>`` beside ``out_dir`` (``<name>`` shortened, with a hash of the
  full name, where the full name would exceed the file system's 255-byte limit), marked with the writer's
  host and pid, and renamed into place when complete. With ``overwrite``, the previous export is first moved
  into a marked ``.<name>.old-<id>`` folder (as its ``prev``), removed once the new one is in place; the
  new folder's marker is removed last. So a kill at any point leaves every folder marked, and a later
  export of the same ``out_dir`` finishes the job for writers that died (same host, pid gone): it removes
  their marked ``.tmp-``/``.old-`` folders, after putting a parked previous export back as ``out_dir`` when
  ``out_dir`` is missing (the killed export is rolled back), and removes a dead writer's marker left in a
  committed ``out_dir``. Folders without the library's marker are never touched.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import socket
import uuid
from pathlib import Path
from typing import Any

from .. import _io
from .._checkpoint.errors import ForeignFileError, OutputPathError
from .._checkpoint.format import writable
from .foreign import plain_file_name, read_json_object
from .like import EXPORT_RECORD

__all__ = ["EXPORT_FORMAT", "check_out_dir", "check_out_place", "new_tmp_dir", "commit_dir"]

EXPORT_FORMAT = "functional_ema.hf_export"
_IN_PROGRESS = ".functional_ema_export_in_progress"


def check_out_dir(out_dir: Any, avoid: list[Path], overwrite: bool) -> Path:
    """``out_dir`` resolved, after the checks of the module docstring.

    Raises:
        OutputPathError: naming ``out_dir`` and why.
    """
    out, real = check_out_place(out_dir, avoid)
    if real.parent.is_dir():
        _recover_killed_commits(real)
    if real.is_dir() and os.path.ismount(real):
        raise OutputPathError(
            f"out_dir: {out} (-> {real}) is a mount point: the export is built beside it and renamed into place, "
            f"which a mount point does not allow; name a folder inside it, e.g. {out / 'ema_hf'}"
        )
    if real.exists() and not real.is_dir():
        raise OutputPathError(f"out_dir: {out} exists and is not a folder; choose another name")
    if real.is_dir() and any(real.iterdir()):
        if not overwrite:
            raise OutputPathError(
                f"out_dir: refusing to replace the existing, non-empty folder {out}: pass overwrite=True (--overwrite) "
                "to replace a previous export as a whole once the new one is complete, or choose another name"
            )
        _check_previous_export(real, out)
    return real


def check_out_place(out_dir: Any, avoid: list[Path]) -> tuple[Path, Path]:
    """``out_dir`` as given and resolved, after the checks of where it is, which need nothing read: not the current
    folder, the home folder, one of their parents or ``/``; not inside, at or above a path of ``avoid``; not under a
    file; in a folder this user may write (the export is built beside ``out_dir``, its missing folders made first:
    else refused last, naming a temporary folder). The command line calls it first, with its other usage errors
    (exit 2), before the source is read.

    Raises:
        OutputPathError: naming ``out_dir`` and why.
    """
    if not isinstance(out_dir, (str, os.PathLike)) or not os.fspath(out_dir) or "\x00" in os.fspath(out_dir):
        raise OutputPathError(f"out_dir (OUT_DIR) must name a new folder, got {out_dir!r}")
    out = Path(out_dir)
    try:
        real = out.resolve()
        avoid_real = [p.resolve() for p in avoid]
        cwd = Path.cwd().resolve()
    except (OSError, RuntimeError) as e:
        raise OutputPathError(f"out_dir: cannot resolve {out}: {e}") from None
    home = Path(os.path.expanduser("~")).resolve()
    if _home_or_above(real, cwd, home):
        raise OutputPathError(
            f"out_dir: refusing to write {out_dir!r} (-> {real}): it is the current folder, one of its parents, the "
            "home folder or '/'; name a new folder for the export"
        )
    for a in avoid_real:
        inside = a.is_dir() and a in real.parents
        if _near(real, a):
            raise OutputPathError(
                f"out_dir: refusing to write {out} (-> {real}): it is {'inside' if inside else 'equal to or above'} "
                f"{a}, which this export reads. Write it elsewhere{_elsewhere(out, a, avoid_real, cwd, home)}"
            )
    # before the writable check: a file on the way is not a folder to make writable
    existing = next(p for p in real.parents if p.exists())  # "/" at worst
    if not existing.is_dir():
        raise OutputPathError(f"out_dir: {out} is under {existing}, which is a file, not a folder")
    if not writable(existing):
        raise OutputPathError(
            f"out_dir: cannot write {out} (-> {real}): the folder {existing} is not writable by this user; choose "
            "another place, or make it writable"
        )
    return out, real


def _home_or_above(real: Path, cwd: Path, home: Path) -> bool:
    """``real`` is the current folder, the home folder, one of their parents or ``/``."""
    return real in (cwd, home) or real in cwd.parents or real in home.parents or real.parent == real


def _near(real: Path, a: Path) -> bool:
    """``real`` is ``a``, above it, or inside it (a folder)."""
    return real == a or real in a.parents or (a.is_dir() and a in real.parents)


def _elsewhere(out: Path, a: Path, avoid_real: list[Path], cwd: Path, home: Path) -> str:
    """The advice of a refusal for being near ``a``: a folder of ``out``'s name beside ``a``'s folder (``a`` itself
    when a folder, else the one holding the file), else beside a path read above ``a`` (a tag folder's root); ""
    where each would be refused too (the same place, near a path read, the current or home folder or above)."""
    name = out.name if out.name not in ("", ".", "..") else "ema_hf"
    for b in (a, *(b for b in avoid_real if b in a.parents)):
        fix = (b if b.is_dir() else b.parent).parent / name
        if not (fix.exists() or _home_or_above(fix, cwd, home) or any(_near(fix, c) for c in avoid_real)):
            return f", e.g. {fix}"
    return ""


def _check_previous_export(real: Path, out: Path) -> None:
    """``overwrite`` replaces only a previous export holding nothing but what it wrote: its record lists those files
    (``written``, from record version 2 on); only a version 1 record, which listed none, replaces the folder whole."""
    record, what = _export_record(real / EXPORT_RECORD)
    if record is None:
        raise OutputPathError(
            f"out_dir: refusing to replace {out}: it is not a previous export of this tool ({what}); --overwrite "
            "replaces only a previous export or an empty folder. Remove it yourself or choose another name"
        )
    problem = _written_problem(record)
    if problem:  # a damaged or forged record: which files the export wrote is unknown, so nothing may go
        raise OutputPathError(
            f"out_dir: refusing to replace {out}: its {EXPORT_RECORD} {problem}, so which files its export wrote is "
            "unknown and nothing is removed. Move out what you want to keep and remove the folder yourself, or "
            "choose another name"
        )
    written = record.get("written")
    if written is not None:
        extra = sorted(p.name for p in real.iterdir() if p.name not in written)
        if extra:
            raise OutputPathError(
                f"out_dir: refusing to replace {out}: it holds files its export did not write ({', '.join(extra[:5])}); "
                "move them out first, or choose another name"
            )


def _export_record(file: Path) -> tuple[dict | None, str]:
    """(``file``'s record, "") when it is one this tool wrote: a regular file (the export writes no link or folder;
    a link's target is someone else's) holding a JSON object of ``EXPORT_FORMAT`` (read as a hostile file:
    :func:`read_json_object`); else (None, why not)."""
    not_ours = f"no {EXPORT_RECORD} written by functional_ema in it"
    if file.is_symlink():  # e.g. a hub cache snapshot, whose files all link into its blobs/
        why = "which an export never writes (a hub cache snapshot's files all are: export to another folder)"
        return None, f"{not_ours}: {file} is a symbolic link, {why}"
    if os.path.lexists(file) and not file.is_file():
        return None, f"{not_ours}: {file} is {'a folder' if file.is_dir() else 'not a regular file'}"
    if not os.path.lexists(file):
        return None, not_ours
    try:
        record = read_json_object(file, "out_dir")
    except ForeignFileError as e:
        return None, f"{not_ours}: {str(e).removeprefix('out_dir: ')}"
    if record.get("format") != EXPORT_FORMAT:
        return None, not_ours
    return record, ""


def _written_problem(record: dict) -> str:
    """What is wrong with ``record``'s list of the files its export wrote ("" when nothing): version 1 records have
    none (the folder is replaced whole, as before), every later one a list of plain file names of the folder."""
    version, written = record.get("format_version"), record.get("written")
    if written is None:
        if type(version) is int and version == 1:
            return ""
        return f"(format_version {version!r}) has no 'written' list of the files its export wrote"
    if not isinstance(written, list):
        return f"has 'written' {type(written).__name__} {written!r:.60}, not a list of file names"
    for name in written:
        if not plain_file_name(name):
            return f"has 'written' naming {name!r:.60}, not a file name of the folder"
    return ""


def new_tmp_dir(real_out: Path) -> Path:
    """A new temporary folder beside ``real_out``, marked as this process's; dead writers' folders removed first."""
    real_out.parent.mkdir(parents=True, exist_ok=True)
    _recover_killed_commits(real_out)
    tmp = real_out.parent / f"{_hidden_stem(real_out.name)}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    _mark(tmp)
    return tmp


def _hidden_stem(name: str) -> str:
    """``.<name>``, shortened (its start and a hash of the whole) where ``.<name>.old-<8 hex>`` would exceed the
    255 bytes most file systems allow in a name: an ``out_dir`` named up to that limit is still exported."""
    raw = name.encode("utf-8", "surrogateescape")
    if len(raw) <= 200:
        return f".{name}"
    head = raw[:160].decode("utf-8", "ignore")  # a cut inside a multi-byte character drops that character
    return f".{head}~{hashlib.sha256(raw).hexdigest()[:16]}"


def _mark(folder: Path) -> None:
    (folder / _IN_PROGRESS).write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))


def _dead_writer(folder: Path) -> bool:
    """``folder`` carries this library's marker, written on this host by a process that is gone."""
    marker: Any = None
    with contextlib.suppress(OSError, ValueError, RecursionError):
        marker = json.loads((folder / _IN_PROGRESS).read_bytes())
    if not (isinstance(marker, dict) and marker.get("host") == socket.gethostname()):
        return False  # not ours, or another machine's writer: left alone
    pid = marker.get("pid")
    return isinstance(pid, int) and not isinstance(pid, bool) and pid > 0 and not _alive(pid)


def _recover_killed_commits(real_out: Path) -> None:
    """Finish what writers of ``real_out`` that died left (see the module docstring); only marked folders."""
    if real_out.is_dir() and _dead_writer(real_out):  # killed after its rename into place: the export is complete
        with contextlib.suppress(OSError):
            (real_out / _IN_PROGRESS).unlink()
    stem = _hidden_stem(real_out.name)
    try:  # not a glob: the name may hold glob characters ('[', '*')
        # Exactly this out_dir's (an id without a dot): ".a.old-x.old-<id>" is out_dir "a.old-x"'s, not "a"'s.
        own = re.compile(re.escape(stem) + r"\.(tmp|old)-[^.]+")
        leftovers = sorted(d for d in real_out.parent.iterdir() if own.fullmatch(d.name))
    except OSError:
        return
    for d in leftovers:
        if not (d.is_dir() and not d.is_symlink() and _dead_writer(d)):
            continue
        prev = d / "prev"
        if d.name.startswith(f"{stem}.old-") and prev.is_dir() and not os.path.lexists(real_out):
            with contextlib.suppress(OSError):  # killed between its two renames: the previous export goes back
                os.rename(prev, real_out)
                _io.fsync_dir(real_out.parent)
        shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # e.g. EPERM: it exists
        return True
    return True


def commit_dir(tmp: Path, final: Path, out: Path, overwrite: bool) -> None:
    """Rename the complete ``tmp`` to ``final``; a previous export there is parked in a marked ``.old-`` folder,
    then removed. Every folder stays marked until the new one is in place (see the module docstring).

    The ownership check runs again here: files that appeared in ``final`` while the export ran are kept.
    """
    old = None
    if final.exists():
        if final.is_dir() and not any(final.iterdir()):
            final.rmdir()
        elif not overwrite:
            raise OutputPathError(f"out_dir: {out} was filled while the export ran; it is left as it is")
        else:
            _check_previous_export(final, out)
            old = final.with_name(f"{_hidden_stem(final.name)}.old-{uuid.uuid4().hex[:8]}")
            old.mkdir()
            _mark(old)  # marked before the previous export moves in: a kill from here on is recovered
            try:
                os.rename(final, old / "prev")
            except OSError:
                shutil.rmtree(old, ignore_errors=True)
                raise
    try:
        os.rename(tmp, final)
    except OSError:
        if old is not None and not os.path.lexists(final):  # the previous export goes back where it was
            os.rename(old / "prev", final)
            shutil.rmtree(old, ignore_errors=True)
        raise
    (final / _IN_PROGRESS).unlink()
    _io.fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
