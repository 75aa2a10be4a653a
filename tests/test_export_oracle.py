"""The export's oracle: every exported folder loads, with the real loader, as exactly the EMA.

Three tables, each row an export followed by the loader a user would call (``AutoModelForCausalLM`` /
``LlavaForConditionalGeneration`` / diffusers' ``UNet2DModel`` ``.from_pretrained(out, output_loading_info=True)``,
``PeftModel.from_pretrained(base, out, adapter_name=...)``) and a comparison of every tensor of the loaded
model's ``state_dict`` with what it must hold, bitwise: the EMA cast to the asked dtype where the EMA has the
tensor (a tied name: its pair's EMA), else ``--like``'s own value (frozen parameters; cast alike). The EMA is a
plain-torch ``lerp`` of the full weights (``tests/_integration_models.py``), for a post-hoc source the
post-hoc file itself. A key the loader reports missing, unexpected or mismatched fails the row.

- **Oracle table**: model families (Llama tied and untied, GPT-2, Llava, a diffusers UNet, PEFT LoRA, DoRA,
  LoRA with ``modules_to_save``, a second adapter trained with the first or alone) x sources (``fe.save`` in one process, ``consolidate_to_file``,
  ``posthoc_to_file``, ``consolidate --dcp``, 2-rank DeepSpeed ZeRO-3 and FSDP2 checkpoints) x options
  (``dtype``, ``max_shard_size``, ``index``, ``adapter_name``, the CLI), a covering set. A valid row must load as
  the EMA; an EMA out of fp16's range exported as fp16 must be refused, naming the tensor.
- **Perturbed ``--like``**: stray files, wrong shapes, flipped tie flags, tied aliases saved (equal or stale),
  malformed ``config.json`` / ``adapter_config.json`` / index / weight files, a ``quantization_config``, FIFOs (or
  links to one) in place of the config or weights, a diffusers pipeline's root, empty or missing folders, another
  family's folder, and foreign sources. Each must be refused or load as the EMA; counted per class (correct, refused, silent, crash).
- **out_dir table**: ``""``, ``"."``, the working directory, its parent, ``None``, a path under a file, an
  existing folder (with and without ``overwrite``), a previous export, an empty folder; through ``to_hf`` and
  the CLI.

A refusal is a ``fe.CheckpointError`` (or a plain ``ValueError`` naming an option); through the CLI, exit code 1
or 2 with one ``error:`` line. After every row the watched folders (the source's, ``--like``, the parent of
``out_dir``) hash the same as before (but ``out_dir`` itself on success) and no ``.tmp-``/``.old-`` folder is
left; a row that breaks this is a crash. ``FE_ORACLE_VERBOSE=1`` prints every perturbed case's outcome and why.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import struct
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("diffusers")

import functional_ema as fe
from functional_ema._testing.files import hashes
from functional_ema._testing.multirank import run_ranks
from tests._integration_models import (
    FAMILY_DECAYS,
    FAMILY_STEPS,
    FAMILY_TAG,
    HF_FAMILIES,
    FamilyRun,
    load_family,
    make_family,
    oracle_problems,
    quiet_hf,
    shard_weights,
    train_family,
)

DTYPES = {None: None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
#: Words a plain ``ValueError`` must contain to count as a refusal naming a bad option.
OPTIONS = re.compile(r"\b(dtype|max_shard_size|index|missing|adapter_name|out_dir|OUT_DIR|like|tag|source)\b")
POSTHOC_SIGMA = 0.07
#: The option's name in a message (not inside a path such as pytest's ``test_out_dir_table0``).
NAMES_OUT_DIR = re.compile(r"(?<![\w/])out_dir(?!\w)", re.IGNORECASE)
EXPORT_TIMEOUT_S = 120  # one export of a tiny model takes a second; a blocked one is reported, not waited on
VERBOSE = os.environ.get("FE_ORACLE_VERBOSE") == "1"  # every perturbed case's outcome and why, not just the counts


# ---------------------------------------------------------------------------------------- the sources


def dist_worker(root: str, like: str) -> dict:
    """2 ranks: the untied tiny Llama trained under DeepSpeed ZeRO-3, then under FSDP2 (each decoder layer and the
    root sharded), two EMAs each, ``fe.save``-d; FSDP2's also into DCP through ``fe.dcp.EMAStateful``. Rank 0
    writes the plain-torch references (``lerp`` of DeepSpeed's ``safe_get_full_fp32_param`` / ``full_tensor()``)."""
    import deepspeed
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file, save_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from functional_ema._testing.multirank import ds_config, full_tensor_of
    from tests._integration_models import ReferenceEMA, deepspeed_full_fp32, family_loss, quiet_hf, tiny_llama_config

    quiet_hf()
    from transformers import LlamaForCausalLM

    out, rank = Path(root), dist.get_rank()
    like_weights = load_file(Path(like) / "model.safetensors")
    result: dict = {}

    def model() -> Any:
        torch.manual_seed(0)  # the same initial weights as the --like folder
        m = LlamaForCausalLM(tiny_llama_config())
        assert all(torch.equal(p, like_weights[n]) for n, p in m.named_parameters()), "not the --like model"
        return m

    def train(layout: str, engine: Any, step_fn: Callable[[int], None], full: Callable[[], dict]) -> fe.EmaState:
        state = fe.init_ema(fe.local_shards(engine), num_emas=len(FAMILY_DECAYS))
        ref = ReferenceEMA(FAMILY_DECAYS)
        ref.feed(0, full())
        for step in range(1, FAMILY_STEPS + 1):
            step_fn(step)
            state = fe.update(state, fe.local_shards(engine), step, decay=FAMILY_DECAYS)
            ref.feed(step, full())
        fe.save(state, engine, out / layout / "ckpt", FAMILY_TAG, decay=FAMILY_DECAYS)
        assert ref.emas is not None
        if rank == 0:
            for k, ema in enumerate(ref.emas):
                save_file({n: t.contiguous() for n, t in ema.items()}, out / layout / f"ref{k}.safetensors")
        return state

    engine, *_ = deepspeed.initialize(
        model=(m := model()), optimizer=torch.optim.AdamW(m.parameters(), lr=1e-2), config=ds_config(3)
    )

    def ds_step(step: int) -> None:
        engine.backward(family_loss("llama_untied", engine, step + 10 * rank))
        engine.step()

    train("zero3", engine, ds_step, lambda: deepspeed_full_fp32(engine))
    result["zero3_stage"] = engine.zero_optimization_stage()

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    sharded = model()
    for layer in sharded.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)

    def fsdp_step(step: int) -> None:
        family_loss("llama_untied", sharded, step + 10 * rank).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    state = train("fsdp2", sharded, fsdp_step, lambda: {n: full_tensor_of(p) for n, p in sharded.named_parameters()})
    dcp.save({"ema": fe.dcp.EMAStateful(sharded, state)}, checkpoint_id=str(out / "fsdp2" / "dcp"))
    return result


