"""The values table: every public parameter, one hostile set each, refused at the door or documented.

The public surface is walked with ``inspect.signature``: ``functional_ema.__all__`` (functions, and the
constructors and public methods of classes), the public functions of ``checkpoint``, ``posthoc``,
``schedules``, ``buffers`` and ``dcp``, and the integrations (``EMAController``, the Lightning,
Transformers and Accelerate callbacks). Every parameter found must have a row in :data:`ROWS` (or a
reason in :data:`NOT_ATTACKED`): a new public function or argument fails this test until someone
decides what its hostile values do. Each row's parameter receives every value of :data:`HOSTILE`
(``None``, a string, a bool, a float, a negative and a huge int, NaN, a numpy scalar, a 0-d tensor, a
list, a dict, a tuple), the other arguments valid, and each outcome is one of:

* refused: a library error (``TypeError``/``ValueError``, the ``CheckpointError``/``MismatchError``
  families, ``ReconstructionError``) whose message names the parameter (or what the row says it
  must name), raised before anything moved: every file under the test's folder hashed before and
  after, the EMA and buffer states and the model's weights compared bitwise;
* documented: accepted, and the row's allowance says why (``None`` is the documented default, a
  numpy integer where ints are accepted, ...);
* silent: accepted without an allowance -- a failure;
* crash: any other exception (``AttributeError``, ``KeyError``, ``IndexError``, ``OverflowError``,
  ``ZeroDivisionError``, a torch message) or a library error whose message does not name the
  parameter -- a failure.

One process, no ranks, a ``torch.nn`` model of 22 weights; the whole table runs in a few seconds.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import math
import os
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import functional_ema as fe
from functional_ema import buffers as fb
from functional_ema import checkpoint as ck
from functional_ema import dcp as fdcp
from functional_ema import posthoc as ph
from functional_ema import schedules as sch
from functional_ema.integrations._common import EMAController

# ----------------------------------------------------------------------------------- hostile values

HOSTILE: dict[str, Callable[[], Any]] = {  # made fresh for each case: a callee may keep or change them
    "None": lambda: None,
    "str": lambda: "abc",
    "bool": lambda: True,
    "float": lambda: 2.7,
    "negative": lambda: -3,
    "huge": lambda: 10**40,
    "nan": lambda: float("nan"),
    "numpy": lambda: np.int64(1),
    "tensor": lambda: torch.tensor(1),
    "list": lambda: [1],
    "dict": lambda: {"a": 1},
    "tuple": lambda: (1,),
}

# Errors of the library (a ValueError or TypeError naming the parameter, or one of its families).
LIBRARY_ERRORS = (TypeError, ValueError, fe.CheckpointError, fe.MismatchError, ph.ReconstructionError)

# ------------------------------------------------------------------------------------ allowances
# Reusable allowance sets: {hostile label: why accepting it is documented behaviour}.
NONE_DEFAULT = {"None": "None is the documented default"}
INT_SCALARS = {"numpy": "integer scalars are ints (operator.index)", "tensor": "a 0-d integer tensor is an int"}
OPT_INT = {**NONE_DEFAULT, **INT_SCALARS}
ONE_INT = {**INT_SCALARS}  # the hostile numpy/tensor values are 1: a valid count, index or step
STR_PATH = {"str": "a relative path (the test runs in its own folder)"}
INT_TAG = {
    "negative": "an int tag is its decimal name (check_tag), '-3' a plain folder name",
    "huge": "an int tag is its decimal name (check_tag)",
}
REAL = {  # a real number (a float parameter): ints, floats, numpy and one-element tensors are numbers
    "float": "a real number",
    "numpy": "a real number",
    "tensor": "a one-element real tensor is a number",
}


@dataclass
class Row:
    """One parameter: what its hostile values may do besides being refused, and what a refusal must name."""

    allow: dict[str, str] = field(default_factory=dict)
    names: tuple[str, ...] = ()  # fragments of which one must appear in the message (default: the name)


def R(*allowances: dict[str, str], names: tuple[str, ...] = (), **more: str) -> Row:
    allow: dict[str, str] = {}
    for a in allowances:
        allow.update(a)
    allow.update(more)
    return Row(allow, names)


MODEL_ARG = ("functional_ema cannot read",)  # adapter_for's TypeError, naming what it accepts

# ------------------------------------------------------------------------------------- the surface


def _public_of(module, names) -> dict[str, Any]:
    out = {}
    for name in names:
        obj = getattr(module, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue  # exceptions: their argument is a message
        out[f"{module.__name__.removeprefix('functional_ema.')}.{name}"] = obj
    return out


def public_parameters() -> dict[tuple[str, str], inspect.Parameter]:
    """(qualified name, parameter) of every public callable: functions, class constructors, public methods."""
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.lightning import EMACallback as LightningEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    found: dict[str, Any] = {}
    found.update(_public_of(fe, fe.__all__))
    for module in (ck, ph, sch, fb, fdcp):
        found.update(_public_of(module, module.__all__))
    found.update(
        {
            "integrations.EMAController": EMAController,
            "integrations.lightning.EMACallback": LightningEMA,
            "integrations.transformers.EMACallback": HFEMA,
            "integrations.accelerate.AcceleratorEMA": AcceleratorEMA,
        }
    )
    params: dict[tuple[str, str], inspect.Parameter] = {}
    for qual, obj in found.items():
        targets = [(qual, obj)]
        if inspect.isclass(obj):
            targets += [
                (f"{qual}.{m}", v)
                for m, v in vars(obj).items()
                if not m.startswith("_") and inspect.isfunction(v)  # methods written here (not properties)
            ]
        for name, fn in targets:
            try:
                sig = inspect.signature(fn)
            except (TypeError, ValueError):
                continue
            for p in sig.parameters.values():
                if p.name != "self":
                    params[(name, p.name)] = p
    return params


# Parameters deliberately not attacked, with the reason.
RECORD = "a NamedTuple/dataclass record: its fields are checked by the verbs that read it (attacked there)"
HOOK = "a framework hook: the framework passes its own objects"
NOT_ATTACKED: dict[str, str] = {
    # records and protocols
    **{
        q: RECORD
        for q in (
            "EmaState",
            "ExpertLayout",
            "ModelPart",
            "SegmentIndex",
            "ShardLayout",
            "ShardSpec",
            "Shards",
            "SwapStats",
            "UpdateInfo",
            "SaveHandle",
            "checkpoint.Loaded",
            "checkpoint.SavedParts",
            "checkpoint.SaveHandle",
            "posthoc.ProfileComparison",
            "posthoc.Snapshot",
            "posthoc.SnapshotInfo",
            "buffers.BufferState",
        )
    },
    "schedules.Schedule": "a Protocol (user schedules implement it)",
    "schedules.DecayLike": "a type alias",
    # framework hooks of the callbacks
    **{
        f"integrations.lightning.EMACallback.{m}": HOOK
        for m in (
            "setup",
            "state_dict",
            "load_state_dict",
            "on_train_start",
            "on_train_batch_end",
            "on_validation_epoch_start",
            "on_validation_epoch_end",
            "on_exception",
            "on_train_end",
        )
    },
    **{
        f"integrations.transformers.EMACallback.{m}": HOOK
        for m in ("on_train_begin", "on_step_end", "on_save", "on_evaluate", "on_train_end")
    },
}


def _not_attacked(qual: str) -> str | None:
    for prefix, why in NOT_ATTACKED.items():
        if qual == prefix or qual.startswith(prefix + "."):
            return why
    return None


# ---------------------------------------------------------------------------------------- the world


class World:
    """The objects every case needs, in ``root``: a model (Linear + BatchNorm: weights and buffers), a
    started EMA state and buffer state, a checkpoint (``ck/t``, with buffers), post-hoc snapshots
    (``snaps``), a DCP checkpoint (``dcp``), a started :class:`EMAController`."""

    def __init__(self, root: Path):
        self.root = root
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        self.model(torch.randn(8, 3))
        self.state = fe.init_ema(fe.local_shards(self.model))
        self.state2 = fe.init_ema(fe.local_shards(self.model), num_emas=2)
        self.bstate = fb.init_buffers(self.model)
        self.scheds = [sch.power(gamma=5.0), sch.power(gamma=12.0)]
        for step in (2, 4, 6):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.1)
            self.state2 = fe.update(self.state2, fe.local_shards(self.model), step, decay=self.scheds)
            ph.save_snapshot(self.state2, self.model, root / "snaps", self.scheds)
        self.state = fe.update(self.state, fe.local_shards(self.model), 6, decay=0.9)
        self.bstate = fb.update_buffers(self.bstate, self.model, 6, decay=0.9)
        fe.save(self.state, self.model, root / "ck", "t", decay=0.9, buffers=self.bstate)
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"ema": fdcp.EMAStateful(self.model, self.state)}, checkpoint_id=str(root / "dcp"))
        self.snapshots = [ph.snapshot(self.state2, self.scheds)]
        self.ctrl = EMAController(0.9, tag="ema")
        self.ctrl.on_step(self.model, 1)
        self.ctrl.save(self.model, root / "ctl", 1)
        self.gammas, self.steps = [5.0, 12.0, 5.0, 12.0], [4.0, 4.0, 6.0, 6.0]

    def fingerprint(self) -> tuple:
        """Every file under ``root`` (name and bytes), and every tensor of the states and the model."""
        files = []
        for path in sorted(self.root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                files.append((str(path.relative_to(self.root)), hashlib.sha256(path.read_bytes()).hexdigest()))
            elif path.is_dir():
                files.append((str(path.relative_to(self.root)), "dir"))
        tensors = []
        for s in (self.state, self.state2, self.ctrl.state):
            tensors.append(s.step.clone())
            for ema in s.emas:
                tensors += [t.clone() for t in ema.values()]
        tensors += [t.clone() for t in self.bstate.emas[0].values()] + [t.clone() for t in self.bstate.copied.values()]
        tensors += [t.detach().clone() for t in self.model.state_dict().values()]
        return tuple(files), tensors


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))


# ---------------------------------------------------------------------------------------- the calls
# qualified name -> (world -> (callable, valid keyword arguments)). Each call with those arguments succeeds.
Call = Callable[[World], tuple[Callable[..., Any], dict[str, Any]]]


def _ctx(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A context manager factory as a call: enter and leave it."""

    def run(**kw):
        with fn(**kw):
            pass

    return run


