"""The export's stages one by one, called directly, in one process (``functional_ema/_export/``, ``export.py``).

Each stage gets hostile and valid inputs and is held to exact outputs: the foreign readers' ``ForeignFileError``
messages (file and field named); the ``--like`` folder kind rules; ``out_dir``'s refusals and what ``overwrite`` may
replace (never a file the export did not write); the loader's meta-device view against what ``save_pretrained``
writes; the plan's names, prefixes, shapes and ties; PEFT's naming rule; and ``to_hf`` end to end on tiny models
(its files, record, shards and refusals). The references are hand-written expectations, independent parsers
(``json``, ``struct``, ``safetensors``, ``xxhash``) and the third-party libraries' own outputs.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from functional_ema import _io
from functional_ema._checkpoint.errors import CheckpointMismatchError, ForeignFileError, OutputPathError
from functional_ema._export import foreign, loader, names, outdir
from functional_ema._export import like as like_mod
from functional_ema._export.like import LikeFolder
from functional_ema._export.loader import LoaderView
from functional_ema._export.plan import Item, Plan, make_plan

# Imported once, at collection: a mutation run forks each mutant's tests after collecting them, so the tests that
# use PEFT (which imports transformers) and diffusers then pay no import of their own.
with contextlib.suppress(ImportError):
    import peft  # noqa: F401
with contextlib.suppress(ImportError):
    import diffusers  # noqa: F401

WHAT = "like (--like)"
FORMAT = "functional_ema.hf_export"
MARKER = ".functional_ema_export_in_progress"


def _raises(exc: type[BaseException], call, *args, **kwargs) -> str:
    """The message of the ``exc`` that ``call(*args, **kwargs)`` raises (anything else fails the test)."""
    with pytest.raises(exc) as info:
        call(*args, **kwargs)
    assert type(info.value) is exc, type(info.value)
    return str(info.value)


def _header(path: Path) -> dict:
    """A safetensors file's JSON header, parsed here (not by the library): name -> entry."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def _dead_pid() -> int:
    """The pid of a process that has exited (and was reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@contextlib.contextmanager
def _hangups():
    """The SIGHUPs this process gets meanwhile, recorded instead of ending it: a liveness probe sends no signal."""
    got: list[int] = []
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: got.append(signum))
    try:
        yield got
    finally:
        signal.signal(signal.SIGHUP, previous)


# ------------------------------------------------------------------------------------------ foreign


def test_read_json_object_returns_the_object_and_refuses_each_malformed_file(tmp_path, monkeypatch):
    ok = tmp_path / "config.json"
    ok.write_text('{"a": [1, {"b": null}], "c": "\\u00e9"}')
    assert foreign.read_json_object(ok, WHAT) == {"a": [1, {"b": None}], "c": "\u00e9"}
    (tmp_path / "folder.json").mkdir()
    for name in ("missing.json", "folder.json"):
        got = _raises(ForeignFileError, foreign.read_json_object, tmp_path / name, WHAT)
        assert got == f"{WHAT}: {tmp_path / name} is not a regular file"
    for name, body, typ in (
        ("list.json", "[1]", "list"),
        ("str.json", '"x"', "str"),
        ("null.json", "null", "NoneType"),
    ):
        (tmp_path / name).write_text(body)
        got = _raises(ForeignFileError, foreign.read_json_object, tmp_path / name, "index")
        assert got == f"index: {tmp_path / name} must hold a JSON object, got {typ}"
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    got = _raises(ForeignFileError, foreign.read_json_object, deep, WHAT)
    assert got == f"{WHAT}: {deep} is nested too deeply to be a model folder's JSON file"
    for name, raw in (("latin1.json", b'{"a": "\xe9"}'), ("cut.json", b'{"a": '), ("nan.json", b"{'a': 1}")):
        (tmp_path / name).write_bytes(raw)
        try:
            json.loads(raw.decode("utf-8"))
        except ValueError as e:  # UnicodeDecodeError included: Python's own words, in the message
            why = str(e)
        got = _raises(ForeignFileError, foreign.read_json_object, tmp_path / name, WHAT)
        assert got == f"{WHAT}: {tmp_path / name} is not valid JSON ({why})"


def test_read_json_object_size_limit_and_unreadable_file(tmp_path, monkeypatch):
    monkeypatch.setattr(foreign, "MAX_JSON_BYTES", 8)
    at_limit, over = tmp_path / "eight.json", tmp_path / "nine.json"
    at_limit.write_text('{"a": 1}')
    over.write_text('{"a": 12}')
    assert foreign.read_json_object(at_limit, WHAT) == {"a": 1}
    got = _raises(ForeignFileError, foreign.read_json_object, over, WHAT)
    assert got == f"{WHAT}: {over} has 9 bytes, more than a model folder's JSON file holds"

    def denied(path: Path, what: str) -> int:  # the one open of a foreign file (the descriptor read after it)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(foreign, "open_regular", denied)
    got = _raises(ForeignFileError, foreign.read_json_object, at_limit, WHAT)
    assert got == f"{WHAT}: cannot read {at_limit}: [Errno 13] Permission denied"


def test_plain_file_name_accepts_bare_names_only():
    good = ["model.safetensors", "..x", ".hidden", "a b", "x..", "model-00001-of-00002.safetensors"]
    bad = ["", ".", "..", "a/b", "../x", "/abs", "a\\b", "a\x00b", None, 3, b"model", ["m"]]
    assert [foreign.plain_file_name(v) for v in good] == [True] * len(good)
    assert [foreign.plain_file_name(v) for v in bad] == [False] * len(bad)


def test_read_weights_header_returns_the_entries_or_names_the_file(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"b": torch.zeros(2, 3), "a": torch.arange(4), "c": torch.ones((), dtype=torch.bfloat16)}, path)
    dtypes = {"F32": torch.float32, "I64": torch.int64, "BF16": torch.bfloat16}
    want = {
        n: _io.TensorEntry(dtypes[e["dtype"]], tuple(e["shape"]), *e["data_offsets"])
        for n, e in _header(path).items()
        if n != "__metadata__"
    }
    got = foreign.read_weights_header(path, WHAT)
    assert got == want and sorted(got) == ["a", "b", "c"]
    assert got["b"] == (torch.float32, (2, 3), got["b"].start, got["b"].start + 24)

    missing = tmp_path / "nope.safetensors"
    got_msg = _raises(ForeignFileError, foreign.read_weights_header, missing, WHAT)
    assert got_msg == f"{WHAT}: {missing}: [Errno 2] No such file or directory: {str(missing)!r}"
    pickled = tmp_path / "pickled.safetensors"
    torch.save({"a": torch.zeros(2)}, pickled)
    got_msg = _raises(ForeignFileError, foreign.read_weights_header, pickled, "w")
    assert got_msg.startswith(f"w: {pickled}: {pickled} is a pickle / torch.save file, not safetensors.")
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[:-4])
    size = path.stat().st_size
    got_msg = _raises(ForeignFileError, foreign.read_weights_header, cut, WHAT)
    assert got_msg == f"{WHAT}: {cut}: {cut} is truncated: {size - 4} bytes, its header describes {size}"


def test_read_index_returns_the_weight_map_or_names_the_field(tmp_path):
    index = tmp_path / "model.safetensors.index.json"
    wmap = {"b.weight": "model-00002-of-00002.safetensors", "a.weight": "model-00001-of-00002.safetensors"}
    index.write_text(json.dumps({"metadata": {"total_size": 12}, "weight_map": wmap}))
    got = foreign.read_index(index, WHAT)
    assert got == wmap and list(got) == list(wmap)
    assert foreign.read_index(_write(tmp_path / "empty.json", {"weight_map": {}}), WHAT) == {}
    for doc, typ in (({"metadata": {}}, "missing"), ({"weight_map": []}, "list"), ({"weight_map": None}, "NoneType")):
        _write(index, doc)
        got_msg = _raises(ForeignFileError, foreign.read_index, index, WHAT)
        assert got_msg == f"{WHAT}: {index}: field 'weight_map' must be an object, got {typ}"
    for name, file in (
        ("a", "../model.safetensors"),
        ("a", "/abs/model.safetensors"),
        ("a", "sub/model.safetensors"),
        ("a", 1),
        ("a", ""),
        ("a", None),
        ("", "model.safetensors"),
    ):
        _write(index, {"weight_map": {"ok": "model.safetensors", name: file}})
        got_msg = _raises(ForeignFileError, foreign.read_index, index, WHAT)
        assert got_msg == (
            f"{WHAT}: {index}: field 'weight_map' entry {name!r}: {file!r} is not a file name in the index's folder "
            "(no paths: the export reads nothing outside --like)"
        )
    _write(index, [1])
    assert (
        _raises(ForeignFileError, foreign.read_index, index, WHAT)
        == f"{WHAT}: {index} must hold a JSON object, got list"
    )


def _write(path: Path, doc: object) -> Path:
    path.write_text(json.dumps(doc))
    return path


# -------------------------------------------------------------------------------------------- names


def test_strip_wrappers_removes_wrapper_components_and_leading_module():
    cases = {
        "module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight": "model.layers.0.mlp.weight",
        "_forward_module.model._fsdp_wrapped_module.lm_head.weight": "model.lm_head.weight",
        "module.module.x.weight": "x.weight",
        "module.x": "x",
        "module": "module",
        "module.module": "module",
        "model.module.weight": "model.module.weight",
        "x.module": "x.module",
        "_orig_mod": "",
        "a._orig_mod_b.c": "a._orig_mod_b.c",
        "weight": "weight",
    }
    assert {n: names.strip_wrappers(n) for n in cases} == cases


def test_peft_name_applies_peft_saving_rule():
    cases = {
        ("m.q.lora_A.default.weight", "default"): "m.q.lora_A.weight",
        ("m.q.lora_B.a1.weight", "a1"): "m.q.lora_B.weight",
        ("m.q.lora_A.other.weight", "default"): "m.q.lora_A.other.weight",
        ("m.lm_head.modules_to_save.default.weight", "default"): "m.lm_head.weight",
        ("m.lm_head.modules_to_save.default.sub.bias", "default"): "m.lm_head.sub.bias",
        ("m.lm_head.modules_to_save.other.weight", "default"): "m.lm_head.modules_to_save.other.weight",
        ("m.x.modules_to_save", "default"): "m.x.modules_to_save",
        # then PEFT's removal of the adapter name as the second-to-last component, on every saved name (peft 0.21)
        ("m.default.modules_to_save.default.weight", "default"): "m.weight",
        ("m.q.lora_magnitude_vector.default.weight", "default"): "m.q.lora_magnitude_vector",
        ("m.q.lora_magnitude_vector.default", "default"): "m.q.lora_magnitude_vector",
        ("m.q.lora_magnitude_vector.other.weight", "default"): "m.q.lora_magnitude_vector.other.weight",
        ("lora_magnitude_vector.default.weight", "default"): "lora_magnitude_vector",
        ("x.default", "default"): "x",
        ("default.default", "default"): "default",  # as PEFT: the last component removed
        ("default", "default"): "default",
        ("m.default.w", "a"): "m.default.w",
        # a module path component equal to the adapter name stays: only PEFT's own place is removed
        ("m.layers.0.mlp.gate_proj.lora_A.mlp.weight", "mlp"): "m.layers.0.mlp.gate_proj.lora_A.weight",
        ("m.layers.0.q.lora_B.0.weight", "0"): "m.layers.0.q.lora_B.weight",
        ("m.mlp.lm_head.modules_to_save.mlp.weight", "mlp"): "m.mlp.lm_head.weight",
    }
    assert {k: names.peft_name(*k) for k in cases} == cases
    if importlib.util.find_spec("peft") is not None:  # PEFT's own rule agrees where no modules_to_save is involved
        from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key as peft_rule

        plain = [k for k in cases if "modules_to_save" not in k[0] and "lora_magnitude_vector" not in k[0]]
        assert {k: peft_rule(*k) for k in plain} == {k: cases[k] for k in plain}


def test_adapters_in_finds_the_name_after_the_first_marker():
    given = [
        "m.q.lora_A.default.weight",
        "m.q.lora_B.other.weight",
        "m.v.lora_A.default.weight",
        "m.e.lora_embedding_A.emb",
        "m.e.lora_embedding_B.emb",
        "m.q.lora_magnitude_vector.dora.weight",
        "m.h.modules_to_save.default.weight",
        "m.i.ia3_l.ia",
        "m.x.lora_A",  # a marker last: no adapter after it
        "m.plain.weight",
        "m.lora_A.first.lora_B.second",
    ]
    assert names.adapters_in(given) == {
        "default": ["m.q.lora_A.default.weight", "m.v.lora_A.default.weight", "m.h.modules_to_save.default.weight"],
        "other": ["m.q.lora_B.other.weight"],
        "emb": ["m.e.lora_embedding_A.emb", "m.e.lora_embedding_B.emb"],
        "dora": ["m.q.lora_magnitude_vector.dora.weight"],
        "ia": ["m.i.ia3_l.ia"],
        "first": ["m.lora_A.first.lora_B.second"],
    }
    assert names.adapters_in([]) == {}


# ------------------------------------------------------------------------------------------- outdir


def _listing(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` -> its bytes (``None`` for a folder): what a refusal must leave as it was."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def _previous_export(
    folder: Path, written: object = None, files: tuple[str, ...] = ("model.safetensors",), version: object = 2
) -> Path:
    """A folder as an export of record ``version`` left it (``written`` None: the record has no such key)."""
    folder.mkdir(parents=True)
    record: dict = {"format": FORMAT, "format_version": version}
    if written is not None:
        record["written"] = written
    (folder / "ema_export.json").write_text(json.dumps(record))
    for f in files:
        (folder / f).write_bytes(b"old " + f.encode())
    return folder


def test_check_out_dir_refuses_values_that_name_no_new_folder(tmp_path):
    for value in (None, 3, b"out", "", "a\x00b", Path("a\x00b")):
        got = _raises(OutputPathError, outdir.check_out_dir, value, [], False)
        assert got == f"out_dir (OUT_DIR) must name a new folder, got {value!r}"
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(RuntimeError) as resolving:
        (loop / "x").resolve()
    got = _raises(OutputPathError, outdir.check_out_dir, loop / "x", [], False)
    assert got == f"out_dir: cannot resolve {loop / 'x'}: {resolving.value}"
    with pytest.raises(RuntimeError) as resolving:
        loop.resolve()
    got = _raises(OutputPathError, outdir.check_out_dir, tmp_path / "fine", [loop], False)  # what is read, too
    assert got == f"out_dir: cannot resolve {tmp_path / 'fine'}: {resolving.value}"


def test_check_out_dir_refuses_cwd_home_their_parents_and_root(tmp_path, monkeypatch):
    cwd, home = tmp_path / "a" / "b", tmp_path / "h" / "home"
    cwd.mkdir(parents=True)
    home.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("HOME", str(home))
    before = _listing(tmp_path)
    for value, real in (
        (".", cwd),
        (Path("."), cwd),
        (str(cwd), cwd),
        ("..", cwd.parent),
        (str(tmp_path), tmp_path),
        (str(home), home),
        (str(home.parent), home.parent),
        ("/", Path("/")),
    ):
        got = _raises(OutputPathError, outdir.check_out_dir, value, [], True)
        assert got == (
            f"out_dir: refusing to write {value!r} (-> {real}): it is the current folder, one of its parents, the "
            "home folder or '/'; name a new folder for the export"
        )
    assert outdir.check_out_dir("~", [], False) == cwd / "~"  # not expanded: a new folder named '~'
    assert outdir.check_out_dir(str(home / "ema"), [], False) == home / "ema"
    assert outdir.check_out_dir(str(home.parent / "ema"), [], False) == home.parent / "ema"
    assert outdir.check_out_dir("new", [], False) == cwd / "new"
    assert _listing(tmp_path) == before


def test_check_out_dir_stays_away_from_what_is_read(tmp_path):
    src = tmp_path / "w" / "run" / "ckpt"
    src.mkdir(parents=True)
    source_file = tmp_path / "ema.safetensors"
    source_file.write_bytes(b"x")
    avoid = [src, source_file]
    # the suggestion: beside the folder read (the file's folder), unless that is refused too (then none)
    for out, where, a, fix in (
        (src, "equal to or above", src, None),  # src.parent / "ckpt" is src
        (src / "hf", "inside", src, src.parent / "hf"),
        (src / "tag" / "hf", "inside", src, src.parent / "hf"),
        (src.parent, "equal to or above", src, src.parent / "run"),
        (tmp_path / "w", "equal to or above", src, src.parent / "w"),
        (source_file, "equal to or above", source_file, tmp_path.parent / source_file.name),
    ):
        got = _raises(OutputPathError, outdir.check_out_dir, out, avoid, True)
        assert got == (
            f"out_dir: refusing to write {out} (-> {out}): it is {where} {a}, which this export reads. Write it "
            f"elsewhere{'' if fix is None else f', e.g. {fix}'}"
        )
    # Under a file: not inside what is read (a file holds no folder), and refused as a path under a file.
    for out in (source_file / "hf", source_file / "x" / "hf"):
        got = _raises(OutputPathError, outdir.check_out_dir, out, avoid, False)
        assert got == f"out_dir: {out} is under {source_file}, which is a file, not a folder"
    assert outdir.check_out_dir(tmp_path / "w" / "hf", avoid, False) == tmp_path / "w" / "hf"
    assert outdir.check_out_dir(tmp_path / "w" / "run" / "ckpt2", avoid, False) == src.parent / "ckpt2"


def test_check_out_dir_files_empty_and_non_empty_folders(tmp_path):
    link = tmp_path / "link"
    (tmp_path / "real").mkdir()
    link.symlink_to(tmp_path / "real")
    assert outdir.check_out_dir(link / "new", [], False) == tmp_path / "real" / "new"  # resolved
    assert outdir.check_out_dir(str(link), [], False) == tmp_path / "real"  # empty: no overwrite needed
    afile = tmp_path / "afile"
    afile.write_text("mine")
    for overwrite in (False, True):
        got = _raises(OutputPathError, outdir.check_out_dir, afile, [], overwrite)
        assert got == f"out_dir: {afile} exists and is not a folder; choose another name"
    (tmp_path / "real" / "keep.txt").write_text("mine")
    before = _listing(tmp_path)
    got = _raises(OutputPathError, outdir.check_out_dir, link, [], False)
    assert got == (
        f"out_dir: refusing to replace the existing, non-empty folder {link}: pass overwrite=True (--overwrite) to "
        "replace a previous export as a whole once the new one is complete, or choose another name"
    )
    not_ours = (
        f"out_dir: refusing to replace {link}: it is not a previous export of this tool (no ema_export.json written "
        "by functional_ema in it); --overwrite replaces only a previous export or an empty folder. Remove it yourself "
        "or choose another name"
    )
    assert _raises(OutputPathError, outdir.check_out_dir, link, [], True) == not_ours
    record = tmp_path / "real" / "ema_export.json"
    for body, why in (  # what is wrong with a file that is no record, named (read as foreign.read_json_object reads)
        ("{", "is not valid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))"),
        ("[1]", "must hold a JSON object, got list"),
        ("null", "must hold a JSON object, got NoneType"),
        (json.dumps({"format": "other"}), None),
        (json.dumps({"written": ["keep.txt"]}), None),
        ("[" * 100_000, "is nested too deeply to be a model folder's JSON file"),
    ):
        record.write_text(body)
        want = not_ours if why is None else not_ours.replace("in it)", f"in it: {record} {why})")
        assert _raises(OutputPathError, outdir.check_out_dir, link, [], True) == want, body[:9]
    record.write_text(json.dumps({"format": FORMAT}))
    real_open = foreign.open_regular

    def unreadable(path: Path, what: str) -> int:
        if Path(path).name == "ema_export.json":
            raise PermissionError(13, "Permission denied")
        return real_open(path, what)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(foreign, "open_regular", unreadable)
        got = _raises(OutputPathError, outdir.check_out_dir, link, [], True)
        assert got == not_ours.replace("in it)", f"in it: cannot read {record}: [Errno 13] Permission denied)")
    record.unlink()
    record.mkdir()  # a folder of that name is no record
    got = _raises(OutputPathError, outdir.check_out_dir, link, [], True)
    assert got == not_ours.replace("in it)", f"in it: {tmp_path / 'real' / 'ema_export.json'} is a folder)")
    record.rmdir()
    (tmp_path / "real" / "keep.txt").write_text("mine")
    assert _listing(tmp_path)["real/keep.txt"] == before["real/keep.txt"] == b"mine"


def test_overwrite_replaces_only_a_previous_export_of_its_own_files(tmp_path):
    written = ["config.json", "ema_export.json", "model.safetensors"]
    prev = _previous_export(tmp_path / "prev", written, ("model.safetensors", "config.json"))
    assert outdir.check_out_dir(prev, [], True) == prev
    v1 = _previous_export(tmp_path / "v1", None, ("model.safetensors", "notes.md"), version=1)  # no list of files
    assert outdir.check_out_dir(v1, [], True) == v1  # replaced whole, as version 1 exports always were
    extra = ["a.md", "b.md", "c", "d", "e", "f"]
    for name in extra:
        (prev / name).write_text("mine")
    (prev / "sub").mkdir()  # a folder it did not write counts too
    before = _listing(tmp_path)
    got = _raises(OutputPathError, outdir.check_out_dir, prev, [], True)
    assert got == (
        f"out_dir: refusing to replace {prev}: it holds files its export did not write (a.md, b.md, c, d, e); move "
        "them out first, or choose another name"
    )
    for name in [*extra[1:], "sub"]:
        (prev / name).unlink() if name != "sub" else (prev / name).rmdir()
    got = _raises(OutputPathError, outdir.check_out_dir, prev, [], True)
    assert got.endswith("it holds files its export did not write (a.md); move them out first, or choose another name")
    assert _listing(tmp_path)["prev/a.md"] == before["prev/a.md"]
    got = _raises(OutputPathError, outdir.check_out_dir, prev, [], False)  # no overwrite: refused before the record
    assert "refusing to replace the existing, non-empty folder" in got


def test_overwrite_refuses_a_damaged_record_removing_nothing(tmp_path):
    """A record of version 2 or later whose ``written`` was missing, null or not a list was taken for a version 1
    record, and the folder replaced whole: the user's ``notes.md`` beside it was deleted. Only a version 1 record
    (``format_version`` 1, as the exports before ``written`` wrote it) replaces the folder whole; any other record
    needs a list of plain file names, else it is refused naming the record and what is wrong, nothing removed. A
    record that is a link (even to a valid record), a folder or a dangling link is not one the export wrote."""
    files = ("model.safetensors", "notes.md")
    rows = (
        ("no written", None, 2, "(format_version 2) has no 'written' list of the files its export wrote"),
        ("no version", None, None, "(format_version None) has no 'written' list of the files its export wrote"),
        ("version str", None, "1", "(format_version '1') has no 'written' list of the files its export wrote"),
        ("version bool", None, True, "(format_version True) has no 'written' list of the files its export wrote"),
        ("version 3", None, 3, "(format_version 3) has no 'written' list of the files its export wrote"),
        ("written str", "notes.md", 2, "has 'written' str 'notes.md', not a list of file names"),
        (
            "written dict",
            {"model.safetensors": 1},
            2,
            "has 'written' dict {'model.safetensors': 1}, not a list of file names",
        ),
        ("written up", ["ema_export.json", "../x"], 2, "has 'written' naming '../x', not a file name of the folder"),
        ("written sub", ["a/notes.md"], 2, "has 'written' naming 'a/notes.md', not a file name of the folder"),
        ("written dots", [".."], 1, "has 'written' naming '..', not a file name of the folder"),
        ("written int", [1], 2, "has 'written' naming 1, not a file name of the folder"),
    )
    for name, written, version, problem in rows:
        folder = _previous_export(tmp_path / name.replace(" ", "_"), written, files, version)
        before = _listing(tmp_path)
        got = _raises(OutputPathError, outdir.check_out_dir, folder, [], True)
        assert got == (
            f"out_dir: refusing to replace {folder}: its ema_export.json {problem}, so which files its export wrote "
            "is unknown and nothing is removed. Move out what you want to keep and remove the folder yourself, or "
            "choose another name"
        ), name
        tmp = _tmp_export(tmp_path, folder.name, {"model.safetensors": b"new"})
        assert _raises(OutputPathError, outdir.commit_dir, tmp, folder, folder, True) == got  # checked again there
        shutil.rmtree(tmp)
        assert _listing(tmp_path) == before, name
    null = _previous_export(tmp_path / "null", None, files)
    _write(null / "ema_export.json", {"format": FORMAT, "format_version": 2, "written": None})
    got = _raises(OutputPathError, outdir.check_out_dir, null, [], True)
    assert "its ema_export.json (format_version 2) has no 'written' list" in got
    valid = _write(tmp_path / "valid.json", {"format": FORMAT, "format_version": 1})  # would replace the folder whole
    link_kind = (  # a hub cache snapshot's files all link into its blobs/: never replaced, said so
        "a symbolic link, which an export never writes (a hub cache snapshot's files all are: export to another folder)"
    )
    for kind, make in (
        (link_kind, lambda f: f.symlink_to(valid)),
        (link_kind, lambda f: f.symlink_to(tmp_path / "missing.json")),
        ("a folder", lambda f: f.mkdir()),
    ):
        folder = tmp_path / f"link{len(list(tmp_path.glob('link*')))}"
        folder.mkdir()
        (folder / "notes.md").write_text("mine")
        make(folder / "ema_export.json")
        before = _listing(tmp_path)
        got = _raises(OutputPathError, outdir.check_out_dir, folder, [], True)
        assert got == (
            f"out_dir: refusing to replace {folder}: it is not a previous export of this tool (no ema_export.json "
            f"written by functional_ema in it: {folder / 'ema_export.json'} is {kind}); --overwrite replaces only a "
            "previous export or an empty folder. Remove it yourself or choose another name"
        )
        assert _listing(tmp_path) == before


def test_new_tmp_dir_marks_its_folder_and_removes_only_dead_writers_folders(tmp_path, monkeypatch):
    with _hangups() as got:
        _new_tmp_dir_cases(tmp_path, monkeypatch)
    assert got == []  # this process's own folder was probed, never signalled


def _new_tmp_dir_cases(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "a" / "deep" / "ema_hf"
    tmp = outdir.new_tmp_dir(out)  # its parents made
    assert tmp.parent == out.parent and not out.exists()
    assert tmp.name.startswith(".ema_hf.tmp-") and len(tmp.name) == len(".ema_hf.tmp-") + 8
    int(tmp.name[-8:], 16)  # hex
    assert [p.name for p in tmp.iterdir()] == [MARKER]
    assert json.loads((tmp / MARKER).read_text()) == {"host": socket.gethostname(), "pid": os.getpid()}
    assert outdir.new_tmp_dir(out) != tmp and tmp.is_dir()  # a live writer's folder (this process) is kept

    host, dead = socket.gethostname(), _dead_pid()
    markers = {
        ".ema_hf.tmp-dead": {"host": host, "pid": dead},
        ".ema_hf.tmp-other-host": {"host": "elsewhere", "pid": dead},
        ".ema_hf.tmp-no-host": {"pid": dead},
        ".ema_hf.tmp-str-pid": {"host": host, "pid": str(dead)},
        ".ema_hf.tmp-list": [host, dead],
        ".ema_hf.tmp-bad-json": "{",
        ".ema_hf.tmp-deep-json": "[" * 100_000,
        ".ema_hf.tmp-none": None,
        ".ema_hfx.tmp-dead": {"host": host, "pid": dead},  # another out_dir's
        ".other.tmp-dead": {"host": host, "pid": dead},
        "ema_hf.tmp-dead": {"host": host, "pid": dead},
    }
    for name, marker in markers.items():
        (out.parent / name).mkdir()
        (out.parent / name / "model.safetensors").write_bytes(b"partial")
        if marker is not None:
            body = marker if isinstance(marker, str) else json.dumps(marker)
            (out.parent / name / MARKER).write_text(body)
    ours = {p.name for p in out.parent.iterdir() if p.name not in markers}
    glob = Path.glob
    monkeypatch.setattr(Path, "glob", lambda self, pattern: sorted(glob(self, pattern)))  # others' folders first
    third = outdir.new_tmp_dir(out)
    assert {p.name for p in out.parent.iterdir()} == ours | {third.name} | set(markers) - {".ema_hf.tmp-dead"}
    for name in set(markers) - {".ema_hf.tmp-dead"}:
        assert (out.parent / name / "model.safetensors").read_bytes() == b"partial"

    # The pid's type and sign are checked before any liveness test: with every pid 'dead', these are still kept.
    monkeypatch.setattr(outdir, "_alive", lambda pid: False)
    pids = {"bool": True, "zero": 0, "neg": -5, "one": 1, "gone": 7}
    for name, pid in pids.items():
        (out.parent / f".ema_hf.tmp-{name}").mkdir()
        (out.parent / f".ema_hf.tmp-{name}" / MARKER).write_text(json.dumps({"host": host, "pid": pid}))
    fourth = outdir.new_tmp_dir(out)
    kept = {p.name for p in out.parent.iterdir()}
    assert {".ema_hf.tmp-bool", ".ema_hf.tmp-zero", ".ema_hf.tmp-neg"} <= kept
    assert not {".ema_hf.tmp-one", ".ema_hf.tmp-gone"} & kept
    assert tmp.name not in kept and third.name not in kept  # this process's folders, now 'dead' by the patch

    # A dead writer's folder that cannot be removed (busy, read-only) is left as it is: the export goes on.
    monkeypatch.setattr(shutil, "rmtree", _failing_rmtree)
    (out.parent / ".ema_hf.tmp-stuck").mkdir()
    (out.parent / ".ema_hf.tmp-stuck" / MARKER).write_text(json.dumps({"host": host, "pid": 7}))
    fifth = outdir.new_tmp_dir(out)
    assert fifth.is_dir() and (out.parent / ".ema_hf.tmp-stuck").is_dir() and fourth.is_dir()


def _failing_rmtree(path: object, ignore_errors: bool = False, **kwargs: object) -> None:
    """``shutil.rmtree`` of a folder that cannot be removed: an error, unless told to ignore errors."""
    if not ignore_errors:
        raise OSError(16, "Device or resource busy", str(path))


def test_alive_reads_the_kill_probe(monkeypatch):
    with _hangups() as got:
        assert outdir._alive(os.getpid()) is True
    assert got == []
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert outdir._alive(child.pid) is True
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=0.5)  # a signal sent by the probe would have ended it by now
        assert child.returncode is None  # probed, not signalled
    finally:
        child.kill()
        child.wait()
    assert outdir._alive(_dead_pid()) is False
    probes = []

    def denied(pid: int, sig: int) -> None:
        probes.append((pid, sig))
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", denied)
    assert outdir._alive(4321) is True and probes == [(4321, 0)]


def _spy_commit(monkeypatch) -> list[tuple]:
    calls: list[tuple] = []
    rename, fsync_dir = os.rename, _io.fsync_dir

    def spy_rename(a, b) -> None:
        calls.append(("rename", Path(a), Path(b)))
        rename(a, b)

    def spy_fsync(d) -> None:
        calls.append(("fsync_dir", Path(d)))
        fsync_dir(d)

    monkeypatch.setattr(os, "rename", spy_rename)
    monkeypatch.setattr(_io, "fsync_dir", spy_fsync)
    return calls


def _tmp_export(parent: Path, name: str, files: dict[str, bytes]) -> Path:
    tmp = parent / f".{name}.tmp-12345678"
    tmp.mkdir(parents=True)
    (tmp / MARKER).write_text("{}")
    for f, b in files.items():
        (tmp / f).write_bytes(b)
    return tmp


def test_commit_dir_renames_into_a_new_or_empty_folder(tmp_path, monkeypatch):
    calls = _spy_commit(monkeypatch)
    for final in (tmp_path / "new", tmp_path / "empty"):
        if final.name == "empty":
            final.mkdir()
        tmp = _tmp_export(tmp_path, final.name, {"model.safetensors": b"new"})
        calls.clear()
        outdir.commit_dir(tmp, final, Path(final.name), overwrite=False)
        assert calls == [("rename", tmp, final), ("fsync_dir", tmp_path)]
        assert _listing(final) == {"model.safetensors": b"new"} and not tmp.exists()


def test_recovery_takes_only_this_out_dirs_leftovers_and_a_failed_commit_puts_the_previous_back(tmp_path):
    """A dead writer's marked folders are recovered only for their own out_dir: ``.a.old-x.old-<id>`` is out_dir
    ``a.old-x``'s (its parked export is not moved to ``a``, nor removed), ``.a.tmp-x.tmp-<id>`` is ``a.tmp-x``'s;
    ``.a.old-<id>`` is ``a``'s (put back as ``a``). And a commit whose final rename fails puts the previous
    export it parked back in place."""
    dead = {"host": socket.gethostname(), "pid": _dead_pid()}

    def parked(name: str, files: dict[str, bytes]) -> Path:
        folder = tmp_path / name
        (folder / "prev").mkdir(parents=True)
        for f, data in files.items():
            (folder / "prev" / f).write_bytes(data)
        (folder / MARKER).write_text(json.dumps(dead))
        return folder

    others = [parked(".a.old-x.old-1234abcd", {"model.safetensors": b"x"}), parked(".a.tmp-x.tmp-1234abcd", {})]
    before = {p.name: _listing(p) for p in others}
    mine = parked(".a.old-89abcdef", {"model.safetensors": b"a"})
    with pytest.raises(OutputPathError, match="not a previous export"):  # recovered first, then checked
        outdir.check_out_dir(tmp_path / "a", [], True)
    assert {p.name: _listing(p) for p in others} == before  # another out_dir's: untouched
    assert _listing(tmp_path / "a") == {"model.safetensors": b"a"} and not mine.exists()  # a's own: put back

    final = _previous_export(tmp_path / "out", ["ema_export.json", "model.safetensors"])
    before = _listing(final)
    tmp = _tmp_export(tmp_path, "out", {"model.safetensors": b"new", "ema_export.json": b"{}"})
    rename = os.rename

    def failing_final_rename(src, dst):
        if Path(src) == tmp:
            raise OSError(28, "No space left on device")
        return rename(src, dst)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(os, "rename", failing_final_rename)
        with pytest.raises(OSError, match="No space left"):
            outdir.commit_dir(tmp, final, Path("out"), True)
    assert _listing(final) == before  # the previous export is back in place
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]


def test_commit_dir_replaces_a_previous_export_and_keeps_what_appeared(tmp_path, monkeypatch):
    calls = _spy_commit(monkeypatch)
    final = _previous_export(tmp_path / "out", ["ema_export.json", "model.safetensors"])
    tmp = _tmp_export(tmp_path, "out", {"model.safetensors": b"new", "ema_export.json": b"{}"})
    before = _listing(tmp_path)
    got = _raises(OutputPathError, outdir.commit_dir, tmp, final, Path("out"), False)
    assert got == "out_dir: out was filled while the export ran; it is left as it is"
    assert _listing(final) == {k[4:]: v for k, v in before.items() if k.startswith("out/")} and calls == []
    assert (tmp / MARKER).exists() and (tmp / "model.safetensors").read_bytes() == b"new"  # still marked: removable

    outdir.commit_dir(tmp, final, Path("out"), True)
    assert [c[0] for c in calls] == ["rename", "rename", "fsync_dir"]
    old = calls[0][2].parent  # the previous export parked as <old>/prev in a marked folder
    assert calls[0][1] == final and calls[0][2].name == "prev" and old.parent == tmp_path
    assert old.name.startswith(".out.old-") and len(old.name) == len(".out.old-") + 8 and int(old.name[-8:], 16) >= 0
    assert calls[1:] == [("rename", tmp, final), ("fsync_dir", tmp_path)]
    assert _listing(final) == {"model.safetensors": b"new", "ema_export.json": b"{}"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the old one removed, no .tmp- left

    # The previous export moved aside cannot be removed (busy): the new one is in place all the same.
    _write(final / "ema_export.json", {"format": FORMAT, "written": ["ema_export.json", "model.safetensors"]})
    tmp = _tmp_export(tmp_path, "out", {"model.safetensors": b"newest"})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shutil, "rmtree", _failing_rmtree)
        outdir.commit_dir(tmp, final, Path("out"), True)
    assert _listing(final) == {"model.safetensors": b"newest"}
    (old,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.old-")]
    marker = json.loads((old / MARKER).read_text())
    assert marker == {"host": socket.gethostname(), "pid": os.getpid()}  # a later export removes it once we are gone
    prev = _listing(old / "prev")
    assert prev == {"model.safetensors": b"new", "ema_export.json": prev["ema_export.json"]}
    shutil.rmtree(old)

    # A file that appeared in the previous export while the new one was written: nothing is replaced.
    _write(final / "ema_export.json", {"format": FORMAT, "written": ["ema_export.json", "model.safetensors"]})
    (final / "notes.md").write_text("mine")
    tmp = _tmp_export(tmp_path, "out", {"model.safetensors": b"newer"})
    before = _listing(final)
    got = _raises(OutputPathError, outdir.commit_dir, tmp, final, Path("given/out"), True)
    assert got.startswith("out_dir: refusing to replace given/out: it holds files its export did not write (notes.md)")
    assert _listing(final) == before
    afile = tmp_path / "afile"
    afile.write_text("mine")
    tmp = _tmp_export(tmp_path, "afile", {})
    got = _raises(OutputPathError, outdir.commit_dir, tmp, afile, afile, False)
    assert got == f"out_dir: {afile} was filled while the export ran; it is left as it is"
    got = _raises(OutputPathError, outdir.commit_dir, tmp, afile, afile, True)
    assert got.startswith(f"out_dir: refusing to replace {afile}: it is not a previous export of this tool")
    assert afile.read_text() == "mine"


# --------------------------------------------------------------------------------------------- plan


def _entry(shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> _io.TensorEntry:
    return _io.TensorEntry(dtype, shape, 0, math.prod(shape) * dtype.itemsize)


def _like(
    root: Path,
    weights: dict[str, _io.TensorEntry] | None = None,
    kind: str = "transformers",
    config: dict | None = None,
) -> LikeFolder:
    folder = root / "like"
    config_file = folder / ("adapter_config.json" if kind == "peft" else "config.json")
    file = folder / f"{ {'peft': 'adapter_model'}.get(kind, 'model') }.safetensors"
    held = {n: (file, e) for n, e in (weights or {}).items()}
    return LikeFolder(folder, folder, kind, config or {}, config_file, held, [], [])


def _view(saved: dict[str, tuple[int, ...]], rename=None, aliases=None, converted=None) -> LoaderView:
    return LoaderView("transformers.TinyForCausalLM", saved, rename or {}, aliases or {}, converted or {})


def _plan(shapes: dict[str, tuple[int, ...]], like: LikeFolder, view=None, adapter="default", cast=None, **kw) -> Plan:
    dtypes = kw.pop("dtypes", {})
    full = {n: dtypes.get(n, torch.float32) for n in shapes}
    return make_plan(shapes, full, like, view, adapter, cast, kw.pop("missing", "like"))


F32, BF16 = torch.float32, torch.bfloat16


def test_plan_places_names_as_saved_and_casts_floats_only(tmp_path):
    like = _like(tmp_path, {"a.weight": _entry((2, 3)), "step": _entry((), torch.int64)})
    got = _plan({"_orig_mod.a.weight": (2, 3), "step": ()}, like, dtypes={"step": torch.int64})
    assert got == Plan(
        [Item("a.weight", F32, (2, 3), "ema", "_orig_mod.a.weight"), Item("step", torch.int64, (), "ema", "step")],
        [],
        "",
        [],
    )
    got = _plan({"a.weight": (2, 3), "step": ()}, like, cast=BF16, dtypes={"step": torch.int64})
    assert got.items == [
        Item("a.weight", BF16, (2, 3), "ema", "a.weight"),
        Item("step", torch.int64, (), "ema", "step"),
    ]
    # No weights in --like and no loader view: the names as saved, unconstrained.
    free = _like(tmp_path)
    got = _plan({"module.x": (4,), "y": (1, 1)}, free, cast=torch.float16)
    assert got == Plan(
        [Item("x", torch.float16, (4,), "ema", "module.x"), Item("y", torch.float16, (1, 1), "ema", "y")], [], "", []
    )


def test_plan_drops_the_one_prefix_most_names_need(tmp_path):
    like = _like(tmp_path, {"model.a": _entry((1,)), "model.b": _entry((2,)), "b": _entry((2,))})
    # 'model.b' fits with prefix 'lit' and, as 'b', with 'lit.model': the prefix every name fits wins.
    got = _plan({"lit.model.a": (1,), "lit.model.b": (2,)}, like, missing="like")
    assert got.prefix == "lit"
    assert got.items == [
        Item("model.a", F32, (1,), "ema", "lit.model.a"),
        Item("model.b", F32, (2,), "ema", "lit.model.b"),
        Item("b", F32, (2,), "like", "b"),
    ]
    # Equal counts: the shorter prefix ('a' before 'a.b').
    like2 = _like(tmp_path, {"b.x": _entry((3,)), "x": _entry((3,))})
    got = _plan({"a.b.x": (3,)}, like2)
    assert (got.prefix, got.items) == ("a", [Item("b.x", F32, (3,), "ema", "a.b.x"), Item("x", F32, (3,), "like", "x")])
    # No prefix needed: '' is the shortest of the prefixes every name fits with.
    got = _plan({"model.a": (1,), "model.b": (2,)}, like)
    assert got.prefix == "" and [it.name for it in got.items] == ["model.a", "model.b", "b"]
    # The most names win over the shortest (''), and a prefix of several components is dropped whole.
    like3 = _like(tmp_path, {"model.a": _entry((1,)), "model.b": _entry((2,)), "z.y.model.a": _entry((1,))})
    got = _plan({"z.y.model.a": (1,), "z.y.model.b": (2,)}, like3)
    assert got.prefix == "z.y" and [(it.name, it.origin) for it in got.items] == [
        ("model.a", "ema"),
        ("model.b", "ema"),
        ("z.y.model.a", "like"),
    ]


def test_plan_refuses_names_that_fit_only_under_different_prefixes(tmp_path):
    like = _like(tmp_path, {"model.a": _entry((1,)), "model.b": _entry((2,)), "model.c": _entry((3,))})
    msg = _raises(
        CheckpointMismatchError, _plan, {"x.model.a": (1,), "x.model.b": (2,), "y.model.c": (3,), "z": (1,)}, like
    )
    assert msg == (
        f"2 EMA tensor(s) have no place in {tmp_path / 'like'}'s weights: ['y.model.c', 'z'] (they fit only after "
        "dropping other prefixes than 'x': ['y']) (its weights are named like ['model.a', 'model.b', 'model.c']). Is "
        "--like the model this EMA was trained from?"
    )
    msg = _raises(CheckpointMismatchError, _plan, {"model.a": (1,), "q": (1,)}, like)
    assert msg == (
        f"1 EMA tensor(s) have no place in {tmp_path / 'like'}'s weights: ['q'] (its weights are named like "
        "['model.a', 'model.b', 'model.c']). Is --like the model this EMA was trained from?"
    )
    many = {f"p{i}.model.a": (1,) for i in range(5)}
    four = _like(tmp_path, {n: _entry((1,)) for n in ("model.a", "model.b", "model.c", "model.d")})
    msg = _raises(
        CheckpointMismatchError, _plan, {"model.a": (1,), "model.b": (1,), **many, "q": (1,), "r": (1,)}, four
    )
    assert msg == (
        f"7 EMA tensor(s) have no place in {tmp_path / 'like'}'s weights: ['p0.model.a', 'p1.model.a', 'p2.model.a', "
        "'p3.model.a', 'p4.model.a', 'q' and 1 more] (they fit only after dropping other prefixes than '': ['p0', "
        "'p1', 'p2' and 2 more]) (its weights are named like ['model.a', 'model.b', 'model.c' and 1 more]). Is "
        "--like the model this EMA was trained from?"
    )


def test_plan_renamings_ties_and_converted_tensors(tmp_path):
    saved = {"lm.model.x": (2,), "model.embed.weight": (4, 2), "head.bias": (4,)}
    view = _view(
        saved,
        rename={"model.lm.x": "lm.model.x"},
        aliases={"lm_head.weight": "model.embed.weight"},
        converted={"model.experts.w": ["model.experts.0.w", "model.experts.1.w", "model.experts.2.w", "x.3.w"]},
    )
    like = _like(tmp_path, {n: _entry(s) for n, s in saved.items()})
    shapes = {"model.lm.x": (2,), "model.embed.weight": (4, 2), "lm_head.weight": (4, 2), "head.bias": (4,)}
    got = _plan(shapes, like, view)
    assert got == Plan(
        [
            Item("lm.model.x", F32, (2,), "ema", "model.lm.x"),
            Item("model.embed.weight", F32, (4, 2), "ema", "model.embed.weight"),
            Item("head.bias", F32, (4,), "ema", "head.bias"),
        ],
        [("lm_head.weight", "model.embed.weight")],
        "",
        [],
    )
    # The view alone (a weightless --like): the same names, the tied alias left out, the prefix dropped.
    got = _plan({f"_forward_module.pl.{n}": s for n, s in shapes.items()}, _like(tmp_path), view)
    assert got.prefix == "pl" and [it.name for it in got.items] == ["lm.model.x", "model.embed.weight", "head.bias"]
    assert got.ties == [("_forward_module.pl.lm_head.weight", "model.embed.weight")]
    bad_tie = {**shapes, "lm_head.weight": (2, 4)}
    msg = _raises(CheckpointMismatchError, _plan, bad_tie, like, view)
    assert msg == (
        "1 EMA tensor(s) do not fit what the loader expects (EMA shape -> --like's): ['lm_head.weight [2, 4] -> "
        "model.embed.weight [4, 2]']; is --like the model this EMA was trained from, at the same size?"
    )
    msg = _raises(CheckpointMismatchError, _plan, {**shapes, "model.experts.w": (3, 2)}, like, view)
    assert msg == (
        "1 EMA tensor(s) are saved by transformers.TinyForCausalLM.save_pretrained as several tensors each (e.g. "
        "'model.experts.w' -> ['model.experts.0.w', 'model.experts.1.w', 'model.experts.2.w' and 1 more]: fused MoE "
        "experts), which this export does not convert: load the EMA into the model (fe.swapped, or copy_to_model) "
        "and call save_pretrained"
    )
    # Not converted, not placed (no view): the plain refusal. A converted name under a prefix is plainly unplaced too.
    msg = _raises(CheckpointMismatchError, _plan, {**shapes, "p.model.experts.w": (3, 2)}, like, view)
    assert msg.startswith("1 EMA tensor(s) have no place in") and "['p.model.experts.w']" in msg


def test_plan_refuses_shapes_integer_targets_collisions_and_nothing(tmp_path):
    like = _like(tmp_path, {"a": _entry((2, 3)), "b": _entry((4,)), "n": _entry((1,), torch.int64)})
    msg = _raises(CheckpointMismatchError, _plan, {"a": (3, 2), "b": (4,), "n": (1,)}, like)
    assert msg == (
        "2 EMA tensor(s) do not fit what the loader expects (EMA shape -> --like's): ['a [3, 2] -> a [2, 3]', 'n "
        "(torch.float32) -> n, an integer tensor (torch.int64) in --like']; is --like the model this EMA was trained "
        "from, at the same size?"
    )
    ints = {"n": torch.int32, "a": torch.int64}  # an integer EMA where --like holds a float: kept as it is
    got = _plan({"a": (2, 3), "b": (4,), "n": (1,)}, like, dtypes=ints, cast=BF16)
    assert got.items == [
        Item("a", torch.int64, (2, 3), "ema", "a"),
        Item("b", BF16, (4,), "ema", "b"),
        Item("n", torch.int32, (1,), "ema", "n"),
    ]
    five = _like(tmp_path, {f"w{i}": _entry((1,)) for i in range(5)})
    msg = _raises(CheckpointMismatchError, _plan, {f"w{i}": (2,) for i in range(5)}, five)
    assert msg.startswith("5 EMA tensor(s) do not fit") and "'w3 [2] -> w3 [1]' and 1 more]" in msg
    msg = _raises(CheckpointMismatchError, _plan, {"_orig_mod.a": (2, 3), "a": (2, 3)}, like)
    assert msg == "EMA tensors '_orig_mod.a' and 'a' both export as 'a'"
    msg = _raises(CheckpointMismatchError, _plan, {"module.x": (1,), "x": (1,)}, _like(tmp_path))
    assert msg == "EMA tensors 'module.x' and 'x' both export as 'x'"
    for shapes_, folder in (({}, like), ({}, _like(tmp_path))):
        msg = _raises(CheckpointMismatchError, _plan, shapes_, folder)
        assert msg == "the source holds no EMA tensor to export (an empty or foreign file?)"


def test_plan_copies_or_refuses_what_the_ema_lacks(tmp_path):
    like = _like(tmp_path, {"a": _entry((2,)), "emb": _entry((3, 2)), "step": _entry((), torch.int64)})
    got = _plan({"a": (2,)}, like, cast=torch.float16)
    assert got.items == [
        Item("a", torch.float16, (2,), "ema", "a"),
        Item("emb", torch.float16, (3, 2), "like", "emb"),
        Item("step", torch.int64, (), "like", "step"),
    ]
    msg = _raises(CheckpointMismatchError, _plan, {"a": (2,)}, like, missing="error")
    assert msg == (
        "2 weight(s) the loader reads have no EMA: ['emb', 'step'] (frozen parameters or buffers); pass "
        'missing="like" (--missing like) to copy them from there'
    )
    view = _view({"a": (2,), "emb": (3, 2)})
    for missing in ("like", "error"):
        msg = _raises(CheckpointMismatchError, _plan, {"a": (2,)}, _like(tmp_path), view, missing=missing)
        assert msg == (
            "1 weight(s) the loader reads have no EMA: ['emb'] (frozen parameters or buffers); and --like has no "
            "weights to copy them from: the loader would leave them randomly initialised"
        )
    seven = _like(tmp_path, {f"w{i}": _entry((1,)) for i in range(8)})
    msg = _raises(CheckpointMismatchError, _plan, {"w7": (1,)}, seven, missing="error")
    assert msg.startswith("7 weight(s) the loader reads have no EMA: ['w0', 'w1', 'w2', 'w3', 'w4', 'w5' and 1 more] (")
    full = _plan({"a": (2,), "emb": (3, 2), "step": ()}, like, missing="error", dtypes={"step": torch.int64})
    assert [it.origin for it in full.items] == ["ema", "ema", "ema"]


def test_plan_refuses_an_untied_weight_whose_pair_the_ema_holds(tmp_path):
    """--like untied, the EMA lacking lm_head but holding the embedding it would be tied to: trained tied (its EMA is
    the embedding's) or frozen, a checkpoint cannot say; refused naming both and the flag, unless the selection
    left it out."""
    saved = {"emb": (3, 2), "lm_head.weight": (3, 2)}
    like = _like(tmp_path, {n: _entry(s) for n, s in saved.items()})
    view = _view(saved)._replace(untied={"lm_head.weight": "emb"})
    msg = _raises(CheckpointMismatchError, _plan, {"emb": (3, 2)}, like, view)
    assert msg.startswith(
        "the EMA has no 'lm_head.weight' but has 'emb', which transformers.TinyForCausalLM ties it to when "
        f"tie_word_embeddings is true; --like's config ({tmp_path / 'like' / 'config.json'}) sets tie_word_embeddings"
    )
    both = _plan(saved, like, view)
    assert [it.origin for it in both.items] == ["ema", "ema"]
    for selection in ({"include": ["emb"], "exclude": None}, {"include": None, "exclude": ["lm_*"]}):
        got = make_plan({"emb": (3, 2)}, {"emb": F32}, like, view, "default", None, "like", selection)
        assert [(it.name, it.origin) for it in got.items] == [("emb", "ema"), ("lm_head.weight", "like")]
    kept = {"include": None, "exclude": ["x*"]}
    with pytest.raises(CheckpointMismatchError, match="tie_word_embeddings"):
        make_plan({"emb": (3, 2)}, {"emb": F32}, like, view, "default", None, "like", kept)


def test_plan_checks_like_weights_against_the_loader_view(tmp_path):
    like = _like(tmp_path, {"a": _entry((2,)), "b": _entry((1,)), "s": _entry(())})
    assert _plan({"a": (2,), "b": (1,), "s": ()}, like, _view({"a": (2,), "b": (1,), "s": ()})).prefix == ""
    cases = (
        ({"a": (3,), "b": (1,), "s": ()}, 1, "a [2] vs [3]"),
        ({"a": (2,), "c": (4,), "s": ()}, 2, "b [1] vs absent; c absent vs [4]"),
        ({"a": (2,), "b": (1,), "s": (), "c": (5,), "d": (6,), "e": (7,), "f": (8,), "g": (9,)}, 5, None),
    )
    for saved, count, given in cases:
        msg = _raises(ForeignFileError, _plan, {"a": (2,)}, like, _view(saved))
        shown = given or "c absent vs [5]; d absent vs [6]; e absent vs [7]; f absent vs [8]"
        assert msg == (
            f"like (--like): the weights in {tmp_path / 'like'} are not what transformers.TinyForCausalLM built from "
            f"config.json saves ({count} name(s) differ, weights vs config: {shown}): the folder is not laid out as "
            "this transformers saves that model. Its weights may be saved from the base model (names without the head "
            "model's prefix, as in older Hub folders), hold keys the loader drops or lack tied ones it fills, or its "
            "config (a flag such as tie_word_embeddings, or a size) was edited. Load it with from_pretrained, "
            "save_pretrained it to a new folder, and pass that as --like"
        )


LORA = {
    "base_model.model.m.q.lora_A.default.weight": (4, 8),
    "base_model.model.m.q.lora_B.default.weight": (8, 4),
    "base_model.model.lm_head.modules_to_save.default.weight": (16, 8),
}


def _peft_like(tmp_path: Path, config: dict | None = None, **extra: tuple[int, ...]) -> LikeFolder:
    saved = {
        "base_model.model.m.q.lora_A.weight": (4, 8),
        "base_model.model.m.q.lora_B.weight": (8, 4),
        "base_model.model.lm_head.weight": (16, 8),
        **extra,
    }
    return _like(tmp_path, {n: _entry(s) for n, s in saved.items()}, "peft", config or {"peft_type": "LORA"})


def test_plan_peft_names_and_other_adapters_left_out(tmp_path):
    other = {"base_model.model.m.q.lora_A.other.weight": (2, 8), "base_model.model.m.q.lora_B.other.weight": (8, 2)}
    shapes = {f"module.{n}": s for n, s in {**LORA, **other}.items()}
    got = _plan(shapes, _peft_like(tmp_path))
    keys = [f"module.{n}" for n in LORA]
    assert got == Plan(
        [
            Item("base_model.model.m.q.lora_A.weight", F32, (4, 8), "ema", keys[0]),
            Item("base_model.model.m.q.lora_B.weight", F32, (8, 4), "ema", keys[1]),
            Item("base_model.model.lm_head.weight", F32, (16, 8), "ema", keys[2]),
        ],
        [],
        "",
        [f"module.{n}" for n in other],
    )
    # The other adapter exported instead: its names, the first adapter's tensors left out.
    like_other = _like(
        tmp_path,
        {"base_model.model.m.q.lora_A.weight": _entry((2, 8)), "base_model.model.m.q.lora_B.weight": _entry((8, 2))},
        "peft",
        {"peft_type": "LORA"},
    )
    got = _plan(dict(other, **LORA), like_other, adapter="other")
    assert [it.key for it in got.items] == list(other) and got.other_adapters == list(LORA)
    msg = _raises(CheckpointMismatchError, _plan, dict(LORA), _peft_like(tmp_path), adapter="other")
    assert msg == (
        f"--like {tmp_path / 'like'} is a PEFT adapter folder and adapter_name (--adapter-name) is 'other', but the "
        "EMA's adapter names are: 'default' (3 tensors, e.g. 'base_model.model.m.q.lora_A.default.weight'). Pass the "
        "adapter name the EMA was trained with"
    )
    msg = _raises(CheckpointMismatchError, _plan, dict(other, **LORA), _peft_like(tmp_path), adapter="x")
    assert "adapter names are: 'default' (3 tensors, e.g. " in msg and "), 'other' (2 tensors, e.g. 'base_model" in msg
    msg = _raises(CheckpointMismatchError, _plan, {"m.weight": (1,)}, _peft_like(tmp_path))
    assert "but the EMA's adapter names are: none. Pass the adapter name" in msg


def test_plan_peft_refusals(tmp_path):
    frozen = {"base_model.model.m.k.weight": (8, 8), "base_model.model.m.norm": (8,)}
    msg = _raises(CheckpointMismatchError, _plan, {**LORA, **frozen}, _peft_like(tmp_path))
    assert msg == (
        f"--like {tmp_path / 'like'} is a PEFT adapter folder, but 2 EMA tensor(s) are neither adapter weights nor "
        "modules_to_save: ['base_model.model.m.k.weight', 'base_model.model.m.norm']; PEFT saves only those. To ship "
        "these too, export with --like the base model's folder after merging, or train them as modules_to_save"
    )
    five = {f"base_model.model.m.k{i}.weight": (1,) for i in range(5)}
    msg = _raises(CheckpointMismatchError, _plan, {**LORA, **five}, _peft_like(tmp_path))
    assert (
        "but 5 EMA tensor(s) are neither adapter weights nor modules_to_save: ['base_model.model.m.k0.weight', " in msg
    )
    assert "'base_model.model.m.k3.weight' and 1 more]; PEFT saves only those." in msg
    config = tmp_path / "like" / "adapter_config.json"
    tti = {"peft_type": "LORA", "trainable_token_indices": [1, 2]}
    msg = _raises(CheckpointMismatchError, _plan, dict(LORA), _peft_like(tmp_path, tti))
    assert msg == (
        f"{config}: field 'trainable_token_indices' asks PEFT for trainable token embeddings, but the EMA holds none "
        "(no trainable_tokens_delta): PEFT could not load the export. Give the adapter's own config"
    )
    delta = {**LORA, "base_model.model.emb.token_adapter.trainable_tokens_delta.default": (2, 8)}
    msg = _raises(CheckpointMismatchError, _plan, delta, _peft_like(tmp_path, tti))
    assert (
        "1 EMA tensor(s) are neither adapter weights nor modules_to_save: ['base_model.model.emb.token_adapter" in msg
    )
    assert _plan(dict(LORA), _peft_like(tmp_path, {"peft_type": "LORA", "trainable_token_indices": None})).prefix == ""
    dora_cfg = {"peft_type": "LORA", "use_dora": True}
    msg = _raises(CheckpointMismatchError, _plan, dict(LORA), _peft_like(tmp_path, dora_cfg))
    assert msg == (
        f"{config}: field 'use_dora' is True, but the EMA holds no DoRA magnitudes (lora_magnitude_vector): PEFT "
        "would initialise them from the base weights. Give the adapter's own config"
    )
    dora = {**LORA, "base_model.model.m.q.lora_magnitude_vector.default.weight": (8,)}
    msg = _raises(CheckpointMismatchError, _plan, dora, _peft_like(tmp_path))
    assert msg == (
        f"{config}: field 'use_dora' is False, but the EMA holds DoRA magnitudes (lora_magnitude_vector): PEFT would "
        "ignore them. Give the adapter's own config"
    )
    got = _plan(dora, _peft_like(tmp_path, dora_cfg, **{"base_model.model.m.q.lora_magnitude_vector": (8,)}))
    assert got.items[-1] == Item("base_model.model.m.q.lora_magnitude_vector", F32, (8,), "ema", list(dora)[-1])
    two = _peft_like(tmp_path, None, **{"base_model.model.m.v.lora_A.weight": (4, 8), "x.lora_B.weight": (8, 4)})
    msg = _raises(CheckpointMismatchError, _plan, dict(LORA), two)
    assert msg == (
        f"2 weight(s) of the adapter in {tmp_path / 'like'} have no EMA: ['base_model.model.m.v.lora_A.weight', "
        "'x.lora_B.weight']; the exported adapter would hold their initial values. Is the EMA of this adapter (its "
        "names, --adapter-name)?"
    )
    eight = _peft_like(tmp_path, None, **{f"m.l{i}.lora_A.weight": (1, 1) for i in range(5)})
    msg = _raises(CheckpointMismatchError, _plan, {"base_model.model.m.q.lora_A.default.weight": (4, 8)}, eight)
    assert msg.startswith(
        f"7 weight(s) of the adapter in {tmp_path / 'like'} have no EMA: ['base_model.model.m.q.lora_B.weight', "
        "'base_model.model.lm_head.weight', 'm.l0.lora_A.weight', 'm.l1.lora_A.weight', 'm.l2.lora_A.weight', "
        "'m.l3.lora_A.weight' and 1 more]; "
    )
    msg = _raises(CheckpointMismatchError, _plan, {**LORA, "q.lora_A.default.weight": (4, 8)}, _peft_like(tmp_path))
    assert msg == (
        f"1 EMA tensor(s) have no place in {tmp_path / 'like'}'s weights: ['q.lora_A.default.weight'] (its weights "
        "are named like ['base_model.model.lm_head.weight', 'base_model.model.m.q.lora_A.weight', "
        "'base_model.model.m.q.lora_B.weight']). PEFT saves only the adapters and modules_to_save. Is --like the "
        "model this EMA was trained from?"
    )


# --------------------------------------------------------------------------------------------- like


def _weights_file(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({n: torch.zeros(s) for n, s in tensors.items()}, path)
    return path


def _entries(path: Path) -> dict[str, tuple[Path, _io.TensorEntry]]:
    """The (file, entry) of every tensor of ``path``, from the header as parsed here."""
    dtypes = {"F32": torch.float32}
    return {
        n: (path, _io.TensorEntry(dtypes[e["dtype"]], tuple(e["shape"]), *e["data_offsets"]))
        for n, e in _header(path).items()
        if n != "__metadata__"
    }


def _model_folder(root: Path, config: dict | None = None) -> Path:
    root.mkdir(parents=True)
    _write(root / "config.json", config or {"architectures": ["TinyForCausalLM"], "model_type": "tiny"})
    return root


def test_read_like_transformers_folder_weights_copied_and_ignored_files(tmp_path):
    like = _model_folder(tmp_path / "base")
    single = _weights_file(like / "model.safetensors", {"a.weight": (2, 3), "b": (4,)})
    for name in ("tokenizer.json", "generation_config.json", "ema_export.json", "consolidated.safetensors"):
        (like / name).write_text("{}")
    for name in ("adapter_model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "x.gguf"):
        (like / name).write_bytes(b"stray")
    (like / "sub").mkdir()
    (like / "sub" / "notes.md").write_text("not copied")
    got = like_mod.read_like(str(like), "default")
    assert got == LikeFolder(
        like,
        like,
        "transformers",
        {"architectures": ["TinyForCausalLM"], "model_type": "tiny"},
        like / "config.json",
        _entries(single),
        [like / "config.json", like / "generation_config.json", like / "tokenizer.json"],
        [
            "adapter_model.safetensors",
            "consolidated.safetensors",
            "model.safetensors.index.json",
            "pytorch_model.bin",
            "sub/",  # a subfolder: listed, never copied (nor followed)
            "x.gguf",
        ],
    )
    assert got.stem == "model"
    bare = _model_folder(tmp_path / "bare", {"model_type": "tiny"})
    assert like_mod.read_like(bare, "default") == LikeFolder(
        bare, bare, "transformers", {"model_type": "tiny"}, bare / "config.json", {}, [bare / "config.json"], []
    )
    # The files are read by the foreign readers, each refusal naming --like, the file and the field.
    single.write_bytes(single.read_bytes()[:-2])
    msg = _raises(ForeignFileError, like_mod.read_like, like, "default")
    assert msg.startswith(f"{WHAT}: {single}: {single} is truncated: ")
    _write(bare / "config.json", [1])
    msg = _raises(ForeignFileError, like_mod.read_like, bare, "default")
    assert msg == f"{WHAT}: {bare / 'config.json'} must hold a JSON object, got list"


def test_read_like_sharded_weights_by_their_index(tmp_path):
    like = _model_folder(tmp_path / "base")
    one = _weights_file(like / "model-00001-of-00002.safetensors", {"a": (2,), "b": (3,)})
    two = _weights_file(like / "model-00002-of-00002.safetensors", {"c": (1, 1)})
    _weights_file(like / "model-00003-of-00002.safetensors", {"z": (1,)})  # not in the index: ignored
    index = _write(like / "model.safetensors.index.json", {"weight_map": {"a": one.name, "c": two.name, "b": one.name}})
    got = like_mod.read_like(like, "default")
    assert got.weights == {**_entries(one), **_entries(two)} and got.ignored == ["model-00003-of-00002.safetensors"]
    assert got.copied == [like / "config.json"]
    _write(index, {"weight_map": {"a": one.name, "b": one.name, "c": "model-00000.safetensors"}})
    msg = _raises(ForeignFileError, like_mod.read_like, like, "default")
    assert msg == f"{WHAT}: {index} names 'model-00000.safetensors', which is not a file in {like}"
    (like / "adir.safetensors").mkdir()
    _write(index, {"weight_map": {"a": "adir.safetensors"}})
    msg = _raises(ForeignFileError, like_mod.read_like, like, "default")
    assert msg == f"{WHAT}: {index} names 'adir.safetensors', which is not a file in {like}"
    for wmap, odd in (
        ({"a": one.name, "c": two.name}, ["b"]),
        ({"a": one.name, "b": one.name, "x": one.name, "y": one.name, "w": one.name, "v": one.name}, ["v", "w", "x"]),
        ({"a": one.name, "b": one.name, "c": one.name}, ["c"]),
    ):
        _write(index, {"weight_map": wmap})
        msg = _raises(ForeignFileError, like_mod.read_like, like, "default")
        assert msg == (
            f"{WHAT}: {index}: field 'weight_map' and the tensors of {one.name} disagree (e.g. {odd}): the index does "
            "not describe this folder's files"
        )
    _write(index, {"weight_map": {"a": "../model.safetensors"}})
    assert _raises(ForeignFileError, like_mod.read_like, like, "default") == (
        f"{WHAT}: {index}: field 'weight_map' entry 'a': '../model.safetensors' is not a file name in the index's "
        "folder (no paths: the export reads nothing outside --like)"
    )
    two.write_bytes(two.read_bytes()[:-1])  # a shard the index names, truncated
    _write(index, {"weight_map": {"c": two.name}})
    msg = _raises(ForeignFileError, like_mod.read_like, like, "default")
    assert msg.startswith(f"{WHAT}: {two}: {two} is truncated: ")
    # The single file is what the loader reads first: the index beside it is ignored, not read.
    _weights_file(like / "model.safetensors", {"s": (5,)})
    got = like_mod.read_like(like, "default")
    assert list(got.weights) == ["s"] and "model.safetensors.index.json" in got.ignored


def test_read_like_refuses_pickle_only_folders(tmp_path):
    for kind, files in (
        ("transformers", ["pytorch_model.bin"]),
        ("transformers", ["pytorch_model.bin", "pytorch_model.bin.index.json"]),
        ("transformers", ["pytorch_model.bin.index.json"]),
        ("diffusers", ["diffusion_pytorch_model.bin"]),
        ("peft", ["adapter_model.bin"]),
    ):
        like = tmp_path / f"{kind}{len(files)}{files[0]}"
        like.mkdir()
        config = {"model_type": "t"} if kind == "transformers" else {"_class_name": "U", "_diffusers_version": "1"}
        _write(like / ("adapter_config.json" if kind == "peft" else "config.json"), config)
        for f in files:
            (like / f).write_bytes(b"\x80\x02pickle")
        msg = _raises(ForeignFileError, like_mod._weights, like, kind)
        assert msg == (
            f"{WHAT}: {like} holds its weights only as pickles ({', '.join(files)}), which this library never loads: "
            "save the model with save_pretrained(..., safe_serialization=True) and give that folder"
        )
        if kind != "peft":
            assert _raises(ForeignFileError, like_mod.read_like, like, "default") == msg
    assert like_mod._weights(tmp_path, "transformers") == ({}, set())


def test_read_like_diffusers_and_peft_folders(tmp_path):
    unet = _model_folder(tmp_path / "unet", {"_class_name": "UNet2DModel", "_diffusers_version": "0.30"})
    w = _weights_file(unet / "diffusion_pytorch_model.safetensors", {"conv.weight": (2, 1)})
    _weights_file(unet / "model.safetensors", {"x": (1,)})  # not what diffusers reads
    got = like_mod.read_like(unet, "default")
    assert (got.kind, got.stem, got.weights, got.ignored) == (
        "diffusers",
        "diffusion_pytorch_model",
        _entries(w),
        ["model.safetensors"],
    )
    for config in ({"_class_name": "UNet2DModel"}, {"_diffusers_version": "1", "_class_name": "U"}):
        _write(unet / "config.json", config)
        assert like_mod.read_like(unet, "default").kind == "diffusers"
    for config, shown in (({"_diffusers_version": "1", "model_type": "t"}, "None"), ({"_class_name": 3}, "3")):
        _write(unet / "config.json", config)
        msg = _raises(ForeignFileError, like_mod.read_like, unet, "default")
        assert msg == f"{WHAT}: {unet / 'config.json'}: field '_class_name' must be a diffusers class name, got {shown}"

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    _write(adapter / "adapter_config.json", {"peft_type": "LORA", "_class_name": 3})  # PEFT's: not a diffusers field
    aw = _weights_file(adapter / "adapter_model.safetensors", {"m.lora_A.weight": (2, 4)})
    (adapter / "README.md").write_text("card")
    got = like_mod.read_like(adapter, "default")
    assert got == LikeFolder(
        adapter,
        adapter,
        "peft",
        {"peft_type": "LORA", "_class_name": 3},
        adapter / "adapter_config.json",
        _entries(aw),
        [adapter / "README.md", adapter / "adapter_config.json"],
        [],
    )
    assert got.stem == "adapter_model"
    other = adapter / "other"
    other.mkdir()
    _write(other / "adapter_config.json", {"peft_type": "LORA", "r": 2})
    ow = _weights_file(other / "adapter_model.safetensors", {"m.lora_B.weight": (4, 2)})
    got = like_mod.read_like(adapter, "other")
    assert (got.given, got.folder, got.kind, got.config_file) == (adapter, other, "peft", other / "adapter_config.json")
    assert got.weights == _entries(ow) and got.copied == [other / "adapter_config.json"]
    # PEFT saves a non-default adapter in its own folder: its folder wins even inside a model folder.
    base = _model_folder(tmp_path / "base_with_adapter")
    (base / "other").mkdir()
    _write(base / "other" / "adapter_config.json", {"peft_type": "LORA"})
    assert like_mod.read_like(base, "other").folder == base / "other"
    # The default adapter is the folder's own, whatever a subfolder named 'default' holds.
    (adapter / "default").mkdir()
    _write(adapter / "default" / "adapter_config.json", {"peft_type": "LORA"})
    assert like_mod.read_like(adapter, "default").folder == adapter


def test_read_like_folder_kind_refusals(tmp_path):
    for value in (None, 3, "", "a\x00b", b"folder"):
        msg = _raises(ForeignFileError, like_mod.read_like, value, "default")
        assert msg == f"like (--like) must name the model's save_pretrained folder, got {value!r}"
    afile = tmp_path / "afile"
    afile.write_text("x")
    for given in (afile, tmp_path / "missing"):
        msg = _raises(ForeignFileError, like_mod.read_like, given, "default")
        assert msg == f"{WHAT}: {given} is not a folder (give the model's save_pretrained folder)"
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "model.safetensors").write_bytes(b"")
    for adapter in ("default", "other"):
        msg = _raises(ForeignFileError, like_mod.read_like, empty, adapter)
        assert msg == (
            f"{WHAT}: {empty} holds no config.json (a Hugging Face model folder) and no adapter_config.json (a PEFT "
            "adapter folder)"
        )
    model = _model_folder(tmp_path / "model")
    msg = _raises(ForeignFileError, like_mod.read_like, model, "other")
    assert msg == (
        f"adapter_name (--adapter-name) is 'other', but like (--like) {model} is a model folder, not a PEFT adapter "
        "folder (no adapter_config.json): the adapter name applies to a PEFT export only"
    )
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    _write(adapter / "adapter_config.json", {"peft_type": "LORA"})
    (adapter / "other").mkdir()  # no adapter_config.json in it
    msg = _raises(ForeignFileError, like_mod.read_like, adapter, "other")
    assert msg == (
        f"{WHAT}: adapter_name (--adapter-name) is 'other', but PEFT saves a non-default adapter in {adapter / 'other'}/, "
        f"which does not exist; {adapter}/adapter_config.json is the 'default' adapter's"
    )
    weights = [f"{s}{x}" for s in ("model", "diffusion_pytorch_model", "pytorch_model") for x in like_mod_suffixes()]
    for name in weights:
        (adapter / name).mkdir() if name.endswith(".bin") else (adapter / name).write_bytes(b"")
        msg = _raises(ForeignFileError, like_mod.read_like, adapter, "default")
        assert msg == (
            f"{WHAT}: {adapter} holds both a model's weights and adapter_config.json (a PEFT adapter): give the base "
            "model's folder to export full weights, or the adapter's folder to export a PEFT adapter"
        ), name
        (adapter / name).rmdir() if name.endswith(".bin") else (adapter / name).unlink()
    (adapter / "adapter_config.json").unlink()
    (adapter / "adapter_config.json").mkdir()  # a folder of that name is not a config
    msg = _raises(ForeignFileError, like_mod.read_like, adapter, "default")
    assert msg.startswith(f"{WHAT}: {adapter} holds no config.json")


def _without(monkeypatch, *missing: str) -> None:
    """``importlib.util.find_spec`` answers that ``missing`` are not installed."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a))


def like_mod_suffixes() -> tuple[str, ...]:
    return (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def test_check_config_types_the_fields_the_export_reads(tmp_path):
    path = tmp_path / "config.json"
    check = like_mod._check_config
    for config in (
        {"architectures": ["A"]},
        {"model_type": "t", "architectures": None, "tie_word_embeddings": False, "text_config": None},
        {"_class_name": "U"},
        {"architecture": "resnet18", "dtype": None, "torch_dtype": "float32", "vision_config": {}, "audio_config": {}},
    ):
        assert check(config, path, "transformers") is None
    for config in ({}, {"architectures": [], "model_type": "", "_class_name": None, "architecture": 0}, {"name": "x"}):
        msg = _raises(ForeignFileError, check, config, path, "transformers")
        assert msg == (
            f"{WHAT}: {path} names no model (none of ['architectures', 'model_type', '_class_name', 'architecture']): "
            "no loader could build a model from it; give the model's save_pretrained folder"
        )
    for field, value, want in (
        ("architectures", "LlamaForCausalLM", "a list of class names"),
        ("architectures", ["A", 1], "a list of class names"),
        ("tie_word_embeddings", "true", "true or false"),
        ("tie_word_embeddings", None, "true or false"),
        ("text_config", [], "an object"),
        ("vision_config", "x", "an object"),
        ("audio_config", 1, "an object"),
        ("dtype", 16, "a dtype name"),
        ("torch_dtype", ["float32"], "a dtype name"),
    ):
        msg = _raises(ForeignFileError, check, {"model_type": "t", field: value}, path, "diffusers")
        assert msg == f"{WHAT}: {path}: field {field!r} must be {want}, got {value!r}"


def test_check_config_peft_fields(tmp_path, monkeypatch):
    _without(monkeypatch, "peft")  # PEFT's own parser: its own test
    path = tmp_path / "adapter_config.json"
    check = like_mod._check_config
    ok = {
        "peft_type": "LORA",
        "modules_to_save": ["lm_head"],
        "trainable_token_indices": {"embed": [1]},
        "r": 8,
        "lora_alpha": 16.5,
        "lora_dropout": 1,
        "rank_pattern": {"q": 2},
        "alpha_pattern": {"q": 0.5},
        "target_modules": "q_proj",
        "bias": "lora_only",
        "use_dora": False,
        "use_rslora": True,
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    assert check(ok, path, "peft") is None
    assert check({"peft_type": "X", "modules_to_save": None, "target_modules": None}, path, "peft") is None
    assert check({"peft_type": "X", "trainable_token_indices": [1], "lora_dropout": 0.0}, path, "peft") is None
    for field, value, want in (
        ("modules_to_save", "lm_head", "null or a list of module names"),
        ("modules_to_save", ["a", 1], "null or a list of module names"),
        ("peft_type", None, "a PEFT method name"),
        ("peft_type", 1, "a PEFT method name"),
        ("trainable_token_indices", 3, "null, a list or an object"),
        ("r", 0, "an int > 0"),
        ("r", True, "an int > 0"),
        ("r", 2.0, "an int > 0"),
        ("lora_alpha", "8", "a number"),
        ("lora_alpha", float("nan"), "a number"),
        ("lora_alpha", float("-inf"), "a number"),
        ("lora_alpha", False, "a number"),
        ("lora_dropout", 1.5, "a number in [0, 1]"),
        ("lora_dropout", -0.1, "a number in [0, 1]"),
        ("rank_pattern", {"q": 0}, "an object of ints > 0"),
        ("rank_pattern", [1], "an object of ints > 0"),
        ("alpha_pattern", {"q": "1"}, "an object of numbers"),
        ("target_modules", ["q", 1], "null, a name or a list of names"),
        ("bias", "some", "'none', 'all' or 'lora_only'"),
        ("use_dora", "yes", "true or false"),
        ("use_rslora", 1, "true or false"),
        ("fan_in_fan_out", None, "true or false"),
        ("inference_mode", 0, "true or false"),
    ):
        config = {"peft_type": "LORA", field: value} if field != "peft_type" else {field: value}
        if value is None and field == "peft_type":
            config = {}
        msg = _raises(ForeignFileError, check, config, path, "peft")
        assert msg == f"{WHAT}: {path}: field {field!r} must be {want}, got {value!r}", field


def test_peft_own_parser_and_declared_types(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    import typing

    from peft import LoraConfig, PeftConfig

    folder = tmp_path / "adapter"
    folder.mkdir()
    path = folder / "adapter_config.json"
    _write(path, {"peft_type": "LORA", "layers_to_transform": [0, 1], "init_lora_weights": "gaussian"})
    assert like_mod._check_config(json.loads(path.read_text()), path, "peft") is None

    # The config changed while PEFT read it: the second reading (for the declared types) refuses it, named.
    def read_then_replace(folder_: str, **kwargs: object) -> object:
        parsed = real_from_pretrained(folder_, **kwargs)
        path.write_text("[1]")
        return parsed

    real_from_pretrained = PeftConfig.from_pretrained
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(PeftConfig, "from_pretrained", read_then_replace)
        msg = _raises(ForeignFileError, like_mod._check_config, {"peft_type": "LORA"}, path, "peft")
    assert msg == f"{WHAT}: {path} must hold a JSON object, got list"
    for config in ({"peft_type": "NOPE"}, {"peft_type": "LORA", "task_type": "NOPE" * 80}):
        _write(path, config)
        try:
            PeftConfig.from_pretrained(str(folder))
        except Exception as e:  # noqa: BLE001 - PEFT's own refusal, the reference
            why = f"{type(e).__name__}: {str(e)[:200]}"
        msg = _raises(ForeignFileError, like_mod._check_config, config, path, "peft")
        assert msg == f"{WHAT}: {path}: PEFT cannot read this adapter config ({why})"
    hints = typing.get_type_hints(LoraConfig)
    for field, value, shown in (
        ("layers_to_transform", "abc", "'abc'"),
        ("layers_to_transform", ["0"], "['0']"),
        ("init_lora_weights", "nope", "'nope'"),
        ("layers_to_transform", "x" * 100, repr("x" * 100)[:60]),
    ):
        config = {"peft_type": "LORA", field: value}
        _write(path, config)
        msg = _raises(ForeignFileError, like_mod._check_config, config, path, "peft")
        assert msg == (
            f"{WHAT}: {path}: field {field!r} is {shown}, not of the type PEFT declares for it ({hints[field]}): PEFT "
            "could not load the export"
        )
    # Without PEFT installed, its own parser is not run: only the fields checked here.
    _without(monkeypatch, "peft")
    assert like_mod._check_config(config, path, "peft") is None


def test_conforms_to_peft_annotations():
    import typing

    conforms = like_mod._conforms
    yes = [
        (None, type(None)),
        (None, typing.Optional[int]),  # noqa: UP045 - the spelling PEFT's annotations use
        (3, typing.Union[int, str]),  # noqa: UP007
        ("a", int | str),
        ("b", typing.Literal["a", "b"]),
        ([1, 2], list[int]),
        ([], list[int]),
        ([1, "x"], list),
        ([1, "x"], tuple[int, str]),
        (["x", 1], tuple[str, int]),
        ([1, 2, 3], tuple[int, ...]),
        ({"a": 1}, dict[str, int]),
        ({"a": "x"}, dict),
        ({}, dict),
        (True, bool),
        (1, int),
        (1.5, float),
        (2, float),
        ("s", str),
        (object(), typing.Any),
        ([1], typing.Callable),
    ]
    no = [
        (0, type(None)),
        ("x", typing.Optional[int]),  # noqa: UP045
        (1.5, typing.Union[str, bool]),  # noqa: UP007
        (None, int | str),
        ("c", typing.Literal["a", "b"]),
        ([1, "2"], list[int]),
        ("ab", list[str]),
        ((1, "x"), tuple[int, str]),
        ([1], tuple[int, str]),
        (["x", 1], tuple[int, str]),
        ([1, "x", 2], tuple[int, str]),
        (["x"], tuple[int, ...]),
        ("ab", tuple[str, ...]),
        ({"a": "1"}, dict[str, int]),
        ([("a", 1)], dict[str, int]),
        ([], dict),
        (1, bool),
        (True, int),
        (float("nan"), float),
        ("1", float),
        (1, str),
    ]
    assert [conforms(v, h) for v, h in yes] == [True] * len(yes)
    assert [conforms(v, h) for v, h in no] == [False] * len(no)
    assert [like_mod._real(v) for v in (0, -2.5, 1e308, True, float("inf"), float("nan"), "1", None)] == [
        True,
        True,
        True,
        False,
        False,
        False,
        False,
        False,
    ]


def test_declared_types_of_peft_config_fields():
    import dataclasses

    @dataclasses.dataclass
    class Declared:
        n: int = 0
        names: list[str] | None = None

    path = Path("adapter_config.json")
    assert like_mod._check_declared_types(path, {"n": 1, "names": ["a"], "other": object()}, Declared) is None
    assert like_mod._check_declared_types(path, {"names": None}, Declared) is None  # a field absent: PEFT's default
    msg = _raises(ForeignFileError, like_mod._check_declared_types, path, {"n": 1, "names": [1]}, Declared)
    assert msg == (
        f"{WHAT}: adapter_config.json: field 'names' is [1], not of the type PEFT declares for it "
        "(list[str] | None): PEFT could not load the export"
    )

    class Unresolved:
        n: NoSuchType  # noqa: F821 - annotations that cannot be resolved: nothing to check

    @dataclasses.dataclass
    class UnresolvedData:
        n: NoSuchType = 0  # noqa: F821

    class Plain:
        n: int

    for cls in (Unresolved, UnresolvedData, Plain):
        assert like_mod._check_declared_types(path, {"n": "x"}, cls) is None


# ------------------------------------------------------------------------------------------- loader


def test_loader_view_says_why_there_is_none(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    view = loader.loader_view
    cases = (
        ("peft", {"architectures": ["LlamaForCausalLM"]}, "a PEFT adapter: the base model is not given"),
        (
            "transformers",
            {"architectures": ["X"], "auto_map": {}},
            "the config names remote code (auto_map), which the export never runs",
        ),
        (
            "diffusers",
            {"_class_name": "X", "auto_map": None},
            "the config names remote code (auto_map), which the export never runs",
        ),
        ("transformers", {"model_type": "llama"}, "the config names no transformers model class"),
        ("transformers", {"architectures": []}, "the config names no transformers model class"),
        ("transformers", {"architectures": None}, "the config names no transformers model class"),
        ("transformers", {"architectures": ["a.B"]}, "the config names no transformers model class"),
        ("transformers", {"architectures": [3]}, "the config names no transformers model class"),
        ("diffusers", {"_class_name": None}, "the config names no diffusers model class"),
        ("diffusers", {"_class_name": "os.path"}, "the config names no diffusers model class"),
        ("transformers", {"architectures": ["NoSuchModel"]}, "transformers has no model class 'NoSuchModel'"),
        ("transformers", {"architectures": ["LlamaConfig"]}, "transformers has no model class 'LlamaConfig'"),
        ("transformers", {"architectures": ["logging"]}, "transformers has no model class 'logging'"),
        ("transformers", {"architectures": ["UNet2DModel"]}, "transformers has no model class 'UNet2DModel'"),
        ("diffusers", {"_class_name": "NoSuchModel"}, "diffusers has no model class 'NoSuchModel'"),
        ("diffusers", {"_class_name": "LlamaForCausalLM"}, "diffusers has no model class 'LlamaForCausalLM'"),
    )
    for kind, config, why in cases:
        assert view(kind, config, path) == (None, why), (kind, config)
    _without(monkeypatch, "transformers", "diffusers")
    big = {"num_hidden_layers": 10**9}  # no library: nothing is built, so nothing is checked either
    assert view("transformers", {"architectures": ["LlamaForCausalLM"], **big}, path) == (
        None,
        "transformers is not installed",
    )
    assert view("diffusers", {"_class_name": "UNet2DModel", **big}, path) == (None, "diffusers is not installed")


def test_layer_counts_are_checked_before_any_model_is_built(tmp_path):
    path = tmp_path / "config.json"
    check = loader._check_layers

    def refused(key: str, value: int) -> str:
        return f"{WHAT}: {path}: field {key!r} is {value}, more than 4096 layers: not a model this export builds"

    for config, key, value in (
        ({"num_hidden_layers": 4097}, "num_hidden_layers", 4097),
        ({"n_layer": 5000}, "n_layer", 5000),
        ({"n_layers": 5000}, "n_layers", 5000),
        ({"layers": 4097}, "layers", 4097),
        ({"text_config": {"encoder_layers": 2**40}}, "encoder_layers", 2**40),
        ({"a": {"b": {"c": {"d": {"num_layers": 4097}}}}}, "num_layers", 4097),
    ):
        assert _raises(ForeignFileError, check, config, path) == refused(key, value)
    for config in (
        {"num_hidden_layers": 4096},
        {"num_hidden_layers": True, "layers": 4096.5e3, "n_layer": "9999", "n_layerz": 9999, "depth": 9999},
        {"a": {"b": {"c": {"d": {"e": {"num_layers": 4097}}}}}},  # deeper than any config's sub-configs
        {"layers": [5000]},
    ):
        assert check(config, path) is None
    assert check([{"num_hidden_layers": 5000}], path) is None
    msg = _raises(
        ForeignFileError, loader.loader_view, "transformers", {"architectures": ["X"], "num_hidden_layers": 5000}, path
    )
    assert msg == refused("num_hidden_layers", 5000)
    msg = _raises(ForeignFileError, loader.loader_view, "diffusers", {"_class_name": "X", "n_layers": 9000}, path)
    assert msg == refused("n_layers", 9000)


def test_quiet_silences_warnings_and_library_logs_then_restores_them():
    import logging
    import warnings

    tf, df = logging.getLogger("transformers"), logging.getLogger("diffusers")
    before = tf.level, df.level
    tf.setLevel(logging.INFO)
    df.setLevel(logging.DEBUG)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            with loader._quiet():
                assert (tf.level, df.level) == (logging.ERROR, logging.ERROR)
                warnings.warn("inside", UserWarning, stacklevel=1)
            warnings.warn("outside", UserWarning, stacklevel=1)
        assert [str(w.message) for w in seen] == ["outside"]
        assert (tf.level, df.level) == (logging.INFO, logging.DEBUG)
        with pytest.raises(KeyError), loader._quiet():
            raise KeyError("x")
        assert (tf.level, df.level) == (logging.INFO, logging.DEBUG)
    finally:
        tf.setLevel(before[0])
        df.setLevel(before[1])


def _saved_header(folder: Path) -> dict[str, tuple[int, ...]]:
    """What ``save_pretrained`` wrote into ``folder``: name -> shape, from the safetensors header parsed here."""
    (path,) = folder.glob("*.safetensors")
    return {n: tuple(e["shape"]) for n, e in _header(path).items() if n != "__metadata__"}


def test_transformers_view_is_what_save_pretrained_writes(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from tests._integration_models import quiet_hf, tiny_llama_config

    quiet_hf()
    for tie in (False, True):
        torch.manual_seed(0)
        folder = tmp_path / f"llama_{tie}"
        LlamaForCausalLM(tiny_llama_config(tie=tie)).save_pretrained(folder)
        config = json.loads((folder / "config.json").read_text())
        view, why = loader.loader_view("transformers", config, folder / "config.json")
        assert why == "" and view is not None
        assert view.saved == _saved_header(folder) and next(iter(view.saved)) == "model.embed_tokens.weight"
        assert (view.cls, view.rename, view.converted) == ("transformers.LlamaForCausalLM", {}, {})
        assert view.aliases == ({"lm_head.weight": "model.embed_tokens.weight"} if tie else {})
        assert view.untied == ({} if tie else {"lm_head.weight": "model.embed_tokens.weight"})  # tied when flagged
        assert ("lm_head.weight" in view.saved) is not tie

    # An MoE model: its fused experts are saved one tensor per expert, the router under its saved name.
    cfg = MixtralConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=32,
        num_local_experts=2,
        num_experts_per_tok=1,
    )
    moe = MixtralForCausalLM(cfg)
    moe.save_pretrained(tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    view, why = loader.loader_view("transformers", config, tmp_path / "moe" / "config.json")
    saved = _saved_header(tmp_path / "moe")
    assert why == "" and view is not None and view.saved == saved and view.aliases == {}
    state = set(moe.state_dict())
    assert set(view.rename) | set(view.converted) == state - set(saved) and view.rename and view.converted
    assert all(new in saved and new not in state for new in view.rename.values())
    parts = [p for names_ in view.converted.values() for p in names_]
    assert len(parts) == len(set(parts)) and set(parts) | set(view.rename.values()) == set(saved) - state
    assert all(len(v) == 2 * cfg.num_local_experts for k, v in view.converted.items() if "gate_up" in k)

    folder = tmp_path / "llama_False"
    bad = dict(json.loads((folder / "config.json").read_text()), hidden_size=30)  # not a multiple of the 4 heads
    msg = _raises(ForeignFileError, loader.loader_view, "transformers", bad, _write(folder / "config.json", bad))
    head = f"{WHAT}: {folder / 'config.json'}: transformers.LlamaForCausalLM cannot be built from this config ("
    assert msg.startswith(head) and "(30)" in msg and msg.endswith(")") and len(msg) <= len(head) + 300 + 60
    # A long refusal is cut at 300 characters: here the config class's own (an unknown model_type).
    from transformers import AutoConfig

    unknown = dict(bad, hidden_size=32, model_type="nosuchmodel")
    _write(folder / "config.json", unknown)
    with pytest.raises(ValueError) as refused:
        AutoConfig.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)
    assert len(str(refused.value)) > 300
    msg = _raises(ForeignFileError, loader.loader_view, "transformers", unknown, folder / "config.json")
    assert msg == f"{head}ValueError: {str(refused.value)[:300]})"

    # Keys the class never saves (_keys_to_ignore_on_save) are not in the view either.
    ignored = ["model.norm.weight", "lm_head.weight", "no.such.key"]
    monkeypatch.setattr(LlamaForCausalLM, "_keys_to_ignore_on_save", ignored)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(tmp_path / "ignoring")
    config = json.loads((tmp_path / "ignoring" / "config.json").read_text())
    view, _ = loader.loader_view("transformers", config, tmp_path / "ignoring" / "config.json")
    assert view is not None and view.saved == _saved_header(tmp_path / "ignoring")
    assert "model.norm.weight" not in view.saved and "lm_head.weight" not in view.saved


def test_transformers_view_reads_the_config_locally_and_follows_renamed_ties(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    from transformers import AutoConfig, CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

    from tests._integration_models import quiet_hf, tiny_llama_config

    quiet_hf()
    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, image_size=16, patch_size=8
    )
    text = tiny_llama_config(tie=True)
    cfg = LlavaConfig(
        vision_config=vision, text_config=text, image_token_index=63, vocab_size=64, tie_word_embeddings=True
    )
    LlavaForConditionalGeneration(cfg).save_pretrained(tmp_path / "llava")
    config = json.loads((tmp_path / "llava" / "config.json").read_text())
    calls = []
    real = AutoConfig.from_pretrained

    def spy(folder: str, **kwargs: object) -> object:
        calls.append((folder, kwargs))
        return real(folder, **kwargs)

    monkeypatch.setattr(AutoConfig, "from_pretrained", spy)
    view, why = loader.loader_view("transformers", config, tmp_path / "llava" / "config.json")
    # The loader's own reading of config.json: from the folder only, never running code it names.
    assert calls == [(str(tmp_path / "llava"), {"local_files_only": True, "trust_remote_code": False})]
    saved = _saved_header(tmp_path / "llava")
    assert why == "" and view is not None and view.saved == saved
    # Both the tied pair's names are renamed when saved (transformers 5): the alias and its holder, as saved.
    assert view.rename["lm_head.weight"] == "language_model.lm_head.weight"
    assert view.rename["model.language_model.embed_tokens.weight"] == "language_model.model.embed_tokens.weight"
    assert view.aliases == {"language_model.lm_head.weight": "language_model.model.embed_tokens.weight"}
    assert all(new in saved for old, new in view.rename.items() if old != "lm_head.weight")


def test_diffusers_view_is_what_save_pretrained_writes(tmp_path):
    pytest.importorskip("diffusers")
    from diffusers import UNet2DModel

    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
    )
    unet.save_pretrained(tmp_path / "unet")
    config = json.loads((tmp_path / "unet" / "config.json").read_text())
    view, why = loader.loader_view("diffusers", config, tmp_path / "unet" / "config.json")
    assert why == "" and view == LoaderView("diffusers.UNet2DModel", _saved_header(tmp_path / "unet"), {}, {}, {})
    bad = dict(config, block_out_channels=[8], down_block_types=["DownBlock2D", "DownBlock2D"])
    msg = _raises(ForeignFileError, loader.loader_view, "diffusers", bad, tmp_path / "unet" / "config.json")
    assert msg.startswith(
        f"{WHAT}: {tmp_path / 'unet' / 'config.json'}: diffusers.UNet2DModel cannot be built from this config ("
    )


def test_stub_modules_from_adapter_names_and_shapes():
    stub = loader._stub_modules
    assert stub({}) == {}
    assert stub(
        {
            "base_model.model.m.q.lora_A.weight": (4, 8),
            "base_model.model.m.q.lora_B.weight": (6, 4),
            "base_model.model.m.q.lora_magnitude_vector": (6,),
            "base_model.model.head.weight": (3, 6),
            "base_model.model.head.bias": (3,),
            "x.base_model.model.k.lora_A.weight": (2, 5),
            "x.base_model.model.k.lora_B.weight": (7, 2),
            "v.lora_B.weight": (9, 2),
            "v.lora_A.default.weight": (2, 1),
            "base_model.model.x.y.head.weight": (2, 4),
            "base_model.model.x.y.head.bias": (2,),
        }
    ) == {
        "m.q": {"in": 8, "out": 6},
        "head": {"out": 3, "in": 6, "bias": True},
        "x.base_model.model.k": {"in": 5, "out": 7},
        "v": {"out": 9, "in": 1},
        "x.y.head": {"out": 2, "in": 4, "bias": True},
    }
    for planned in (
        {"m.q.lora_A.weight": (4, 8)},  # no lora_B: no output size
        {"m.q.lora_B.weight": (6, 4)},
        {"m.q.lora_A.weight": (4, 8, 1), "m.q.lora_B.weight": (6, 4)},  # a conv's LoRA
        {"m.q.lora_A.weight": (4, 8), "m.q.lora_B.weight": (6,)},
        {"m.emb.lora_embedding_A": (4, 8)},
        {"m.head.weight": (3,)},
        {"m.head.bias": (3, 1)},
        {"m.head.bias": (3,)},
        {"m.ia3_l": (3,)},
        {"m.q.lora_A.weight": (4, 8), "m.q.lora_B.weight": (6, 4), "m.q.scale": (6,)},  # 1-D, not a bias
    ):
        assert stub(planned) is None, planned


def test_stub_builds_linear_modules_at_the_named_paths():
    root = loader._stub(
        {"m.q": {"in": 8, "out": 6}, "m.k": {"in": 2, "out": 3, "bias": True}, "head": {"in": 6, "out": 3}}
    )
    got = {
        n: (m.in_features, m.out_features, m.bias is not None)
        for n, m in root.named_modules()
        if n and isinstance(m, torch.nn.Linear)
    }
    assert got == {"m.q": (8, 6, False), "m.k": (2, 3, True), "head": (6, 3, False)}
    assert [n for n, m in root.named_modules()] == ["", "m", "m.q", "m.k", "head"]
    assert type(root.m) is torch.nn.Module


def test_peft_expected_is_what_peft_reads_for_the_config(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    path = tmp_path / "adapter_config.json"
    lora = {"base_model.model.m.q.lora_A.weight": (4, 8), "base_model.model.m.q.lora_B.weight": (6, 4)}
    _write(path, {"peft_type": "LORA", "r": 4, "target_modules": ["q"]})
    assert loader.peft_expected(path, lora) == (lora, "")
    _write(path, {"peft_type": "LORA", "r": 2, "target_modules": ["q"]})  # another rank: PEFT reads other shapes
    assert loader.peft_expected(path, lora) == (
        {"base_model.model.m.q.lora_A.weight": (2, 8), "base_model.model.m.q.lora_B.weight": (6, 2)},
        "",
    )
    full = {**lora, "base_model.model.m.q.lora_magnitude_vector": (6,), "base_model.model.head.weight": (3, 6)}
    _write(path, {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "use_dora": True, "modules_to_save": ["head"]})
    assert loader.peft_expected(path, full) == (full, "")
    _write(path, {"peft_type": "LORA", "r": 4, "target_modules": ["nomatch_" + "x" * 300]})
    msg = _raises(ForeignFileError, loader.peft_expected, path, lora)
    head = f"{WHAT}: {path}: PEFT cannot build this adapter over the modules the EMA names (NoMatchingPeftModuleError: "
    assert msg.startswith(head + "Target modules {'nomatch_xxx") and msg.endswith("x)") and len(msg) == len(head) + 301
    assert loader.peft_expected(path, {"m.emb.lora_embedding_A": (4, 8)}) == (
        None,
        "the adapter has weights other than Linear LoRA, DoRA and modules_to_save",
    )
    _without(monkeypatch, "peft")
    assert loader.peft_expected(path, lora) == (None, "peft is not installed")


# ------------------------------------------------------------------------------------------- export


def test_parse_dtype_and_size():
    from functional_ema.export import parse_dtype, parse_size

    for given, want in (
        (None, None),
        ("fp32", F32),
        ("FLOAT32", F32),
        ("bf16", BF16),
        ("BFloat16", BF16),
        ("fp16", torch.float16),
        ("float16", torch.float16),
        (torch.bfloat16, BF16),
        (torch.float32, F32),
        (torch.float16, torch.float16),
    ):
        assert parse_dtype(given) is want, given
    for bad in ("int8", "fp64", "", " bf16", torch.float64, torch.int8, 16, ["bf16"]):
        msg = _raises(ValueError, parse_dtype, bad)
        assert msg == f"dtype (--dtype) must be one of fp32, bf16, fp16 (or the torch dtypes), got {bad!r}"
    for given, want in (
        (1, 1),
        (20_000, 20_000),
        ("7", 7),
        ("7B", 7),
        ("3.9b", 3),
        ("10KB", 10**4),
        ("10kb", 10**4),
        (" 2 KiB ", 2048),
        ("1.5MB", 1_500_000),
        ("500MiB", 500 * 2**20),
        ("5GB", 5 * 10**9),
        ("1gib", 2**30),
        ("2TB", 2 * 10**12),
        ("5TiB", 5 * 2**40),
        ("0.0001KB", 1),
    ):
        assert parse_size(given) == want, given
    for bad in (0, -1, True, 1.5, None, "", "0", "0.0", "-5MB", "5XB", "GB", "5 G B", "1e3", "5PB", "5KiBB"):
        msg = _raises(ValueError, parse_size, bad)
        assert msg == (
            "max_shard_size (--max-shard-size) must be a positive size such as 5GB, 500MB, 64KiB or a number of "
            f"bytes, got {bad!r}"
        )


def test_hf_name_checks_its_arguments():
    from functional_ema.export import hf_name

    assert hf_name("module.m.q.lora_A.default.weight") == "m.q.lora_A.default.weight"
    assert hf_name("module.m.q.lora_A.default.weight", "default") == "m.q.lora_A.weight"
    assert _raises(TypeError, hf_name, 3) == "name must be a str, got int 3"
    assert _raises(TypeError, hf_name, "x", b"a") == "adapter_name must be a str, got bytes b'a'"


def test_shards_are_consecutive_groups_within_the_limit():
    from functional_ema.export import _shards

    sizes = {"a": 4, "b": 4, "c": 10, "d": 1, "e": 7, "f": 1}
    assert _shards(list(sizes), sizes, 8) == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert _shards(list(sizes), sizes, 100) == [list(sizes)]
    assert _shards(list(sizes), sizes, 1) == [[n] for n in sizes]
    assert _shards(["c", "a"], sizes, 8) == [["c"], ["a"]]
    assert _shards([], sizes, 8) == []


def test_check_options_names_each_bad_option():
    from functional_ema.export import _check_options

    flags = {"overwrite": False, "verify": True, "progress": None}
    assert _check_options("bf16", "1KiB", "like", 0, "default", flags) == (BF16, 1024)
    assert _check_options(None, 5, "error", 3, "my_adapter-2", {**flags, "progress": True}) == (None, 5)
    assert _check_options(None, 5, "like", 0, "XL", flags) == (None, 5)
    for what, value in (("overwrite", 1), ("verify", "yes"), ("progress", 0), ("overwrite", None)):
        msg = _raises(TypeError, _check_options, None, 5, "like", 0, "default", {**flags, what: value})
        assert msg == f"{what} must be True or False, got {type(value).__name__} {value!r}"
    for args, msg in (
        (
            ("fp8", 5, "like", 0, "a"),
            "dtype (--dtype) must be one of fp32, bf16, fp16 (or the torch dtypes), got 'fp8'",
        ),
        ((None, "x", "like", 0, "a"), "max_shard_size (--max-shard-size) must be a positive size"),
        ((None, 5, "zeros", 0, "a"), 'missing (--missing) must be "like" or "error", got \'zeros\''),
        ((None, 5, None, 0, "a"), 'missing (--missing) must be "like" or "error", got None'),
        ((None, 5, "like", -1, "a"), "index (--index) must be an int >= 0, got -1"),
        ((None, 5, "like", True, "a"), "index (--index) must be an int >= 0, got True"),
        ((None, 5, "like", 1.0, "a"), "index (--index) must be an int >= 0, got 1.0"),
        ((None, 5, "like", "0", "a"), "index (--index) must be an int >= 0, got '0'"),
    ):
        assert _raises(ValueError, _check_options, *args, flags).startswith(msg)
    for bad in ("", "a.b", "a/b", "a\\b", "a\x00", "a b", "a\tb", "a\nb", 3, None):
        msg = _raises(ValueError, _check_options, None, 5, "like", 0, bad, flags)
        assert msg == f"adapter_name (--adapter-name) must be a PEFT adapter name (no dots or separators), got {bad!r}"


def test_check_cast_refuses_values_that_become_inf():
    from functional_ema.export import _check_cast

    fine = torch.tensor([1.0, -65504.0, float("inf"), float("nan")])
    assert _check_cast(fine, fine.half(), "w") is None  # inf and nan were not finite before the cast
    assert _check_cast(fine[:2], fine[:2].half(), "w") is None
    big = torch.tensor([-1e5, 7e4, 1.0, float("inf"), float("nan"), 65504.0])
    msg = _raises(CheckpointMismatchError, _check_cast, big, big.half(), "layer.weight")
    assert msg == (
        "tensor 'layer.weight': 2 value(s) (up to 1e+05 in magnitude) do not fit torch.float16 and would become inf; "
        "export in bf16 or fp32 (--dtype)"
    )


class _Tiny(torch.nn.Module):
    """A linear layer and a batch norm (float buffers averaged, an int64 buffer copied)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)
        self.norm = torch.nn.BatchNorm1d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.lin(x))


DECAYS = (0.5, 0.75)


def _tiny_run(root: Path) -> dict:
    """The tiny module's --like folder (``save_pretrained``'s shape: config, weights, a tokenizer file) and its
    checkpoint (two EMAs and the buffers, one update); the expected tensors of EMA 1, from the states in memory."""
    import functional_ema as fe
    from functional_ema import buffers

    torch.manual_seed(0)
    model = _Tiny()
    like = root / "like"
    like.mkdir(parents=True)
    save_file({n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}, like / "model.safetensors")
    _write(like / "config.json", {"model_type": "tiny", "torch_dtype": "float32"})
    (like / "tokenizer.json").write_text('{"vocab": {}}')
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    bstate = buffers.init_buffers(model, num_emas=2)
    model(torch.randn(4, 3, generator=torch.Generator().manual_seed(1)))  # the batch norm's buffers move
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=list(DECAYS))
    bstate = buffers.update_buffers(bstate, model, 1, decay=list(DECAYS))
    fe.save(state, model, root / "ckpt", "t", decay=list(DECAYS), buffers=bstate)
    shapes = {n: p.shape for n, p in model.named_parameters()}
    want = {n: state.emas[1][n].reshape(shapes[n]).clone() for n in shapes}
    want.update({n: t.clone() for n, t in bstate.emas[1].items()})
    want.update({n: t.clone() for n, t in bstate.copied.items()})
    assert sorted(want) == sorted(model.state_dict()) and want["norm.num_batches_tracked"].item() == 1
    return {"ckpt": root / "ckpt", "like": like, "want": want, "initial": torch.load}


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[n].dtype == want[n].dtype and torch.equal(got[n], want[n]) for n in want
    )


def test_to_hf_writes_the_ema_its_record_and_like_files(tmp_path):
    from safetensors import safe_open

    from functional_ema._checkpoint.format import library_version
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    out = to_hf(ckpt, tmp_path / "hf", like, tag="t", index=1, progress=False)
    assert out == tmp_path / "hf"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "ema_export.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    assert _same(_read_all(out), want)
    assert (out / "config.json").read_bytes() == (like / "config.json").read_bytes()  # copied as it is: no dtype
    assert (out / "tokenizer.json").read_text() == '{"vocab": {}}'
    record = json.loads((out / "ema_export.json").read_text())
    assert record == {
        "source": str(ckpt),
        "source_kind": "checkpoint",
        "tag": "t",
        "step": 1,
        "ema_index": 1,
        "schedule": {"kind": "constant", "decay": 0.75},
        "saved_world_size": 1,
        "buffers": ["norm.num_batches_tracked", "norm.running_mean", "norm.running_var"],
        "format": FORMAT,
        "format_version": 2,
        "library": f"functional_ema {library_version()}",
        "dtype": "as saved",
        "layout": "transformers",
        "like": str(like),
        "like_folder": str(like),
        "files": ["model.safetensors"],
        "prefix_dropped": "",
        "copied_from_like": [],
        "ignored_in_like": [],
        "other_adapters_left_out": [],
        "tied_left_out": [],
        "aliases_from_ema": {},
        "written": ["config.json", "ema_export.json", "model.safetensors", "tokenizer.json"],
        "loader_check": {
            "class": None,
            "result": "not run: the config names no transformers model class; without it, a weight the loader reads "
            "that neither the EMA nor --like's weights hold cannot be seen (the loader would leave it initialised)",
        },
        "config_dtype": None,
    }
    assert (out / "ema_export.json").read_text() == json.dumps(record, indent=2) + "\n"
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    keys = ("format", "source", "tag", "step", "ema_index", "schedule", "dtype", "layout")
    assert meta == {"format": "pt", "functional_ema": json.dumps({k: record[k] for k in keys})}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "hf", "like"]


def test_to_hf_bf16_shards_their_index_and_overwrite(tmp_path):
    from safetensors import safe_open

    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    keys = ("format", "source", "tag", "step", "ema_index", "schedule", "dtype", "layout")
    # bf16, sharded: the index, the shards, config.json saying the dtype; floats cast, the int buffer kept.
    sharded = to_hf(ckpt, tmp_path / "hf16", like, tag="t", index=1, dtype="bf16", max_shard_size=10, progress=False)
    files = [f"model-0000{i}-of-00005.safetensors" for i in range(1, 6)]
    assert sorted(p.name for p in sharded.iterdir()) == sorted(
        [*files, "model.safetensors.index.json", "config.json", "ema_export.json", "tokenizer.json"]
    )
    cast = {n: t.to(BF16) if t.is_floating_point() else t for n, t in want.items()}
    assert _same(_read_all(sharded), cast)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    record16 = json.loads((sharded / "ema_export.json").read_text())
    # In the source's order, cut at 10 bytes: 12 | 4 + 4 | 4 + 4 | 4 | 8 (the int64 buffer, copied, last).
    groups = [
        ["lin.weight"],
        ["lin.bias", "norm.weight"],
        ["norm.bias", "norm.running_mean"],
        ["norm.running_var"],
        ["norm.num_batches_tracked"],
    ]
    assert [_read_all_names(sharded / f) for f in files] == groups
    assert index == {
        "metadata": {"total_size": 12 + 4 * 5 + 8, "functional_ema": json.dumps({k: record16[k] for k in keys})},
        "weight_map": {n: f for f, g in zip(files, groups) for n in g},
    }
    assert list(index["weight_map"]) == [n for g in groups for n in g]
    assert (sharded / "model.safetensors.index.json").read_text() == json.dumps(index, indent=2)
    assert json.loads(index["metadata"]["functional_ema"])["dtype"] == "bfloat16"
    with safe_open(str(sharded / files[0]), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "functional_ema": index["metadata"]["functional_ema"]}
    assert json.loads((sharded / "config.json").read_text()) == {
        "model_type": "tiny",
        "torch_dtype": "bfloat16",
        "dtype": "bfloat16",
    }
    assert record16["files"] == files and record16["dtype"] == "bfloat16"
    assert record16["written"] == sorted(
        [*files, "model.safetensors.index.json", "config.json", "ema_export.json", "tokenizer.json"]
    )

    # Replaced as a whole (overwrite), unverified, EMA 0; a previous export's files all go.
    again = to_hf(ckpt, sharded, like, tag="t", overwrite=True, verify=False, progress=False)
    assert sorted(p.name for p in again.iterdir()) == [
        "config.json",
        "ema_export.json",
        "model.safetensors",
        "tokenizer.json",
    ]
    record0 = json.loads((again / "ema_export.json").read_text())
    assert record0["ema_index"] == 0 and record0["schedule"] == {"kind": "constant", "decay": 0.5}
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def _read_all_names(path: Path) -> list[str]:
    return [n for n in _header(path) if n != "__metadata__"]


def test_to_hf_from_files_this_library_wrote(tmp_path):
    import functional_ema as fe
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    src = fe.consolidate_to_file(ckpt, tmp_path / "ema.safetensors", "t", index=1, progress=False)
    with _io.SafetensorsFile(src) as f:
        meta = dict(f.metadata)
    out = to_hf(src, tmp_path / "hf", like, progress=False)
    buffers = [n for n in _header(like / "model.safetensors") if n.startswith("norm.r") or n.endswith("tracked")]
    from safetensors.torch import load_file

    initial = load_file(like / "model.safetensors")
    assert _same(_read_all(out), {**{n: want[n] for n in want if n not in buffers}, **{n: initial[n] for n in buffers}})
    record = json.loads((out / "ema_export.json").read_text())
    assert {
        k: record[k] for k in ("source", "source_kind", "source_format", "step", "ema_index", "source_verified")
    } == {
        "source": str(src),
        "source_kind": "file",
        "source_format": "functional_ema.consolidated",
        "step": 1,
        "ema_index": 1,
        "source_verified": True,
    }
    assert record["source_metadata"] == {k: meta[k] for k in sorted(meta)} and list(
        record["source_metadata"]
    ) == sorted(meta)
    assert record["copied_from_like"] == buffers and "tag" not in record

    # An export file (no checksums of its own, no digits in step): its tensors, nothing verified.
    plain = tmp_path / "plain.safetensors"
    save_file(dict(want), plain, metadata={"format": "functional_ema.export", "step": "x", "ema_index": "", "tag": "t"})
    out2 = to_hf(plain, tmp_path / "hf2", like, progress=False, missing="error")
    assert _same(_read_all(out2), want)
    record2 = json.loads((out2 / "ema_export.json").read_text())
    assert (record2["step"], record2["ema_index"], record2["source_verified"]) == (None, None, False)
    assert "tag" not in record2 and record2["source_metadata"]["tag"] == "t"
    assert record2["format"] == FORMAT and record2["source_metadata"]["format"] == "functional_ema.export"


def test_a_file_source_refuses_a_tag_or_index_it_does_not_hold(tmp_path, capsys):
    """A consolidated file holds one EMA of one tag: --tag / --index were ignored (asked --tag s6, got the file's s3;
    --index 1 on a file of EMA 0 exported EMA 0). Now a value other than the file's own ``tag`` / ``ema_index``
    metadata is refused, naming both, as a checkpoint refuses an index it does not hold; omitted or matching, the
    export is the file's EMA. A file recording no ema_index (post-hoc) holds EMA 0 only, and no tag to match."""
    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    src = fe.consolidate_to_file(ckpt, tmp_path / "ema.safetensors", "t", index=1, progress=False)
    fix = "omit --tag and --index for a file (it holds one EMA), or export the checkpoint folder"
    for kw, why in (
        ({"index": 0}, f"index=0, but the file {src} holds EMA 1 of tag 't' only"),
        ({"index": 2}, f"index=2, but the file {src} holds EMA 1 of tag 't' only"),
        ({"tag": "s6"}, f"tag='s6', but the file {src} holds tag 't'"),
        ({"tag": "s6", "index": 1}, f"tag='s6', but the file {src} holds tag 't'"),
    ):
        assert _raises(CheckpointMismatchError, to_hf, src, tmp_path / "hf", like, **kw) == f"{why}: {fix}", kw
    assert main(["export", str(src), str(tmp_path / "hf"), "--like", str(like), "--index", "0"]) == 1
    assert capsys.readouterr().err == f"error: index=0, but the file {src} holds EMA 1 of tag 't' only: {fix}\n"
    assert not (tmp_path / "hf").exists()
    omitted = to_hf(src, tmp_path / "omitted", like, progress=False)
    matching = to_hf(src, tmp_path / "matching", like, tag="t", index=1, progress=False)
    assert main(["export", str(src), str(tmp_path / "cli"), "--like", str(like), "--tag", "t", "--index", "1"]) == 0
    got = _read_all(matching)
    assert all(torch.equal(got[n], want[n]) for n, _ in _Tiny().named_parameters())  # EMA 1, as asked
    for other in (omitted, tmp_path / "cli"):
        assert _same(_read_all(other), got)
    # a post-hoc file: no ema_index, no tag recorded
    post = tmp_path / "post.safetensors"
    save_file(dict(want), post, metadata={"format": "functional_ema.posthoc", "step": "1"})
    assert _raises(CheckpointMismatchError, to_hf, post, tmp_path / "hf", like, index=1) == (
        f"index=1, but the file {post} holds one EMA (index 0: it records no ema_index): {fix}"
    )
    assert _raises(CheckpointMismatchError, to_hf, post, tmp_path / "hf", like, tag="t") == (
        f"tag='t', but the file {post} records no tag (its metadata has none): {fix}"
    )
    assert _same(_read_all(to_hf(post, tmp_path / "post_hf", like, index=0, progress=False)), want)


def test_to_hf_refuses_foreign_or_corrupt_files_and_fp16_overflow(tmp_path):
    import functional_ema as fe
    from functional_ema._checkpoint.errors import CorruptCheckpointError
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    src = fe.consolidate_to_file(ckpt, tmp_path / "ema.safetensors", "t", index=1, progress=False)
    with _io.SafetensorsFile(src) as f:
        meta = dict(f.metadata)
    refusals = []
    foreign_fmt = tmp_path / "foreign.safetensors"
    save_file(dict(want), foreign_fmt, metadata={"format": "pt"})
    refusals.append(
        (
            foreign_fmt,
            CheckpointMismatchError,
            (
                f"{foreign_fmt}: not a file of full EMA weights written by functional_ema (its safetensors metadata 'format' "
                "is 'pt', expected one of ['functional_ema.consolidated', 'functional_ema.export', 'functional_ema.posthoc']); "
                "export a checkpoint folder, or the output of consolidate, consolidate --dcp or posthoc"
            ),
        )
    )
    pickled = tmp_path / "pickled.safetensors"
    torch.save(dict(want), pickled)
    refusals.append(
        (pickled, CorruptCheckpointError, f"source: {pickled} is a pickle / torch.save file, not safetensors.")
    )
    bad_algo = tmp_path / "bad_algo.safetensors"
    save_file(dict(want), bad_algo, metadata={**meta, "content_checksum_algo": "crc32/1"})
    refusals.append(
        (
            bad_algo,
            CorruptCheckpointError,
            (f"source: {bad_algo}: metadata 'content_checksum_algo' is 'crc32/1', expected xxh3_64/4194304"),
        )
    )
    flipped = tmp_path / "flipped.safetensors"
    raw = bytearray(src.read_bytes())
    raw[-1] ^= 0xFF
    flipped.write_bytes(bytes(raw))
    refusals.append((flipped, CorruptCheckpointError, f"source: {flipped}: checksum mismatch in tensor "))
    for source, exc, start in refusals:
        msg = _raises(exc, to_hf, source, tmp_path / "bad", like, progress=False)
        assert msg.startswith(start), msg
        assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    unverified = to_hf(flipped, tmp_path / "unverified", like, progress=False, verify=False)
    assert json.loads((unverified / "ema_export.json").read_text())["source_verified"] is False

    # fp16 that does not fit: refused naming the tensor, nothing left behind.
    huge = tmp_path / "huge.safetensors"
    save_file({**want, "lin.weight": torch.full((2, 3), 1e5)}, huge, metadata={"format": "functional_ema.posthoc"})
    msg = _raises(CheckpointMismatchError, to_hf, huge, tmp_path / "fp16", like, dtype="fp16", progress=False)
    assert msg.startswith("tensor 'lin.weight': 6 value(s) (up to 1e+05 in magnitude) do not fit torch.float16")
    assert sorted(p.name for p in tmp_path.iterdir() if "fp16" in p.name) == []


def test_to_hf_checkpoint_without_buffers_copies_them_from_like(tmp_path):
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.export import to_hf

    torch.manual_seed(0)
    model = _Tiny()
    like = tmp_path / "like"
    like.mkdir()
    save_file({n: t.clone().contiguous() for n, t in model.state_dict().items()}, like / "model.safetensors")
    _write(like / "config.json", {"model_type": "tiny"})
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        model.lin.weight.mul_(2)
    state = fe.update(state, fe.local_shards(model), 3, decay=0.5)
    fe.save(state, model, tmp_path / "ckpt", "nb")  # no decay given: no schedule recorded
    out = to_hf(tmp_path / "ckpt", tmp_path / "hf", like, progress=False)
    record = json.loads((out / "ema_export.json").read_text())
    initial = load_file(like / "model.safetensors")
    buffers = [
        n
        for n in _header(like / "model.safetensors")
        if n in ("norm.running_mean", "norm.running_var", "norm.num_batches_tracked")
    ]
    assert record["buffers"] == [] and record["copied_from_like"] == buffers and record["step"] == 3
    assert record["tag"] == "nb" and record["schedule"] is None
    want = {n: state.emas[0][n].reshape(p.shape) for n, p in model.named_parameters()}
    assert _same(_read_all(out), {**want, **{n: initial[n] for n in buffers}})
    msg = _raises(CheckpointMismatchError, to_hf, tmp_path / "ckpt", tmp_path / "strict", like, missing="error")
    assert msg.startswith("3 weight(s) the loader reads have no EMA:") and not (tmp_path / "strict").exists()


def _fake_source(tensors: dict[str, torch.Tensor], info: dict | None = None):
    from functional_ema.export import _Source

    def fill(dst: torch.Tensor, name: str) -> None:
        dst.copy_(tensors[name].reshape(-1))

    shapes = {n: tuple(t.shape) for n, t in tensors.items()}
    return _Source(shapes, {n: t.dtype for n, t in tensors.items()}, fill, info or {}, [])


def test_check_ties_compares_the_alias_with_what_it_is_tied_to(tmp_path):
    from functional_ema.export import _check_ties, _Like

    emb = torch.arange(1.0, 5.0).reshape(2, 2)
    like_file = _weights_file(tmp_path / "like" / "model.safetensors", {})
    save_file({"emb": emb, "other": torch.ones(3)}, like_file)
    like = LikeFolder(
        tmp_path / "like",
        tmp_path / "like",
        "transformers",
        {},
        tmp_path / "like" / "config.json",
        _entries_any(like_file),
        [],
        [],
    )
    reader = _Like(like)
    assert torch.equal(reader.read("emb"), emb.reshape(-1)) and torch.equal(reader.read("other"), torch.ones(3))
    close = emb + 1e-4  # the same in bf16, not in fp32
    for dtype, origin, ok in ((F32, "ema", False), (BF16, "ema", True), (F32, "like", False), (BF16, "like", True)):
        items = [Item("emb", dtype, (2, 2), origin, "emb")]
        plan_ = Plan(items, [("lm_head.weight", "emb")], "", [])
        src = _fake_source({"lm_head.weight": close, **({"emb": emb} if origin == "ema" else {})})
        if ok:
            assert _check_ties(plan_, src, reader) == ["lm_head.weight"]
        else:
            msg = _raises(CheckpointMismatchError, _check_ties, plan_, src, reader)
            assert msg == (
                f"EMA tensor 'lm_head.weight' is tied to 'emb' by --like's config ({tmp_path / 'like' / 'config.json'}), "
                "but their values differ: the loaded model would hold one value for both, not this EMA. If the model "
                "was trained untied, set tie_word_embeddings to false in --like's config.json and save the output "
                "embedding there"
            )
    # Compared in the dtype written: the holder's EMA differs from the alias's only below bf16's precision.
    swapped = Plan([Item("emb", BF16, (2, 2), "ema", "emb")], [("lm_head.weight", "emb")], "", [])
    assert _check_ties(swapped, _fake_source({"lm_head.weight": emb, "emb": close}), reader) == ["lm_head.weight"]
    # Each side read in its own saved dtype: fp64 values that differ only below fp32's precision still differ.
    emb64 = emb.to(torch.float64)
    fine = emb64 + 1e-12
    assert torch.equal(fine.float(), emb.float()) and not torch.equal(fine, emb64)
    f64 = Plan([Item("emb", torch.float64, (2, 2), "ema", "emb")], [("lm_head.weight", "emb")], "", [])
    for alias, holder in ((fine, emb64), (emb64, fine)):
        src = _fake_source({"lm_head.weight": alias, "emb": holder})
        msg = _raises(CheckpointMismatchError, _check_ties, f64, src, reader)
        assert msg.startswith("EMA tensor 'lm_head.weight' is tied to 'emb' by --like's config")
    assert _check_ties(f64, _fake_source({"lm_head.weight": fine, "emb": fine.clone()}), reader) == ["lm_head.weight"]
    same = _fake_source({"lm_head.weight": emb, "emb": emb, "x": torch.zeros(1)})
    assert _check_ties(Plan([Item("emb", F32, (2, 2), "ema", "emb")], [], "", []), same, reader) == []
    assert _check_ties(
        Plan([Item("E", F32, (2, 2), "ema", "emb")], [("lm_head.weight", "E")], "", []), same, reader
    ) == ["lm_head.weight"]
    like_file.write_bytes(like_file.read_bytes()[:-4])
    msg = _raises(ForeignFileError, reader.read, "emb")
    assert msg.startswith(f"{WHAT}: {like_file}: {like_file} is truncated:")
    like_file.unlink()
    assert _raises(ForeignFileError, reader.read, "emb").startswith(f"{WHAT}: {like_file}: [Errno 2] No such file")


def _entries_any(path: Path) -> dict[str, tuple[Path, _io.TensorEntry]]:
    return dict((n, (path, e)) for n, e in foreign.read_weights_header(path, WHAT).items())


class _Bar:
    def __init__(self) -> None:
        self.seen: list[int] = []

    def update(self, n: int) -> None:
        self.seen.append(n)


def _like_reader(like_file: Path) -> object:
    from functional_ema.export import _Like

    folder = like_file.parent
    entries = _entries_any(like_file)
    return _Like(LikeFolder(folder, folder, "transformers", {}, folder / "config.json", entries, [], []))


A = torch.tensor([[1.0, 2.5, -3.0], [4.0, 1e-3, 6.0]])
N = torch.tensor([7, 8])
FROZEN = torch.tensor([1.5, -2.0, 3.25, 0.0])
PLAN = Plan(
    [
        Item("a", BF16, (2, 3), "ema", "a"),
        Item("n", torch.int64, (2,), "ema", "n"),
        Item("frozen", torch.float16, (4,), "like", "frozen"),
    ],
    [],
    "",
    [],
)
FILES = ["one.safetensors", "two.safetensors"]


def _written(tmp_path: Path) -> tuple[Path, dict, torch.Tensor, _Bar, object]:
    """``PLAN`` written by ``_write`` into ``tmp_path/out``: (folder, checksums, scratch buffer, bar, --like reader)."""
    from functional_ema.export import _scratch, _write

    like_file = tmp_path / "like" / "model.safetensors"
    like_file.parent.mkdir()
    save_file({"frozen": FROZEN}, like_file)
    like = _like_reader(like_file)
    src = _fake_source({"a": A, "n": N})
    buffer = _scratch(PLAN, src)
    out = tmp_path / "out"
    out.mkdir()
    bar = _Bar()
    sums = _write(out, PLAN, [["a", "n"], ["frozen"]], FILES, src, like, {"format": "pt", "x": "{}"}, bar, buffer)
    return out, sums, buffer, bar, like


def test_write_casts_and_checksums_every_tensor_as_planned(tmp_path):
    import xxhash

    from functional_ema.export import _scratch, _write

    out, sums, buffer, bar, like = _written(tmp_path)
    assert buffer.dtype == torch.uint8 and buffer.numel() == (2 * 3 * 4) // 4 * 4 + 4  # fp32 source: the larger
    assert bar.seen == [12, 16, 8]
    assert _same(_read_all(out), {"a": A.to(BF16), "n": N, "frozen": FROZEN.half()})
    assert [_read_all_names(out / f) for f in FILES] == [["a", "n"], ["frozen"]]
    assert _header(out / "one.safetensors")["__metadata__"] == {"format": "pt", "x": "{}"}

    def xxh(t: torch.Tensor) -> list[int]:
        raw = t.view(torch.int16) if t.dtype in (BF16, torch.float16) else t
        return [xxhash.xxh3_64_intdigest(raw.numpy().tobytes())]

    assert sums == {
        "one.safetensors": {"a": xxh(A.to(BF16)), "n": xxh(N)},
        "two.safetensors": {"frozen": xxh(FROZEN.half())},
    }

    # fp16 out of range is refused while writing, before the file is complete.
    big = _fake_source({"a": torch.full((2, 3), 7e4), "n": N})
    plan16 = Plan([Item("a", torch.float16, (2, 3), "ema", "a")], [], "", [])
    args = (out, plan16, [["a"]], ["three.safetensors"], big, like, {}, _Bar(), _scratch(plan16, big))
    msg = _raises(CheckpointMismatchError, _write, *args)
    assert msg.startswith("tensor 'a': 6 value(s) (up to 7e+04 in magnitude) do not fit torch.float16")


def test_read_back_refuses_anything_not_as_planned(tmp_path):
    from functional_ema.export import _read_back

    out, sums, buffer, _, _ = _written(tmp_path)
    assert _read_back(out, PLAN, FILES, sums, buffer) is None

    def refused(plan_x: Plan, files_x: list[str]) -> str:
        return _raises(CheckpointMismatchError, _read_back, out, plan_x, files_x, sums, buffer)

    extra = PLAN._replace(items=[*PLAN.items, Item("x", F32, (1,), "ema", "x"), Item("y", F32, (1,), "ema", "y")])
    assert refused(extra, FILES) == "export self-check: tensors never written: ['x', 'y']"
    assert refused(PLAN, FILES[:1]) == "export self-check: tensors never written: ['frozen']"
    unplanned = "export self-check: one.safetensors holds 'a' torch.bfloat16[2, 3], not as planned"
    assert refused(PLAN._replace(items=PLAN.items[1:]), FILES) == unplanned
    assert refused(PLAN._replace(items=[Item("a", F32, (2, 3), "ema", "a"), *PLAN.items[1:]]), FILES) == unplanned
    assert refused(PLAN._replace(items=[Item("a", BF16, (3, 2), "ema", "a"), *PLAN.items[1:]]), FILES) == unplanned
    twice = "export self-check: two.safetensors holds 'frozen' torch.float16[4], not as planned"
    assert refused(PLAN, [*FILES, "two.safetensors"]) == twice
    raw = bytearray((out / "two.safetensors").read_bytes())
    raw[-1] ^= 0x01
    (out / "two.safetensors").write_bytes(bytes(raw))
    with pytest.raises(_io.FormatError) as info:
        _read_back(out, PLAN, FILES, sums, buffer)
    assert str(info.value).startswith(f"{out / 'two.safetensors'}: checksum mismatch in tensor 'frozen', bytes 0..8")
    assert str(info.value).endswith("export self-check")


def test_scratch_fits_the_largest_tensor_read_or_written():
    from functional_ema.export import _scratch

    src = _fake_source({"a": torch.zeros(3), "b": torch.zeros(5, dtype=torch.float16)})
    cases = (
        ([Item("a", torch.float16, (3,), "ema", "a")], 16),  # 3 x 4 bytes read
        ([Item("b", F32, (5,), "ema", "b")], 24),  # 5 x 4 bytes written
        ([Item("c", BF16, (7,), "like", "c")], 16),  # --like's: its own dtype
        ([Item("a", F32, (3,), "ema", "a"), Item("c", F32, (2, 2), "like", "c")], 20),
        ([], 4),
    )
    for items, nbytes in cases:
        buf = _scratch(Plan(items, [], "", []), src)
        assert (buf.dtype, buf.numel()) == (torch.uint8, nbytes), items
    default = torch.get_default_dtype()
    try:  # the size in bytes, whatever the default dtype
        torch.set_default_dtype(torch.float64)
        assert _scratch(Plan([Item("a", F32, (3,), "ema", "a")], [], "", []), src).numel() == 16
    finally:
        torch.set_default_dtype(default)


def test_record_and_config_of_each_layout(tmp_path):
    from functional_ema._checkpoint.format import library_version
    from functional_ema.export import _record, _write_config

    src = _fake_source({}, {"format": "evil", "step": 3, "source": "s", "dtype": "x", "extra": [1]})
    plan_ = Plan(
        [Item("a", F32, (1,), "ema", "a"), Item("b", F32, (1,), "like", "b"), Item("c", F32, (1,), "like", "c")],
        [("t", "a")],
        "pre",
        ["o"],
    )
    for kind, layout in (("transformers", "transformers"), ("diffusers", "diffusers"), ("peft", "peft")):
        like = _like(tmp_path, kind=kind)._replace(ignored=["z.bin"], folder=tmp_path / "like" / "sub")
        for cast, dtype in ((None, "as saved"), (BF16, "bfloat16"), (torch.float16, "float16")):
            got = _record(src, like, plan_, cast, ["f.safetensors"], {"tied_left_out": ["t"], "prefix_dropped": "x"})
            assert got == {
                "step": 3,
                "source": "s",
                "extra": [1],
                "format": FORMAT,
                "format_version": 2,
                "library": f"functional_ema {library_version()}",
                "dtype": dtype,
                "layout": layout,
                "like": str(tmp_path / "like"),
                "like_folder": str(tmp_path / "like" / "sub"),
                "files": ["f.safetensors"],
                "prefix_dropped": "x",
                "copied_from_like": ["b", "c"],
                "ignored_in_like": ["z.bin"],
                "other_adapters_left_out": ["o"],
                "tied_left_out": ["t"],
            }
            assert list(got)[:3] == ["step", "source", "extra"]
    like = _like(tmp_path)._replace(config={"model_type": "t", "torch_dtype": "float32", "n": [1]})
    for kind, cast in (("transformers", None), ("diffusers", BF16), ("peft", BF16)):
        _write_config(tmp_path, like._replace(kind=kind), cast)
        assert not (tmp_path / "config.json").exists()
    _write_config(tmp_path, like, torch.float16)
    want = {"model_type": "t", "torch_dtype": "float16", "n": [1], "dtype": "float16"}
    assert (tmp_path / "config.json").read_text() == json.dumps(want, indent=2) + "\n"
    assert like.config["torch_dtype"] == "float32"  # --like's own config untouched
    _write_config(tmp_path, like._replace(config={"dtype": "float32", "a": 1}), BF16)
    assert json.loads((tmp_path / "config.json").read_text()) == {"dtype": "bfloat16", "a": 1}


def test_check_peft_compares_the_adapter_with_what_peft_reads(tmp_path):
    pytest.importorskip("peft")
    from functional_ema.export import _check_peft

    like = _peft_like(tmp_path)
    like.folder.mkdir(parents=True)
    lora = {"base_model.model.m.q.lora_A.weight": (4, 8), "base_model.model.m.q.lora_B.weight": (6, 4)}
    plan_ = Plan([Item(n, F32, s, "ema", n) for n, s in lora.items()], [], "", [])
    _write(like.config_file, {"peft_type": "LORA", "r": 4, "target_modules": ["q"]})
    assert _check_peft(like, plan_, "default") == ""
    _write(like.config_file, {"peft_type": "LORA", "r": 2, "target_modules": ["q"]})
    msg = _raises(CheckpointMismatchError, _check_peft, like, plan_)
    assert msg == (
        f"{like.config_file} and the EMA disagree: PEFT, reading this config, expects other adapter weights than the "
        "EMA's (2 name(s), written vs read: base_model.model.m.q.lora_A.weight [4, 8] vs [2, 8]; "
        "base_model.model.m.q.lora_B.weight [6, 4] vs [6, 2]). Give the adapter's own config"
    )
    _write(like.config_file, {"peft_type": "LORA", "r": 4, "target_modules": ["q"], "use_dora": True})
    msg = _raises(CheckpointMismatchError, _check_peft, like, plan_)
    assert "(1 name(s), written vs read: base_model.model.m.q.lora_magnitude_vector not written vs [6])" in msg
    five = Plan(
        [*plan_.items, *[Item(f"base_model.model.h{i}.weight", F32, (2, 2), "ema", "x") for i in range(5)]], [], "", []
    )
    _write(like.config_file, {"peft_type": "LORA", "r": 4, "target_modules": ["q"]})
    msg = _raises(CheckpointMismatchError, _check_peft, like, five)
    assert "(5 name(s), written vs read: base_model.model.h0.weight [2, 2] vs not read; " in msg
    assert "h3.weight [2, 2] vs not read). Give" in msg
    odd = Plan([Item("m.emb.lora_embedding_A", F32, (4, 8), "ema", "x")], [], "", [])
    assert (
        _check_peft(like, odd, "default") == "the adapter has weights other than Linear LoRA, DoRA and modules_to_save"
    )


class _Spy:
    """``functional_ema.checkpoint._progress`` recorded: what the export shows while it writes."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.updates: list[int] = []
        self.closed = 0

    def __call__(self, total: int, enabled: bool | None, desc: str) -> _Spy:
        self.calls.append((total, enabled, desc))
        return self

    def update(self, n: int) -> None:
        self.updates.append(n)

    def close(self) -> None:
        self.closed += 1


def test_to_hf_checks_its_arguments_progress_and_read_back(tmp_path, monkeypatch):
    from functional_ema import checkpoint, export
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like = run["ckpt"], run["like"]
    for kwargs, exc, msg in (
        ({"overwrite": "yes"}, TypeError, "overwrite must be True or False, got str 'yes'"),
        ({"verify": 1}, TypeError, "verify must be True or False, got int 1"),
        ({"progress": "no"}, TypeError, "progress must be True or False, got str 'no'"),
        ({"index": 5}, CheckpointMismatchError, "index=5, but tag 't' holds 2 EMA(s) (valid: 0..1)"),
    ):
        assert _raises(exc, to_hf, ckpt, tmp_path / "bad", like, tag="t", **kwargs) == msg
    assert (
        _raises(TypeError, to_hf, 3, tmp_path / "bad", like)
        == "source (SOURCE) must be a path (a str or os.PathLike), got int 3"
    )
    for out, where in (
        (like / "hf", f"inside {like}"),
        (ckpt / "t" / "hf", f"inside {ckpt}"),
        (ckpt / "t", f"inside {ckpt}"),
        (tmp_path, f"equal to or above {ckpt}"),
    ):
        got = _raises(OutputPathError, to_hf, ckpt, out, like, tag="t")
        assert got.startswith(f"out_dir: refusing to write {out} (-> {out}): it is {where}, which this export reads")
    assert not (tmp_path / "bad").exists() and not (like / "hf").exists()

    spy, read_back = _Spy(), []
    real = export._read_back
    monkeypatch.setattr(checkpoint, "_progress", spy)
    monkeypatch.setattr(export, "_read_back", lambda *a: read_back.append(a[2]) or real(*a))
    to_hf(ckpt, tmp_path / "hf", like, tag="t", max_shard_size=16)
    nbytes = sum(t.numel() * t.element_size() for t in run["want"].values())
    assert spy.calls == [(nbytes, None, "export hf")] and sum(spy.updates) == nbytes and spy.closed == 1
    assert len(spy.updates) == len(run["want"]) and read_back == [
        sorted(p.name for p in (tmp_path / "hf").glob("model-*"))
    ]
    to_hf(ckpt, tmp_path / "hf2", like, tag="t", verify=False, progress=True)
    assert spy.calls[-1] == (nbytes, True, "export hf2") and len(read_back) == 1 and spy.closed == 2


def test_to_hf_peft_adapter_of_a_plain_module(tmp_path):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    import functional_ema as fe
    from functional_ema.export import to_hf

    torch.manual_seed(0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q"], init_lora_weights="gaussian")
    model = get_peft_model(_PeftNet(), config)
    model.save_pretrained(tmp_path / "adapter")
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.mul_(3.0)
    state = fe.update(state, fe.local_shards(model), 2, decay=0.5)
    fe.save(state, model, tmp_path / "ckpt", "p")
    out = to_hf(
        tmp_path / "ckpt", tmp_path / "hf", tmp_path / "adapter", dtype="bf16", max_shard_size=8, progress=False
    )
    names_ = sorted(p.name for p in out.iterdir())
    assert names_ == ["README.md", "adapter_config.json", "adapter_model.safetensors", "ema_export.json"]
    record = json.loads((out / "ema_export.json").read_text())
    assert (
        record["written"] == names_ and record["layout"] == "peft" and record["files"] == ["adapter_model.safetensors"]
    )
    assert record["loader_check"] == {
        "class": "peft",
        "result": "names and shapes as PEFT reads them for this adapter_config.json",
    }
    shapes = {n: p.shape for n, p in model.named_parameters() if p.requires_grad}
    want = {n.replace(".default", ""): state.emas[0][n].reshape(s).to(BF16) for n, s in shapes.items()}
    assert sorted(want) == ["base_model.model.m.q.lora_A.weight", "base_model.model.m.q.lora_B.weight"]
    assert _same(_read_all(out), want)
    assert (out / "adapter_config.json").read_bytes() == (tmp_path / "adapter" / "adapter_config.json").read_bytes()


def test_to_hf_with_a_loader_view_records_the_class_and_leaves_tied_aliases_out(tmp_path):
    pytest.importorskip("transformers")
    from transformers import LlamaForCausalLM

    import functional_ema as fe
    from functional_ema.export import to_hf
    from tests._integration_models import quiet_hf, tiny_llama_config

    quiet_hf()
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tie=True))
    model.save_pretrained(tmp_path / "base")
    state = fe.init_ema(fe.local_shards(model))
    full = {f"_orig_mod.{n}": t.reshape(p.shape) for (n, p), t in zip(model.named_parameters(), state.emas[0].values())}
    full["_orig_mod.lm_head.weight"] = full["_orig_mod.model.embed_tokens.weight"].clone()
    save_file(full, tmp_path / "ema.safetensors", metadata={"format": "functional_ema.export"})
    out = to_hf(tmp_path / "ema.safetensors", tmp_path / "hf", tmp_path / "base", progress=False)
    record = json.loads((out / "ema_export.json").read_text())
    assert record["loader_check"] == {
        "class": "transformers.LlamaForCausalLM",
        "result": "names, shapes and ties as save_pretrained writes them",
    }
    assert record["tied_left_out"] == ["_orig_mod.lm_head.weight"] and record["prefix_dropped"] == ""
    assert _same(_read_all(out), {n.removeprefix("_orig_mod."): t for n, t in full.items() if "lm_head" not in n})
    halves = {n: t.to(BF16) for n, t in full.items()}  # a bf16 source: each tensor read in its own dtype
    save_file(halves, tmp_path / "bf16.safetensors", metadata={"format": "functional_ema.export"})
    out16 = to_hf(tmp_path / "bf16.safetensors", tmp_path / "hf16", tmp_path / "base", progress=False)
    assert _same(_read_all(out16), {n.removeprefix("_orig_mod."): t for n, t in halves.items() if "lm_head" not in n})
    full["_orig_mod.lm_head.weight"] += 1.0
    save_file(full, tmp_path / "untied.safetensors", metadata={"format": "functional_ema.export"})
    msg = _raises(CheckpointMismatchError, to_hf, tmp_path / "untied.safetensors", tmp_path / "hf2", tmp_path / "base")
    assert msg.startswith("EMA tensor '_orig_mod.lm_head.weight' is tied to 'model.embed_tokens.weight' by --like's")
    assert not (tmp_path / "hf2").exists()


def test_to_hf_verifies_the_checkpoint_it_reads(tmp_path):
    from functional_ema._checkpoint.errors import CorruptCheckpointError
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    for name in ("ema_rank_00000_of_00001.safetensors", "buffers_rank_00000_of_00001.safetensors"):
        path = ckpt / "t" / name
        good = path.read_bytes()
        raw = bytearray(good)
        raw[-1] ^= 0x40  # the last tensor's last byte: the size and header stay right
        path.write_bytes(bytes(raw))
        msg = _raises(CorruptCheckpointError, to_hf, ckpt, tmp_path / "bad", like, tag="t", index=1)
        assert str(path) in msg and "checksum" in msg, msg
        assert not (tmp_path / "bad").exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
        out = to_hf(ckpt, tmp_path / f"unverified_{name}", like, tag="t", index=1, verify=False)
        got = _read_all(out)
        assert sorted(got) == sorted(want) and sum(not torch.equal(got[n], want[n]) for n in want) == 1
        path.write_bytes(good)


def test_to_hf_two_shards_tp_dims_and_failures_while_writing(tmp_path, monkeypatch):
    from functional_ema import export
    from functional_ema.export import to_hf

    run = _tiny_run(tmp_path)
    ckpt, like, want = run["ckpt"], run["like"], run["want"]
    # 72 bytes in fp32, at most 40 a shard: 24 + 8 + 8, then 4 x 8. Two shards: an index too.
    out = to_hf(ckpt, tmp_path / "two", like, tag="t", index=1, max_shard_size=40, progress=False)
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert sorted(p.name for p in out.glob("model*")) == [*files, "model.safetensors.index.json"]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == 72 and sorted(set(index["weight_map"].values())) == files
    assert _same(_read_all(out), want)
    for tp_dims, msg in (
        ({"nope": 0}, "tp_dims names 'nope', which is not a parameter of tag 't'"),
        ({"lin.weight": 5}, "tp_dims['lin.weight']=5: parameter 'lin.weight' has 2 dimension(s)"),
    ):
        got = _raises(CheckpointMismatchError, to_hf, ckpt, tmp_path / "bad", like, tag="t", tp_dims=tp_dims)
        assert got.startswith(msg), got

    # out_dir filled by someone else while the export ran: refused naming it, theirs kept, ours removed.
    real_new_tmp_dir = export.new_tmp_dir

    def racing(real_out: Path) -> Path:
        tmp = real_new_tmp_dir(real_out)
        real_out.mkdir()
        (real_out / "theirs.txt").write_text("theirs")
        return tmp

    monkeypatch.setattr(export, "new_tmp_dir", racing)
    given = tmp_path / "raced"
    msg = _raises(OutputPathError, to_hf, ckpt, given, like, tag="t", progress=False)
    assert msg == f"out_dir: {given} was filled while the export ran; it is left as it is"
    assert _listing(given) == {"theirs.txt": b"theirs"} and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    monkeypatch.setattr(export, "new_tmp_dir", real_new_tmp_dir)

    # A temporary folder that cannot be removed after a failure does not hide the failure.
    huge = tmp_path / "huge.safetensors"
    save_file({**want, "lin.weight": torch.full((2, 3), 1e5)}, huge, metadata={"format": "functional_ema.posthoc"})
    monkeypatch.setattr(shutil, "rmtree", _failing_rmtree)
    msg = _raises(CheckpointMismatchError, to_hf, huge, tmp_path / "fp16", like, dtype="fp16", progress=False)
    assert msg.startswith("tensor 'lin.weight': 6 value(s)")


def test_to_hf_peft_loader_check_and_refusal(tmp_path, monkeypatch):
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    import functional_ema as fe
    from functional_ema.export import to_hf

    torch.manual_seed(0)
    model = get_peft_model(_PeftNet(), LoraConfig(r=4, lora_alpha=8, target_modules=["q"]))
    model.save_pretrained(tmp_path / "adapter")
    fe.save(fe.init_ema(fe.local_shards(model)), model, tmp_path / "ckpt", "p")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    _write(tmp_path / "adapter" / "adapter_config.json", {**config, "use_dora": False, "r": 2})  # not the EMA's rank
    msg = _raises(CheckpointMismatchError, to_hf, tmp_path / "ckpt", tmp_path / "hf", tmp_path / "adapter")
    assert msg.startswith(f"{tmp_path / 'adapter' / 'adapter_config.json'} and the EMA disagree: PEFT, reading this")
    assert not (tmp_path / "hf").exists()
    _without(monkeypatch, "peft")  # no PEFT to check with: the export says so in its record
    out = to_hf(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "adapter", progress=False)
    record = json.loads((out / "ema_export.json").read_text())
    assert record["loader_check"] == {"class": None, "result": "not run: peft is not installed"}


class _PeftNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.m = torch.nn.ModuleDict({"q": torch.nn.Linear(8, 6), "k": torch.nn.Linear(8, 6)})