@dataclass
class Sources:
    """Every family trained in this process, and the sources built from them and by the 2-rank launch."""

    root: Path
    runs: dict[str, FamilyRun]
    files: dict[tuple[str, str], Path] = field(default_factory=dict)  # (family, source) -> a safetensors file
    dist: dict[str, tuple[Path, list[dict[str, torch.Tensor]]]] = field(default_factory=dict)
    times: dict[str, float] = field(default_factory=dict)


def _cli(*argv: str) -> tuple[int, str, str]:
    """``python -m functional_ema ...`` in this process: (exit code, stdout, stderr)."""
    from functional_ema.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main(list(argv))
        except SystemExit as e:  # argparse's usage errors
            rc = e.code if isinstance(e.code, int) else 2
    return rc, out.getvalue(), err.getvalue()


def _dcp_file(dcp_dir: Path, out: Path, index: int = 0) -> Path:
    rc, _, err = _cli("consolidate", "--dcp", str(dcp_dir), str(out), "--index", str(index))
    assert rc == 0, err
    return out


def _check_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> None:
    assert sorted(got) == sorted(want), (what, sorted(set(got) ^ set(want))[:5])
    bad = [n for n in want if not torch.equal(got[n], want[n])]
    assert not bad, (what, bad[:5])


def _build_sources(root: Path) -> Sources:
    from safetensors.torch import load_file

    quiet_hf()
    src = Sources(root, {})
    t0 = time.monotonic()
    for family in HF_FAMILIES:
        run = train_family(family, root / family, snapshots=family in ("gpt2", "unet"))
        for k, ema in enumerate(run.emas):  # the checkpoint holds the plain-torch EMAs, bitwise
            _check_equal(fe.consolidate(run.ckpt, FAMILY_TAG, index=k), ema, f"{family} EMA {k}")
        moved = [n for n, t in run.emas[0].items() if not torch.equal(t, run.initial[n])]
        assert len(moved) == len(run.emas[0]), f"{family}: EMA equal to the initial weights"
        src.runs[family] = run
        src.files[family, "consolidated"] = fe.consolidate_to_file(
            run.ckpt, root / family / "ema.safetensors", FAMILY_TAG, progress=False
        )
    src.times["train families"] = time.monotonic() - t0
    for family in ("gpt2", "unet"):  # post-hoc EMAs of a length between the two tracked
        snaps = src.runs[family].snaps
        assert snaps is not None
        path = fe.posthoc.posthoc_to_file(
            snaps, root / family / "posthoc.safetensors", sigma_rel=POSTHOC_SIGMA, max_profile_error=None
        )
        offline = fe.posthoc.posthoc_offline(snaps, sigma_rel=POSTHOC_SIGMA, max_profile_error=None)
        _check_equal(load_file(path), offline, f"{family} post-hoc file")
        src.files[family, "posthoc"] = path
    import torch.distributed.checkpoint as dcp

    gpt2 = src.runs["gpt2"]  # DCP in one process (no process group): EMAStateful, then consolidate --dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.distributed is disabled ... assuming ... a single process": meant
        dcp.save({"ema": fe.dcp.EMAStateful(gpt2.model, gpt2.state)}, checkpoint_id=str(root / "gpt2" / "dcp"))
    src.files["gpt2", "dcp"] = _dcp_file(root / "gpt2" / "dcp", root / "gpt2" / "dcp.safetensors")
    _check_equal(load_file(src.files["gpt2", "dcp"]), gpt2.emas[0], "gpt2 DCP file")
    lu = src.runs["llama_untied"]  # an EMA out of fp16's range (a norm scaled up), saved by fe.save
    huge = [{n: t * 1e6 if n == "model.norm.weight" else t for n, t in e.items()} for e in lu.state.emas]
    fe.save(fe.EmaState(lu.state.step, tuple(huge)), lu.model, root / "llama_untied" / "huge", FAMILY_TAG)
    return src


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    """The families (one process), then one 2-rank launch: ZeRO-3 and FSDP2 (+ DCP) of the untied Llama."""
    from safetensors.torch import load_file

    root = tmp_path_factory.mktemp("oracle")
    src = _build_sources(root)
    t0 = time.monotonic()
    res = run_ranks(
        "tests.test_export_oracle:dist_worker",
        world_size=2,
        timeout=600,
        root=str(root / "dist"),
        like=str(src.runs["llama_untied"].like),
    )
    assert res[0]["zero3_stage"] == 3
    src.times["2-rank launch"] = time.monotonic() - t0
    for layout in ("zero3", "fsdp2"):
        refs = [load_file(root / "dist" / layout / f"ref{k}.safetensors") for k in range(len(FAMILY_DECAYS))]
        for k, ref in enumerate(refs):
            _check_equal(fe.consolidate(root / "dist" / layout / "ckpt", FAMILY_TAG, index=k), ref, f"{layout} {k}")
        src.dist[layout] = (root / "dist" / layout / "ckpt", refs)
    src.files["llama_untied", "fsdp2_dcp"] = _dcp_file(
        root / "dist" / "fsdp2" / "dcp", root / "dist" / "dcp.safetensors"
    )
    _check_equal(load_file(src.files["llama_untied", "fsdp2_dcp"]), src.dist["fsdp2"][1][0], "FSDP2 DCP file")
    return src


