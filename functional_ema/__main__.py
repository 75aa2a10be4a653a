"""Command line: ``python -m functional_ema <command> ...`` (also installed as ``functional-ema``).

Commands:
    consolidate CHECKPOINT_DIR OUT.safetensors [--tag T] [--index K] [--tp-dim NAME=DIM ... | --tp-rank R]
            [--storage-options JSON]
        Rebuild full EMA weights from the per-rank files of a checkpoint, with no GPU and no process
        group, streaming: peak memory is about the largest single parameter. Pipeline stages go into
        one file; tensor-parallel slices are joined where the split is known, else written one file
        per tensor-parallel rank (OUT.tp<r>of<T>.safetensors). CHECKPOINT_DIR may be an fsspec URL
        (s3://...), read in place with --storage-options (else fsspec's configuration).
    consolidate --dcp DCP_DIR OUT.safetensors [--key ema] [--index K] [--no-verify]
        The same from a torch.distributed.checkpoint folder holding an fe.dcp.EMAStateful, every row's
        checksum verified (--no-verify skips that; --tag, --tp-dim, --tp-rank are refused).
    export SOURCE OUT_DIR --like HF_MODEL_DIR [--dtype bf16] [--max-shard-size 5GB] [--index K] [--tag T]
            [--storage-options JSON]
        Write the EMA as a Hugging Face model folder (sharded safetensors + index, config and tokenizer
        files copied from --like) that from_pretrained loads; or, when --like is a PEFT adapter folder,
        as a PEFT adapter folder. SOURCE: a checkpoint, or a consolidated .safetensors file this library
        wrote, or either at an fsspec URL (s3://..., with --storage-options); for a file, --tag and --index are
        omitted or the file's own. The export checks itself (docs/shipping.md) and refuses rather than ship anything but the EMA;
        --overwrite replaces only a previous export or an empty folder.
    posthoc SNAPSHOT_DIR OUT.safetensors (--sigma-rel S | --gamma G) [--step N] [--plot PNG] [--storage-options JSON]
        Synthesise the post-hoc EMA of any length from power-EMA snapshots (functional_ema.posthoc).
        SNAPSHOT_DIR may be an fsspec URL (s3://...). --plot follows OUT's rules (never inside the snapshots, an
        existing file only with --overwrite), checked with every other option before anything is read.

--storage-options JSON: a JSON object of fsspec arguments for a URL source ({"endpoint_url": ..., "key": ...,
"secret": ...}), passed to the verb's storage_options=; refused with a local source. Without it, fsspec's
configuration (FSSPEC_S3_* variables, the filesystem's own, e.g. AWS_*) is used; prefer that for secrets, which
on a command line are visible to other users of the machine.

Adding a command: write ``_add_<name>(subparsers)`` that registers a parser with
``set_defaults(run=<function taking the parsed args, returning an exit code>)`` and append it to
``_COMMANDS``.

Every path argument (CHECKPOINT_DIR, SNAPSHOT_DIR, SOURCE, OUT, OUT_DIR, --like, --plot) takes a leading ``~`` as the
user's home (``os.path.expanduser``), quoted or not (``~name`` of no user is refused, unless a file or folder of that
name is in the current folder); ``file://~/x`` names a host ``~`` and is refused. OUT (and --plot) at or inside the
checkpoint or snapshot folder given (with a tag folder given: its root itself, a pointer file there such as
``latest`` or another tag folder, as the library refuses them), or in a folder not writable, is a usage error; so is
export's OUT_DIR at, inside or above SOURCE or --like, the current or home folder or above, under a file, or in a
folder not writable.

Exit codes: 0 success, 1 checkpoint or reconstruction error (message on stderr), 2 usage error (an existing OUT
without --overwrite, or a folder where a file is due, included: checked before any tensor is read), 130 interrupted
(Ctrl-C: one line saying of each output whether it is complete and kept, the previous file unchanged, or not
written, from what changed on disk since the command began; then killed by SIGINT), 143 terminated (SIGTERM, as
sent by timeout, Slurm or Kubernetes: the same cleanup and line, then killed by SIGTERM, status 143 in a shell;
``main()`` called by another program ends its process so too, as SIGTERM's default action would).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .posthoc import DEFAULT_MAX_PROFILE_ERROR, SNAPSHOT_PREFIX

if TYPE_CHECKING:
    # what add_subparsers returns (argparse's own, private, name for it)
    _Subparsers = argparse._SubParsersAction[argparse.ArgumentParser]


def _user_path(text: str) -> str:
    """A path argument as it enters: a leading ``~`` or ``~user`` expanded (``os.path.expanduser``), as a shell
    does unquoted; a quoted one, or one from a config file, would otherwise name a folder ``~`` in the current
    directory (``export`` made ``./~/hf``). A URL never starts with ``~``; ``file://~/x`` names the host ``~``
    and is refused as such (a URL is not a shell word). ``~name`` for no user ``name`` is left as a shell leaves
    it where a file or folder of that name is in the current folder, else refused as the usage error it is (the
    library's hint, "'~' is not expanded here", would suggest the same path)."""
    if not text.startswith("~"):
        return text
    path = os.path.expanduser(text)
    first = text.split("/", 1)[0]
    if path == text and not os.path.lexists(first):
        user = first[1:]
        raise argparse.ArgumentTypeError(
            f"{text!r}: there is no user {user!r} (a leading {first} is that user's home); write the path out"
            if user
            else f"{text!r}: the home folder is unknown (HOME is not set); write the path out"
        )
    return path


def _add_input_output(p: argparse.ArgumentParser, source: str, source_help: str) -> None:
    """The arguments every command shares: where to read, the .safetensors file to write."""
    p.add_argument(source, type=_user_path, help=source_help)
    p.add_argument(
        "out",
        type=_user_path,
        help="output .safetensors file (written atomically; never inside the checkpoint being read)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT if it exists (atomically); refused otherwise, also for a file that appears at OUT while this "
        "runs (kept, and nothing written)",
    )
    p.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the checksum checks (XXH3-64; CRC-32 for format-1 checkpoints) of the bytes read",
    )