def _lightning(**kw):
    from functional_ema.integrations.lightning import EMACallback

    return EMACallback(**kw)


def _hf(**kw):
    from functional_ema.integrations.transformers import EMACallback

    return EMACallback(**kw)


def _accelerate(**kw):
    from functional_ema.integrations.accelerate import AcceleratorEMA

    return AcceleratorEMA(**kw)


class _Accelerator:
    """The two hooks ``AcceleratorEMA`` registers (a real ``accelerate.Accelerator`` is not needed to attack
    the helper's own arguments; the integration tests use real ones)."""

    def register_save_state_pre_hook(self, hook):
        return contextlib.nullcontext()

    def register_load_state_pre_hook(self, hook):
        return contextlib.nullcontext()


def _acc_ema(w: World):
    ema = _accelerate(accelerator=_Accelerator(), model=w.model, decay=0.9)
    ema.ema.on_step(w.model, 1)
    return ema


def _ctrl_fresh(w: World) -> EMAController:
    c = EMAController(0.9)
    c.on_step(w.model, 1)
    return c


CALLS: dict[str, Call] = {
    # core
    "init_ema": lambda w: (fe.init_ema, dict(shards=fe.local_shards(w.model), num_emas=1, dtype=torch.float32, device=None, pin_memory=False, step=0)),
    "update": lambda w: (fe.update, dict(state=w.state, shards=fe.local_shards(w.model), step=7, decay=0.9, inplace=False, nonfinite=None)),
    "update_info": lambda w: (fe.update_info, dict(state=w.state, shards=fe.local_shards(w.model))),
    "ema_nbytes": lambda w: (fe.ema_nbytes, dict(state=w.state)),
    "local_shards": lambda w: (fe.local_shards, dict(x=w.model)),
    "shard_layout": lambda w: (fe.shard_layout, dict(x=w.model)),
    "process_group": lambda w: (fe.process_group, dict(x=w.model)),
    "gather_full": lambda w: (fe.gather_full, dict(state=w.state, x=w.model, index=0, dst=None, device=None, bucket_bytes=1 << 20, join_parts=False)),
    "swapped": lambda w: (_ctx(fe.swapped), dict(x=w.model, state=w.state, index=0)),
    # checkpoints
    "save": lambda w: (fe.save, dict(state=w.state, engine=w.model, save_dir=w.root / "ck", tag="t2", decay=0.9, buffers=w.bstate, extra={"k": 1}, timeout=30.0)),
    "load": lambda w: (fe.load, dict(engine=w.model, load_dir=w.root / "ck", tag="t", dtype=None, verify=True, timeout=30.0, out=None)),
    "consolidate": lambda w: (fe.consolidate, dict(checkpoint_dir=w.root / "ck", tag="t", index=0, verify=True, tp_dims=None, tp_rank=None)),
    "consolidate_to_file": lambda w: (fe.consolidate_to_file, dict(checkpoint_dir=w.root / "ck", out_path=w.root / "out" / "c.safetensors", tag="t", index=0, verify=True, progress=False, overwrite=True, tp_dims=None, tp_rank=None)),
    "client_state_summary": lambda w: (fe.client_state_summary, dict(state=w.state, engine=w.model)),
    "AsyncSaver": lambda w: (fe.AsyncSaver, dict(max_in_flight=1, commit_timeout=60.0, pin_memory=False)),
    "AsyncSaver.save": lambda w: (_async_save, dict(state=w.state, engine=w.model, save_dir=w.root / "ck", tag="t3", decay=0.9, buffers=w.bstate, extra=None, timeout=30.0)),
    "AsyncSaver.wait": lambda w: (fe.AsyncSaver(pin_memory=False).wait, {}),
    "AsyncSaver.close": lambda w: (fe.AsyncSaver(pin_memory=False).close, {}),
    "checkpoint.read_manifest": lambda w: (ck.read_manifest, dict(checkpoint_dir=w.root / "ck", tag="t")),
    "checkpoint.load_checkpoint": lambda w: (ck.load_checkpoint, dict(engine=w.model, load_dir=w.root / "ck", tag="t", dtype=None, verify=True, timeout=30.0, out=None, buffers=True)),
    "checkpoint.saved_parts": lambda w: (ck.saved_parts, dict(checkpoint_dir=w.root / "ck", tag="t")),
    "checkpoint.default_tag": lambda w: (ck.default_tag, dict(x=w.model, state=w.state)),
    "checkpoint.rank_file_name": lambda w: (ck.rank_file_name, dict(rank=0, world_size=1, generation=0, part=None)),
    # post-hoc
    "posthoc.expressible_range": lambda w: (ph.expressible_range, dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, step=6, max_profile_error=0.5, rcond=None)),
    "posthoc.list_snapshots": lambda w: (ph.list_snapshots, dict(snapshot_dir=w.root / "snaps", prefix="snapshot_", part=None)),
    "posthoc.plot_profile": None,  # filled below (needs matplotlib)
    "posthoc.posthoc_local": lambda w: (ph.posthoc_local, dict(snapshot_dir=w.root / "snaps", layout=fe.shard_layout(w.model), sigma_rel=None, gamma=7.0, step=None, max_profile_error=None, dtype=torch.float32, verify=True, prefix="snapshot_", buffer_bytes=1 << 20)),
    "posthoc.posthoc_offline": lambda w: (ph.posthoc_offline, dict(snapshot_dir=w.root / "snaps", sigma_rel=None, gamma=7.0, step=None, max_profile_error=None, dtype=torch.float32, verify=True, prefix="snapshot_", buffer_bytes=1 << 20)),
    "posthoc.posthoc_to_file": lambda w: (ph.posthoc_to_file, dict(snapshot_dir=w.root / "snaps", out_path=w.root / "out" / "p.safetensors", sigma_rel=None, gamma=7.0, step=None, max_profile_error=None, dtype=torch.float32, verify=True, prefix="snapshot_", buffer_bytes=1 << 20, overwrite=True)),
    "posthoc.power_profile": lambda w: (ph.power_profile, dict(gamma=5.0, step=6.0, tau=np.arange(7.0))),
    "posthoc.profile_error": lambda w: (ph.profile_error, dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, coeffs=[0.25, 0.25, 0.25, 0.25], sigma_rel=None, gamma=7.0, step=6.0)),
    "posthoc.profile_inner": lambda w: (ph.profile_inner, dict(gamma_a=5.0, step_a=4.0, gamma_b=7.0, step_b=6.0)),
    "posthoc.reconstruct": lambda w: (ph.reconstruct, dict(snapshots=w.snapshots, sigma_rel=None, gamma=5.0, step=None, max_profile_error=None, dtype=torch.float32)),
    "posthoc.reconstruction_profile": lambda w: (ph.reconstruction_profile, dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, sigma_rel=None, gamma=7.0, step=6.0, coeffs=None, num=50, max_profile_error=None)),
    "posthoc.save_snapshot": lambda w: (ph.save_snapshot, dict(state=w.state2, engine=w.model, snapshot_dir=w.root / "snaps2", schedules=w.scheds, tag=None)),
    "posthoc.snapshot": lambda w: (ph.snapshot, dict(state=w.state2, schedules=w.scheds, dtype=torch.float32, device="cpu")),
    "posthoc.snapshot_gammas": lambda w: (ph.snapshot_gammas, dict(schedules=w.scheds)),
    "posthoc.snapshot_tag": lambda w: (ph.snapshot_tag, dict(step=6)),
    "posthoc.solve_coefficients": lambda w: (ph.solve_coefficients, dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, sigma_rel=None, gamma=7.0, step=6.0, max_profile_error=None, rcond=None)),
    "posthoc.synthesize": lambda w: (ph.synthesize, dict(snapshots=[{"w": torch.ones(2)}, {"w": torch.zeros(2)}], coeffs=[0.5, 0.5], dtype=torch.float32, accumulate_dtype=torch.float64)),
    # schedules
    "schedules.constant": lambda w: (sch.constant, dict(decay=0.9)),
    "schedules.litema": lambda w: (sch.litema, dict(decay=0.9)),
    "schedules.warmup": lambda w: (sch.warmup, dict(inv_gamma=1.0, power=0.75, min_decay=0.0, max_decay=0.9999, start_step=0)),
    "schedules.half_life": lambda w: (sch.half_life, dict(steps=100.0)),
    "schedules.power": lambda w: (sch.power, dict(gamma=None, sigma_rel=0.1)),
    "schedules.sigma_rel_to_gamma": lambda w: (sch.sigma_rel_to_gamma, dict(sigma_rel=0.1)),
    "schedules.gamma_to_sigma_rel": lambda w: (sch.gamma_to_sigma_rel, dict(gamma=7.0)),
    "schedules.interval_decay": lambda w: (sch.interval_decay, dict(decay=0.9, start=2, stop=4)),
    "schedules.as_schedule": lambda w: (sch.as_schedule, dict(decay=0.9)),
    "schedules.check_decay": lambda w: (sch.check_decay, dict(decay=0.9, what="decay")),
    # buffers
    "buffers.module_buffers": lambda w: (fb.module_buffers, dict(x=w.model)),
    "buffers.init_buffers": lambda w: (fb.init_buffers, dict(x=w.model, num_emas=1, step=0, dtype=torch.float32)),
    "buffers.update_buffers": lambda w: (fb.update_buffers, dict(bstate=fb.init_buffers(w.model), x=w.model, step=3, decay=0.9, mode="average")),
    "buffers.swapped_buffers": lambda w: (_ctx(fb.swapped_buffers), dict(x=w.model, bstate=w.bstate, index=0)),
    "buffers.load_buffers": lambda w: (fb.load_buffers, dict(x=w.model, load_dir=w.root / "ck", tag="t", verify=True)),
    "buffers.has_buffers": lambda w: (fb.has_buffers, dict(load_dir=w.root / "ck", tag="t")),
    "buffers.consolidate": lambda w: (fb.consolidate, dict(checkpoint_dir=w.root / "ck", tag="t", index=0, verify=True)),
    "buffers.buffer_file_name": lambda w: (fb.buffer_file_name, dict(rank=0, world_size=1, generation=0)),
    # dcp
    "dcp.EMAStateful": lambda w: (fdcp.EMAStateful, dict(x=w.model, state=w.state)),
    "dcp.EMAStateful.state_dict": lambda w: (fdcp.EMAStateful(w.model, w.state).state_dict, {}),
    "dcp.EMAStateful.load_state_dict": lambda w: (
        fdcp.EMAStateful(w.model, fe.init_ema(fe.local_shards(w.model))).load_state_dict,
        dict(state_dict=fdcp.EMAStateful(w.model, w.state).state_dict()),
    ),
    "dcp.consolidate_dcp": lambda w: (fdcp.consolidate_dcp, dict(checkpoint_dir=w.root / "dcp", key="ema", index=0)),
    # integrations
    "integrations.EMAController": lambda w: (EMAController, dict(decay=0.9, every_n_steps=1, start_step=0, buffers=None, eval_index=0, posthoc_dir=None, posthoc_every=None, export_path=None, copy_to_model=False, tag="ema", dtype=torch.float32, async_save=False)),
    "integrations.EMAController.on_step": lambda w: (_ctrl_fresh(w).on_step, dict(x=w.model, step=2)),
    "integrations.EMAController.swapped": lambda w: (_ctx(w.ctrl.swapped), dict(x=w.model, index=0)),
    "integrations.EMAController.save": lambda w: (_ctrl_fresh(w).save, dict(x=w.model, save_dir=w.root / "ctl2", framework_step=1)),
    "integrations.EMAController.wait": lambda w: (w.ctrl.wait, {}),
    "integrations.EMAController.load": lambda w: (EMAController(0.9).load, dict(x=w.model, load_dir=w.root / "ctl", framework_step=1)),
    "integrations.EMAController.full_state_dict": lambda w: (w.ctrl.full_state_dict, dict(x=w.model, index=0, dst=0, strip_prefix="")),
    "integrations.EMAController.export": lambda w: (w.ctrl.export, dict(x=w.model, path=w.root / "out" / "e.safetensors", index=0, strip_prefix="")),
    "integrations.EMAController.copy_to_model": lambda w: (_ctrl_fresh(w).copy_to_model, dict(x=torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), index=0)),
    "integrations.EMAController.on_train_end": lambda w: (w.ctrl.on_train_end, dict(x=w.model, strip_prefix="")),
    "integrations.lightning.EMACallback": lambda w: (_lightning, dict(decay=0.9)),
    "integrations.transformers.EMACallback": lambda w: (_hf, dict(decay=0.9, metric_prefix="eval_ema")),
    "integrations.transformers.EMACallback.attach": lambda w: (_hf(decay=0.9).attach, dict(trainer=_HFTrainer())),
    "integrations.accelerate.AcceleratorEMA": lambda w: (_accelerate, dict(accelerator=_Accelerator(), model=w.model, decay=0.9)),
    "integrations.accelerate.AcceleratorEMA.step": None,  # no parameters
    "integrations.accelerate.AcceleratorEMA.swapped": lambda w: (_ctx(_acc_ema(w).swapped), dict(index=0)),
    "integrations.accelerate.AcceleratorEMA.export": lambda w: (_acc_ema(w).export, dict(path=w.root / "out" / "a.safetensors", index=0)),
    "integrations.accelerate.AcceleratorEMA.copy_to_model": lambda w: (_acc_ema(w).copy_to_model, dict(index=0)),
}