# ------------------------------------------------------------------------------------ export and judge


@dataclass
class Attempt:
    """One export: ``ok`` (the folder written), ``refused`` or ``crash``, and why."""

    outcome: str
    detail: str = ""


def _refusal(e: BaseException) -> str | None:
    """The refusal's text when ``e`` is one (see the module docstring), else ``None``."""
    if isinstance(e, fe.CheckpointError) or (type(e) is ValueError and OPTIONS.search(str(e))):
        return f"{type(e).__name__}: {e}"
    return None


def _cli_flags(opts: dict[str, Any]) -> list[str]:
    flags = ["--no-progress"]
    for key, value in opts.items():
        if key == "overwrite":
            flags += ["--overwrite"] if value else []
        elif value is not None:
            flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def export(source: Any, out: Any, like: Any, via: str = "api", **opts: Any) -> Attempt:
    """``to_hf`` (``via="api"``) or ``python -m functional_ema export`` (``via="cli"``, in this process); one that
    has not ended after ``EXPORT_TIMEOUT_S`` (a read blocked on a FIFO of ``--like``) is a crash, never a hung table."""
    from functional_ema.export import to_hf

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(EXPORT_TIMEOUT_S)
    try:
        if via == "api":
            to_hf(source, out, like, progress=False, **opts)
            return Attempt("ok")
        rc, _, err = _cli("export", str(source), str(out), "--like", str(like), *_cli_flags(opts))
    except _Hang:
        return Attempt("crash", f"hang: the export had not ended after {EXPORT_TIMEOUT_S} s")
    except Exception as e:  # noqa: BLE001 - what escapes is the finding
        why = _refusal(e)
        return Attempt("refused", why) if why else Attempt("crash", f"{type(e).__name__}: {str(e)[:300]}")
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    if rc == 0:
        return Attempt("ok")
    if rc in (1, 2) and len(errors) == 1 and "Traceback" not in err:
        return Attempt("refused", f"exit {rc}: {errors[0]}")
    return Attempt("crash", f"exit {rc}: {err.strip()[-300:]}")


_WEIGHT_NAMES = {
    "model": r"model(-\d{5}-of-\d{5})?\.safetensors",
    "diffusers": r"diffusion_pytorch_model(-\d{5}-of-\d{5})?\.safetensors",
    "peft": r"adapter_model\.safetensors",
}


def _layout_problems(kind: str, out: Path, sharded: bool) -> list[str]:
    """The weight files follow the folder kind; no other weight file (a stray one copied); sharded when asked."""
    weights = sorted(p.name for p in out.iterdir() if p.name.endswith((".safetensors", ".bin", ".pt", ".pth")))
    problems = [
        f"weight file {w!r} is not {_WEIGHT_NAMES[kind]}" for w in weights if not re.fullmatch(_WEIGHT_NAMES[kind], w)
    ]
    if not (out / "ema_export.json").is_file():
        problems.append("no ema_export.json")
    if sharded and (len(weights) < 2 or not list(out.glob("*.safetensors.index.json"))):
        problems.append(f"max_shard_size did not shard: {weights}")
    return problems


def _adapter_config_problems(out: Path, like: Path, adapter: str) -> list[str]:
    """PEFT: the exported adapter_config.json is the adapter's own (``like/<name>/`` for a non-default adapter)."""
    own = like / adapter if adapter != "default" and (like / adapter / "adapter_config.json").is_file() else like
    if not like.is_dir() or not (own / "adapter_config.json").is_file():
        return []
    if not (out / "adapter_config.json").is_file():
        return ["no adapter_config.json"]
    got, want = (json.loads((d / "adapter_config.json").read_text()) for d in (out, own))
    return [] if got == want else [f"adapter_config.json is not {own / 'adapter_config.json'}"]