def _storage_options(text: str) -> dict[str, Any]:
    """``--storage-options``'s value: a JSON object (fsspec's arguments), checked where it enters; argparse names
    the flag in the error. The text is never echoed (it may hold a secret)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(
            f"not JSON ({e.msg} at character {e.pos}): give a JSON object of fsspec arguments, e.g. "
            '\'{"endpoint_url": "http://127.0.0.1:8333"}\''
        ) from None
    if not isinstance(value, dict):
        kind = {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
        raise argparse.ArgumentTypeError(
            f'expected a JSON object of fsspec arguments ({{"key": ..., "secret": ...}}), got a JSON {kind}'
        )
    return value


def _add_storage_options(p: argparse.ArgumentParser, source: str) -> None:
    p.add_argument(
        "--storage-options",
        type=_storage_options,
        default=None,
        metavar="JSON",
        help=f"for a URL {source} (s3://...): fsspec's arguments as a JSON object, e.g. "
        '\'{"endpoint_url": "http://...", "key": "...", "secret": "..."}\' (default: fsspec\'s configuration, e.g. '
        "FSSPEC_S3_* variables, which keep secrets out of the process list); refused with a local path",
    )


def _refuse_local_options(args: argparse.Namespace, source: str, what: str) -> None:
    """``ValueError`` when ``--storage-options`` is given with a local ``source`` (named ``what``): nothing reads them."""
    from ._storage import is_url

    if args.storage_options is not None and not is_url(source):
        raise ValueError(f"--storage-options are for a URL {what} (s3://...); {source!r} is a local path")


def _add_consolidate(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "consolidate",
        help="write full EMA weights of a checkpoint into one .safetensors file",
        description=(
            "Rebuild full EMA weights from the ema_rank_*.safetensors files that functional_ema.save wrote beside "
            "DeepSpeed's checkpoint, and stream them into one safetensors file whose names are the module's "
            "parameter names. Needs no GPU and no process group. Peak memory is about the largest single "
            "parameter (the header is written first, then one tensor at a time)."
        ),
    )
    _add_input_output(p, "checkpoint_dir", "DeepSpeed checkpoint directory (holding 'latest'), or one tag folder")
    p.add_argument("--tag", default=None, help="tag folder to read (default: the one named in CHECKPOINT_DIR/latest)")
    p.add_argument("--index", type=int, default=0, help="which EMA, when several were tracked (default 0)")
    tp = p.add_mutually_exclusive_group()
    tp.add_argument(
        "--tp-dim",
        action="append",
        default=None,
        metavar="NAME=DIM",
        help="tensor-parallel checkpoints whose split the engine did not record (a plain mpu=): join NAME's "
        "slices along DIM ('none' for a parameter replicated across the ranks); give one per parameter",
    )
    tp.add_argument(
        "--tp-rank",
        type=int,
        default=None,
        help="tensor-parallel checkpoints: write this rank's slices as they are, not joined",
    )
    _add_storage_options(p, "CHECKPOINT_DIR")
    p.add_argument(
        "--dcp",
        action="store_true",
        help="CHECKPOINT_DIR is a torch.distributed.checkpoint folder holding an fe.dcp.EMAStateful (its .metadata "
        "pickle is read with an allow-list of DCP's classes; every row's XXH3-64 checksum is verified unless "
        "--no-verify; --tag, --tp-dim and --tp-rank do not apply)",
    )
    p.add_argument(
        "--key", default=None, help="with --dcp: the state-dict key the EMAStateful was saved under (default 'ema')"
    )
    bar = p.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress", dest="progress", action="store_true", default=None, help="always show a progress bar"
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    p.set_defaults(run=_run_consolidate)


def _consolidate_usage(args: argparse.Namespace) -> Path:
    """OUT as a local path, after the usage errors found before anything is read (``ValueError`` naming the
    argument): a URL where a local path is taken, local-only options with a URL, OUT in a missing or unwritable
    folder or at or inside the checkpoint read; OUT a folder, or an existing file without --overwrite, where OUT is
    the file written (``--dcp``, ``--tp-dim`` or ``--tp-rank``: else a tag saved tensor-parallel with no recorded split
    writes one file per rank instead, each checked once the manifest names them, and OUT itself is left alone)."""
    from ._args import check_path, refuse_url
    from ._checkpoint.format import check_out_folder

    # before any Path() of them: Path("s3://b/x") is the local folder s3:/b/x
    refuse_url(args.out, "OUT", "the file is written locally; upload it afterwards")
    if args.dcp:
        refuse_url(args.checkpoint_dir, "CHECKPOINT_DIR", "--dcp reads a local folder")
    _refuse_local_options(args, args.checkpoint_dir, "CHECKPOINT_DIR")
    _refuse_mistyped_url(args.checkpoint_dir, "CHECKPOINT_DIR")
    out = check_path(args.out, "OUT")  # a file:///abs/o.safetensors URL is the file it names
    check_out_folder(out, "OUT")  # else found last, after the checkpoint was read, naming a temporary file
    if args.dcp:
        _refuse_inside(out, "OUT", args.checkpoint_dir, "CHECKPOINT_DIR", "DCP checkpoint")
    else:  # a tag folder given as CHECKPOINT_DIR (its manifest there, no --tag) is read with its root above it
        _refuse_inside(out, "OUT", args.checkpoint_dir, "CHECKPOINT_DIR", "checkpoint", args.tag is None)
    if args.dcp or args.tp_dim or args.tp_rank is not None:  # OUT is the one file written
        _refuse_existing(out, "OUT", args.overwrite)
    return out


def _refuse_existing(out: Path, what: str, overwrite: bool) -> None:
    """A usage error (``ValueError`` naming ``what`` and the fix) for an output file that is a folder, or that exists
    without ``overwrite``: the library refuses both too, but only once the source is read (exit 1). A file that
    appears while the command runs is still the library's to keep (exit 1)."""
    if out.is_dir():
        raise ValueError(f"{what}: refusing to write {out}: it is a folder; name the .safetensors file to write")
    if not overwrite and (out.exists() or out.is_symlink()):
        raise ValueError(
            f"{what}: refusing to replace the existing file {out}: pass --overwrite to replace it (atomically), or "
            "choose another name"
        )


