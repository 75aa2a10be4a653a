"""The *Files* table: every kind of file the library reads, from a checkpoint of every layout, attacked.

A self-attack built as three registries, so that a new surface joins by adding one row:

- ``LAYOUTS``: how a checkpoint of that layout is built (plain module, DeepSpeed ZeRO-3, DeepSpeed
  tensor parallel (``mpu=``), pipeline and MoE, FSDP2, HSDP, FSDP2 x DTensor tensor parallel, the
  integration controller), each written twice into the same tag (the older save is kept as a source of
  stale files) by real engines in two multi-rank launches, once per session; ``bucket``, a plain module
  saved twice to a ``memory://`` URL by the object-store writer in this process, its objects downloaded
  (and read back by URL too: the ``consolidate url`` reader); and ``hf``, the export's
  inputs built in this process (``build_hf``: tiny Llama, LoRA and UNet ``--like`` folders, a checkpoint,
  consolidated files and a post-hoc output).
- ``FILE_KINDS``: which files of a built checkpoint are of that kind (rank files, buffers files,
  manifests, ``ema_latest``, the integration record, post-hoc snapshot files, DCP ``.metadata`` and
  ``.distcp``; the export's ``config.json``, weight index, ``model.safetensors``, ``adapter_config.json``,
  adapter and diffusers weights, consolidated files, post-hoc outputs) and which offline readers read it
  (``READS``: the files of its layout a reader reads, when not all).
- ``MUTATIONS``: seeded bit flips in the header and in the data, truncation, deletion, another rank's
  file copied over this one (duplicate), two ranks' files exchanged (swap), the older save's file, and
  every JSON field set to a type-confused value (``None``, a string, a list, a dict, negative, a float,
  huge, a bool; the integration record's checksum recomputed, as a forger would); for DCP's files, a tensor's
  global size in ``.metadata`` grown, negative or huge, and a file replaced by a folder; for the export's ``--like``
  files, a FIFO or a link to one in the file's place (a reader that opens it blocks: a *hang*).

Every case must end in the clean checkpoint's exact result (bitwise), or, for the readers in ``ORACLES``
(the export ``to_hf``), in what their oracle accepts: an export of a checkpoint holds the consolidated EMA,
an ``hf`` export loads with the real loader (transformers, PEFT, diffusers) as exactly the reference EMA
(a mutated ``--like`` may legitimately change the output, e.g. a config field copied verbatim); or a library
error (``CheckpointError`` / ``MismatchError`` family) with every file unchanged (hashed before and after);
anything else is a *crash* (a raw exception or a changed file), a *silent* wrong result, or a *hang*.
A file the library writes into a built checkpoint that no kind claims fails the table.

Above budget 1 (or with ``FE_FUZZ_ONLINE=1``) a sample of the cases is also loaded with ``fe.load`` into the
layout that saved them, on its ranks (two more launches).

``FE_FUZZ_BUDGET`` (default 1) multiplies the seeds per class, ``FE_FUZZ_SEED`` (default 0) moves them;
``make fuzz`` runs a larger budget. ``FE_FUZZ_CACHE``, a folder, keeps the built checkpoints across runs;
``FE_FUZZ_ONLY``, a regular expression, runs the cases whose id (layout|kind|mutation|file|argument)
matches.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import shutil
import signal
import struct
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

import functional_ema as fe
from functional_ema._testing.files import hashes
from functional_ema._testing.multirank import run_ranks

BUDGET = int(os.environ.get("FE_FUZZ_BUDGET", "1"))
SEED = int(os.environ.get("FE_FUZZ_SEED", "0"))
TAG = "t"
CASE_TIMEOUT_S = 60


# ----------------------------------------------------------------------------------- the builders


def _online_loads(x: Any, cases: Path) -> dict[str, str]:
    """``fe.load`` into the saving layout of every mutated copy under ``cases`` (``cases/c*/ck``), against the
    clean copy's load (``cases/clean/ck``): this rank's outcome per case."""
    clean = fe.load(x, cases / "clean" / "ck", TAG)
    out = {}
    for d in sorted(p for p in cases.iterdir() if p.name != "clean"):
        try:
            got = fe.load(x, d / "ck", TAG)
            same = int(got.step) == int(clean.step) and all(
                a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a) for a, b in zip(got.emas, clean.emas)
            )
            out[d.name] = "correct" if same and len(got.emas) == len(clean.emas) else "silent"
        except (fe.CheckpointError, fe.MismatchError) as e:
            out[d.name] = f"refused: {type(e).__name__}"
        except Exception as e:  # noqa: BLE001 - the finding
            out[d.name] = f"crash: {type(e).__name__}: {str(e)[:200]}"
    return out


#: A user's files in a tag folder, named like the library's files or their temporaries (``.tmp-``) but none of them:
#: put there before a layout's first save, they are left as they are by it and by the re-save of the tag (whose
#: cleanup removes older generations and crashed saves' temporary files by their exact names only); the
#: ``user look-alike`` row then attacks them (the readers must read past them).
USER_LOOKALIKES = (
    "ema_notes.tmp-backup",
    "buffers_of_mine.tmp-1",
    "ema_manifest.json.tmp-copy",
    "ema_latest.tmp-x",
    "ema_rank_00000_of_00002.safetensors.tmp-1-aa",
)


def _save_twice(
    root: Path,
    save: Callable[[Path], Any],
    advance: Callable[[], None],
    x: Any = None,
    online: Path | None = None,
    user_files: bool = True,
) -> dict[str, str]:
    """``save(dir)`` into ``root/ck``; copied to ``root/older`` (and a DCP folder beside it to ``root/older_dcp``)
    by rank 0; ``advance()``; saved again. With ``online``: then the online loads of ``online/<layout>``.
    ``user_files``: rank 0 first puts :data:`USER_LOOKALIKES` into the tag folder; both saves must leave them."""
    import torch.distributed as dist

    user = {root / "ck" / TAG / name: f"{name}: a user's notes\n".encode() for name in USER_LOOKALIKES}
    if user_files and dist.get_rank() == 0:
        (root / "ck" / TAG).mkdir(parents=True)
        for path, data in user.items():
            path.write_bytes(data)
    dist.barrier()
    save(root / "ck")
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.copytree(root / "ck", root / "older")
        if (root / "dcp").exists():
            shutil.copytree(root / "dcp", root / "older_dcp")
    dist.barrier()
    advance()
    save(root / "ck")
    dist.barrier()
    if user_files:
        left = {path.name: path.read_bytes() if path.is_file() else None for path in user}
        assert left == {path.name: data for path, data in user.items()}, f"a save removed a user's files: {left}"
    return _online_loads(x, online / root.name) if online is not None and (online / root.name).is_dir() else {}


class _Run:
    """One layout's training state in a builder: the step, the EMA state and the buffers' state."""

    def __init__(self, state: fe.EmaState, bstate: fe.buffers.BufferState | None = None):
        self.state, self.bstate, self.step = state, bstate, int(state.step)


def _build_plain(root: Path, online: Path | None) -> dict:
    from functional_ema._testing.multirank import BNSeq

    torch.manual_seed(0)
    model = BNSeq()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def train(step: int) -> None:
        g = torch.Generator().manual_seed(step)  # the same batch on every rank: a replicated plain module
        model(torch.randn(8, 7, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    return _build_engine(root, model, train, online, buffers=True)


def _build_engine(
    root: Path,
    engine: Any,
    train: Callable[[int], None],
    online: Path | None,
    buffers: bool = False,
    snapshots: bool = False,
) -> dict:
    from functional_ema import posthoc, schedules
    from functional_ema._testing.multirank import checkpoint_decays

    run = _Run(fe.init_ema(fe.local_shards(engine), num_emas=2))
    if buffers:
        run.bstate = fe.buffers.init_buffers(engine, num_emas=2)
    tracked = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    snap = fe.init_ema(fe.local_shards(engine), num_emas=2) if snapshots else None

    def advance() -> None:
        nonlocal snap
        run.step += 1
        train(run.step)
        run.state = fe.update(run.state, fe.local_shards(engine), run.step, decay=checkpoint_decays())
        if buffers:
            run.bstate = fe.buffers.update_buffers(run.bstate, engine, run.step, decay=checkpoint_decays())
        if snapshots:
            snap = fe.update(snap, fe.local_shards(engine), run.step, decay=tracked)
            posthoc.save_snapshot(snap, engine, root / "snaps", tracked)

    advance()
    return _save_twice(
        root,
        lambda d: fe.save(run.state, engine, d, TAG, decay=checkpoint_decays(), buffers=run.bstate),
        advance,
        engine,
        online,
    )


def _ds_train(engine: Any, forward: Callable[[int], torch.Tensor]) -> Callable[[int], None]:
    def train(step: int) -> None:
        engine.backward(forward(step))
        engine.step()

    return train


def deepspeed_builder(root: str, online: str | None = None) -> dict:
    """2 ranks: plain module, ZeRO-3 (with post-hoc snapshots), MoE (expert parallel 2, with buffers), pipeline
    (2 stages, BatchNorm buffers), tensor parallel through ``mpu=`` (2). MoE first: DeepSpeed keeps the
    pipeline's topology in its global groups, which MoE's expert groups are then cut from."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    from functional_ema._testing.multirank import (
        MPU,
        TPMLP,
        MoENet,
        batch,
        ds_config,
        make_engine,
        train_step,
    )

    base, times, loads = Path(root), {}, {}
    online = Path(online) if online else None
    t0 = time.monotonic()
    loads["plain"] = _build_plain(base / "plain", online)
    times["plain"] = time.monotonic() - t0

    t0 = time.monotonic()
    engine = make_engine(3)
    loads["zero3"] = _build_engine(
        base / "zero3", engine, lambda step: train_step(engine, step), online, snapshots=True
    )
    times["zero3"] = time.monotonic() - t0

    t0 = time.monotonic()
    model = MoENet(2, seed=0)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    moe, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=ds_config(2))

    def moe_loss(step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1234 + 1000 * step + dist.get_rank())
        out, aux = moe(torch.randn(16, 7, generator=g))
        return ((out - torch.randn(16, 5, generator=g)) ** 2).mean() + aux

    loads["moe"] = _build_engine(base / "moe", moe, _ds_train(moe, moe_loss), online, buffers=True)
    times["moe"] = time.monotonic() - t0

    t0 = time.monotonic()
    from deepspeed.pipe import PipelineModule

    torch.manual_seed(0)
    module = PipelineModule(
        layers=[nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Tanh(), nn.Linear(13, 5)],
        num_stages=2,
        loss_fn=nn.MSELoss(),
        partition_method="uniform",
    )
    pipe, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=ds_config(1)
    )

    def pipe_train(step: int) -> None:
        g = torch.Generator().manual_seed(step)
        pipe.train_batch(iter([(torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g))]))

    loads["pp"] = _build_engine(base / "pp", pipe, pipe_train, online, buffers=True)
    times["pp"] = time.monotonic() - t0

    t0 = time.monotonic()
    mpu = MPU(2)
    tp = make_engine(2, model=TPMLP(mpu.get_model_parallel_rank(), 2, mpu.get_model_parallel_group()), mpu=mpu)

    def tp_loss(step: int) -> torch.Tensor:
        x, y = batch(tp, step, seed=99)  # the same batch on both tensor-parallel ranks (data parallel 1)
        return ((tp(x) - y) ** 2).mean()

    loads["ds_tp"] = _build_engine(base / "ds_tp", tp, _ds_train(tp, tp_loss), online)
    times["ds_tp"] = time.monotonic() - t0
    return {"times": times, "loads": loads}