def judge(run: FamilyRun, out: Path, ema: dict[str, torch.Tensor], dtype: str | None, sharded: bool, like: Path) -> str:
    """``""`` when ``out`` loads, with the family's real loader, as exactly ``ema`` (see the module docstring);
    else what differs (a loader that raises included)."""
    problems = _layout_problems(run.kind, out, sharded)
    if run.kind == "peft":
        problems += _adapter_config_problems(out, Path(like), run.adapter)
    try:
        loaded, info = load_family(run.kind, run.family, out, run.base, run.adapter)
    except Exception as e:  # noqa: BLE001 - the folder does not load: the finding
        return "; ".join([*problems, f"the loader raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"])
    problems += info + oracle_problems(loaded, ema, run.initial, run.aliases, DTYPES[dtype], run.kind == "peft")
    return "; ".join(problems[:4]) + (f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")


def _watched(paths: list[Path], out: Path | None) -> dict[str, str]:
    """The hashes of every file under ``paths`` (a file: its folder), ``out``'s own files left out."""
    merged: dict[str, str] = {}
    for folder in (p if p.is_dir() else p.parent for p in paths):
        if folder.is_dir():
            merged.update(hashes(folder))
    skip = str(out) + os.sep if out is not None else None
    return {k: v for k, v in merged.items() if skip is None or not k.startswith(skip)}


def _leftovers(paths: list[Path]) -> list[str]:
    found = []
    for folder in (p if p.is_dir() else p.parent for p in paths):
        if folder.is_dir():
            found += [str(q) for q in folder.iterdir() if ".tmp-" in q.name or ".old-" in q.name]
    return found


def attempt_and_judge(
    run: FamilyRun,
    source: Any,
    out: Path,
    like: Any,
    ema: dict[str, torch.Tensor],
    watch: list[Path],
    via: str = "api",
    given_out: Any = "<out>",
    **opts: Any,
) -> tuple[str, str]:
    """(class, why): ``correct`` (loads as ``ema``), ``refused``, ``silent`` (exported, loads as something else)
    or ``crash`` (anything else escaped, or a watched file changed, or a temporary folder was left). ``out`` is
    where the folder must appear; ``given_out``, when set, the out_dir value given for it (``"."``, ``None``)."""
    before = _watched(watch, None)
    got = export(source, out if isinstance(given_out, str) and given_out == "<out>" else given_out, like, via, **opts)
    after = _watched(watch, out if got.outcome == "ok" else None)
    if got.outcome == "ok":  # out_dir itself is the export's (a previous export in it replaced)
        before = {k: v for k, v in before.items() if not k.startswith(str(out) + os.sep)}
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    if changed:
        return "crash", f"{got.outcome}, but files changed: {changed[:3]}"
    if left := _leftovers([*watch, out.parent]):
        return "crash", f"{got.outcome}, but left {left[:2]}"
    if got.outcome != "ok":
        return got.outcome, got.detail
    sharded = bool(opts.get("max_shard_size")) and run.kind != "peft"
    why = judge(run, out, ema, opts.get("dtype"), sharded, like)
    return ("silent", why) if why else ("correct", "")


def print_table(title: str, header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(header)]
    widths[-1] = len(header[-1])  # the last column (why) runs on
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


# ---------------------------------------------------------------------------------------- the oracle table


@dataclass(frozen=True)
class Row:
    family: str
    source: str  # save, consolidated, posthoc, dcp, zero3, fsdp2, fsdp2_dcp, huge
    opts: tuple[tuple[str, Any], ...] = ()
    via: str = "api"
    expect: str = "load"  # "load": must load as the EMA; "refuse": must be refused, naming ``names``
    names: str = ""


SHARD = ("max_shard_size", 20_000)
ROWS = (
    Row("llama_untied", "save"),
    Row("llama_untied", "save", (("dtype", "bf16"), SHARD)),
    Row("llama_untied", "save", (("index", 1),), via="cli"),
    Row("llama_untied", "zero3"),
    Row("llama_untied", "zero3", (("index", 1), ("dtype", "fp16"))),
    Row("llama_untied", "fsdp2", (SHARD,)),
    Row("llama_untied", "fsdp2", (("index", 1), ("dtype", "bf16")), via="cli"),
    Row("llama_untied", "fsdp2_dcp", (("dtype", "fp32"),)),
    Row("llama_untied", "huge", (("dtype", "bf16"),)),
    Row("llama_untied", "huge", (("dtype", "fp16"),), expect="refuse", names="model.norm.weight"),
    Row("llama_tied", "save"),
    Row("llama_tied", "save", (("index", 1), SHARD)),
    Row("llama_tied", "consolidated", (("dtype", "fp16"),)),
    Row("gpt2", "save", (SHARD,)),
    Row("gpt2", "dcp", (("dtype", "bf16"),)),
    Row("gpt2", "posthoc"),
    Row("llava", "save"),
    Row("llava", "consolidated", (("dtype", "bf16"), ("max_shard_size", 30_000))),
    Row("unet", "save", (("dtype", "fp16"),)),
    Row("unet", "consolidated"),
    Row("unet", "posthoc", (("max_shard_size", 10_000),), via="cli"),
    Row("lora", "save"),
    Row("lora", "consolidated", (("dtype", "bf16"),), via="cli"),
    Row("dora", "save"),
    Row("dora", "consolidated", (("dtype", "fp16"),)),
    Row("lora_mts", "save"),
    Row("lora_mts", "consolidated", (("dtype", "bf16"),)),
    Row("two_adapters", "save"),
    Row("two_adapters", "consolidated", (("dtype", "bf16"),), via="cli"),
    Row("two_adapters", "save", (("adapter_name", "default"),)),
    Row("other_adapter", "save", (("dtype", "bf16"),)),
)


def _row_source(src: Sources, row: Row) -> tuple[Path, dict[str, Any], dict[str, torch.Tensor]]:
    """The row's source, the export's options (``tag`` for a checkpoint) and the EMA it must load as."""
    from safetensors.torch import load_file

    run, opts = src.runs[row.family], dict(row.opts)
    index = opts.get("index", 0)
    if row.source in ("save", "huge", "zero3", "fsdp2"):
        opts["tag"] = FAMILY_TAG
    if row.source == "save":
        return run.ckpt, opts, run.emas[index]
    if row.source == "huge":
        return (
            run.ckpt.parent / "huge",
            opts,
            {n: t * 1e6 if n == "model.norm.weight" else t for n, t in run.emas[0].items()},
        )
    if row.source in ("zero3", "fsdp2"):
        path, refs = src.dist[row.source]
        return path, opts, refs[index]
    path = src.files[row.family, row.source]
    if row.source == "posthoc":
        return path, opts, load_file(path)
    return path, opts, src.dist["fsdp2"][1][0] if row.source == "fsdp2_dcp" else run.emas[0]


@pytest.mark.table
def test_oracle_table(sources: Sources, tmp_path: Path) -> None:
    """Every valid row loads, with the real loader, as exactly the EMA; the fp16 overflow is refused, naming it."""
    t0 = time.monotonic()
    table, failures = [], []
    for i, row in enumerate(ROWS):
        run = sources.runs[row.family]
        source, opts, ema = _row_source(sources, row)
        if run.kind == "peft":
            opts.setdefault("adapter_name", run.adapter)
        adapter = opts.get("adapter_name", run.adapter)
        run_row = FamilyRun(**{**run.__dict__, "adapter": adapter})  # the adapter this row loads
        (tmp_path / f"r{i}").mkdir()
        watch = [source, run.like, tmp_path / f"r{i}"]
        outcome, why = attempt_and_judge(
            run_row, source, tmp_path / f"r{i}" / "out", run.like, ema, watch, row.via, **opts
        )
        ok = outcome == "correct" if row.expect == "load" else outcome == "refused" and row.names in why
        shown = " ".join(f"{k}={v}" for k, v in row.opts) + (" [cli]" if row.via == "cli" else "")
        table.append(
            (row.family, row.source, shown or "-", outcome, "ok" if ok else "FAIL", " ".join(why.split())[:160])
        )
        if not ok:
            failures.append(f"{row.family}/{row.source} {shown}: {outcome} (want {row.expect}) {why[:300]}")
    print_table(
        f"Oracle table: {len(ROWS)} rows in {time.monotonic() - t0:.1f} s (sources built: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in sources.times.items())
        + ")",
        ("family", "source", "options", "outcome", "row", "why"),
        table,
    )
    assert not failures, "\n".join(failures)


# --------------------------------------------------------------------------------- perturbed --like folders


class _Unpickled:
    """A pickle that leaves a folder behind when something unpickles it (loading never unpickles)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (os.makedirs, (str(self.marker),))


@dataclass
class Ctx:
    """What a perturbation needs: the sources, the case's folder, a marker an unpickler would create."""

    src: Sources
    family: str
    case: Path
    marker: Path
    wide: dict[str, Path]


def _cfg_name(like: Path) -> str:
    return "adapter_config.json" if (like / "adapter_config.json").exists() else "config.json"


def _weights(like: Path) -> Path:
    """The folder's one weight file (model, diffusers or PEFT)."""
    (found,) = [p for p in like.glob("*.safetensors")]
    return found


def _names_in(path: Path) -> list[str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def _edit_config(like: Path, edit: Callable[[dict], None]) -> None:
    path = like / _cfg_name(like)
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


def _tie(value: bool | None) -> Callable[[Path, Ctx], None]:
    def apply(like: Path, ctx: Ctx) -> None:
        def edit(doc: dict) -> None:
            for d in (doc, doc.get("text_config")):
                if isinstance(d, dict):
                    if value is None:
                        d.pop("tie_word_embeddings", None)
                    else:
                        d["tie_word_embeddings"] = value

        _edit_config(like, edit)

    return apply


def _custom_class_with_alias(like: Path, ctx: Ctx) -> None:
    """No loader view (``architectures`` names the user's own class) and the tied aliases saved beside what they are
    tied to, equal (as many hub folders are)."""
    from safetensors.torch import load, save_file

    _edit_config(like, lambda d: d.update(architectures=[f"My{d['architectures'][0]}"]))
    path = _weights(like)
    tensors = load(path.read_bytes())  # not a memory map: replaced
    for alias, holder in ctx.src.runs[ctx.family].aliases.items():
        tensors[alias] = tensors[holder].clone()
    save_file(tensors, path, metadata={"format": "pt"})


def _alias_saved(stale: bool) -> Callable[[Path, Ctx], None]:
    """The tied aliases saved beside what they are tied to (older Hub folders), under the loader's view: equal (left
    out as save_pretrained leaves them, loads as the EMA), or ``stale`` (other values: refused naming the tie)."""

    def apply(like: Path, ctx: Ctx) -> None:
        from safetensors.torch import load, save_file

        path = _weights(like)
        tensors = load(path.read_bytes())  # not a memory map: replaced
        for alias, holder in ctx.src.runs[ctx.family].aliases.items():
            tensors[alias] = tensors[holder] + (1 if stale else 0)
        save_file(tensors, path, metadata={"format": "pt"})

    return apply


def _fifo_at(path: Callable[[Path], Path], link: bool = False) -> Callable[[Path, Ctx], None]:
    """``path(like)`` replaced by a FIFO (or a link to one beside the folder): opening it for reading blocks."""

    def apply(like: Path, ctx: Ctx) -> None:
        target = path(like)
        target.unlink()
        pipe = like.parent / f"{target.name}.pipe" if link else target
        os.mkfifo(pipe)
        if link:
            target.symlink_to(pipe)

    return apply


def _pipeline_root(like: Path, ctx: Ctx) -> None:
    """A diffusers pipeline's root as --like: ``model_index.json``, the model in ``unet/``, a ``scheduler/``."""
    unet = like.parent / "unet"
    like.rename(unet)
    (like / "scheduler").mkdir(parents=True)
    unet.rename(like / "unet")
    (like / "scheduler" / "scheduler_config.json").write_text("{}")
    (like / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "U"]}))