class _HFTrainer:
    """What ``EMACallback.attach`` uses of a ``transformers.Trainer`` (the integration tests use real ones)."""

    def __init__(self):
        self.callback_handler = type("H", (), {"callbacks": []})()

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb)

    def train(self, *a, **k):
        return None


def _async_save(**kw):
    saver = fe.AsyncSaver(pin_memory=False)
    try:
        saver.save(**kw).wait()
    finally:
        saver.close()


def _plot(w: World):
    pytest.importorskip("matplotlib")
    return ph.plot_profile, dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, path=str(w.root / "out" / "p.png"), sigma_rel=None, gamma=7.0, step=6.0, coeffs=None, num=50, dpi=20)


CALLS["posthoc.plot_profile"] = _plot

# ---------------------------------------------------------------------------------------- the rows
# (qualified name, parameter) -> Row. A parameter without a row fails test_every_public_parameter_has_a_row.

ROWS: dict[tuple[str, str], Row] = {}


def rows(qual: str, **params: Row) -> None:
    for p, row in params.items():
        ROWS[(qual, p)] = row


# (filled below, per callable)


# ---------------------------------------------------------------------------------------- the runner


@dataclass
class Outcome:
    qual: str
    param: str
    label: str
    kind: str  # "refused", "documented", "silent", "crash"
    detail: str = ""


