"""Command line: ``python -m functional_ema <command> ...`` (also installed as ``functional-ema``).

Commands:
    consolidate CHECKPOINT_DIR OUT.safetensors [--tag T] [--index K]
        Rebuild full EMA weights from the per-rank files of a checkpoint, with no GPU and no process
        group, streaming: peak memory is about the largest single parameter.

Adding a command: write ``_add_<name>(subparsers)`` that registers a parser with
``set_defaults(run=<function taking the parsed args, returning an exit code>)`` and append it to
``_COMMANDS``.

Exit codes: 0 success, 1 checkpoint error (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .posthoc import _add_posthoc


def _add_consolidate(subparsers) -> None:
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
    p.add_argument("checkpoint_dir", help="DeepSpeed checkpoint directory (holding 'latest'), or one tag folder")
    p.add_argument("out", help="output .safetensors file (written atomically; replaced if it exists)")
    p.add_argument("--tag", default=None, help="tag folder to read (default: the one named in CHECKPOINT_DIR/latest)")
    p.add_argument("--index", type=int, default=0, help="which EMA, when several were tracked (default 0)")
    p.add_argument("--no-verify", action="store_true", help="skip the CRC-32 checks of the bytes read")
    bar = p.add_mutually_exclusive_group()
    bar.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show a progress bar")
    bar.add_argument("--no-progress", dest="progress", action="store_false", help="never show a progress bar")
    p.set_defaults(run=_run_consolidate)


def _run_consolidate(args) -> int:
    import time

    from safetensors import safe_open

    from .checkpoint import consolidate_to_file

    t0 = time.perf_counter()
    out = consolidate_to_file(
        args.checkpoint_dir, args.out, args.tag, index=args.index, verify=not args.no_verify, progress=args.progress
    )
    with safe_open(str(out), framework="pt") as f:
        meta, n = f.metadata() or {}, len(list(f.keys()))
    size = out.stat().st_size
    dt = time.perf_counter() - t0
    print(
        f"wrote {out}: {n} tensors, {size / 2**20:.1f} MiB, EMA {meta.get('ema_index')} of tag {meta.get('tag')!r} "
        f"(step {meta.get('step')}) in {dt:.2f} s"
    )
    return 0


_COMMANDS: list[Callable] = [_add_consolidate, _add_posthoc]


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

    try:
        return int(args.run(args) or 0)
    except (CheckpointError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