def _config_text(text: str) -> Callable[[Path, Ctx], None]:
    return lambda like, ctx: (like / _cfg_name(like)).write_text(text)


def _shard(like: Path, ctx: Ctx | None = None) -> None:
    shard_weights(like)


def _index(edit: Callable[[dict, Path], Any]) -> Callable[[Path, Ctx], None]:
    def apply(like: Path, ctx: Ctx) -> None:
        _shard(like)
        (path,) = like.glob("*.safetensors.index.json")
        doc = json.loads(path.read_text())
        doc = edit(doc, like) or doc
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))

    return apply


def _first_to(value: Callable[[str, Path], str]) -> Callable[[dict, Path], None]:
    def edit(doc: dict, like: Path) -> None:
        first = next(iter(doc["weight_map"]))
        doc["weight_map"][first] = value(doc["weight_map"][first], like)

    return edit


def _dotdot(shard: str, like: Path) -> str:
    shutil.copyfile(like / shard, like.parent / "x.safetensors")  # a real file there: reading it would work
    return "../x.safetensors"


def _raw(edit: Callable[[bytes], bytes]) -> Callable[[Path, Ctx], None]:
    def apply(like: Path, ctx: Ctx) -> None:
        path = _weights(like)
        path.write_bytes(edit(path.read_bytes()))

    return apply