def _run_consolidate(args: argparse.Namespace) -> int:
    import time

    from safetensors import safe_open

    from .checkpoint import consolidate_to_file

    t0 = time.perf_counter()
    try:
        out = _consolidate_usage(args)
        tp_dims = None if args.dcp else _consolidate_options(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.dcp:
        return _run_consolidate_dcp(args, out, t0)
    ranks, outs = _consolidate_outputs(args, out, tp_dims)
    try:  # the files written are known only now (the tag's manifest, no tensor read): refused as OUT is, none written
        for path in outs:
            _refuse_existing(path, "OUT", args.overwrite)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.outputs.expect(*outs)  # before the first is written: Ctrl-C's message compares them
    for rank, path in zip(ranks, outs):
        written = consolidate_to_file(
            args.checkpoint_dir,
            path,
            args.tag,
            index=args.index,
            verify=not args.no_verify,
            progress=args.progress,
            overwrite=args.overwrite,
            tp_dims=tp_dims,
            tp_rank=rank,
            storage_options=args.storage_options,
        )
        with safe_open(str(written), framework="pt") as f:
            meta, n = f.metadata() or {}, len(list(f.keys()))
        size = written.stat().st_size
        print(
            f"wrote {written}: {n} tensors, {size / 2**20:.1f} MiB, EMA {meta.get('ema_index')} of tag {meta.get('tag')!r} "
            f"(step {meta.get('step')}){'' if rank is None else f', tensor-parallel rank {rank}'} in "
            f"{time.perf_counter() - t0:.2f} s"
        )
    return 0


def _consolidate_options(args: argparse.Namespace) -> dict[str, int | None] | None:
    """``consolidate``'s options without ``--dcp`` checked (``ValueError`` naming the flag: a usage error, one line,
    exit 2, no traceback); returns ``--tp-dim``'s values as ``tp_dims``."""
    if args.key is not None:
        raise ValueError("--key applies only with --dcp")
    for flag, value, what in (("--index", args.index, "an EMA index"), ("--tp-rank", args.tp_rank, "a rank")):
        if value is not None and not 0 <= value < 2**63:
            raise ValueError(f"{flag} is {what} (0 to 2**63 - 1), got {value}")
    return _tp_dims(args.tp_dim) if args.tp_dim else None


def _consolidate_outputs(
    args: argparse.Namespace, out: Path, tp_dims: dict[str, int | None] | None
) -> tuple[list[int | None], list[Path]]:
    """(tensor-parallel ranks, files) to write: OUT, or, for a tag saved tensor-parallel with no recorded split and
    no --tp-dim/--tp-rank, one file per tensor-parallel rank (said on stdout)."""
    from .checkpoint import saved_parts

    saved = saved_parts(args.checkpoint_dir, args.tag, storage_options=args.storage_options)
    if not (tp_dims is None and args.tp_rank is None and saved.tp_size > 1 and not saved.tp_split_known):
        return [args.tp_rank], [out]
    # how the tensor-parallel slices join is unknown: one file per tensor-parallel rank
    print(
        f"tag saved with tensor-parallel size {saved.tp_size} and no recorded split: writing one file per "
        "tensor-parallel rank (join them with --tp-dim NAME=DIM ...)"
    )
    return list(range(saved.tp_size)), [_per_rank_name(out, t, saved.tp_size) for t in range(saved.tp_size)]


def _run_consolidate_dcp(args: argparse.Namespace, out: Path, t0: float) -> int:
    import time

    from ._args import check_path
    from ._io import write_tensors
    from .dcp import _consolidate

    given = [
        flag
        for flag, value in (("--tag", args.tag), ("--tp-dim", args.tp_dim), ("--tp-rank", args.tp_rank))
        if value is not None
    ]
    if given:
        print(
            f"error: {' and '.join(given)} {'does' if len(given) == 1 else 'do'} not apply with --dcp (a DCP "
            "checkpoint has no tags, and DCP joins tensor-parallel pieces itself)",
            file=sys.stderr,
        )
        return 2
    if args.index < 0:
        print(f"error: --index is an EMA index (>= 0), got {args.index}", file=sys.stderr)
        return 2
    try:
        src = check_path(args.checkpoint_dir, "CHECKPOINT_DIR")  # a file:///abs/dcp URL is the folder it names
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    key = "ema" if args.key is None else args.key
    full, step = _consolidate(src, key, args.index, not args.no_verify)
    meta = {"format": "functional_ema.export", "source": "dcp", "ema_index": str(args.index), "step": str(step)}
    args.outputs.expect(out)
    write_tensors(out, full, meta, replace=args.overwrite)  # without it, a file that appeared at OUT meanwhile is kept
    print(
        f"wrote {out}: {len(full)} tensors, {out.stat().st_size / 2**20:.1f} MiB, EMA {args.index} of DCP key "
        f"{key!r} (step {step}){'' if not args.no_verify else ', checksums not verified (--no-verify)'} in "
        f"{time.perf_counter() - t0:.2f} s"
    )
    return 0


def _tp_dims(items: list[str]) -> dict[str, int | None]:
    """``--tp-dim``'s values as ``tp_dims``; ``ValueError`` naming the flag for a malformed one."""
    out: dict[str, int | None] = {}
    for item in items:
        name, sep, dim = item.rpartition("=")
        # ASCII digits only: str.isdigit also takes '²', which int() refuses
        if not sep or not name or not ((dim.isascii() and dim.isdigit()) or dim.lower() == "none"):
            raise ValueError(f"--tp-dim takes NAME=DIM (DIM an int >= 0 or 'none'), got {item!r}")
        out[name] = None if dim.lower() == "none" else int(dim)
    return out


def _per_rank_name(out: Path, rank: int, size: int) -> Path:
    """``ema.safetensors`` -> ``ema.tp0of2.safetensors``."""
    stem, suffix = (
        (out.name[: -len(".safetensors")], ".safetensors") if out.name.endswith(".safetensors") else (out.name, "")
    )
    return out.with_name(f"{stem}.tp{rank}of{size}{suffix}")


def _add_posthoc(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "posthoc",
        help="synthesise the EMA of any sigma_rel from power-EMA snapshots into one .safetensors file",
        description=(
            "Post-hoc EMA (Karras et al. 2024): combine the snapshots that posthoc.save_snapshot wrote (one "
            "safetensors file per rank per snapshot) into the EMA of the requested sigma_rel or gamma at the "
            "requested step, by a float64 least-squares fit of the power-EMA averaging profiles. Needs no GPU "
            "and no process group."
        ),
    )
    _add_input_output(p, "snapshot_dir", "directory holding the snapshot_<step> folders, or its URL (s3://...)")
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--sigma-rel", type=float, help="EMA width relative to the step, e.g. 0.15")
    target.add_argument("--gamma", type=float, help="power-EMA exponent instead of --sigma-rel")
    p.add_argument("--step", type=int, default=None, help="step to reconstruct at (default: the last snapshot)")
    p.add_argument(
        "--max-profile-error",
        type=float,
        default=DEFAULT_MAX_PROFILE_ERROR,
        help=f"refuse targets whose averaging profile is off by more than this (relative L2, default {DEFAULT_MAX_PROFILE_ERROR})",
    )
    p.add_argument(
        "--plot",
        metavar="PNG",
        type=_user_path,
        default=None,
        help="also save the synthesised vs requested profile (needs matplotlib; the format is the extension, .png "
        "appended to a name without one; an existing file only with --overwrite)",
    )
    p.add_argument(
        "--prefix", default=SNAPSHOT_PREFIX, help=f"tag prefix of the snapshot folders (default {SNAPSHOT_PREFIX!r})"
    )
    _add_storage_options(p, "SNAPSHOT_DIR")
    p.set_defaults(run=_run_posthoc)


def _run_posthoc(args: argparse.Namespace) -> int:
    from safetensors import safe_open

    from ._args import check_path
    from ._posthoc.plot import draw_profile
    from .posthoc import list_snapshots, posthoc_to_file

    try:  # every option checked before any snapshot is read: a usage error is one line and exit 2
        plot = _posthoc_usage(args)
    except (ValueError, TypeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.outputs.expect(check_path(args.out, "OUT"), *([] if plot is None else [plot]))
    out = posthoc_to_file(
        args.snapshot_dir,
        args.out,
        sigma_rel=args.sigma_rel,
        gamma=args.gamma,
        step=args.step,
        max_profile_error=args.max_profile_error,
        verify=not args.no_verify,
        prefix=args.prefix,
        overwrite=args.overwrite,
        storage_options=args.storage_options,
    )
    with safe_open(str(out), framework="pt") as f:
        meta = f.metadata() or {}
    print(
        f"wrote {out}: post-hoc EMA sigma_rel={float(meta['sigma_rel']):.4g} (gamma={float(meta['gamma']):.4g}) at step "
        f"{meta['step']} from {meta['num_snapshots']} snapshots; profile error {float(meta['profile_error']):.2e}"
    )
    if plot is not None:
        infos = list_snapshots(args.snapshot_dir, prefix=args.prefix, storage_options=args.storage_options)
        gammas = [g for i in infos for g in i.gammas]
        steps = [i.step for i in infos for _ in i.gammas]
        # without --overwrite, a file that appears at --plot meanwhile is kept
        draw_profile(gammas, steps, plot, gamma=float(meta["gamma"]), step=int(meta["step"]), replace=args.overwrite)
        print(f"wrote {plot}")
    return 0


def _refuse_inside(out: Path, what: str, source: str, source_name: str, kind: str, tag_folder: bool = False) -> None:
    """A usage error (``ValueError`` naming ``what``, ``out`` and the folder) for an output at or inside the local
    folder ``source`` being read, checked before anything is read (``check_outside``). With ``tag_folder``, when
    ``source`` is a tag folder (:func:`_tag_roots`), its root is held to what the library refuses there (the root,
    its pointer files, its tag folders), no more. A URL source has no local folder to keep out of."""
    from ._args import check_path
    from ._checkpoint.errors import OutputPathError
    from ._checkpoint.format import check_outside
    from ._storage import is_url

    if is_url(source):
        return
    src = check_path(source, source_name)  # a file:///abs/dir URL is the folder it names
    roots = _tag_roots(src) if tag_folder else []
    try:
        check_outside(out, src, f"{kind} {src} ({source_name})", roots)
    except OutputPathError as e:  # a usage error, named once
        raise ValueError(f"{what}: {e}") from None
    for folder in (src, *roots):
        _refuse_in_linked_tag(out, what, folder, f"{kind} {folder}")


def _refuse_in_linked_tag(out: Path, what: str, root: Path, kind: str) -> None:
    """A usage error for an output inside a tag folder of ``root`` that is a link leading elsewhere (``ck/t1 ->
    ../other/t1``): ``check_outside`` compares resolved paths and so misses it, while the reader reads the tag through
    the link, and nothing later refuses the output: it would be written into the other checkpoint's tag folder. Found
    as the path is typed (``os.path.abspath``: ``ck/t1/x``) and however it is spelled (``ck_link/t1/x``,
    ``../other/t1/x``: resolved, against each link of the resolved root). A folder of another kind (``ck/exports``, a
    link to another disk) stays open."""
    from ._checkpoint.format import _looks_like_tag, _outside_fix

    typed, base = Path(os.path.abspath(out)), Path(os.path.abspath(root))
    first = base / typed.relative_to(base).parts[0] if base in typed.parents else None
    if first is None or first == typed or not _looks_like_tag(first):
        first = _linked_tag_holding(out, root)
    if first is not None:
        real = Path(os.path.realpath(first))
        link = f" (a link to {real})" if real != first else ""
        raise ValueError(
            f"{what}: refusing to write {out}: it is inside the tag folder {first}{link} of the {kind} being read, "
            f"and would add to or replace that checkpoint's files. {_outside_fix(out, Path(root).resolve())}"
        )


def _linked_tag_holding(out: Path, root: Path) -> Path | None:
    """The entry of ``root`` (resolved) that is a link to a tag folder holding ``out`` (resolved), or None."""
    from ._checkpoint.format import _looks_like_tag

    real_out, real_root = Path(os.path.realpath(out)), Path(os.path.realpath(root))
    try:
        entries = [e for e in real_root.iterdir() if e.is_symlink()]
    except OSError:  # not a folder (a missing root is the reader's to name)
        return None
    for entry in entries:
        if Path(os.path.realpath(entry)) in real_out.parents and _looks_like_tag(entry):
            return entry
    return None


def _tag_roots(local: Path) -> list[Path]:
    """The checkpoint roots above ``local`` when it is a tag folder (its manifest there: the reader and ``to_hf``,
    handed it with no tag, read it with its root above it): the parent of the path as typed
    (``os.path.abspath``, as they take it: a link's own folder) and, where a link leads elsewhere, its target's.
    [] for any other path."""
    from ._checkpoint.format import MANIFEST_NAME

    if not (local / MANIFEST_NAME).is_file():
        return []
    return list(dict.fromkeys([Path(os.path.abspath(local)).parent, Path(os.path.realpath(local)).parent]))


def _refuse_mistyped_url(location: str, name: str) -> None:
    """A usage error (``ValueError`` naming the argument) for a path that looks like a URL missing a slash
    (``s3:/bucket/run``), checked with the other options: the verbs refuse it too, later, as a traceback."""
    from ._storage import refuse_mistyped_url

    try:
        refuse_mistyped_url(location)
    except ValueError as e:
        raise ValueError(f"{name}: {e}") from None


def _posthoc_usage(args: argparse.Namespace) -> Path | None:
    """``posthoc``'s options checked (``ValueError``/``TypeError`` naming the option; ``ImportError`` for ``--plot``
    without matplotlib); returns the file ``--plot`` will write (a name without extension gets ``.png``), or None."""
    from ._args import check_int, check_path, check_real, refuse_url
    from ._checkpoint.errors import OutputPathError
    from ._checkpoint.format import check_out_folder, check_output
    from ._posthoc.plot import plot_file
    from ._posthoc.profiles import target_gamma
    from ._storage import is_url

    # before any Path() of them: Path("s3://b/x") is the local folder s3:/b/x
    refuse_url(args.out, "OUT", "the file is written locally; upload it afterwards")
    refuse_url(args.plot, "--plot", "the picture is written locally")
    _refuse_local_options(args, args.snapshot_dir, "SNAPSHOT_DIR")
    _refuse_mistyped_url(args.snapshot_dir, "SNAPSHOT_DIR")
    out = check_path(args.out, "OUT")
    check_out_folder(out, "OUT")  # else found last, after every snapshot was read, naming a temporary file
    _refuse_inside(out, "OUT", args.snapshot_dir, "SNAPSHOT_DIR", "snapshot folder")
    _refuse_existing(out, "OUT", args.overwrite)
    try:
        target_gamma(args.sigma_rel, args.gamma)
    except ValueError as e:
        raise ValueError(f"{'--sigma-rel' if args.gamma is None else '--gamma'}: {e}") from None
    if args.step is not None and args.step < 1:  # a power EMA has no profile before step 1
        raise ValueError(f"--step must be >= 1 (a training step with snapshots at or before it), got {args.step}")
    if args.step is not None:  # a step is an int64 (update's rule), as posthoc_to_file refuses it later
        check_int(args.step, "--step")
    check_real(args.max_profile_error, "--max-profile-error", low=0.0)
    if args.plot is None:
        return None
    plot, _ = plot_file(args.plot, "--plot")
    parent = plot.parent if str(plot.parent) else Path(".")
    if not parent.is_dir():
        raise ValueError(f"--plot: the folder {parent} of {plot} does not exist")
    if plot.resolve() == out.resolve():
        raise ValueError(f"--plot {plot} is OUT: the picture and the weights need two files")
    # OUT's rules (never inside the snapshots, an existing file only with --overwrite): a usage error too
    _refuse_inside(plot, "--plot", args.snapshot_dir, "SNAPSHOT_DIR", "snapshot folder")
    snapshots = args.snapshot_dir if is_url(args.snapshot_dir) else check_path(args.snapshot_dir, "SNAPSHOT_DIR")
    try:
        check_output(plot, snapshots, [], args.overwrite, "--plot")
    except OutputPathError as e:  # named once: some of check_output's messages start with what they check
        raise ValueError(str(e) if str(e).startswith("--plot") else f"--plot: {e}") from None
    return plot


def _add_export(subparsers: _Subparsers) -> None:
    p = subparsers.add_parser(
        "export",
        help="write the EMA as a Hugging Face model folder (or PEFT adapter folder) that from_pretrained loads",
        description=(
            "Stream one EMA of a checkpoint (any layout) or of a consolidated .safetensors file into OUT_DIR as "
            "safetensors shards named as save_pretrained names them, with model.safetensors.index.json when "
            "sharded, every non-weight file of --like (config.json, generation_config.json, tokenizer files) "
            "copied, and ema_export.json recording which EMA it is. Peak memory is about one tensor."
        ),
    )
    p.add_argument(
        "source",
        type=_user_path,
        help="checkpoint directory (or tag folder), or a consolidated .safetensors file this library wrote",
    )
    p.add_argument(
        "out_dir",
        type=_user_path,
        help="folder to create (built under a temporary name, renamed when complete); never the current folder or above",
    )
    p.add_argument(
        "--like", required=True, type=_user_path, help="the model's save_pretrained folder, or a PEFT adapter folder"
    )
    p.add_argument(
        "--tag",
        default=None,
        help="tag folder to read (default: the one named in 'latest'); for a .safetensors SOURCE, omit it or give "
        "the file's own tag (refused otherwise)",
    )
    p.add_argument(
        "--index",
        type=int,
        default=None,
        help="which EMA, when several were tracked (default 0); for a .safetensors SOURCE (one EMA), omit it or give "
        "the file's own ema_index (refused otherwise)",
    )
    p.add_argument("--dtype", default=None, help="fp32, bf16 or fp16 for floating tensors (default: as saved)")
    p.add_argument("--max-shard-size", default="5GB", help="most bytes per shard, e.g. 5GB, 500MB (default 5GB)")
    p.add_argument(
        "--missing",
        choices=("like", "error"),
        default="like",
        help="weights of --like the EMA lacks (frozen ones): copy them from --like (default) or refuse",
    )
    p.add_argument(
        "--adapter-name",
        default="default",
        help="PEFT: the adapter the EMA was trained as (a non-default one is read from LIKE/<name>/, as PEFT saves it)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="replace OUT_DIR as a whole when it is a previous export (never a folder this tool did not write)",
    )
    p.add_argument("--no-verify", action="store_true", help="skip the checksum checks of the bytes read")
    _add_storage_options(p, "SOURCE")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show a bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    p.set_defaults(run=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    import time

    from .checkpoint import CheckpointError
    from .export import EXPORT_RECORD, to_hf

    t0 = time.perf_counter()
    try:
        _refuse_local_options(args, args.source, "SOURCE")
        out_dir = _export_out_place(args)
        if out_dir is not None:
            args.outputs.expect(out_dir)
        out = to_hf(
            args.source,
            args.out_dir,
            args.like,
            tag=args.tag,
            index=args.index,
            dtype=args.dtype,
            max_shard_size=args.max_shard_size,
            missing=args.missing,
            adapter_name=args.adapter_name,
            overwrite=args.overwrite,
            verify=not args.no_verify,
            progress=args.progress,
            storage_options=args.storage_options,
        )
    except ValueError as e:
        if isinstance(e, CheckpointError):
            raise
        print(f"error: {e}", file=sys.stderr)  # a bad option value (named in the message): a usage error
        return 2
    record = json.loads((out / EXPORT_RECORD).read_text())
    # hidden ones (huggingface-cli download's .cache/) are listed in the record, not said
    subfolders = [n for n in record.get("ignored_in_like", []) if n.endswith("/") and not n.startswith(".")]
    if subfolders:  # only --like's files are copied: said, as the record says it
        print(
            f"note: --like's subfolders {', '.join(subfolders)} were not copied (the export copies the folder's own "
            f"files); listed in {EXPORT_RECORD} (ignored_in_like)",
            file=sys.stderr,
        )
    size = sum(f.stat().st_size for f in out.iterdir() if f.name.endswith(".safetensors"))
    print(
        f"wrote {out}: {len(record['files'])} file(s), {size / 2**20:.1f} MiB ({record['dtype']}), "
        f"{_exported_ema(record)} at step {record.get('step')} in {time.perf_counter() - t0:.2f} s"
    )
    return 0


def _exported_ema(record: dict) -> str:
    """Which EMA an export holds, for its summary line: a file without an index (a post-hoc synthesis) by its
    sigma_rel where recorded, not "EMA None"."""
    if record.get("ema_index") is not None:
        return f"EMA {record['ema_index']}"
    sigma = (record.get("source_metadata") or {}).get("sigma_rel")
    return f"the post-hoc EMA of sigma_rel {sigma}" if sigma else "the file's EMA"


def _export_out_place(args: argparse.Namespace) -> Path | None:
    """OUT_DIR checked before the source is read (``check_out_dir``): the current or home folder or above, inside or
    above SOURCE or --like, under a file, in a folder not writable, a mount point, a file, a non-empty folder without
    --overwrite or, with it, one that is not a previous export (its record read, nothing of the source): a usage error
    (exit 2, naming OUT_DIR), as the other verbs refuse OUT. A dead export's marked folders beside it are recovered
    first, as the export does, once every option is valid (a usage error writes nothing). Returns OUT_DIR as a local path; None for a URL or a malformed path, left to ``to_hf``,
    which names it. A tag folder as SOURCE: its root too, as ``to_hf`` refuses it."""
    from ._args import check_path
    from ._export.outdir import check_out_dir
    from ._storage import is_url
    from .export import _check_options

    if is_url(args.out_dir):
        return None
    avoid = []
    for path, name in ((args.source, "source (SOURCE)"), (args.like, "like (--like)")):
        try:
            local = None if is_url(path) else check_path(path, name)
        except ValueError:  # to_hf names it
            local = None
        if local is not None and os.path.lexists(local):  # a missing source is to_hf's to name, not OUT_DIR's
            avoid.append(local)
            if name == "source (SOURCE)":  # a tag folder: to_hf avoids its root
                avoid.extend(_tag_roots(local))
    try:
        out = check_path(args.out_dir, "out_dir (OUT_DIR)")
    except ValueError:
        return None
    try:
        # every option first: check_out_dir recovers a dead export's marked folders, which a usage error must not do
        flags = {"overwrite": args.overwrite, "verify": not args.no_verify, "progress": args.progress}
        _check_options(args.dtype, args.max_shard_size, args.missing, args.index, args.adapter_name, flags)
        check_out_dir(os.fspath(out), avoid, args.overwrite)  # named as given (a file:// URL as its path)
    except ValueError as e:  # an OutputPathError, a CheckpointError too: raised as the usage error it is
        raise ValueError(str(e)) from None
    return out


_COMMANDS: list[Callable[[_Subparsers], None]] = [_add_consolidate, _add_export, _add_posthoc]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m functional_ema", description="functional_ema tools")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS:
        add(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit code (see the module docstring)."""
    args = build_parser().parse_args(argv)
    from .checkpoint import CheckpointError
    from .posthoc import ReconstructionError

    args.outputs = _Outputs()  # what the verb writes, for Ctrl-C's message
    term = _OnSigterm()  # read before the try, installed in it, restored in its finally: no window leaks the handler
    try:
        term.install()
        return int(args.run(args) or 0)
    except _Terminated:  # SIGTERM (timeout, Slurm, Kubernetes): Ctrl-C's cleanup and line
        print(f"error: {args.command} terminated (SIGTERM): {args.outputs.interrupted()}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:  # Ctrl-C: the writers have removed their temporary files; no traceback
        print(f"error: {args.command} interrupted: {args.outputs.interrupted()}", file=sys.stderr)
        return 130
    except (CheckpointError, ReconstructionError, OSError) as e:  # OSError: e.g. a full disk while writing OUT
        print(f"error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not _storage_client_error(e):
            raise
        print(
            f"error: the storage client for a URL argument failed: {type(e).__name__}: {e}. Pass --storage-options "
            '\'{"key": ..., "secret": ..., "endpoint_url": ...}\' or set fsspec\'s configuration (FSSPEC_S3_KEY, ...)',
            file=sys.stderr,
        )
        return 1
    finally:
        term.restore()  # then, after SIGTERM, ends the process by it (an API caller too, as SIGTERM's default does)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread by :class:`_OnSigterm`. A ``KeyboardInterrupt``: every writer's
    cleanup and every ``except KeyboardInterrupt: raise`` of the library treat it as Ctrl-C (DCP's reader turns
    other exceptions into a corruption error)."""


class _OnSigterm:
    """SIGTERM raising :class:`_Terminated` while :func:`main` runs (once: a second one during the cleanup is ignored,
    so that the temporary files still go); its default action would end the process at once and leave
    ``OUT.tmp-*`` behind. Only where SIGTERM has its default action, in the main thread (elsewhere ``signal.signal``
    is refused): an ignored or handled SIGTERM stays as the caller set it. One per call of main, not module state."""

    def __init__(self) -> None:
        import threading

        main_thread = threading.current_thread() is threading.main_thread()
        ours = hasattr(signal, "SIGTERM") and main_thread and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        self.ours, self.fired, self.closing = ours, False, False

    def install(self) -> None:
        if self.ours:
            signal.signal(signal.SIGTERM, self)

    def __call__(self, signum: int, frame: Any) -> None:
        if not self.fired:
            self.fired = True
            if not self.closing:  # during restore(): noted only, delivered again once the default is back
                raise _Terminated()

    def restore(self) -> None:
        """SIGTERM's default action back; after a SIGTERM, the signal sent again so that the process ends by it
        (a parent sees -15, a shell 143), its one line and cleanup done, as :func:`_exit` does for Ctrl-C."""
        self.closing = True  # first: a SIGTERM from here on is noted, not raised out of main's finally
        if not self.ours:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if self.fired:
            for stream in (sys.stdout, sys.stderr):  # what was said before the process ends
                with contextlib.suppress(OSError, ValueError):
                    stream.flush()
            os.kill(os.getpid(), signal.SIGTERM)


def _identity(path: Path) -> tuple[Any, ...] | None:
    """What tells a committed output from the one before it: every writer renames a new file (folder) into place,
    so its inode differs (and a file's mtime, should the inode be reused); the link and what it leads to. None: absent.
    A folder's mtime is left out: an export's recovery may remove a dead writer's marker from the previous one."""
    import stat

    try:
        link = os.lstat(path)
    except OSError:
        return None
    try:
        target: os.stat_result | None = os.stat(path)
    except OSError:  # a broken link
        target = None
    return tuple(
        None if st is None else (st.st_dev, st.st_ino, None if stat.S_ISDIR(st.st_mode) else st.st_mtime_ns)
        for st in (link, target)
    )


@dataclass
class _Outputs:
    """The outputs a verb writes, for Ctrl-C's message (``main``): each one's :func:`_identity` taken before the verb
    writes any (``expect``). After Ctrl-C, one whose identity changed was committed, complete (a writer renames only
    a complete file into place), whether or not the verb got to say so; one unchanged is the previous file or is
    not written (its temporary file removed)."""

    paths: list[Path] = field(default_factory=list)
    before: list[tuple[Any, ...] | None] = field(default_factory=list)

    def expect(self, *paths: Path) -> None:
        for path in paths:
            self.paths.append(Path(path))
            self.before.append(_identity(Path(path)))

    def interrupted(self) -> str:
        if not self.paths:  # interrupted before it named them: nothing was written yet
            return "the output it was writing is not in place (its temporary file was removed)"
        complete: list[str] = []
        previous: list[str] = []
        missing: list[str] = []
        parked: list[str] = []
        for path, was in zip(self.paths, self.before):
            now = _identity(path)
            old = _parked(path) if now is None and was is not None else None
            if old is not None:  # export --overwrite, interrupted between commit_dir's two renames
                parked.append(
                    f"{path} is not in place: the previous export is parked in {old}, and the next export to it puts it back"
                )
                continue
            (missing if now is None else complete if now != was else previous).append(str(path))
        parts = [f"{_listed(complete)} complete and kept"] if complete else []
        if previous:
            kind = "folder" if all(Path(p).is_dir() for p in previous) else "file"
            parts.append(f"{_listed(previous)} the previous {kind}{'s' if len(previous) > 1 else ''}, unchanged")
        if missing:
            parts.append(f"{_listed(missing)} not written (no partial file left)")
        parts.extend(parked)
        if complete and len(complete) == len(self.paths):
            parts[0] += f" (interrupted after writing {'it' if len(complete) == 1 else 'them all'})"
        return "; ".join(parts)


def _parked(path: Path) -> Path | None:
    """Where ``export --overwrite`` parked the previous export of the folder ``path`` (``commit_dir``: moved into
    ``.NAME.old-<id>/prev`` before the new one is renamed into place), when it is there; else None."""
    import re

    from ._export.outdir import _hidden_stem

    real = Path(os.path.realpath(path))
    own = re.compile(re.escape(_hidden_stem(real.name)) + r"\.old-[^.]+")  # as commit_dir names it, not a glob
    try:
        return next(
            (d / "prev" for d in sorted(real.parent.iterdir()) if own.fullmatch(d.name) and (d / "prev").is_dir()), None
        )
    except OSError:
        return None


def _listed(paths: list[str]) -> str:
    """``a is`` / ``a, b are``."""
    return f"{', '.join(paths)} {'is' if len(paths) == 1 else 'are'}"


def _storage_client_error(e: Exception) -> bool:
    """An error of an object store's client library (botocore's ``NoCredentialsError``, ``EndpointConnectionError``):
    not an ``OSError``, yet a setup for the user to fix, not a fault of this tool. Only a client that was imported
    can have raised it."""
    boto = sys.modules.get("botocore.exceptions")
    return boto is not None and isinstance(e, boto.BotoCoreError)


def _exit(code: int) -> None:
    """Exit with ``code``; after Ctrl-C (130) by SIGINT itself, so that a shell loop around the command stops too
    (bash goes on when a child exits 130 normally: it takes that as the child having handled the signal)."""
    if code == 130 and hasattr(signal, "SIGINT"):
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(code)


def cli() -> None:
    """The ``functional-ema`` console script: :func:`main`, exiting as :func:`_exit` does."""
    _exit(main())


if __name__ == "__main__":
    cli()