def _run_one(world: World, qual: str, param: str, label: str, row: Row) -> Outcome:
    fn, kwargs = CALLS[qual](world)
    kwargs = {**kwargs, param: HOSTILE[label]()}
    before = world.fingerprint()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(**kwargs)
    except LIBRARY_ERRORS as e:
        msg = str(e)
        names = row.names or (param,)
        if not any(n in msg for n in names):
            return Outcome(qual, param, label, "crash", f"{type(e).__name__} not naming {names}: {msg[:300]}")
        if not _same(before, world.fingerprint()):
            return Outcome(qual, param, label, "crash", f"refused after something moved: {type(e).__name__}: {msg[:200]}")
        return Outcome(qual, param, label, "refused", f"{type(e).__name__}: {msg[:120]}")
    except Exception as e:  # noqa: BLE001 - what the table counts as a crash
        return Outcome(qual, param, label, "crash", f"{type(e).__name__}: {str(e)[:300]}")
    if label in row.allow:
        return Outcome(qual, param, label, "documented", row.allow[label])
    return Outcome(qual, param, label, "silent", "accepted")


def run_table(root: Path, only: Callable[[str, str], bool] = lambda q, p: True) -> list[Outcome]:
    params = public_parameters()
    os.chdir(root)
    world = World(root)
    clean = world.fingerprint()
    outcomes = []
    for (qual, param), p in sorted(params.items()):
        if _not_attacked(qual) or p.kind is inspect.Parameter.VAR_KEYWORD or not only(qual, param):
            continue
        row = ROWS.get((qual, param), Row())
        for label in HOSTILE:
            outcomes.append(_run_one(world, qual, param, label, row))
            if not _same(clean, world.fingerprint()):  # an accepted value wrote or moved something: start again
                for child in sorted(root.iterdir()):
                    _remove(child)
                world = World(root)
                clean = world.fingerprint()
    return outcomes


def _remove(path: Path) -> None:
    import shutil

    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink()