def _torch_saved(like: Path, ctx: Ctx) -> None:
    from safetensors.torch import load

    path = _weights(like)
    torch.save(load(path.read_bytes()), path)  # not load_file: a memory map of the file being replaced


def _stray(name: str, make: Callable[[Path, Ctx], bytes]) -> Callable[[Path, Ctx], None]:
    return lambda like, ctx: (like / name).write_bytes(make(like, ctx))


def _zeros_under_like_names(like: Path, ctx: Ctx) -> bytes:
    from safetensors.torch import save

    return save({n: torch.zeros(1) for n in _names_in(_weights(like))})


def _copy_from(family: str, *names: str) -> Callable[[Path, Ctx], None]:
    def apply(like: Path, ctx: Ctx) -> None:
        run = ctx.src.runs[family]
        for n in names:
            shutil.copyfile((run.base if n in ("config.json", "model.safetensors") else run.like) / n, like / n)

    return apply


def _replace_with(folder: Callable[[Ctx], Path]) -> Callable[[Path, Ctx], None]:
    def apply(like: Path, ctx: Ctx) -> None:
        shutil.rmtree(like)
        shutil.copytree(folder(ctx), like)

    return apply


def _empty(like: Path, ctx: Ctx) -> None:
    shutil.rmtree(like)
    like.mkdir()


#: Another family's folder for each family (names and shapes that cannot fit).
FOREIGN = {
    "llama_untied": "gpt2",
    "llama_tied": "gpt2",
    "gpt2": "llama_untied",
    "llava": "llama_untied",
    "unet": "llama_untied",
    "lora": "llama_untied",
    "dora": "lora",
    "lora_mts": "unet",
    "two_adapters": "gpt2",
    "other_adapter": "unet",
}
_ALL = tuple(HF_FAMILIES)
_MODELS = tuple(f for f, k in HF_FAMILIES.items() if k != "peft")
_PEFT = tuple(f for f, k in HF_FAMILIES.items() if k == "peft")
_TIED = ("llama_untied", "llama_tied", "gpt2", "llava")
_FEW = ("llama_untied", "unet", "lora")
_DEEP = "[" * 100_000 + "]" * 100_000


@dataclass(frozen=True)
class Perturbation:
    name: str
    families: tuple[str, ...]
    apply: Callable[[Path, Ctx], None]
    like: Callable[[Path], Path] | None = None  # the --like given (default: the perturbed folder)