def _merge_private(d: Path, private: Path) -> None:
    """Rank 0 merges every rank's private folder (``private/own<r>/<d.name>``) into ``d``, as Ray's upload or
    an ``rsync`` of the node-local folders would: the union of the files (the manifests are the same bytes)."""
    import torch.distributed as dist

    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(d, ignore_errors=True)  # a fresh merge each save, as Ray uploads each report anew
        for own in sorted(private.glob(f"own*/{d.name}")):
            shutil.copytree(own, d, dirs_exist_ok=True)
    dist.barrier()


def fsdp_builder(root: str, online: str | None = None) -> dict:
    """4 ranks: FSDP2 (4), HSDP (2 x 2), FSDP2 x DTensor tensor parallel (2 x 2); FSDP2 and HSDP also into DCP;
    FSDP2 saved with ``shared=False`` into a folder per rank, then merged (``private``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    from functional_ema._testing.multirank import TP_DECAY, tp_batch, tp_mesh, tp_model

    base, times, loads = Path(root), {}, {}
    for layout in ("fsdp2", "hsdp", "tp", "private"):
        t0 = time.monotonic()
        if layout in ("fsdp2", "private"):
            mesh = init_device_mesh("cpu", (4,), mesh_dim_names=("shard",))
        elif layout == "hsdp":
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        else:
            mesh = tp_mesh((2, 2))
        model, opt = tp_model(0, mesh, tp=layout == "tp")
        run = _Run(fe.init_ema(fe.local_shards(model), num_emas=2))

        def advance(model=model, opt=opt, mesh=mesh, run=run):
            run.step += 1
            model(tp_batch(run.step, mesh)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            run.state = fe.update(run.state, fe.local_shards(model), run.step, decay=(TP_DECAY, 0.9))

        def save(d, model=model, run=run, layout=layout):
            if layout == "private":  # each rank's own folder, outside the layout's (no row claims them)
                private = base.parent / f"{base.name}.private"
                own = private / f"own{dist.get_rank()}" / d.name
                fe.save(run.state, model, own, TAG, decay=(TP_DECAY, 0.9), shared=False)
                _merge_private(d, private)
                return
            fe.save(run.state, model, d, TAG, decay=(TP_DECAY, 0.9))
            if layout != "tp":  # the same EMA through DCP, into the layout's DCP folder
                dcp.save({"ema": fe.dcp.EMAStateful(model, run.state)}, checkpoint_id=str(d.parent / "dcp" / d.name))

        advance()
        # private: the merged folder is made anew from the ranks' own folders after each save (no user files)
        loads[layout] = _save_twice(
            base / layout, save, advance, model, Path(online) if online else None, user_files=layout != "private"
        )
        times[layout] = time.monotonic() - t0
    return {"times": times, "loads": loads}


def build_controller(root: Path) -> None:
    """The integration controller (one process): a not-started record (step 2, over an older one at step 1)
    and a started EMA with its record in the manifest (step 4, over an older save at step 3)."""
    from functional_ema._testing.multirank import BNSeq
    from functional_ema.integrations import EMAController

    torch.manual_seed(0)
    net = BNSeq()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    c = EMAController(0.9, buffers="average", start_step=3)
    for step in range(1, 5):
        g = torch.Generator().manual_seed(step)
        net(torch.randn(8, 7, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        c.on_step(net, step)
        where = "ck/unstarted" if step < 3 else "ck/started"
        c.save(net, root / where, step)
        if step in (1, 3):
            shutil.copytree(root / where, root / where.replace("ck/", "older/"))


#: Accelerate is in the environment: its layout (``build_accelerate``) and the save record's rows run.
HAS_ACCELERATE = importlib.util.find_spec("accelerate") is not None


def build_accelerate(root: Path) -> None:
    """``accelerator.save_state`` with an ``AcceleratorEMA`` (one process, tests/test_integrations_accelerate.py's
    run): ``ck`` saved into at steps 3 and 6 (its save record, the EMA inside, Accelerate's own files), ``older`` the
    same run's step-3 save."""
    from tests.test_integrations_accelerate import _same_folder_run

    for where, save_at in (("older", (3,)), ("ck", (3, 6))):
        *_, ema, _, _ = _same_folder_run(root / where, async_save=False, save_at=save_at)
        ema.remove_hooks()


def _accelerate_load(d: Path) -> tuple:
    """``accelerator.load_state(ck)`` into a fresh accelerator and helper: (the helper's optimizer step, the EMA, the
    model's weights). A refusal must leave everything as it was (no EMA, the step counter and weights unchanged): else
    an ``AssertionError``, which the table counts as a crash."""
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from tests.test_integrations_accelerate import _own, _prepared

    acc, model, _ = _prepared(seed=1)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    before = _own(model)
    try:
        acc.load_state(str(d / "ck"))
    except (fe.CheckpointError, fe.MismatchError):
        changed = [n for n, p in _own(model).items() if not torch.equal(p, before[n])]
        if ema.state is not None or ema.optimizer_step or changed:
            raise AssertionError(f"refused, but loaded: EMA {ema.state is not None}, weights {changed}") from None
        raise
    finally:
        ema.remove_hooks()
    return ema.optimizer_step, fe.gather_full(ema.state, model), _own(model)


def build_bucket(root: Path) -> None:
    """A plain module (one process, two EMAs, buffers) saved twice into one tag at a ``memory://`` URL, through
    the object-store writer (``_checkpoint/bucket.py``: streamed objects, a marker, the manifest last); what each
    save left in the store downloaded as it is (``older/`` after the first, ``ck/`` after the second)."""
    import secrets

    import fsspec

    from functional_ema._testing.multirank import BNSeq, checkpoint_decays

    torch.manual_seed(0)
    net = BNSeq()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    run = _Run(fe.init_ema(fe.local_shards(net), num_emas=2), fe.buffers.init_buffers(net, num_emas=2))
    url = f"memory://fe-hostile-{secrets.token_hex(4)}/ck"
    fs = fsspec.filesystem("memory")
    try:
        for step, where in ((1, "older"), (2, "ck")):
            g = torch.Generator().manual_seed(step)
            net(torch.randn(8, 7, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            run.state = fe.update(run.state, fe.local_shards(net), step, decay=checkpoint_decays())
            assert run.bstate is not None
            run.bstate = fe.buffers.update_buffers(run.bstate, net, step, decay=checkpoint_decays())
            fe.save(run.state, net, url, TAG, decay=checkpoint_decays(), buffers=run.bstate)
            fs.get(url, str(root / where), recursive=True)
    finally:
        fs.rm(url, recursive=True)


def _at_url(d: Path, folder: str, read: Callable[[str], Any]) -> Any:
    """``read(url)`` of the layout's ``folder`` uploaded as it is to a new ``memory://`` prefix (the
    object-store reader: ranged reads, nothing listed but what a URL reader lists); the prefix removed after."""
    import secrets

    import fsspec

    fs = fsspec.filesystem("memory")
    url = f"memory://fe-hostile-read-{secrets.token_hex(4)}/{folder}"
    fs.put(str(d / folder), url, recursive=True)
    try:
        return read(url)
    finally:
        fs.rm(url, recursive=True)


def _consolidated_url(d: Path) -> list:
    """``consolidate`` by URL: both EMAs joined through ``ema_latest``."""
    return _at_url(d, "ck", lambda url: [fe.consolidate(url, index=i) for i in range(2)])


def _posthoc_url(d: Path) -> dict:
    """``posthoc_offline`` of the snapshots by URL: the same synthesis as the local reader's."""
    return _at_url(d, "snaps", lambda url: fe.posthoc.posthoc_offline(url, sigma_rel=0.08, max_profile_error=None))


def build_hf(root: Path, work: Path) -> None:
    """The export's inputs (one process, tiny models of ``tests/_integration_models.py``): a Llama's
    ``save_pretrained`` folder (``like/``, one parameter frozen: the export copies it from there), the same
    weights sharded (``like_sharded/``), a LoRA adapter folder over that Llama (``adapter/``) and a diffusers
    UNet's folder (``unet_like/``); the Llama's EMA checkpoint (``ck/``, two EMAs), its consolidated file
    (``ema.safetensors``) and a post-hoc output (``posthoc.safetensors``); the LoRA's and the UNet's consolidated
    EMAs (``lora.safetensors``, ``unet.safetensors``); what the oracle compares with (``ref/``, never attacked)."""
    from safetensors.torch import load_file, save_file

    from tests._integration_models import FAMILY_DECAYS, FAMILY_TAG, quiet_hf, shard_weights, train_family

    quiet_hf()
    llama = train_family("llama_untied", work / "llama", snapshots=True)
    lora = train_family("lora", work / "lora")
    unet = train_family("unet", work / "unet")
    root.mkdir(parents=True)
    fe.save(llama.state, llama.model, root / "ck", TAG, decay=FAMILY_DECAYS)
    fe.checkpoint.consolidate_to_file(root / "ck", root / "ema.safetensors", TAG, progress=False)
    fe.posthoc.posthoc_to_file(
        work / "llama" / "snaps", root / "posthoc.safetensors", sigma_rel=0.07, max_profile_error=None
    )
    for name, run in (("lora", lora), ("unet", unet)):
        fe.checkpoint.consolidate_to_file(run.ckpt, root / f"{name}.safetensors", FAMILY_TAG, progress=False)
    base = load_file(lora.base / "model.safetensors")  # the LoRA's base is the Llama of like/: one folder serves both
    assert all(torch.equal(t, llama.initial[n]) for n, t in base.items())
    for folder, src in (
        ("like", llama.like),
        ("like_sharded", llama.like),
        ("adapter", lora.like),
        ("unet_like", unet.like),
    ):
        shutil.copytree(src, root / folder, ignore=shutil.ignore_patterns("README.md", "generation_config.json"))
    shard_weights(root / "like_sharded")
    (root / "ref").mkdir()
    refs = {"llama": llama, "lora": lora, "unet": unet}
    for name, run in refs.items():
        save_file({n: t.contiguous() for n, t in run.emas[0].items()}, root / "ref" / f"{name}.safetensors")
        save_file({n: t.contiguous() for n, t in run.initial.items()}, root / "ref" / f"{name}_initial.safetensors")
    shutil.copyfile(root / "posthoc.safetensors", root / "ref" / "posthoc.safetensors")


# ------------------------------------------------------------------------------- the readers


def _controller(step: int) -> Callable[[Path], tuple]:
    """The record's reader: a fresh controller with the saving run's rules resumes at the framework's step."""
    from functional_ema._testing.multirank import BNSeq
    from functional_ema.integrations import EMAController

    def read(d: Path) -> tuple:
        torch.manual_seed(0)
        c = EMAController(0.9, buffers="average", start_step=3)
        got = c.load(BNSeq(), d / "ck" / ("started" if step >= 3 else "unstarted"), framework_step=step)
        b = c.buffer_state
        emas = [dict(e) for e in c.state.emas] if c.state is not None else None
        return got, emas, b and ([dict(e) for e in b.emas], dict(b.copied), int(b.step))

    return read


def _consolidated(d: Path) -> list:
    """Both EMAs joined offline, through ``ema_latest`` (no tag given)."""
    return [fe.consolidate(d / "ck", index=i) for i in range(2)]


def _to_file(d: Path) -> dict:
    out = d.parent / f"{d.name}.out.safetensors"  # beside the layout's folder, not in it
    fe.checkpoint.consolidate_to_file(d / "ck", out, TAG, index=1, progress=False)
    from safetensors.torch import load_file

    try:
        return load_file(out)
    finally:
        out.unlink()


def _manifest(d: Path) -> tuple:
    """How the model was split; a checkpoint of one part: its manifest's fields (``read_manifest`` reads one part)."""
    parts = fe.checkpoint.saved_parts(d / "ck", TAG)
    if parts.tp_size * parts.pp_size > 1:
        return tuple(parts)
    m = fe.checkpoint.read_manifest(d / "ck", TAG)
    return tuple(parts), {k: m.get(k) for k in ("step", "num_emas", "dtype", "tag", "generation", "extra", "schedules")}


def _export_checkpoint(d: Path) -> dict[str, torch.Tensor]:
    """``to_hf`` of EMA 1 with a ``--like`` folder holding only a ``config.json`` (the names as the checkpoint
    holds them): the exported tensors, judged against the consolidated EMA 1 (:data:`ORACLES`)."""
    from safetensors.torch import load_file

    from functional_ema.export import to_hf

    like, out = d.parent / f"{d.name}.like", d.parent / f"{d.name}.hf"  # beside the layout's folder, not in it
    for stale in (like, out):  # an interrupted run's (FE_FUZZ_CACHE keeps the folder beside)
        shutil.rmtree(stale, ignore_errors=True)
    like.mkdir()
    (like / "config.json").write_text(json.dumps({"model_type": "fe_files_table"}))
    try:
        to_hf(d / "ck", out, like, tag=TAG, index=1, progress=False)
        got: dict[str, torch.Tensor] = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(f))
        return got
    finally:
        shutil.rmtree(like, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)


#: The exports of the ``hf`` layout: reader -> (source, --like, family, the EMA it must load as, options).
HF_EXPORTS: dict[str, tuple[str, str, str, str, dict[str, Any]]] = {
    "export ck>like": ("ck", "like", "llama_untied", "llama", {"tag": TAG}),
    "export file>like_sharded": (
        "ema.safetensors",
        "like_sharded",
        "llama_untied",
        "llama",
        {"dtype": "fp16", "max_shard_size": 20_000},
    ),
    "export posthoc>like": ("posthoc.safetensors", "like", "llama_untied", "posthoc", {"dtype": "bf16"}),
    "export lora": ("lora.safetensors", "adapter", "lora", "lora", {}),
    "export unet": ("unet.safetensors", "unet_like", "unet", "unet", {"dtype": "bf16"}),
}
_DTYPES = {None: None, "fp16": torch.float16, "bf16": torch.bfloat16}


def _like_values(like: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """``names`` as ``like``'s weight files (perhaps mutated) hold them, where they can be read."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for f in sorted(like.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as sf:
                found.update({n: sf.get_tensor(n) for n in names if n in set(sf.keys())})
        except Exception:  # noqa: BLE001 - unreadable: the clean value stays the expectation
            continue
    return found


def _hf_oracle(d: Path, out: Path, reader: str) -> str:
    """``""`` when ``out`` loads with the family's real loader as exactly the reference EMA (``d/ref``) cast to the
    export's dtype, and a weight the EMA lacks as ``--like``'s own; else what differs."""
    from safetensors.torch import load_file

    from tests._integration_models import HF_FAMILIES, load_family, oracle_problems

    _, like, family, ref, opts = HF_EXPORTS[reader]
    kind = HF_FAMILIES[family]
    ema = load_file(d / "ref" / f"{ref}.safetensors")
    initial = load_file(d / "ref" / f"{'llama' if family == 'llama_untied' else family}_initial.safetensors")
    if kind == "model":
        initial.update(_like_values(d / like, [n for n in initial if n not in ema]))
    try:
        loaded, problems = load_family(kind, family, out, d / "like", "default")  # a LoRA's base: the Llama of like/
    except Exception as e:  # noqa: BLE001 - the exported folder does not load: the oracle's no
        return f"the loader raised {type(e).__name__}: {' '.join(str(e).split())[:200]}"
    problems += oracle_problems(loaded, ema, initial, {}, _DTYPES[opts.get("dtype")], kind == "peft")
    return "; ".join(problems[:3])


def _hf_export(reader: str) -> Callable[[Path], str]:
    source, like, _, _, opts = HF_EXPORTS[reader]

    def read(d: Path) -> str:
        from functional_ema.export import to_hf

        out = d.parent / f"{d.name}.hf"
        shutil.rmtree(out, ignore_errors=True)
        try:
            to_hf(d / source, out, d / like, progress=False, **opts)
            return _hf_oracle(d, out, reader)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    return read


READERS: dict[str, Callable[[Path], Any]] = {
    "consolidate": _consolidated,
    "consolidate url": _consolidated_url,
    "consolidate_to_file": _to_file,
    "saved_parts/read_manifest": _manifest,
    "buffers.consolidate": lambda d: [fe.buffers.consolidate(d / "ck", TAG, index=i) for i in range(2)],
    "posthoc_offline": lambda d: fe.posthoc.posthoc_offline(d / "snaps", sigma_rel=0.08, max_profile_error=None),
    "posthoc url": _posthoc_url,
    "consolidate_dcp": lambda d: fe.dcp.consolidate_dcp(d / "dcp" / "ck"),
    "controller.load(2)": _controller(2),
    "controller.load(4)": _controller(4),
    "export": _export_checkpoint,
    "accelerate.load_state": _accelerate_load,
    **{name: _hf_export(name) for name in HF_EXPORTS},
}


def _export_vs_consolidated(layout: str, value: Any, clean: dict) -> str:
    """The export of a checkpoint's EMA 1 holds the consolidated EMA 1 (with the saved buffers, if any)."""
    key = (layout, "buffers.consolidate") if (layout, "buffers.consolidate") in clean else (layout, "consolidate")
    want = clean[key][1]
    if _same(value, want):
        return ""
    return f"not the consolidated EMA 1: {sorted(set(value) ^ set(want))[:3] or [n for n in want if not _same(value[n], want[n])][:3]}"


#: Readers judged by an oracle rather than by equality with the clean copy's result (a mutated ``--like`` may
#: legitimately change the output, e.g. a config field copied verbatim): (layout, value, clean results) -> ""
#: when right, else why not. The ``hf`` exports judge themselves (their value is the oracle's verdict).
ORACLES: dict[str, Callable[[str, Any, dict], str]] = {
    "export": _export_vs_consolidated,
    **{name: (lambda layout, value, clean: value) for name in HF_EXPORTS},
}
#: The files a reader reads, when not all of the layout's: a case runs it only if the mutated file is one of them.
READS = {
    "export ck>like": r"^(ck|like)/",
    "export file>like_sharded": r"^(ema\.safetensors$|like_sharded/)",
    "export posthoc>like": r"^(posthoc\.safetensors$|like/)",
    "export lora": r"^(lora\.safetensors$|adapter/)",
    "export unet": r"^(unet\.safetensors$|unet_like/)",
}


# ------------------------------------------------------------------------------- the registries


@dataclass(frozen=True)
class Layout:
    builder: str  # which launch (or in-process build) writes it
    readers: tuple[str, ...]


_CK = ("consolidate", "consolidate_to_file", "saved_parts/read_manifest", "export")
LAYOUTS: dict[str, Layout] = {
    "plain": Layout("deepspeed", (*_CK, "buffers.consolidate")),
    # by URL: ranged reads, 2 files; the snapshots too
    "zero3": Layout("deepspeed", (*_CK, "posthoc_offline", "posthoc url", "consolidate url")),
    "pp": Layout("deepspeed", (*_CK, "buffers.consolidate")),
    "moe": Layout("deepspeed", (*_CK, "buffers.consolidate")),
    "ds_tp": Layout("deepspeed", _CK),
    "fsdp2": Layout("fsdp", (*_CK, "consolidate_dcp")),
    "hsdp": Layout("fsdp", (*_CK, "consolidate_dcp")),
    "tp": Layout("fsdp", (*_CK, "consolidate url")),  # by URL: model-parallel parts joined from ranged reads
    "private": Layout("fsdp", _CK),  # saved with shared=False into a folder per rank, merged
    # saved to a URL (memory://), the objects downloaded; also read back by URL
    "bucket": Layout("bucket", (*_CK, "buffers.consolidate", "consolidate url")),
    "controller": Layout("controller", ("controller.load(2)", "controller.load(4)")),
    "hf": Layout("hf", tuple(HF_EXPORTS)),
    # accelerator.save_state's folder: the helper's save record beside the EMA and Accelerate's own files
    **({"accelerate": Layout("accelerate", ("accelerate.load_state",))} if HAS_ACCELERATE else {}),
}


@dataclass(frozen=True)
class FileKind:
    pattern: str  # a regular expression over the path relative to the layout's folder
    readers: tuple[str, ...]  # the READERS that read it (those of them a layout has run on each case)
    json: bool = False  # its JSON fields are attacked one by one
    forge: Callable[[Path], None] | None = None  # after a JSON edit: what a forger recomputes (a checksum)


def _forge_record(path: Path) -> None:
    from functional_ema._checkpoint.format import record_bytes

    path.write_bytes(record_bytes(json.loads(path.read_bytes())))


_RANK = r"ema_(?:tp\d+of\d+_pp\d+of\d+_)?rank_\d+_of_\d+(?:\.gen\d+)?\.safetensors"
_CKPT = (
    *_CK,
    "buffers.consolidate",
    "controller.load(4)",
    "export ck>like",
    "consolidate url",
    "accelerate.load_state",
)
_HF_LIKE = ("export ck>like", "export file>like_sharded", "export posthoc>like")
FILE_KINDS: dict[str, FileKind] = {
    "rank file": FileKind(rf"^ck/({TAG}|started/ema|ema)/{_RANK}$", _CKPT),
    "buffers file": FileKind(
        rf"^ck/({TAG}|started/ema|ema)/buffers_(?:tp\d+of\d+_pp\d+of\d+_)?rank_\d+_of_\d+(?:\.gen\d+)?\.safetensors$",
        _CKPT,
    ),
    "manifest": FileKind(rf"^ck/({TAG}|started/ema|ema)/ema_manifest\.json$", _CKPT, json=True),
    "ema_latest": FileKind(r"^(ck/(started/)?|snaps/)ema_latest$", (*_CKPT, "posthoc_offline", "posthoc url")),
    "integration record": FileKind(
        r"^ck/unstarted/ema/integration\.json$", ("controller.load(2)",), json=True, forge=_forge_record
    ),
    "snapshot rank file": FileKind(rf"^snaps/snapshot_\d+/{_RANK}$", ("posthoc_offline", "posthoc url")),
    "snapshot manifest": FileKind(
        r"^snaps/snapshot_\d+/ema_manifest\.json$", ("posthoc_offline", "posthoc url"), json=True
    ),
    "dcp metadata": FileKind(r"^dcp/ck/\.metadata$", ("consolidate_dcp",)),
    "dcp data": FileKind(r"^dcp/ck/[^/]+\.distcp$", ("consolidate_dcp",)),
    # The export's --like folders (another tool's files) and its file sources, in the hf layout.
    "hf config.json": FileKind(r"^(like|like_sharded|unet_like)/config\.json$", (*_HF_LIKE, "export unet"), json=True),
    "hf weight index": FileKind(r"^like_sharded/model\.safetensors\.index\.json$", _HF_LIKE, json=True),
    "hf weights": FileKind(r"^like(_sharded)?/model(-\d{5}-of-\d{5})?\.safetensors$", _HF_LIKE),
    "adapter_config.json": FileKind(r"^adapter/adapter_config\.json$", ("export lora",), json=True),
    "adapter weights": FileKind(r"^adapter/adapter_model\.safetensors$", ("export lora",)),
    "diffusers weights": FileKind(r"^unet_like/diffusion_pytorch_model\.safetensors$", ("export unet",)),
    "consolidated file": FileKind(
        r"^(ema|lora|unet)\.safetensors$", ("export file>like_sharded", "export lora", "export unet")
    ),
    "posthoc output": FileKind(r"^posthoc\.safetensors$", ("export posthoc>like",)),
    # A user's files named like the library's (USER_LOOKALIKES), kept by the saves: never read, whatever they hold.
    # AcceleratorEMA's record of the last accelerator.save_state into the folder (the curated rows: RECORD_ROWS)
    **(
        {
            "save record": FileKind(
                r"^ck/ema_save_state\.json$", ("accelerate.load_state",), json=True, forge=_forge_record
            )
        }
        if HAS_ACCELERATE
        else {}
    ),
    "user look-alike": FileKind(rf"^ck/{TAG}/({'|'.join(map(re.escape, USER_LOOKALIKES))})$", _CKPT),
}
# Accelerate's own files in its layout's folder: read by Accelerate, not by the library (not attacked here).
_ACCELERATE_OWN = r"^ck/(model\.safetensors|optimizer\.bin|random_states_\d+\.pkl)$"
# Written, never read as data: the write lock of a tag (an empty file, only ``flock``-ed); the older saves are
# this test's own copies, and so are the hf layout's references (``ref/``: what its oracle compares with).
NOT_READ = (r"(^|/)\.ema_write\.lock$", r"^older(_dcp)?/", r"^ref/", _ACCELERATE_OWN)


def _spans(path: Path, raw: bytes) -> dict[str, tuple[int, int]]:
    """Where a bit flip lands: ``header`` (safetensors: the length and the JSON header; a JSON or text
    file, DCP's metadata: all of it) and ``data`` (the tensor bytes)."""
    if path.suffix == ".safetensors" and len(raw) >= 8:
        n = min(struct.unpack("<Q", raw[:8])[0] + 8, len(raw))
        return {"header": (0, n), "data": (n, len(raw))}
    if path.suffix == ".distcp":
        return {"data": (0, len(raw))}
    return {"header": (0, len(raw))}


def _older(d: Path, rel: str) -> Path | None:
    """The same file (same rank, any generation) in the save before, if there is one: the tag's older save, or
    the snapshot before (the same rank's file of an earlier snapshot)."""
    if rel.startswith("snaps/snapshot_"):
        snaps = sorted(p.name for p in (d / "snaps").glob("snapshot_*"))
        i = snaps.index(rel.split("/")[1])
        src = d / "snaps" / snaps[i - 1] / rel.split("/", 2)[2] if i else None
        return src if src is not None and src.exists() else None
    if not rel.startswith(("ck/", "dcp/")):
        return None
    src = d / re.sub(r"^ck/", "older/", re.sub(r"^dcp/", "older_dcp/", rel))
    if src.exists():
        return src
    plain = re.sub(r"\.gen\d+(\.safetensors)$", r"\1", src.name)
    for cand in src.parent.glob("*") if src.parent.is_dir() else ():
        if re.sub(r"\.gen\d+(\.safetensors)$", r"\1", cand.name) == plain:
            return cand
    return None


@dataclass(frozen=True)
class Case:
    layout: str
    kind: str
    mutation: str
    file: str  # relative to the layout's folder
    arg: Any  # the seed, the other file, or (JSON path, value)

    @property
    def id(self) -> str:
        return f"{self.layout}|{self.kind}|{self.mutation}|{self.file}|{self.arg!r}"


def _flip(span: str) -> tuple[Callable, Callable]:
    def plan(rng: random.Random, d: Path, rel: str, siblings: list[str]) -> list:
        raw = (d / rel).read_bytes()
        lo, hi = _spans(d / rel, raw).get(span, (0, 0))
        return [rng.randrange(lo * 8, hi * 8) for _ in range(2 * BUDGET)] if hi > lo else []

    def apply(d: Path, rel: str, bit: int) -> None:
        raw = bytearray((d / rel).read_bytes())
        raw[bit // 8] ^= 1 << (bit % 8)
        (d / rel).write_bytes(bytes(raw))

    return plan, apply


def _truncate_plan(rng: random.Random, d: Path, rel: str, siblings: list[str]) -> list[int]:
    size = (d / rel).stat().st_size
    return sorted({0, *(rng.randrange(size) for _ in range(2 * BUDGET))}) if size else []


def _truncate(d: Path, rel: str, size: int) -> None:
    with open(d / rel, "r+b") as f:
        f.truncate(size)


def _duplicate(d: Path, rel: str, other: str) -> None:
    shutil.copyfile(d / other, d / rel)


def _swap(d: Path, rel: str, other: str) -> None:
    a, b = (d / rel).read_bytes(), (d / other).read_bytes()
    (d / rel).write_bytes(b)
    (d / other).write_bytes(a)


def _older_apply(d: Path, rel: str, older: str) -> None:
    shutil.copyfile(older, d / rel)


_ODD_VALUES = (None, "x", [], {}, -1, 0.5, 2**70, True)


def _json_paths(doc: Any, prefix: tuple = ()) -> list[tuple]:
    """Every field's path (objects and lists, down to the leaves), the top level excluded."""
    out = []
    items = doc.items() if isinstance(doc, dict) else enumerate(doc) if isinstance(doc, list) else ()
    for k, v in items:
        out.append((*prefix, k))
        out.extend(_json_paths(v, (*prefix, k)))
    return out


def _json_plan(rng: random.Random, d: Path, rel: str, siblings: list[str]) -> list[tuple]:
    """3 x budget fields, each a distinct field of the document (list positions alike: ``files[i].bytes`` is one
    field, at a seeded position), each set to every odd value."""
    by_field: dict[tuple, list[tuple]] = {}
    for path in _json_paths(json.loads((d / rel).read_bytes())):
        by_field.setdefault(tuple("[]" if isinstance(k, int) else k for k in path), []).append(path)
    fields = sorted(by_field, key=repr)
    chosen = [rng.choice(by_field[f]) for f in rng.sample(fields, min(len(fields), 3 * BUDGET))]
    return [(p, v) for p in chosen for v in _ODD_VALUES]


def _json_apply(d: Path, rel: str, arg: tuple) -> None:
    path, value = arg
    doc = json.loads((d / rel).read_bytes())
    node = doc
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    (d / rel).write_text(json.dumps(doc))
    kind = _kind_of(rel)
    if kind and FILE_KINDS[kind].forge:
        FILE_KINDS[kind].forge(d / rel)


def _siblings_plan(rng: random.Random, d: Path, rel: str, siblings: list[str]) -> list[str]:
    return rng.sample(siblings, min(len(siblings), BUDGET))


def _dcp_sizes_plan(rng: random.Random, d: Path, rel: str, siblings: list[str]) -> list[tuple[str, str]]:
    """``budget`` tensors of EMA 0 (the one ``consolidate_dcp`` reads) in a DCP ``.metadata``, each given a grown, a
    negative and a huge global size."""
    import pickle

    meta = pickle.loads((d / rel).read_bytes())  # the test's own build
    fqns = sorted(f for f, m in meta.state_dict_metadata.items() if ".emas.0." in f and hasattr(m, "chunks"))
    return [(f, v) for f in rng.sample(fqns, min(len(fqns), BUDGET)) for v in ("grown", "negative", "huge")]


def _dcp_sizes(d: Path, rel: str, arg: tuple[str, str]) -> None:
    import pickle

    fqn, variant = arg
    meta = pickle.loads((d / rel).read_bytes())
    size = list(meta.state_dict_metadata[fqn].size) or [1]
    size[0] = {"grown": size[0] + 3, "negative": -1, "huge": 2**62}[variant]
    meta.state_dict_metadata[fqn].size = torch.Size(size)
    (d / rel).write_bytes(pickle.dumps(meta))


def _as_folder(d: Path, rel: str, _: Any) -> None:
    (d / rel).unlink()
    (d / rel).mkdir()


def _as_fifo(d: Path, rel: str, how: str) -> None:
    """The file replaced by a FIFO (``"fifo"``), or by a link to one beside the folder (``"link"``): opening it for
    reading waits for a writer for ever, so a reader that opens it hangs (the export did, probe AQ F1)."""
    (d / rel).unlink()
    if how == "fifo":
        os.mkfifo(d / rel)
    else:
        os.mkfifo(d / f"{Path(rel).name}.pipe")
        (d / rel).symlink_to(d / f"{Path(rel).name}.pipe")


#: The export's --like files, which another tool (or a user) may leave as a FIFO or a link to one.
_LIKE_KINDS = ("hf config.json", "hf weight index", "hf weights", "adapter_config.json", "adapter weights")


@dataclass(frozen=True)
class Mutation:
    plan: Callable  # (rng, layout folder, file, same-kind files beside it) -> one argument per case
    apply: Callable[[Path, str, Any], None]
    json_only: bool = False
    kinds: tuple[str, ...] = ()  # the FILE_KINDS it applies to, when not all


MUTATIONS: dict[str, Mutation] = {
    "flip header": Mutation(*_flip("header")),
    "flip data": Mutation(*_flip("data")),
    "truncate": Mutation(_truncate_plan, _truncate),
    "delete": Mutation(lambda rng, d, rel, s: [None], lambda d, rel, _: (d / rel).unlink()),
    "duplicate": Mutation(_siblings_plan, _duplicate),
    "swap": Mutation(_siblings_plan, _swap),
    "older save": Mutation(lambda rng, d, rel, s: [str(o)] if (o := _older(d, rel)) else [], _older_apply),
    "json fields": Mutation(_json_plan, _json_apply, json_only=True),
    # DCP's .metadata gives each tensor its global size, which the reader allocates: grown past its pieces
    # (uninitialised memory was returned), negative, too large to allocate
    "dcp sizes": Mutation(_dcp_sizes_plan, _dcp_sizes, kinds=("dcp metadata",)),
    "as folder": Mutation(lambda rng, d, rel, s: [None], _as_folder, kinds=("dcp metadata", "dcp data")),
    # a FIFO, or a link to one, where --like's config, index or weights were: refused naming it, never opened
    "as fifo": Mutation(lambda rng, d, rel, s: ["fifo", "link"], _as_fifo, kinds=(*_LIKE_KINDS, "diffusers weights")),
}


def _kind_of(rel: str) -> str | None:
    kinds = [k for k, fk in FILE_KINDS.items() if re.search(fk.pattern, rel)]
    assert len(kinds) <= 1, (rel, kinds)
    return kinds[0] if kinds else None


# ----------------------------------------------------------------------------------- the run


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """Every layout's checkpoint, built once: two launches (2 and 4 ranks) and the controller in-process."""
    cache = os.environ.get("FE_FUZZ_CACHE")  # a folder to keep the built checkpoints in, across runs
    base = Path(cache) if cache else tmp_path_factory.mktemp("hostile_files")
    if (base / "built.json").exists():
        times = json.loads((base / "built.json").read_text())
        if "hf" not in times:  # a cache from before the hf layout
            _build_hf_timed(base, times)
        if "bucket" not in times:  # a cache from before the bucket layout
            _build_bucket_timed(base, times)
        if HAS_ACCELERATE and "accelerate" not in times:  # a cache from before the accelerate layout
            _build_accelerate_timed(base, times)
        return base, times
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    times = {}
    t0 = time.monotonic()
    times.update(
        run_ranks("tests.test_hostile_files:deepspeed_builder", world_size=2, timeout=600, root=str(base))[0]["times"]
    )
    times["deepspeed launch"] = time.monotonic() - t0
    t0 = time.monotonic()
    times.update(
        run_ranks("tests.test_hostile_files:fsdp_builder", world_size=4, timeout=600, root=str(base))[0]["times"]
    )
    times["fsdp launch"] = time.monotonic() - t0
    t0 = time.monotonic()
    build_controller(base / "controller")
    times["controller"] = time.monotonic() - t0
    _build_hf_timed(base, times)
    _build_bucket_timed(base, times)
    if HAS_ACCELERATE:
        _build_accelerate_timed(base, times)
    return base, times


def _build_bucket_timed(base: Path, times: dict) -> None:
    t0 = time.monotonic()
    shutil.rmtree(base / "bucket", ignore_errors=True)
    build_bucket(base / "bucket")
    times["bucket"] = time.monotonic() - t0
    (base / "built.json").write_text(json.dumps(times))


def _build_accelerate_timed(base: Path, times: dict) -> None:
    t0 = time.monotonic()
    shutil.rmtree(base / "accelerate", ignore_errors=True)
    build_accelerate(base / "accelerate")
    times["accelerate"] = time.monotonic() - t0
    (base / "built.json").write_text(json.dumps(times))


def _build_hf_timed(base: Path, times: dict) -> None:
    t0 = time.monotonic()
    shutil.rmtree(base / "hf", ignore_errors=True)
    shutil.rmtree(base / "hf_build", ignore_errors=True)
    build_hf(base / "hf", base / "hf_build")  # hf_build: the training folders the layout is made from
    times["hf"] = time.monotonic() - t0
    (base / "built.json").write_text(json.dumps(times))


class _Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Hang()


def _read(reader: str, d: Path) -> tuple[str, Any]:
    """("ok", result) or (outcome, error text)."""
    old = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CASE_TIMEOUT_S)
    try:
        return "ok", READERS[reader](d)
    except _Hang:
        return "hang", f"no answer after {CASE_TIMEOUT_S} s"
    except (fe.CheckpointError, fe.MismatchError, fe.posthoc.ReconstructionError) as e:
        return "refused", f"{type(e).__name__}: {e}"
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - anything else is the finding (DCP's CheckpointException is a BaseException)
        return "crash", f"{type(e).__name__}: {e}"
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if hasattr(a, "_asdict") and hasattr(b, "_asdict"):
        return _same(a._asdict(), b._asdict())
    return type(a) is type(b) and a == b


def _files(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*") if p.is_file())


def _cases(base: Path) -> list[Case]:
    cases = []
    for layout in LAYOUTS:
        d = base / layout
        by_kind: dict[str, list[str]] = {}
        for rel in _files(d):
            kind = _kind_of(rel)
            if kind:
                by_kind.setdefault(kind, []).append(rel)
        for kind, rels in by_kind.items():
            for mname, m in MUTATIONS.items():
                if (m.json_only and not FILE_KINDS[kind].json) or (m.kinds and kind not in m.kinds):
                    continue
                rng = random.Random(f"{SEED}|{layout}|{kind}|{mname}")
                for rel in rng.sample(rels, min(len(rels), 2 * BUDGET)):
                    siblings = [r for r in rels if r != rel and Path(r).parent == Path(rel).parent]
                    for arg in m.plan(rng, d, rel, siblings):
                        cases.append(Case(layout, kind, mname, rel, arg))
    return cases


# The online pass: ``fe.load`` of a sample of cases into the layout that saved them, on its ranks (rebuilt by the
# same builders in two more launches). In ``make fuzz`` (a budget above 1) or with FE_FUZZ_ONLINE=1.
ONLINE = os.environ.get("FE_FUZZ_ONLINE", "1" if BUDGET > 1 else "0") == "1"
ONLINE_KINDS = ("rank file", "buffers file", "manifest")  # what ``fe.load`` reads (by tag)


def _online_pass(base: Path, cases: list[Case], tmp: Path) -> list[tuple[Case, str, str]]:
    """Per layout, up to 8 x budget cases of the kinds ``fe.load`` reads, loaded on the saving layout's ranks:
    (worst outcome over the ranks, why). Ranks that disagree (one refuses, another loads) count as a crash."""
    root, picked = tmp / "online", {}
    for layout, spec in LAYOUTS.items():
        if spec.builder in ("controller", "hf", "bucket", "accelerate"):  # built in this process: no ranks to load on
            continue
        pool = [c for c in cases if c.layout == layout and c.kind in ONLINE_KINDS]
        rng = random.Random(f"{SEED}|online|{layout}")
        shutil.copytree(base / layout / "ck", root / layout / "clean" / "ck")
        for j, case in enumerate(rng.sample(pool, min(len(pool), 8 * BUDGET))):
            d = root / layout / f"c{j:04d}"
            shutil.copytree(base / layout, d, symlinks=True, ignore=shutil.ignore_patterns("older", "older_dcp"))
            MUTATIONS[case.mutation].apply(d, case.file, case.arg)
            picked[layout, d.name] = case, hashes(d)
    results = []
    for builder, world in (("deepspeed_builder", 2), ("fsdp_builder", 4)):
        ranks = run_ranks(
            f"tests.test_hostile_files:{builder}",
            world_size=world,
            timeout=900,
            root=str(tmp / builder),
            online=str(root),
        )
        for layout, per_case in ranks[0]["loads"].items():
            for name in per_case:
                outs = sorted({r["loads"][layout][name].split(":")[0] for r in ranks})
                case, before = picked[layout, name]
                worst = "crash" if len(outs) > 1 else "correct" if outs == ["correct"] else outs[0]
                why = "; ".join(f"rank {i}: {r['loads'][layout][name]}" for i, r in enumerate(ranks))
                if hashes(root / layout / name) != before:
                    worst, why = "crash", "fe.load changed files"
                results.append((case, worst, why))
    return results


def test_every_file_written_has_a_row(built: tuple[Path, dict]) -> None:
    """A file the library writes into a built checkpoint that no kind claims is a surface nobody attacks."""
    base, _ = built
    unclaimed, seen = [], set()
    for layout in LAYOUTS:
        for rel in _files(base / layout):
            kind = _kind_of(rel)
            if kind:
                seen.add(kind)
            elif not any(re.search(p, rel) for p in NOT_READ):
                unclaimed.append(f"{layout}/{rel}")
    assert not unclaimed, f"files of no FILE_KINDS row (add one): {unclaimed}"
    assert seen == set(FILE_KINDS), f"rows no built checkpoint has a file of: {set(FILE_KINDS) - seen}"


@pytest.mark.table
def test_hostile_files_table(built: tuple[Path, dict], tmp_path: Path) -> None:
    base, build_times = built
    t0 = time.monotonic()
    clean = {}
    for layout, spec in LAYOUTS.items():
        for reader in spec.readers:
            outcome, value = _read(reader, base / layout)
            assert outcome == "ok", (layout, reader, value)
            clean[layout, reader] = value
    for (layout, reader), value in clean.items():  # the oracles' readers are right on the clean copies
        assert reader not in ORACLES or not ORACLES[reader](layout, value, clean), (layout, reader, value)
    counts: dict[tuple[str, str], Counter] = {}
    failures: dict[str, str] = {}
    only = re.compile(os.environ.get("FE_FUZZ_ONLY", ""))  # a focused run: the cases whose id matches
    cases = [c for c in _cases(base) if only.search(c.id)]
    for i, case in enumerate(cases):
        d = tmp_path / f"c{i}"
        shutil.copytree(base / case.layout, d, symlinks=True, ignore=shutil.ignore_patterns("older", "older_dcp"))
        MUTATIONS[case.mutation].apply(d, case.file, case.arg)
        before = hashes(d)
        worst, why = "correct", ""
        for reader in (r for r in LAYOUTS[case.layout].readers if r in FILE_KINDS[case.kind].readers):
            if not re.search(READS.get(reader, ""), case.file):
                continue  # not a file this reader reads
            outcome, value = _read(reader, d)
            if outcome == "ok" and reader in ORACLES:
                verdict = ORACLES[reader](case.layout, value, clean)
                outcome, value = ("silent", verdict) if verdict else ("correct", "")
            elif outcome == "ok":
                outcome, value = ("correct", "") if _same(value, clean[case.layout, reader]) else ("silent", reader)
            rank = ("correct", "refused", "silent", "crash", "hang")
            if rank.index(outcome) > rank.index(worst):
                worst, why = outcome, f"{reader}: {value}"
        if hashes(d) != before:
            worst, why = "crash", "a reader changed files"
        counts.setdefault((case.kind, case.mutation), Counter())["cases"] += 1
        counts[case.kind, case.mutation][worst] += 1
        if worst in ("silent", "crash", "hang"):
            failures[case.id] = f"{worst}: {' '.join(why.split())[:300]}"
        shutil.rmtree(d)
        if i % 500 == 499:
            print(f"{i + 1}/{len(cases)} cases, {time.monotonic() - t0:.0f} s", flush=True)
    if ONLINE:
        for case, worst, why in _online_pass(base, cases, tmp_path):
            counts.setdefault((case.kind, case.mutation + " [load]"), Counter())["cases"] += 1
            counts[case.kind, case.mutation + " [load]"][worst] += 1
            if worst in ("silent", "crash", "hang"):
                failures[case.id + " [load]"] = f"{worst}: {' '.join(why.split())[:300]}"
    elapsed = time.monotonic() - t0
    print(f"\nFiles table: budget {BUDGET}, seed {SEED}, {len(cases)} cases in {elapsed:.1f} s; built in", build_times)
    cols = ("cases", "correct", "refused", "silent", "crash", "hang")
    print(f"{'kind':<20} {'mutation':<12} " + " ".join(f"{c:>7}" for c in cols))
    for (kind, mname), c in sorted(counts.items()):
        print(f"{kind:<20} {mname:<12} " + " ".join(f"{c[k]:>7}" for k in cols))
    for cid, why in sorted(failures.items()):
        print("FAIL", cid, why)
    assert not failures, "\n".join(f"{k} -> {v}" for k, v in sorted(failures.items())[:30])


# ------------------------------------------------------- the save record's rows (AcceleratorEMA)


#: The curated rows of the ``save record`` kind (AcceleratorEMA's ``ema_save_state.json``; the table's mutations attack
#: it too, through ``accelerate.load_state``): each row a damaged or forged record in a
#: whole folder (step 6, EMA at step 6), the error ``load_state`` must raise, and a fragment of its message. None of
#: them may load anything. ``forge``: the record rewritten with that field and a valid checksum (a hand edit).
RECORD_ROWS = (
    ("truncated", lambda raw: raw[: len(raw) // 2], "CorruptCheckpointError", "not a readable JSON record"),
    ("empty", lambda raw: b"", "CorruptCheckpointError", "not a readable JSON record"),
    ("not JSON", lambda raw: b"\x00\xff garbage", "CorruptCheckpointError", "not a readable JSON record"),
    ("huge", lambda raw: b" " * (1 << 21) + raw, "CorruptCheckpointError", "far more than a record"),
    (
        "byte flipped",
        lambda raw: raw.replace(b'"optimizer_step": 6', b'"optimizer_step": 7'),
        "CorruptCheckpointError",
        "checksum",
    ),
    ("forged kind", {"kind": "something else"}, "CorruptCheckpointError", "is not the accelerator.save_state record"),
    ("forged tag", {"tag": "other"}, "CorruptCheckpointError", "is not the accelerator.save_state record"),
    ("forged step -1", {"optimizer_step": -1}, "CorruptCheckpointError", "is not the accelerator.save_state record"),
    ("forged step bool", {"optimizer_step": True}, "CorruptCheckpointError", "is not the accelerator.save_state"),
    ("forged step str", {"optimizer_step": "6"}, "CorruptCheckpointError", "is not the accelerator.save_state"),
    ("forged complete", {"complete": "yes"}, "CorruptCheckpointError", "is not the accelerator.save_state record"),
    ("unfinished", {"complete": False}, "CheckpointMismatchError", "optimizer step 6 into this folder did not finish"),
    ("another step", {"optimizer_step": 3}, "CheckpointMismatchError", "optimizer step 3"),
)


@pytest.mark.skipif(not HAS_ACCELERATE, reason="needs accelerate")
def test_a_damaged_or_forged_save_record_is_refused_loading_nothing(tmp_path):
    """Every row of :data:`RECORD_ROWS`: refused with its error naming the record's folder, nothing loaded (no EMA,
    the step counter and the model's weights as they were); the folder it was copied from resumes whole."""
    from functional_ema._checkpoint.format import read_record, record_bytes
    from tests.test_integrations_accelerate import _load_refused, _load_whole, _same_folder_run

    *_, ema, weights, emas = _same_folder_run(tmp_path / "whole", async_save=False)
    ema.remove_hooks()
    record = tmp_path / "whole" / "ema_save_state.json"
    raw, fields = record.read_bytes(), read_record(record)
    assert fields is not None and fields["optimizer_step"] == 6 and fields["complete"] is True
    for name, change, error, fragment in RECORD_ROWS:
        folder = tmp_path / name.replace(" ", "_")
        shutil.copytree(tmp_path / "whole", folder)
        if callable(change):
            (folder / record.name).write_bytes(change(raw))
        else:
            body = {k: v for k, v in fields.items() if k not in ("format", "checksum")}
            (folder / record.name).write_bytes(record_bytes({**body, **change}))
        kind = getattr(fe.checkpoint, error)
        message = _load_refused(folder, None, kind)
        assert fragment in message and str(folder) in message, (name, message)
    (tmp_path / "dir_record").mkdir()
    shutil.copytree(tmp_path / "whole", tmp_path / "dir_record", dirs_exist_ok=True)
    (tmp_path / "dir_record" / record.name).unlink()
    (tmp_path / "dir_record" / record.name).mkdir()  # a folder where the record goes
    _load_refused(tmp_path / "dir_record", None, fe.checkpoint.CorruptCheckpointError)
    _load_whole(tmp_path / "whole", weights[6], emas[6], 6)


# ------------------------------------------- the export record's and the selection record's rows


#: What the record tests below lower ``foreign.MAX_JSON_BYTES`` to (64 MiB), so that a row over it is quick to hash.
_JSON_CAP = 2**18  # above the nested row's 100_000 bytes


def _sparse(f: Path, size: int) -> None:
    """A file of ``size`` zero bytes, stored sparse."""
    with open(f, "wb") as out:
        out.truncate(size)


def _tree(d: Path) -> tuple[dict[str, str], list[str]]:
    """What a refusal must leave as it was: every file's hash (a link's target) and every path, folders too."""
    return hashes(d), sorted(str(p.relative_to(d)) for p in d.rglob("*"))


#: The curated rows of ``ema_export.json`` at ``to_hf(..., overwrite=True)`` into a previous export beside which the
#: user put ``notes.md``: each a damaged or forged record (``change``: a callable on (the record, a valid record
#: elsewhere), or the fields forged into the valid record, ``...`` removing one) and a fragment of the refusal, which
#: must name the folder; nothing in it may change. A record this tool wrote lists its files (``written``, record
#: version 2 on); none but a version 1 record, listing none, replaces the folder whole.
EXPORT_RECORD_ROWS = (
    ("junk", lambda f, valid: f.write_bytes(b"\xff\x00 garbage"), "is not a previous export of this tool"),
    ("a folder", lambda f, valid: f.mkdir(), "ema_export.json is a folder)"),
    ("a link to a valid record", lambda f, valid: f.symlink_to(valid), "ema_export.json is a symbolic link, which"),
    ("a dangling link", lambda f, valid: f.symlink_to(f.parent / "gone"), "export to another folder)"),
    ("JSON null", lambda f, valid: f.write_text("null"), "ema_export.json must hold a JSON object, got NoneType"),
    ("nested JSON", lambda f, valid: f.write_text("[" * 100_000), "is not a previous export of this tool"),
    ("v2 without written", {"written": ...}, "ema_export.json (format_version 2) has no 'written' list"),
    ("v2 written null", {"written": None}, "ema_export.json (format_version 2) has no 'written' list"),
    ("v2 written a string", {"written": "notes.md"}, "has 'written' str 'notes.md', not a list of file names"),
    ("v2 written ../x", {"written": ["ema_export.json", "../x"]}, "has 'written' naming '../x', not a file name"),
    ("v2 written a\\b", {"written": ["ema_export.json", "a\\b"]}, "has 'written' naming 'a\\\\b', not a file name"),
    ("no version", {"format_version": ..., "written": ...}, "(format_version None) has no 'written' list"),
    ("too large", lambda f, valid: _sparse(f, _JSON_CAP + 1), f"has {_JSON_CAP + 1} bytes, more than a model folder's"),
)


def test_a_damaged_or_forged_export_record_replaces_nothing(tmp_path, monkeypatch):
    """Every row of :data:`EXPORT_RECORD_ROWS`: ``to_hf(overwrite=True)`` refuses, naming the folder and what is
    wrong with its record, and the folder (the user's ``notes.md`` too) is as it was, no temporary folder left; a
    record of version 1 (as exports before ``written`` wrote it) replaces it whole, as documented, with the EMA."""
    pytest.importorskip("transformers")
    monkeypatch.setattr("functional_ema._export.foreign.MAX_JSON_BYTES", _JSON_CAP)  # the "too large" row
    from safetensors.torch import load_file

    from functional_ema.checkpoint import OutputPathError
    from functional_ema.export import to_hf
    from tests.test_export import _tiny_llama_checkpoint

    ema = _tiny_llama_checkpoint(tmp_path)
    good = to_hf(tmp_path / "ckpt", tmp_path / "good", tmp_path / "base", tag="s")
    raw = json.loads((good / "ema_export.json").read_text())
    assert raw["format_version"] == 2 and "notes.md" not in raw["written"]
    valid = tmp_path / "valid.json"
    shutil.copyfile(good / "ema_export.json", valid)
    for name, change, fragment in EXPORT_RECORD_ROWS:
        d = tmp_path / "rows" / name.replace(" ", "_")
        shutil.copytree(good, d)
        (d / "notes.md").write_text("mine")
        record = d / "ema_export.json"
        record.unlink()
        if callable(change):
            change(record, valid)
        else:
            record.write_text(json.dumps({k: v for k, v in {**raw, **change}.items() if v is not ...}))
        before = _tree(tmp_path / "rows")
        with pytest.raises(OutputPathError) as refused:
            to_hf(tmp_path / "ckpt", d, tmp_path / "base", tag="s", overwrite=True)
        message = str(refused.value)
        assert fragment in message and f"refusing to replace {d}:" in message, (name, message)
        assert _tree(tmp_path / "rows") == before, name
    v1 = tmp_path / "rows" / "v1"
    shutil.copytree(good, v1)
    (v1 / "ema_export.json").write_text(
        json.dumps({k: v for k, v in {**raw, "format_version": 1}.items() if k != "written"})
    )
    (v1 / "stale.md").write_text("from the older export")
    to_hf(tmp_path / "ckpt", v1, tmp_path / "base", tag="s", overwrite=True)
    got = load_file(v1 / "model.safetensors")
    assert set(got) == set(ema) and all(torch.equal(got[n], ema[n]) for n in ema)
    assert not (v1 / "stale.md").exists() and json.loads((v1 / "ema_export.json").read_text())["format_version"] == 2


#: The curated rows of ``ema_selection.json`` (diffusers ``EMAModel.save_pretrained``'s record of its selection) in a
#: folder it saved with ``include="inp.*"``: how the record is damaged (a callable on (the record, a valid record of
#: the same selection elsewhere, a valid record of another selection)), then what ``from_pretrained`` +
#: ``load_state_dict`` into an EMA of the saving selection and ``save_pretrained`` into the folder must do: ``"ok"``
#: (as documented: the EMA loads bitwise; the record is replaced by the new save's), or a fragment of the refusal,
#: which must name the record; a refusal changes nothing in the folder.
SELECTION_RECORD_ROWS = (
    ("junk", lambda f, same, other: f.write_bytes(b"\xff\x00 garbage"), "is not valid JSON", "is not valid JSON"),
    ("JSON null", lambda f, same, other: f.write_text("null"), "must hold a JSON object", "must hold a JSON object"),
    ("a list", lambda f, same, other: f.write_text("[1]"), "must hold a JSON object", "must hold a JSON object"),
    ("too large", lambda f, same, other: _sparse(f, _JSON_CAP + 1), "more than a model folder's", "more than a"),
    ("an interrupted save's mark", lambda f, same, other: f.write_text('{"incomplete": "x"}'), "Save again", "ok"),
    ("a forged mark", lambda f, same, other: f.write_text('{"incomplete": 1, "a": 2}'), "Save again", "beside other"),
    ("a folder", lambda f, same, other: f.mkdir(), "is a folder, not the selection", "is a folder, not the selection"),
    ("a link to a valid record", lambda f, same, other: f.symlink_to(same), "ok", "is a symbolic link, not the"),
    ("a dangling link", lambda f, same, other: f.symlink_to(same.parent / "gone"), "is a link to nothing", "symbolic"),
    ("nested JSON", lambda f, same, other: f.write_text("[" * 100_000), "nested too deeply", "nested too deeply"),
    ("another selection", lambda f, same, other: shutil.copyfile(other, f), "averaged by the save, not by", "ok"),
)


def test_a_damaged_or_forged_selection_record_is_refused_changing_nothing(tmp_path, monkeypatch):
    """Every row of :data:`SELECTION_RECORD_ROWS`, at ``EMAModel.from_pretrained`` + ``load_state_dict`` and at
    ``save_pretrained``: refused naming the record with the folder unchanged (a folder of that name let the save
    rewrite the weights, then raised ``IsADirectoryError``, and the load took it for no record; nested JSON raised a
    raw ``RecursionError``), or, where documented, accepted with the EMA bitwise."""
    pytest.importorskip("diffusers")
    monkeypatch.setattr("functional_ema._export.foreign.MAX_JSON_BYTES", _JSON_CAP)  # the "too large" row
    from functional_ema import MismatchError
    from functional_ema.integrations.diffusers import SELECTION_FILE, EMAModel
    from tests.test_integrations_diffusers import _same_values, _selected_run

    r, other = _selected_run(include="inp.*"), _selected_run(include="out.*")
    r.ema.save_pretrained(tmp_path / "saved")
    other.ema.save_pretrained(tmp_path / "other")
    saved = r.ema.state_dict()
    r.ema.step(r.model.parameters())  # what a later save writes: not the saved values
    later = r.ema.state_dict()
    same, theirs = tmp_path / "same.json", tmp_path / "other" / SELECTION_FILE
    shutil.copyfile(tmp_path / "saved" / SELECTION_FILE, same)
    for name, change, at_load, at_save in SELECTION_RECORD_ROWS:
        d = tmp_path / "rows" / name.replace(" ", "_")
        shutil.copytree(tmp_path / "saved", d)
        record = d / SELECTION_FILE
        record.unlink()
        change(record, same, theirs)
        before = _tree(d)
        try:
            resumed = r.new(bound=True, include="inp.*")
            resumed.load_state_dict(EMAModel.from_pretrained(d, r.net_cls).state_dict())
            assert at_load == "ok", (name, "loaded")
            assert _same_values(resumed.state_dict()["shadow_params"], saved["shadow_params"]), name
        except ValueError as e:  # MismatchError too
            assert at_load != "ok" and at_load in str(e), (name, e)
            # a damaged record is named; values of another selection are refused naming the positions
            named = "'out.weight' (#6)" if isinstance(e, MismatchError) else str(record)
            assert named in str(e), (name, e)
        assert _tree(d) == before, name
        try:
            r.ema.save_pretrained(d)
            assert at_save == "ok", (name, "saved")
            loaded = EMAModel.from_pretrained(d, r.net_cls).state_dict()
            assert loaded["ema_selection"] == later["ema_selection"], name
            assert _same_values(loaded["shadow_params"], later["shadow_params"]), name
        except ValueError as e:
            assert at_save != "ok" and at_save in str(e) and str(record) in str(e), (name, e)
            assert _tree(d) == before, name


# ------------------------------------------------------------------ the taken generation's rows


#: The curated rows of ``.ema_generation`` (the generation a save took: ``writer.TagLock.take_generation``) in the tag
#: folder of a complete checkpoint, at the next save of the tag: how it is damaged or forged (a callable on (the
#: record, a user's file outside the checkpoint, a path outside that does not exist)), then what the save must do:
#: ``"ok"`` (a record that is no generation a save may follow with one more is ignored, as documented: the save
#: takes the manifest's generation + 1 and loads back bitwise), ``"last"`` (a record one below the largest generation
#: a checkpoint may name: the save takes that one and loads back bitwise; the next save of the tag is refused as
#: one no save can follow, never blaming the library's own manifest as damaged), or a fragment of the refusal, which
#: names the record; a refusal changes nothing (the user's file keeps its bytes, no file appears outside, the thing
#: at the record's name stays) and the tag loads its previous checkpoint bitwise.
GENERATION_RECORD_ROWS = (
    ("junk", lambda f, notes, gone: f.write_bytes(b"\xff\x00 garbage"), "ok"),
    ("empty", lambda f, notes, gone: f.write_bytes(b""), "ok"),
    ("negative", lambda f, notes, gone: f.write_bytes(b"-5\n"), "ok"),
    ("2**62 - 1", lambda f, notes, gone: f.write_bytes(b"%d\n" % (2**62 - 1)), "last"),
    ("2**62", lambda f, notes, gone: f.write_bytes(b"%d\n" % 2**62), "ok"),
    ("huge", lambda f, notes, gone: f.write_bytes(b"9" * 100_000), "ok"),
    ("a folder", lambda f, notes, gone: f.mkdir(), "is a folder, not the generation record"),
    ("a link to a user's file", lambda f, notes, gone: f.symlink_to(notes), "is a symbolic link, not the generation"),
    ("a dangling link", lambda f, notes, gone: f.symlink_to(gone), "is a symbolic link, not the generation record"),
)


def _generation_rows_tree(d: Path) -> tuple[dict[str, str], list[str]]:
    """Every file's hash (a link's target) and every path under ``d``, folders too."""
    return hashes(d), sorted(str(p.relative_to(d)) for p in d.rglob("*"))


def test_a_damaged_or_forged_generation_record_is_ignored_or_refused(tmp_path):
    """Every row of :data:`GENERATION_RECORD_ROWS`, at a blocking ``save`` and at an ``AsyncSaver.save(shared=False)``
    of the tag (1 rank, a plain module): the save and its load bitwise, or a refusal naming the record that changes
    nothing (a link there was written through, the user's file outside overwritten, and the link deleted at the
    commit; a record of 2**62 - 1 made a save whose tag every later save called damaged)."""
    from functional_ema._checkpoint.format import MANIFEST_NAME

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    shards = fe.local_shards(model)
    first = fe.update(fe.init_ema(shards), {n: t + 1 for n, t in shards.items()}, 1, decay=0.5)
    second = fe.update(first, {n: t - 2 for n, t in shards.items()}, 2, decay=0.5)
    clean = tmp_path / "clean"
    fe.save(first, model, clean, TAG)

    def same(state: Any, want: Any) -> bool:
        got = fe.load(model, d / "ck", TAG)
        return int(got.step) == int(want.step) and all(torch.equal(got.emas[0][n], want.emas[0][n]) for n in shards)

    for name, change, want in GENERATION_RECORD_ROWS:
        for verb in ("save", "async"):
            d = tmp_path / "rows" / f"{name.replace(' ', '_')}_{verb}"
            shutil.copytree(clean, d / "ck")
            notes, gone, rec = d / "notes.txt", d / "outside" / "gone", d / "ck" / TAG / ".ema_generation"
            notes.write_text("my precious notes\n")
            change(rec, notes, gone)
            before = _generation_rows_tree(d)
            try:
                if verb == "async":
                    fe.AsyncSaver().save(second, model, d / "ck", TAG, shared=False).wait()
                else:
                    fe.save(second, model, d / "ck", TAG)
            except fe.checkpoint.CheckpointError as e:
                assert want not in ("ok", "last") and f"save: {rec} {want}" in str(e), (name, verb, e)
                assert _generation_rows_tree(d) == before and same(None, first), (name, verb)
                continue
            assert want in ("ok", "last"), (name, verb, "saved")
            assert notes.read_text() == "my precious notes\n" and not gone.exists(), (name, verb)
            generation = json.loads((d / "ck" / TAG / MANIFEST_NAME).read_text())["generation"]
            assert generation == (2**62 if want == "last" else 1) and same(None, second), (name, verb)
            if want == "last":  # no save can follow: refused naming why, the checkpoint kept (never called damaged)
                kept = _generation_rows_tree(d)
                with pytest.raises(fe.checkpoint.CheckpointError) as refused:
                    fe.save(first, model, d / "ck", TAG)
                told = str(refused.value).replace(str(d), "<d>")  # the test's folder is named "damaged" too
                assert type(refused.value) is fe.checkpoint.CheckpointError and "damaged" not in told, told
                assert "the largest a checkpoint may name" in str(refused.value) and "loadable" in str(refused.value)
                assert _generation_rows_tree(d) == kept and same(None, second), (name, verb)