PERTURBATIONS = (
    Perturbation("stray consolidated.safetensors", _ALL, _stray("consolidated.safetensors", _zeros_under_like_names)),
    Perturbation(
        "stray adapter_model.safetensors", _MODELS, _stray("adapter_model.safetensors", _zeros_under_like_names)
    ),
    Perturbation(
        "stray pickle weights",
        _ALL,
        _stray("pytorch_model.bin", lambda like, ctx: pickle.dumps(_Unpickled(ctx.marker))),
    ),
    Perturbation("stray adapter_config.json", _MODELS, _copy_from("lora", "adapter_config.json")),
    Perturbation("stray model config+weights", _PEFT, _copy_from("lora", "config.json", "model.safetensors")),
    Perturbation("wrong shapes (2x wide)", _ALL, _replace_with(lambda ctx: ctx.wide[ctx.family])),
    Perturbation("another family's folder", _ALL, _replace_with(lambda ctx: ctx.src.runs[FOREIGN[ctx.family]].like)),
    Perturbation("tie_word_embeddings true", _TIED, _tie(True)),
    Perturbation("tie_word_embeddings false", _TIED, _tie(False)),
    Perturbation("tie_word_embeddings removed", _TIED, _tie(None)),
    Perturbation(  # trained tied: lm_head's EMA is the embedding's, never --like's own lm_head
        "the untied model's folder", ("llama_tied",), _replace_with(lambda ctx: ctx.src.runs["llama_untied"].like)
    ),
    Perturbation("no loader view, tied alias saved", ("llama_tied", "gpt2"), _custom_class_with_alias),
    Perturbation("tied alias saved, equal", ("llama_tied", "gpt2"), _alias_saved(stale=False)),
    Perturbation("tied alias saved, stale", ("llama_tied", "gpt2"), _alias_saved(stale=True)),
    Perturbation(  # a quantized Hub base's config: from_pretrained would quantize the EMA on load
        "config quantization_config",
        _MODELS,
        lambda like, ctx: _edit_config(
            like, lambda d: d.update(quantization_config={"quant_method": "bitsandbytes", "load_in_4bit": True})
        ),
    ),
    Perturbation("a diffusers pipeline's root", ("unet",), _pipeline_root),
    Perturbation("weights a FIFO", _ALL, _fifo_at(_weights)),
    Perturbation("weights a link to a FIFO", _FEW, _fifo_at(_weights, link=True)),
    Perturbation("config a FIFO", _FEW, _fifo_at(lambda like: like / _cfg_name(like))),
    Perturbation(  # a bf16 base: the config must state the dtype written, or from_pretrained loads bf16
        "config dtype bfloat16", _TIED, lambda like, ctx: _edit_config(like, lambda d: d.update(dtype="bfloat16"))
    ),
    Perturbation("config []", _ALL, _config_text("[]")),
    Perturbation("config null", _FEW, _config_text("null")),
    Perturbation('config "x"', _FEW, _config_text('"x"')),
    Perturbation('config {"text_config": null}', _ALL, _config_text('{"text_config": null}')),
    Perturbation(
        "config text_config null", _TIED, lambda like, ctx: _edit_config(like, lambda d: d.update(text_config=None))
    ),
    Perturbation("config 100k deep", _FEW, _config_text(_DEEP)),
    Perturbation("config not JSON", _FEW, _config_text("{")),
    Perturbation("config empty", _FEW, _config_text("")),
    Perturbation("config deleted", _ALL, lambda like, ctx: (like / _cfg_name(like)).unlink()),
    Perturbation("sharded (valid)", _MODELS, _shard),
    Perturbation(
        "index weight_map a list", _MODELS, _index(lambda d, like: d.update(weight_map=list(d["weight_map"].items())))
    ),
    Perturbation(
        "index int values", _MODELS, _index(lambda d, like: d.update(weight_map=dict.fromkeys(d["weight_map"], 1)))
    ),
    Perturbation("index ../x.safetensors", _MODELS, _index(_first_to(_dotdot))),
    Perturbation("index absolute path", _MODELS, _index(_first_to(lambda shard, like: str((like / shard).resolve())))),
    Perturbation("index missing file", _MODELS, _index(_first_to(lambda shard, like: shard.replace("00001", "00009")))),
    Perturbation("index no weight_map", _FEW[:2], _index(lambda d, like: {"metadata": {}})),
    Perturbation("index 100k deep", _FEW[:2], _index(lambda d, like: _DEEP)),
    Perturbation("weights header garbage", _ALL, _raw(lambda b: b[:8] + b"#" * 24 + b[32:])),
    Perturbation("weights header length huge", _FEW, _raw(lambda b: struct.pack("<Q", 2**40) + b[8:])),
    Perturbation("weights truncated", _ALL, _raw(lambda b: b[: len(b) // 2])),
    Perturbation("weights empty", _ALL, _raw(lambda b: b"")),
    Perturbation("weights a torch.save pickle", _ALL, _torch_saved),
    Perturbation(
        "weights an unpickling trap",
        _FEW,
        lambda like, ctx: _weights(like).write_bytes(pickle.dumps(_Unpickled(ctx.marker))),
    ),
    Perturbation("weights deleted", _ALL, lambda like, ctx: _weights(like).unlink()),
    Perturbation("empty folder", _ALL, _empty),
    Perturbation("a file, not a folder", _FEW, lambda like, ctx: None, like=lambda like: like / _cfg_name(like)),
    Perturbation("missing folder", _FEW, lambda like, ctx: None, like=lambda like: like.parent / "nowhere"),
)


def _foreign_sources(src: Sources, case: Path) -> dict[str, Path]:
    """Sources that are not one of our outputs, or hold nothing: each must be refused (llama_untied's folder)."""
    from safetensors.torch import save_file

    run = src.runs["llama_untied"]
    case.mkdir()
    save_file({n: t.contiguous() for n, t in run.emas[0].items()}, case / "foreign.safetensors")
    save_file({}, case / "ours_empty.safetensors", metadata={"format": "functional_ema.consolidated"})
    torch.save(run.emas[0], case / "pickled.safetensors")
    raw = src.files["llama_untied", "consolidated"].read_bytes()
    (case / "truncated.safetensors").write_bytes(raw[: len(raw) // 2])
    (case / "empty_dir").mkdir()
    return {
        "source: another tool's safetensors": case / "foreign.safetensors",
        "source: ours, no tensors": case / "ours_empty.safetensors",
        "source: a torch.save pickle": case / "pickled.safetensors",
        "source: truncated consolidated file": case / "truncated.safetensors",
        "source: an empty folder": case / "empty_dir",
        "source: missing": case / "nowhere",
    }


@pytest.mark.table
def test_perturbed_like_table(sources: Sources, tmp_path: Path) -> None:
    """Each perturbed --like (or foreign source) is refused, folders unchanged, or loads as exactly the EMA."""
    t0 = time.monotonic()
    wide = {}
    for family in HF_FAMILIES:  # the family's model built twice as wide: its folder cannot hold this EMA
        _, wide[family], _ = make_family(family, tmp_path / "wide" / family, width=2)
    counts: dict[str, Counter] = {}
    failures: list[str] = []
    markers = tmp_path / "markers"
    markers.mkdir()

    def record(name: str, family: str, outcome: str, why: str) -> None:
        counts.setdefault(name, Counter())[outcome] += 1
        if VERBOSE:
            print(f"  {name} [{family}]: {outcome} {' '.join(why.split())[:200]}")
        if outcome in ("silent", "crash"):
            failures.append(f"{name} [{family}]: {outcome}: {' '.join(why.split())[:260]}")

    for j, p in enumerate(PERTURBATIONS):
        for family in p.families:
            run = sources.runs[family]
            case = tmp_path / f"p{j}_{family}"
            shutil.copytree(run.like, case / "like")
            ctx = Ctx(sources, family, case, markers / f"p{j}_{family}", wide)
            p.apply(case / "like", ctx)
            like = p.like(case / "like") if p.like else case / "like"
            outcome, why = attempt_and_judge(
                run,
                run.ckpt,
                case / "out",
                like,
                run.emas[0],
                [run.ckpt, case],
                tag=FAMILY_TAG,
                adapter_name=run.adapter,
            )
            if ctx.marker.exists():
                outcome, why = "crash", f"unpickled a file of --like ({outcome})"
            record(p.name, family, outcome, why)
    run = sources.runs["llama_untied"]
    for name, source in _foreign_sources(sources, tmp_path / "foreign").items():
        outcome, why = attempt_and_judge(
            run, source, tmp_path / "foreign" / "out", run.like, run.emas[0], [source, run.like]
        )
        record(name, "llama_untied", outcome, why)
    cols = ("cases", "correct", "refused", "silent", "crash")
    rows = [(name, *(str(sum(c.values()) if k == "cases" else c[k]) for k in cols)) for name, c in counts.items()]
    total = Counter()
    for c in counts.values():
        total.update(c)
    rows.append(("total", *(str(sum(total.values()) if k == "cases" else total[k]) for k in cols)))
    print_table(
        f"Perturbed --like table: {sum(total.values())} cases in {time.monotonic() - t0:.1f} s",
        ("perturbation", *cols),
        rows,
    )
    for f in failures:
        print("FAIL", f)
    assert not failures, "\n".join(failures[:40])


# ------------------------------------------------------------------------------------------- the out_dir table


@dataclass(frozen=True)
class OutCase:
    name: str
    out: Callable[[Path], Any]  # the row's folder -> out_dir (the working directory is row/a/b)
    overwrite: bool = False
    expect: str = "refuse"  # or "export"
    names_out_dir: bool = False  # the refusal must name out_dir
    prepare: Callable[[Path, Sources], None] | None = None
    cli: bool = True


def _prepare_existing(row: Path, src: Sources) -> None:
    (row / "existing").mkdir()
    (row / "existing" / "keep.txt").write_text("mine")


def _prepare_previous(row: Path, src: Sources) -> None:
    from functional_ema.export import to_hf

    run = src.runs["llama_untied"]
    to_hf(src.files["llama_untied", "consolidated"], row / "previous", run.like, progress=False)


def _prepare_file(row: Path, src: Sources) -> None:
    (row / "file.txt").write_text("a file")


OUT_CASES = (
    OutCase('""', lambda row: "", names_out_dir=True),
    OutCase("None", lambda row: None, names_out_dir=True, cli=False),
    OutCase('"."', lambda row: "."),
    OutCase('"." overwrite', lambda row: ".", overwrite=True),
    OutCase("the working directory, overwrite", lambda row: str(row / "a" / "b"), overwrite=True),
    OutCase("its parent, overwrite", lambda row: str(row / "a"), overwrite=True),
    OutCase('"..", overwrite', lambda row: "..", overwrite=True),
    OutCase("under a regular file", lambda row: row / "file.txt" / "out", names_out_dir=True, prepare=_prepare_file),
    OutCase("a non-empty folder", lambda row: row / "existing", prepare=_prepare_existing),
    OutCase("a non-empty folder, overwrite", lambda row: row / "existing", overwrite=True, prepare=_prepare_existing),
    OutCase("a previous export", lambda row: row / "previous", prepare=_prepare_previous),
    OutCase("a previous export, overwrite", lambda row: row / "previous", True, "export", prepare=_prepare_previous),
    OutCase(
        "an empty folder", lambda row: row / "empty", expect="export", prepare=lambda row, src: (row / "empty").mkdir()
    ),
    OutCase("a new folder (relative)", lambda row: "new", expect="export"),
)


@pytest.mark.table
def test_out_dir_table(sources: Sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each out_dir is refused (nothing anywhere changed; its files byte-identical) or written, replacing only
    itself; through to_hf and through the CLI."""
    run = sources.runs["llama_untied"]
    source = sources.files["llama_untied", "consolidated"]
    table, failures = [], []
    for i, case in enumerate(OUT_CASES):
        for via in ("api", "cli") if case.cli else ("api",):
            row = tmp_path / f"o{i}_{via}"
            (row / "a" / "b").mkdir(parents=True)
            (row / "a" / "b" / "keep.txt").write_text("the working directory's file")
            try:
                if case.prepare is not None:
                    case.prepare(row, sources)
            except Exception as e:  # noqa: BLE001 - a previous export that cannot be made is this row's finding
                outcome, why = "crash", f"preparing: {type(e).__name__}: {e}"
            else:
                monkeypatch.chdir(row / "a" / "b")
                out = case.out(row)
                target = (row / "a" / "b" / out).resolve() if out is not None and str(out) else row / "a" / "b"
                outcome, why = attempt_and_judge(
                    run,
                    source,
                    target,
                    run.like,
                    run.emas[0],
                    [row, source, run.like],
                    via,
                    out,
                    overwrite=case.overwrite,
                )
            if case.expect == "refuse":
                ok = outcome == "refused" and (not case.names_out_dir or NAMES_OUT_DIR.search(why) is not None)
            else:
                ok = outcome == "correct"
            table.append((case.name, via, outcome, "ok" if ok else "FAIL", " ".join(why.split())[:150]))
            if not ok:
                failures.append(f"{case.name} [{via}]: {outcome} (want {case.expect}): {why[:300]}")
    print_table(f"out_dir table: {len(table)} rows", ("out_dir", "via", "outcome", "row", "why"), table)
    assert not failures, "\n".join(failures)
