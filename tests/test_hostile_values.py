"""The values table: every public parameter, one hostile set each, refused at the door or documented.

The public surface is walked with ``inspect.signature``: ``functional_ema.__all__`` (functions, and the
constructors and public methods of classes), the public functions of ``checkpoint``, ``posthoc``,
``schedules``, ``buffers`` and ``dcp``, and the integrations (``EMAController``, the Lightning,
Transformers and Accelerate callbacks). Every parameter found must have a row in :data:`ROWS` (or a
reason in :data:`NOT_ATTACKED`): a new public function or argument fails this test until someone
decides what its hostile values do. Each row's parameter receives every value of :data:`HOSTILE`
(``None``, a string, a bool, a float, a negative and a huge int, NaN, a numpy scalar, a 0-d tensor, a
list, a dict, a tuple) and the row's own odd values (``R(values=...)``: ``metric_prefix=""``, ...),
the other arguments valid, and each outcome is one of:

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
import os
import tempfile
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
from functional_ema import export as fx
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
    values: dict[str, Callable[[], Any]] = field(default_factory=dict)  # this parameter's own, beside HOSTILE


def R(
    *allowances: dict[str, str],
    names: tuple[str, ...] = (),
    values: dict[str, Callable[[], Any]] | None = None,
    **more: str,
) -> Row:
    allow: dict[str, str] = {}
    for a in allowances:
        allow.update(a)
    allow.update(more)
    return Row(allow, names, dict(values or {}))


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
        prefix = "" if module is fe else module.__name__.removeprefix("functional_ema.") + "."
        out[f"{prefix}{name}"] = obj
    return out


def public_parameters() -> dict[tuple[str, str], inspect.Parameter]:
    """(qualified name, parameter) of every public callable: functions, class constructors, public methods."""
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.diffusers import EMAModel as DiffusersEMA
    from functional_ema.integrations.lightning import EMACallback as LightningEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    found: dict[str, Any] = {}
    found.update(_public_of(fe, fe.__all__))
    for module in (ck, ph, sch, fb, fdcp, fx):
        found.update(_public_of(module, module.__all__))
    found.update(
        {
            "integrations.EMAController": EMAController,
            "integrations.lightning.EMACallback": LightningEMA,
            "integrations.transformers.EMACallback": HFEMA,
            "integrations.accelerate.AcceleratorEMA": AcceleratorEMA,
            "integrations.diffusers.EMAModel": DiffusersEMA,
        }
    )
    params: dict[tuple[str, str], inspect.Parameter] = {}
    seen: set[int] = set()
    for qual, obj in found.items():
        if id(obj) in seen:
            continue  # re-exported under another name (fe.save is checkpoint.save): attacked once
        seen.add(id(obj))
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
            "on_before_optimizer_step",
            "on_train_batch_end",
            "on_validation_start",
            "on_validation_epoch_start",
            "on_validation_epoch_end",
            "on_test_start",
            "on_test_epoch_start",
            "on_test_epoch_end",
            "on_exception",
            "on_train_end",
        )
    },
    **{
        f"integrations.transformers.EMACallback.{m}": HOOK
        for m in (
            "on_init_end",
            "on_train_begin",
            "on_pre_optimizer_step",
            "on_step_end",
            "on_epoch_end",
            "on_log",
            "on_save",
            "on_evaluate",
            "on_train_end",
        )
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
        self.dirty = False  # the current case changed the world (restored after it)
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
        self.model(torch.randn(8, 3))
        self.state = fe.init_ema(fe.local_shards(self.model))
        self.state2 = fe.init_ema(fe.local_shards(self.model), num_emas=2)
        self.bstate = fb.init_buffers(self.model)
        self.scheds = [sch.power(gamma=5.0), sch.power(gamma=12.0)]
        (root / "out").mkdir()
        self.snapshots = []
        for step in (2, 4, 6):
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.1)
            self.state2 = fe.update(self.state2, fe.local_shards(self.model), step, decay=self.scheds)
            ph.save_snapshot(self.state2, self.model, root / "snaps", self.scheds)
            self.snapshots.append(ph.snapshot(self.state2, self.scheds))
        self.state = fe.update(self.state, fe.local_shards(self.model), 6, decay=0.9)
        self.bstate = fb.update_buffers(self.bstate, self.model, 6, decay=0.9)
        fe.save(self.state, self.model, root / "ck", "t", decay=0.9, buffers=self.bstate)
        import torch.distributed.checkpoint as dcp

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save({"ema": fdcp.EMAStateful(self.model, self.state)}, checkpoint_id=str(root / "dcp"))
        (root / "like").mkdir()  # the export's --like: a weightless folder (no class: no loader view)
        (root / "like" / "config.json").write_text('{"model_type": "values-table"}')
        self.ctrl = EMAController(0.9, tag="ema")
        self.ctrl.on_step(self.model, 1)
        self.ctrl.save(self.model, root / "ctl", 1)
        self.gammas, self.steps = [5.0, 12.0, 5.0, 12.0], [4.0, 4.0, 6.0, 6.0]

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the states and the model (the live objects)."""
        out = []
        for s in (self.state, self.state2, self.ctrl.state):
            out.append(s.step)
            for ema in s.emas:
                out += list(ema.values())
        out += list(self.bstate.emas[0].values()) + list(self.bstate.copied.values())
        return out + [t.detach() for t in self.model.state_dict().values()]

    def fingerprint(self) -> tuple:
        """Every file and folder under ``root`` (name and the bytes' hash), and a copy of every tensor."""
        files = []
        for path in sorted(self.root.rglob("*")):
            if path.is_file() and not path.is_symlink():
                files.append((str(path.relative_to(self.root)), hashlib.sha256(path.read_bytes()).hexdigest()))
            else:
                files.append((str(path.relative_to(self.root)), "dir" if path.is_dir() else "other"))
        return tuple(files), [t.clone() for t in self.tensors()]

    def files_signature(self) -> tuple:
        """Every path under ``root`` with its size, modification time and inode: a file written in place
        (new mtime) or replaced atomically (new inode), created or removed changes it. Cheap enough for
        every case; :meth:`fingerprint` (the bytes' hashes) checks the world at the start and the end."""
        out = []
        for path in sorted(self.root.rglob("*")):
            st = path.lstat()
            out.append((str(path.relative_to(self.root)), st.st_mode, st.st_size, st.st_mtime_ns, st.st_ino))
        return tuple(out)

    def keep(self) -> None:
        """Remember this state of the world (files' bytes, tensors) for :meth:`restore`."""
        self.kept_files = {p: p.read_bytes() for p in self.root.rglob("*") if p.is_file() and not p.is_symlink()}
        self.kept_dirs = {p for p in self.root.rglob("*") if p.is_dir()}
        self.kept_tensors = [t.clone() for t in self.tensors()]
        self.clean = self.fingerprint()
        self.signature = self.files_signature()

    def unchanged(self) -> bool:
        """Whether every file and tensor is as :meth:`keep` saw it."""
        live = self.tensors()
        return (
            self.files_signature() == self.signature
            and len(live) == len(self.kept_tensors)
            and all(torch.equal(a, b) for a, b in zip(live, self.kept_tensors))
        )

    def restore(self) -> None:
        """Undo what an accepted value did: files added or changed, tensors moved."""
        import shutil

        for p in sorted(self.root.rglob("*"), key=lambda p: -len(p.parts)):
            if p.is_symlink() or (p.is_file() and p not in self.kept_files):
                p.unlink()
            elif p.is_dir() and p not in self.kept_dirs:
                shutil.rmtree(p)
        for p, data in self.kept_files.items():
            if not p.is_file() or p.read_bytes() != data:
                p.write_bytes(data)
        with torch.no_grad():
            for live, kept in zip(self.tensors(), self.kept_tensors):
                live.copy_(kept)
        assert _same(self.clean, self.fingerprint()), "the test could not restore its world"
        self.signature = self.files_signature()


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


def _posthoc_args(w: World, **more: Any) -> dict[str, Any]:
    """Valid arguments of the post-hoc verbs that read snapshot files (``more``: a verb's own)."""
    return dict(
        snapshot_dir=w.root / "snaps",
        **more,
        sigma_rel=None,
        gamma=7.0,
        step=None,
        max_profile_error=None,
        dtype=torch.float32,
        verify=True,
        prefix="snapshot_",
        buffer_bytes=1 << 20,
    )


def _acc_ema(w: World):
    ema = _accelerate(accelerator=_Accelerator(), model=w.model, decay=0.9)
    ema.ema.on_step(w.model, 1)
    return ema


_DIFFUSERS_NET: list[type] = []  # the class below, made once (diffusers imported only when the table runs)


def _diffusers_net() -> type:
    """A diffusers model class with the world model's parameters (Linear(3, 4), BatchNorm1d(4)): ``model_cls``."""
    if not _DIFFUSERS_NET:
        from diffusers import ConfigMixin, ModelMixin
        from diffusers.configuration_utils import register_to_config

        class ValuesNet(ModelMixin, ConfigMixin):
            @register_to_config
            def __init__(self, width: int = 4):
                super().__init__()
                self.lin = torch.nn.Linear(3, width)
                self.bn = torch.nn.BatchNorm1d(width)

        _DIFFUSERS_NET.append(ValuesNet)
    return _DIFFUSERS_NET[0]


def _twin() -> torch.nn.Module:
    """A model shaped like the world's, outside the world (a separate copy, or another model to copy into)."""
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))


def _dema(w: World, stepped: bool = True):
    """diffusers' EMAModel API over the world's model: started from a twin, stepped once with the model."""
    from functional_ema.integrations.diffusers import EMAModel

    net = _diffusers_net()
    ema = EMAModel(_twin().parameters(), model_cls=net, model_config=net().config)
    if stepped:
        ema.step(w.model.parameters())
    return ema


def _dema_stored(w: World):
    ema, other = _dema(w), _twin()
    ema.store(other.parameters())
    return ema.restore, dict(parameters=other.parameters())


def _ctrl_fresh(w: World) -> EMAController:
    c = EMAController(0.9)
    c.on_step(w.model, 1)
    return c


CALLS: dict[str, Call] = {
    # core
    "init_ema": lambda w: (
        fe.init_ema,
        dict(shards=fe.local_shards(w.model), num_emas=1, dtype=torch.float32, device=None, pin_memory=False, step=0),
    ),
    "update": lambda w: (
        fe.update,
        dict(
            state=w.state,
            shards=fe.local_shards(w.model),
            step=7,
            decay=0.9,
            inplace=False,
            nonfinite=None,
            blocking=True,
        ),
    ),
    "wait_update": lambda w: (fe.wait_update, dict(state=w.state)),
    "update_info": lambda w: (fe.update_info, dict(state=w.state, shards=fe.local_shards(w.model))),
    "ema_nbytes": lambda w: (fe.ema_nbytes, dict(state=w.state)),
    "local_shards": lambda w: (fe.local_shards, dict(x=w.model)),
    "shard_layout": lambda w: (fe.shard_layout, dict(x=w.model)),
    "process_group": lambda w: (fe.process_group, dict(x=w.model)),
    "gather_full": lambda w: (
        fe.gather_full,
        dict(state=w.state, x=w.model, index=0, dst=None, device=None, bucket_bytes=1 << 20, join_parts=False),
    ),
    "swapped": lambda w: (_ctx(fe.swapped), dict(x=w.model, state=w.state, index=0)),
    # checkpoints
    "save": lambda w: (
        fe.save,
        dict(
            state=w.state,
            engine=w.model,
            save_dir=w.root / "ck",
            tag="t2",
            decay=0.9,
            buffers=w.bstate,
            extra={"k": 1},
            timeout=30.0,
        ),
    ),
    "load": lambda w: (
        fe.load,
        dict(engine=w.model, load_dir=w.root / "ck", tag="t", dtype=None, verify=True, timeout=30.0, out=None),
    ),
    "consolidate": lambda w: (
        fe.consolidate,
        dict(checkpoint_dir=w.root / "ck", tag="t", index=0, verify=True, tp_dims=None, tp_rank=None),
    ),
    "export.to_hf": lambda w: (
        fx.to_hf,
        dict(
            source=w.root / "ck",
            out_dir=w.root / "out" / "hf",
            like=w.root / "like",
            tag="t",
            index=0,
            dtype=None,
            max_shard_size="5GB",
            missing="like",
            adapter_name="default",
            overwrite=True,
            verify=True,
            progress=False,
            tp_dims=None,
        ),
    ),
    "export.parse_dtype": lambda w: (fx.parse_dtype, dict(dtype="bf16")),
    "export.parse_size": lambda w: (fx.parse_size, dict(size="5GB")),
    "export.hf_name": lambda w: (fx.hf_name, dict(name="module.lora_A.default.weight", adapter_name="default")),
    "consolidate_to_file": lambda w: (
        fe.consolidate_to_file,
        dict(
            checkpoint_dir=w.root / "ck",
            out_path=w.root / "out" / "c.safetensors",
            tag="t",
            index=0,
            verify=True,
            progress=False,
            overwrite=True,
            tp_dims=None,
            tp_rank=None,
        ),
    ),
    "client_state_summary": lambda w: (fe.client_state_summary, dict(state=w.state, engine=w.model)),
    "AsyncSaver": lambda w: (fe.AsyncSaver, dict(max_in_flight=1, commit_timeout=60.0, pin_memory=False)),
    "AsyncSaver.save": lambda w: (
        _async_save,
        dict(
            state=w.state,
            engine=w.model,
            save_dir=w.root / "ck",
            tag="t3",
            decay=0.9,
            buffers=w.bstate,
            extra=None,
            timeout=30.0,
            shared=True,
        ),
    ),
    "AsyncSaver.wait": lambda w: (fe.AsyncSaver(pin_memory=False).wait, {}),
    "AsyncSaver.close": lambda w: (fe.AsyncSaver(pin_memory=False).close, {}),
    "checkpoint.read_manifest": lambda w: (ck.read_manifest, dict(checkpoint_dir=w.root / "ck", tag="t")),
    "checkpoint.load_checkpoint": lambda w: (
        ck.load_checkpoint,
        dict(
            engine=w.model,
            load_dir=w.root / "ck",
            tag="t",
            dtype=None,
            verify=True,
            timeout=30.0,
            out=None,
            buffers=True,
        ),
    ),
    "checkpoint.saved_parts": lambda w: (ck.saved_parts, dict(checkpoint_dir=w.root / "ck", tag="t")),
    "checkpoint.default_tag": lambda w: (ck.default_tag, dict(x=w.model, state=w.state)),
    "checkpoint.rank_file_name": lambda w: (ck.rank_file_name, dict(rank=0, world_size=1, generation=0, part=None)),
    # post-hoc
    "posthoc.expressible_range": lambda w: (
        ph.expressible_range,
        dict(snapshot_gammas=w.gammas, snapshot_steps=w.steps, step=6, max_profile_error=0.5, rcond=None),
    ),
    "posthoc.list_snapshots": lambda w: (
        ph.list_snapshots,
        dict(snapshot_dir=w.root / "snaps", prefix="snapshot_", part=None),
    ),
    "posthoc.plot_profile": None,  # filled below (needs matplotlib)
    "posthoc.posthoc_local": lambda w: (ph.posthoc_local, _posthoc_args(w, layout=fe.shard_layout(w.model))),
    "posthoc.posthoc_offline": lambda w: (ph.posthoc_offline, _posthoc_args(w)),
    "posthoc.posthoc_to_file": lambda w: (
        ph.posthoc_to_file,
        _posthoc_args(w, out_path=w.root / "out" / "p.safetensors", overwrite=True),
    ),
    "posthoc.power_profile": lambda w: (ph.power_profile, dict(gamma=5.0, step=6.0, tau=np.arange(7.0))),
    "posthoc.profile_error": lambda w: (
        ph.profile_error,
        dict(
            snapshot_gammas=w.gammas,
            snapshot_steps=w.steps,
            coeffs=[0.25, 0.25, 0.25, 0.25],
            sigma_rel=None,
            gamma=7.0,
            step=6.0,
        ),
    ),
    "posthoc.profile_inner": lambda w: (ph.profile_inner, dict(gamma_a=5.0, step_a=4.0, gamma_b=7.0, step_b=6.0)),
    "posthoc.reconstruct": lambda w: (
        ph.reconstruct,
        dict(snapshots=w.snapshots, sigma_rel=None, gamma=5.0, step=None, max_profile_error=None, dtype=torch.float32),
    ),
    "posthoc.reconstruction_profile": lambda w: (
        ph.reconstruction_profile,
        dict(
            snapshot_gammas=w.gammas,
            snapshot_steps=w.steps,
            sigma_rel=None,
            gamma=7.0,
            step=6.0,
            coeffs=None,
            num=50,
            max_profile_error=None,
        ),
    ),
    "posthoc.save_snapshot": lambda w: (
        ph.save_snapshot,
        dict(
            state=w.state2,
            engine=w.model,
            snapshot_dir=w.root / "snaps2",
            schedules=w.scheds,
            tag=None,
            dtype=torch.float32,
        ),
    ),
    "posthoc.snapshot": lambda w: (
        ph.snapshot,
        dict(state=w.state2, schedules=w.scheds, dtype=torch.float32, device="cpu"),
    ),
    "posthoc.snapshot_gammas": lambda w: (ph.snapshot_gammas, dict(schedules=w.scheds)),
    "posthoc.snapshot_tag": lambda w: (ph.snapshot_tag, dict(step=6)),
    "posthoc.solve_coefficients": lambda w: (
        ph.solve_coefficients,
        dict(
            snapshot_gammas=w.gammas,
            snapshot_steps=w.steps,
            sigma_rel=None,
            gamma=7.0,
            step=6.0,
            max_profile_error=None,
            rcond=None,
        ),
    ),
    "posthoc.synthesize": lambda w: (
        ph.synthesize,
        dict(
            snapshots=[{"w": torch.ones(2)}, {"w": torch.zeros(2)}],
            coeffs=[0.5, 0.5],
            dtype=torch.float32,
            accumulate_dtype=torch.float64,
        ),
    ),
    # schedules
    "schedules.constant": lambda w: (sch.constant, dict(decay=0.9)),
    "schedules.litema": lambda w: (sch.litema, dict(decay=0.9)),
    "schedules.warmup": lambda w: (
        sch.warmup,
        dict(inv_gamma=1.0, power=0.75, min_decay=0.0, max_decay=0.9999, start_step=0),
    ),
    "schedules.half_life": lambda w: (sch.half_life, dict(steps=100.0)),
    "schedules.power": lambda w: (sch.power, dict(gamma=None, sigma_rel=0.1)),
    "schedules.sigma_rel_to_gamma": lambda w: (sch.sigma_rel_to_gamma, dict(sigma_rel=0.1)),
    "schedules.gamma_to_sigma_rel": lambda w: (sch.gamma_to_sigma_rel, dict(gamma=7.0)),
    "schedules.interval_decay": lambda w: (sch.interval_decay, dict(decay=0.9, start=2, stop=4)),
    "schedules.as_schedule": lambda w: (sch.as_schedule, dict(decay=0.9)),
    # buffers
    "buffers.module_buffers": lambda w: (fb.module_buffers, dict(x=w.model)),
    "buffers.init_buffers": lambda w: (fb.init_buffers, dict(x=w.model, num_emas=1, step=0, dtype=torch.float32)),
    "buffers.update_buffers": lambda w: (
        fb.update_buffers,
        dict(bstate=fb.init_buffers(w.model), x=w.model, step=3, decay=0.9, mode="average"),
    ),
    "buffers.swapped_buffers": lambda w: (_ctx(fb.swapped_buffers), dict(x=w.model, bstate=w.bstate, index=0)),
    "buffers.load_buffers": lambda w: (fb.load_buffers, dict(x=w.model, load_dir=w.root / "ck", tag="t", verify=True)),
    "buffers.has_buffers": lambda w: (fb.has_buffers, dict(load_dir=w.root / "ck", tag="t")),
    "buffers.consolidate": lambda w: (
        fb.consolidate,
        dict(checkpoint_dir=w.root / "ck", tag="t", index=0, verify=True),
    ),
    "buffers.buffer_file_name": lambda w: (fb.buffer_file_name, dict(rank=0, world_size=1, generation=0)),
    # dcp
    "dcp.EMAStateful": lambda w: (fdcp.EMAStateful, dict(x=w.model, state=w.state, checkpoint_id=None)),
    "dcp.EMAStateful.state_dict": lambda w: (fdcp.EMAStateful(w.model, w.state).state_dict, {}),
    "dcp.EMAStateful.load_state_dict": lambda w: (
        fdcp.EMAStateful(w.model, fe.init_ema(fe.local_shards(w.model))).load_state_dict,
        dict(state_dict=fdcp.EMAStateful(w.model, w.state).state_dict()),
    ),
    "dcp.consolidate_dcp": lambda w: (
        fdcp.consolidate_dcp,
        dict(checkpoint_dir=w.root / "dcp", key="ema", index=0, verify=True),
    ),
    # integrations
    "integrations.EMAController": lambda w: (
        EMAController,
        dict(
            decay=0.9,
            every_n_steps=1,
            start_step=0,
            buffers=None,
            eval_index=0,
            posthoc_dir=None,
            posthoc_every=None,
            export_path=None,
            copy_to_model=False,
            tag="ema",
            dtype=torch.float32,
            async_save=False,
        ),
    ),
    "integrations.EMAController.on_step": lambda w: (_ctrl_fresh(w).on_step, dict(x=w.model, step=2)),
    "integrations.EMAController.before_optimizer_step": lambda w: (w.ctrl.before_optimizer_step, dict(x=w.model)),
    "integrations.EMAController.swapped": lambda w: (_ctx(w.ctrl.swapped), dict(x=w.model, index=0)),
    "integrations.EMAController.save": lambda w: (
        _ctrl_fresh(w).save,
        dict(x=w.model, save_dir=w.root / "ctl2", framework_step=1),
    ),
    "integrations.EMAController.wait": lambda w: (w.ctrl.wait, {}),
    "integrations.EMAController.load": lambda w: (
        EMAController(0.9).load,
        dict(x=w.model, load_dir=w.root / "ctl", framework_step=1),
    ),
    "integrations.EMAController.full_state_dict": lambda w: (
        w.ctrl.full_state_dict,
        dict(x=w.model, index=0, dst=0, strip_prefix=""),
    ),
    "integrations.EMAController.export": lambda w: (
        w.ctrl.export,
        dict(x=w.model, path=w.root / "out" / "e.safetensors", index=0, strip_prefix=""),
    ),
    "integrations.EMAController.copy_to_model": lambda w: (
        _ctrl_fresh(w).copy_to_model,
        dict(x=torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4)), index=0),
    ),
    "integrations.EMAController.on_train_end": lambda w: (w.ctrl.on_train_end, dict(x=w.model, strip_prefix="")),
    "integrations.lightning.EMACallback": lambda w: (_lightning, dict(decay=0.9)),
    "integrations.transformers.EMACallback": lambda w: (_hf, dict(decay=0.9, metric_prefix="eval_ema")),
    "integrations.transformers.EMACallback.attach": lambda w: (_hf(decay=0.9).attach, dict(trainer=_HFTrainer())),
    "integrations.accelerate.AcceleratorEMA": lambda w: (
        _accelerate,
        dict(accelerator=_Accelerator(), model=w.model, decay=0.9),
    ),
    "integrations.accelerate.AcceleratorEMA.step": None,  # no parameters
    "integrations.accelerate.AcceleratorEMA.swapped": lambda w: (_ctx(_acc_ema(w).swapped), dict(index=0)),
    "integrations.accelerate.AcceleratorEMA.export": lambda w: (
        _acc_ema(w).export,
        dict(path=w.root / "out" / "a.safetensors", index=0),
    ),
    "integrations.accelerate.AcceleratorEMA.copy_to_model": lambda w: (_acc_ema(w).copy_to_model, dict(index=0)),
    "integrations.diffusers.EMAModel": lambda w: (
        _dema_class(),
        dict(
            parameters=_twin().parameters(),
            decay=0.9,
            min_decay=0.0,
            update_after_step=0,
            use_ema_warmup=False,
            inv_gamma=1.0,
            power=0.75,
            foreach=False,
            model_cls=_diffusers_net(),
            model_config=_diffusers_net()().config,
        ),
    ),
    "integrations.diffusers.EMAModel.get_decay": lambda w: (
        _dema(w, stepped=False).get_decay,
        dict(optimization_step=3),
    ),
    "integrations.diffusers.EMAModel.step": lambda w: (_dema(w).step, dict(parameters=w.model.parameters())),
    "integrations.diffusers.EMAModel.store": lambda w: (_dema(w).store, dict(parameters=_twin().parameters())),
    "integrations.diffusers.EMAModel.copy_to": lambda w: (_dema(w).copy_to, dict(parameters=_twin().parameters())),
    "integrations.diffusers.EMAModel.restore": _dema_stored,
    "integrations.diffusers.EMAModel.save_pretrained": lambda w: (
        _dema(w).save_pretrained,
        dict(path=w.root / "out" / "dm"),
    ),
    "integrations.diffusers.EMAModel.load_state_dict": lambda w: (
        _dema(w).load_state_dict,
        dict(state_dict=_dema(w).state_dict()),
    ),
    "integrations.diffusers.EMAModel.to": lambda w: (
        _dema(w).to,
        dict(device="cpu", dtype=torch.float32, non_blocking=False),
    ),
}


def _dema_class() -> type:
    from functional_ema.integrations.diffusers import EMAModel

    return EMAModel


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
    return ph.plot_profile, dict(
        snapshot_gammas=w.gammas,
        snapshot_steps=w.steps,
        path=str(w.root / "out" / "p.png"),
        sigma_rel=None,
        gamma=7.0,
        step=6.0,
        coeffs=None,
        num=50,
        dpi=20,
    )


CALLS["posthoc.plot_profile"] = _plot

# ---------------------------------------------------------------------------------------- the rows
# (qualified name, parameter) -> Row. A parameter without a row fails test_every_public_parameter_has_a_row.

ROWS: dict[tuple[str, str], Row] = {}


def rows(qual: str, **params: Row) -> None:
    for p, row in params.items():
        ROWS[(qual, p)] = row


# (filled below, per callable)


# ---------------------------------------------------------------------------------------- the runner


CASE_TIMEOUT_S = 10  # a case that waits this long is a hang (counted as a crash)


class _Hang(BaseException):
    pass


@contextlib.contextmanager
def _deadline(seconds: float) -> Iterator[None]:
    import signal

    def fire(*_):
        raise _Hang()

    old = signal.signal(signal.SIGALRM, fire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@dataclass
class Outcome:
    qual: str
    param: str
    label: str
    kind: str  # "refused", "documented", "silent", "crash"
    detail: str = ""


def _run_one(world: World, qual: str, param: str, label: str, row: Row) -> Outcome:
    fn, kwargs = CALLS[qual](world)
    kwargs = {**kwargs, param: (row.values.get(label) or HOSTILE[label])()}
    try:
        with warnings.catch_warnings(), _deadline(CASE_TIMEOUT_S):
            warnings.simplefilter("ignore")
            fn(**kwargs)
    except _Hang:
        return Outcome(qual, param, label, "crash", f"no answer within {CASE_TIMEOUT_S} s")
    except LIBRARY_ERRORS as e:
        msg = str(e)
        names = row.names or (param,)
        if not any(n in msg for n in names):
            return Outcome(qual, param, label, "crash", f"{type(e).__name__} not naming {names}: {msg[:300]}")
        if not world.unchanged():
            world.dirty = True
            return Outcome(
                qual, param, label, "crash", f"refused after something moved: {type(e).__name__}: {msg[:200]}"
            )
        return Outcome(qual, param, label, "refused", f"{type(e).__name__}: {msg[:120]}")
    except Exception as e:  # noqa: BLE001 - what the table counts as a crash
        return Outcome(qual, param, label, "crash", f"{type(e).__name__}: {str(e)[:300]}")
    if label in row.allow:
        return Outcome(qual, param, label, "documented", row.allow[label])
    return Outcome(qual, param, label, "silent", "accepted")


TRACE = bool(os.environ.get("FE_VALUES_TRACE"))


def run_table(root: Path, only: Callable[[str, str], bool] = lambda q, p: True) -> list[Outcome]:
    params = public_parameters()
    os.chdir(root)
    world = World(root)
    world.keep()
    outcomes = []
    for (qual, param), p in sorted(params.items()):
        if _not_attacked(qual) or p.kind is inspect.Parameter.VAR_KEYWORD or not only(qual, param):
            continue
        row = ROWS.get((qual, param), Row())
        for label in (*HOSTILE, *(v for v in row.values if v not in HOSTILE)):
            world.dirty = False
            outcomes.append(_run_one(world, qual, param, label, row))
            if TRACE:
                print(outcomes[-1], flush=True)
            if world.dirty or (outcomes[-1].kind != "refused" and not world.unchanged()):
                world.restore()  # an accepted value wrote or moved something: undo it
    assert _same(world.clean, world.fingerprint()), "the world changed during the table"
    return outcomes


MODEL = R(names=MODEL_ARG)
STATE = R(names=("state",))
# Locations that name no place plainly, refused naming the argument before fsspec is asked: a URL with a '.'
# part (the store would fold it), one carrying a secret (never echoed), a file:// URL of another host.
ODD_URLS: dict[str, Callable[[], Any]] = {
    "url_dot_part": lambda: "memory://fe-values/./s",
    "url_secret": lambda: "s3://KEY:SECRET@fe-values/s",
    "file_url_other_host": lambda: "file://host/x",
}
# A URL the offline tools read through fsspec: memory:// only (a test sends no traffic off this machine).
DIR_IN = R(
    names=("checkpoint_dir", "checkpoint directory"),
    values={"url": lambda: "memory://fe-values/missing", **ODD_URLS},
)
DIR_LOAD = R(names=("load_dir", "checkpoint directory"), values=ODD_URLS)
DIR_OUT = R(STR_PATH)
# A URL where only a local path is taken: refused naming the argument (Path() would make it the local folder
# "memory:/..."). memory:// only: nothing is sent anywhere, should it be accepted.
URL_VALUE = {"url": lambda: "memory://fe-values/local-only"}
DIR_OUT_LOCAL = R(STR_PATH, values=URL_VALUE)
OPTIONS = R(NONE_DEFAULT, names=("storage_options",))  # str keys, a dict, and only for a URL
TAG_SAVE = R(NONE_DEFAULT, INT_TAG, str="a plain folder name")
TAG_READ = R(NONE_DEFAULT, names=("tag",))
BOOL = R(bool="a bool")
OPT_BOOL = R(NONE_DEFAULT, bool="a bool")
INDEX = R(INT_SCALARS)
TIMEOUT = R(NONE_DEFAULT, REAL, huge="a bound on a wait, finite")
EMA_DTYPE = R(names=("dtype",))
OPT_EMA_DTYPE = R(NONE_DEFAULT, names=("dtype",))
DEVICE = R(NONE_DEFAULT, names=("device",))
STEP = R(INT_SCALARS)
OPT_STEP = R(OPT_INT)
DECAY = R(
    names=("decay",),
    list="[1]: one decay (1.0) per EMA",
    tuple="(1,): one decay (1.0) per EMA",
    numpy="a real number (1), as schedules.constant takes it",
    tensor="a one-element real tensor is a number (1), as schedules.constant takes it",
)


def _raising(name: str) -> bool:
    raise KeyError(name)


# A selection (include/exclude): odd patterns, patterns of no name, predicates that raise or answer a non-bool.
SELECTION_TYPES: dict[str, Callable[[], Any]] = {
    "empty_pattern": lambda: "",
    "empty_in_list": lambda: ["0.*", ""],
    "bytes": lambda: b"0.*",
    "nested_list": lambda: [["0.*"]],
}
SELECTION_VALUES: dict[str, Callable[[], Any]] = {
    **SELECTION_TYPES,
    "regex": lambda: r"^0\.weight$",
    "no_such_name": lambda: "decoder.*",
    "one_of_two_missing": lambda: ["0.*", "decoder.*"],
    "raises": lambda: _raising,
    "non_bool": lambda: lambda name: 1,
    "tensor_bool": lambda: lambda name: torch.tensor(True),
    "numpy_bool": lambda: lambda name: __import__("numpy").bool_(True),
}
INCLUDE = R(
    NONE_DEFAULT,
    names=("include",),
    values={**SELECTION_VALUES, "empty_list": lambda: [], "selects_nothing": lambda: lambda name: False},
)
EXCLUDE = R(
    NONE_DEFAULT,
    names=("exclude",),
    values={**SELECTION_VALUES, "everything": lambda: "*", "everything_by_predicate": lambda: lambda name: True},
)
# A load's selection also differs from the saved one (every parameter): refused naming the names and selections.
LOAD_INCLUDE = R(INCLUDE.allow, names=("include",), values={**INCLUDE.values, "other_than_saved": lambda: "0.*"})
DECAY_VALUE = R(names=("decay",), numpy="a real number (1)", tensor="a one-element real tensor is a number (1)")

rows(
    "init_ema",
    shards=R(names=("shards",)),
    num_emas=R(INT_SCALARS),
    dtype=EMA_DTYPE,
    # a device this machine lacks: refused naming device, before torch's AssertionError from the allocation
    device=R(DEVICE.allow, names=DEVICE.names, values={"absent_gpu": lambda: "cuda:99"}),
    pin_memory=BOOL,
    step=STEP,
)
rows(
    "update",
    state=STATE,
    shards=R(names=("shards",)),
    step=R(OPT_INT),
    decay=DECAY,
    inplace=BOOL,
    nonfinite=R(NONE_DEFAULT),
    blocking=BOOL,
)
rows("wait_update", state=STATE)
rows("update_info", state=STATE, shards=R(names=("shards",)))
rows("ema_nbytes", state=STATE)
rows("local_shards", x=MODEL, include=INCLUDE, exclude=EXCLUDE)
rows("shard_layout", x=MODEL)
rows("process_group", x=MODEL)
rows(
    "gather_full",
    state=STATE,
    x=MODEL,
    index=INDEX,
    dst=R(NONE_DEFAULT, INT_SCALARS, names=("dst",)),
    device=DEVICE,
    bucket_bytes=R(ONE_INT, huge="a bucket bound, not an allocation"),
    join_parts=BOOL,
)
rows("swapped", x=MODEL, state=STATE, index=INDEX)
for q in ("save", "AsyncSaver.save"):
    rows(
        q,
        state=STATE,
        engine=MODEL,
        save_dir=DIR_OUT,
        tag=TAG_SAVE,
        decay=R(NONE_DEFAULT, DECAY.allow, names=("decay",)),
        buffers=R(NONE_DEFAULT, names=("buffers",)),
        extra=R(NONE_DEFAULT, names=("extra",), dict="a small JSON object, as documented"),
        timeout=TIMEOUT,
    )
for q in ("save", "AsyncSaver.save"):
    rows(q, shared=BOOL, storage_options=R(NONE_DEFAULT, names=("storage_options",)))
rows(  # a URL is a location too (fsspec; memory:// here, per process): the save goes there
    "save",
    save_dir=R(
        STR_PATH,
        url="an fsspec URL: the checkpoint is written there",
        values={"url": lambda: "memory://fe-values/s", **ODD_URLS},
    ),
)
rows(
    "load",
    engine=MODEL,
    load_dir=DIR_LOAD,
    tag=TAG_READ,
    dtype=OPT_EMA_DTYPE,
    verify=BOOL,
    timeout=TIMEOUT,
    out=R(NONE_DEFAULT, names=("out",)),
    shared=BOOL,
    include=LOAD_INCLUDE,
    exclude=EXCLUDE,
)
rows(
    "checkpoint.load_checkpoint",
    engine=MODEL,
    load_dir=DIR_LOAD,
    tag=TAG_READ,
    dtype=OPT_EMA_DTYPE,
    verify=BOOL,
    timeout=TIMEOUT,
    out=R(NONE_DEFAULT, names=("out",)),
    buffers=BOOL,
    shared=BOOL,
    include=LOAD_INCLUDE,
    exclude=EXCLUDE,
)
for q in ("load", "checkpoint.load_checkpoint"):  # a URL is read in place (memory:// here): one holding nothing
    rows(
        q,
        storage_options=R(NONE_DEFAULT, names=("storage_options",)),
        load_dir=R(names=DIR_LOAD.names, values=DIR_IN.values),
    )
for q in ("consolidate", "consolidate_to_file"):
    rows(q, checkpoint_dir=DIR_IN, tag=TAG_READ, index=INDEX, verify=BOOL, tp_dims=R(NONE_DEFAULT), tp_rank=R(OPT_INT))
rows("consolidate_to_file", out_path=DIR_OUT_LOCAL, progress=OPT_BOOL, overwrite=BOOL)
for q in ("consolidate", "consolidate_to_file", "checkpoint.read_manifest", "checkpoint.saved_parts", "export.to_hf"):
    rows(q, storage_options=OPTIONS)
rows("client_state_summary", state=STATE, engine=R(NONE_DEFAULT, names=MODEL_ARG))
SHARD_SIZE = R(names=("max_shard_size",), huge="a limit above the model's size: one shard")
rows(
    "export.to_hf",
    source=R(names=("source", "checkpoint directory"), values=DIR_IN.values),  # a URL is read in place
    out_dir=R(STR_PATH, names=("out_dir",), values=URL_VALUE),
    like=R(names=("like",), values=URL_VALUE),
    tag=TAG_READ,
    index=R(OPT_INT),
    dtype=R(NONE_DEFAULT, names=("dtype",)),
    max_shard_size=SHARD_SIZE,
    missing=R(names=("missing",)),
    adapter_name=R(names=("adapter_name",), values={"dotted": lambda: "a.b", "empty": lambda: ""}),
    overwrite=BOOL,
    verify=BOOL,
    progress=OPT_BOOL,
    tp_dims=R(NONE_DEFAULT),
)
rows("export.parse_dtype", dtype=R(NONE_DEFAULT, names=("dtype",)))
rows("export.parse_size", size=SHARD_SIZE)
rows(
    "export.hf_name",
    name=R(names=("name",), str="a parameter name"),
    adapter_name=R(NONE_DEFAULT, names=("adapter_name",), str="an adapter name"),
)
rows(
    "AsyncSaver",
    max_in_flight=R(INT_SCALARS, huge="a bound on writes in flight"),
    commit_timeout=TIMEOUT,
    pin_memory=BOOL,
)
rows("checkpoint.read_manifest", checkpoint_dir=DIR_IN, tag=TAG_READ)
rows("checkpoint.saved_parts", checkpoint_dir=DIR_IN, tag=TAG_READ)
rows("checkpoint.default_tag", x=MODEL, state=R(NONE_DEFAULT, names=("state",)))
rows(
    "checkpoint.rank_file_name",
    rank=R(INT_SCALARS),
    world_size=R(INT_SCALARS),
    generation=R(INT_SCALARS, huge="a generation number is any int >= 0"),
    part=R(NONE_DEFAULT),
)
rows(
    "buffers.buffer_file_name",
    rank=R(INT_SCALARS),
    world_size=R(INT_SCALARS),
    generation=R(INT_SCALARS, huge="a generation number is any int >= 0"),
)
# schedules
rows("schedules.constant", decay=DECAY_VALUE)
rows("schedules.litema", decay=DECAY_VALUE)
rows(
    "schedules.warmup",
    inv_gamma=R(REAL, huge="a finite real number"),
    power=R(REAL, huge="a finite real number"),
    min_decay=R(names=("min_decay",), numpy="a real number", tensor="a real number"),
    max_decay=R(names=("max_decay",), numpy="a real number", tensor="a real number"),
    start_step=R(INT_SCALARS),
)
rows("schedules.half_life", steps=R(REAL, huge="a finite real number"))
# gamma above schedules.GAMMA_MAX (1e12; the hostile "huge" is 1e40) and sigma_rel below SIGMA_REL_MIN would overflow
# later (describe(), the cubic): refused at the call naming the argument and the range.
EXTREME_GAMMA = {"too_wide": lambda: 1e200}
TINY_SIGMA_REL = {"too_narrow": lambda: 1e-200}
rows(
    "schedules.power",
    gamma=R(REAL, NONE_DEFAULT, values=EXTREME_GAMMA),
    sigma_rel=R(NONE_DEFAULT, values=TINY_SIGMA_REL),
)
rows("schedules.sigma_rel_to_gamma", sigma_rel=R(values=TINY_SIGMA_REL))
rows("schedules.gamma_to_sigma_rel", gamma=R(REAL, values=EXTREME_GAMMA))
rows("schedules.interval_decay", decay=DECAY, start=R(INT_SCALARS), stop=R(INT_SCALARS))
rows("schedules.as_schedule", decay=DECAY)
# buffers
rows("buffers.module_buffers", x=MODEL)
rows("buffers.init_buffers", x=MODEL, num_emas=R(INT_SCALARS), step=STEP, dtype=EMA_DTYPE)
rows(
    "buffers.update_buffers", bstate=R(names=("bstate",)), x=MODEL, step=OPT_STEP, decay=DECAY, mode=R(names=("mode",))
)
rows("buffers.swapped_buffers", x=MODEL, bstate=R(names=("bstate",)), index=INDEX)
rows("buffers.load_buffers", x=MODEL, load_dir=R(names=DIR_LOAD.names, values=URL_VALUE), tag=TAG_READ, verify=BOOL)
rows("buffers.has_buffers", load_dir=R(names=DIR_LOAD.names, values=URL_VALUE), tag=TAG_READ)
rows("buffers.consolidate", checkpoint_dir=DIR_IN, tag=TAG_READ, index=INDEX, verify=BOOL)
# dcp
rows(
    "dcp.EMAStateful",
    x=MODEL,
    state=STATE,
    checkpoint_id=R(
        NONE_DEFAULT,
        STR_PATH,
        names=("checkpoint_id",),
        values=URL_VALUE,
        url="DCP takes an fsspec URL as checkpoint_id; here it is only named in messages",
    ),
)
rows("dcp.EMAStateful.load_state_dict", state_dict=R(names=("state_dict",)))
rows("dcp.consolidate_dcp", checkpoint_dir=DIR_IN, key=R(names=("key",)), index=INDEX, verify=BOOL)
# integrations
rows(
    "integrations.EMAController",
    decay=DECAY,
    every_n_steps=R(INT_SCALARS, huge="updates every 10**40 steps: never after the first, as asked"),
    start_step=R(INT_SCALARS, huge="starts at step 10**40: never, as asked"),
    buffers=R(NONE_DEFAULT),
    eval_index=R(NONE_DEFAULT),
    posthoc_dir=R(NONE_DEFAULT, names=("posthoc_dir", "posthoc_every")),
    # posthoc_every not a multiple of every_n_steps (a check of the two together, which this table's one-argument
    # cases with posthoc off cannot reach) is refused at construction: tests/test_integrations_common.py.
    posthoc_every=R(NONE_DEFAULT, names=("posthoc_dir", "posthoc_every")),
    # A folder (an existing one, the root) is refused when the controller is made, not after the whole run.
    export_path=R(NONE_DEFAULT, STR_PATH, values={"existing_folder": tempfile.gettempdir, "root": lambda: os.sep}),
    copy_to_model=BOOL,
    tag=R(names=("tag",), str="a plain folder name"),
    dtype=EMA_DTYPE,
    async_save=BOOL,
    shared=BOOL,
    # The controller has no model yet: it checks the types; the names are checked at the first update
    # (tests/test_selection.py), where the model enters.
    include=R(NONE_DEFAULT, names=("include",), values=SELECTION_TYPES, str="a pattern, matched at the first update"),
    exclude=R(NONE_DEFAULT, names=("exclude",), values=SELECTION_TYPES, str="a pattern, matched at the first update"),
)
rows(
    "integrations.EMAController.on_step",
    x=MODEL,
    step=R(
        INT_SCALARS,
        negative="before the first optimizer step: a no-op",
        huge="a step past the last one of the int64 counter is refused",
    ),
)
rows("integrations.EMAController.before_optimizer_step", x=MODEL)
rows("integrations.EMAController.swapped", x=MODEL, index=R(NONE_DEFAULT))
rows(
    "integrations.EMAController.save",
    x=MODEL,
    save_dir=DIR_OUT,
    framework_step=R(names=("framework_step",), numpy="the integer 1", tensor="the integer 1"),
)
rows(
    "integrations.EMAController.load",
    x=MODEL,
    load_dir=R(names=("load_dir", "checkpoint directory", "abc/ema holds no complete EMA checkpoint")),
    framework_step=R(
        NONE_DEFAULT, names=("framework_step", "framework step"), numpy="the integer 1", tensor="the integer 1"
    ),
)
rows(
    "integrations.EMAController.full_state_dict",
    x=MODEL,
    index=R(NONE_DEFAULT),
    dst=R(NONE_DEFAULT, INT_SCALARS),
    strip_prefix=R(str="a prefix to strip"),
)
rows(
    "integrations.EMAController.export",
    x=MODEL,
    path=DIR_OUT,
    index=R(NONE_DEFAULT),
    strip_prefix=R(str="a prefix to strip"),
)
rows("integrations.EMAController.copy_to_model", x=MODEL, index=R(NONE_DEFAULT))
rows("integrations.EMAController.on_train_end", x=MODEL, strip_prefix=R(str="a prefix to strip"))
rows("integrations.lightning.EMACallback", decay=DECAY)
# metric_prefix's own odd values: the EMA metrics would have no prefix or the live metrics' ("eval": they
# would overwrite eval_loss); a name with surrounding spaces.
METRIC_PREFIX_ODD = {"empty": lambda: "", "blank": lambda: "  ", "live eval": lambda: "eval", "spaced": lambda: " ema"}
rows(
    "integrations.transformers.EMACallback",
    decay=DECAY,
    metric_prefix=R(str="a metric prefix", values=METRIC_PREFIX_ODD),
)
rows("integrations.transformers.EMACallback.attach", trainer=R(names=("trainer",)))
rows(
    "integrations.accelerate.AcceleratorEMA",
    accelerator=R(names=("accelerator",)),
    model=R(names=("model",)),
    decay=DECAY,
)
rows("integrations.accelerate.AcceleratorEMA.swapped", index=R(NONE_DEFAULT))
rows("integrations.accelerate.AcceleratorEMA.export", path=DIR_OUT, index=R(NONE_DEFAULT))
rows("integrations.accelerate.AcceleratorEMA.copy_to_model", index=R(NONE_DEFAULT))
POSITIVE = R(REAL, huge="a finite real number")
rows(
    "integrations.diffusers.EMAModel",
    parameters=R(names=("parameters",)),
    decay=DECAY_VALUE,
    min_decay=R(names=("min_decay",)),  # 1 (numpy, tensor) is above decay=0.9: refused too
    update_after_step=R(INT_SCALARS),
    use_ema_warmup=BOOL,
    inv_gamma=POSITIVE,
    power=POSITIVE,
    foreach=BOOL,
    model_cls=R(NONE_DEFAULT, names=("model_cls",)),
    model_config=R(NONE_DEFAULT, names=("model_config",), dict="a config mapping, read when save_pretrained builds"),
    # As the controller's: the types here, the names at the first step (tests/test_selection.py).
    include=R(NONE_DEFAULT, names=("include",), values=SELECTION_TYPES, str="a pattern, matched at the first step"),
    exclude=R(NONE_DEFAULT, names=("exclude",), values=SELECTION_TYPES, str="a pattern, matched at the first step"),
)
rows("integrations.diffusers.EMAModel.get_decay", optimization_step=R(INT_SCALARS))
for q in ("step", "store", "copy_to", "restore"):
    rows(f"integrations.diffusers.EMAModel.{q}", parameters=R(names=("parameters",)))
rows("integrations.diffusers.EMAModel.save_pretrained", path=DIR_OUT)
rows("integrations.diffusers.EMAModel.load_state_dict", state_dict=R(names=("state_dict",)))
rows(
    "integrations.diffusers.EMAModel.to",
    device=DEVICE,
    dtype=R(NONE_DEFAULT, names=("dtype",)),
    non_blocking=BOOL,
)

# post-hoc EMA (the profile math takes numbers and numpy arrays; its files take a snapshot folder)
GAMMA_HUGE = {"huge": "a finite exponent > -1/2: the profile of the last steps alone (schedules.power takes it too)"}
ARRAY_LIKE = {"list": "array-like: broadcasts (numpy)", "tuple": "array-like: broadcasts (numpy)"}
SIGMA_OR_GAMMA = R(NONE_DEFAULT, REAL, GAMMA_HUGE, names=("sigma_rel", "gamma"))
PH_STEP = R(NONE_DEFAULT, REAL, names=("step",))
PH_ERR = R(
    NONE_DEFAULT, REAL, huge="a bound on the profile error: a huge one admits any fit", names=("max_profile_error",)
)
SEQ = R(names=("snapshot_gammas", "snapshot_steps", "coeffs", "snapshots"))
# snapshots are read from a folder or in place from a URL (memory:// here): one holding nothing
SNAP_DIR = R(names=("snapshot_dir", "snapshot directory"), values={"url": lambda: "memory://fe-values/no-snaps"})
PREFIX = R(names=("prefix",))
BYTES = R(INT_SCALARS, huge="a memory bound, not an allocation", names=("buffer_bytes",))
for q in ("posthoc.posthoc_local", "posthoc.posthoc_offline", "posthoc.posthoc_to_file"):
    rows(
        q,
        snapshot_dir=SNAP_DIR,
        sigma_rel=SIGMA_OR_GAMMA,
        gamma=SIGMA_OR_GAMMA,
        step=OPT_STEP,
        max_profile_error=PH_ERR,
        dtype=EMA_DTYPE,
        verify=BOOL,
        prefix=PREFIX,
        buffer_bytes=BYTES,
        storage_options=OPTIONS,
    )
rows("posthoc.posthoc_local", layout=R(names=("layout",)))
rows("posthoc.posthoc_to_file", out_path=DIR_OUT_LOCAL, overwrite=BOOL)
for q in ("posthoc.expressible_range", "posthoc.solve_coefficients"):
    rows(
        q,
        snapshot_gammas=SEQ,
        snapshot_steps=SEQ,
        step=PH_STEP,
        max_profile_error=PH_ERR,
        rcond=R(NONE_DEFAULT, REAL, names=("rcond",)),
    )
rows("posthoc.solve_coefficients", sigma_rel=SIGMA_OR_GAMMA, gamma=SIGMA_OR_GAMMA)
for q in ("posthoc.reconstruction_profile", "posthoc.plot_profile"):
    rows(
        q,
        snapshot_gammas=SEQ,
        snapshot_steps=SEQ,
        sigma_rel=SIGMA_OR_GAMMA,
        gamma=SIGMA_OR_GAMMA,
        step=PH_STEP,
        coeffs=R(NONE_DEFAULT, names=("coeffs",)),
        num=R(INT_SCALARS, names=("num",)),
    )
rows("posthoc.reconstruction_profile", max_profile_error=PH_ERR)
rows("posthoc.plot_profile", path=DIR_OUT_LOCAL, dpi=R(INT_SCALARS, names=("dpi",)))
rows(
    "posthoc.profile_error",
    snapshot_gammas=SEQ,
    snapshot_steps=SEQ,
    coeffs=SEQ,
    sigma_rel=SIGMA_OR_GAMMA,
    gamma=SIGMA_OR_GAMMA,
    step=PH_STEP,
)
rows(
    "posthoc.power_profile",
    gamma=R(REAL, GAMMA_HUGE, names=("gamma",)),
    step=R(REAL, names=("step",)),
    tau=R(
        REAL,
        ARRAY_LIKE,
        negative="a time outside (0, step]: the profile is 0 there",
        huge="a time outside (0, step]: the profile is 0 there",
        names=("tau",),
    ),
)
rows("posthoc.profile_inner", **{n: R(REAL, ARRAY_LIKE, GAMMA_HUGE, names=(n,)) for n in ("gamma_a", "gamma_b")})
rows("posthoc.profile_inner", **{n: R(REAL, ARRAY_LIKE, names=(n,)) for n in ("step_a", "step_b")})
rows(
    "posthoc.reconstruct",
    snapshots=SEQ,
    sigma_rel=SIGMA_OR_GAMMA,
    gamma=SIGMA_OR_GAMMA,
    step=OPT_STEP,
    max_profile_error=PH_ERR,
    dtype=EMA_DTYPE,
)
rows(
    "posthoc.list_snapshots",
    snapshot_dir=SNAP_DIR,
    prefix=PREFIX,
    part=R(NONE_DEFAULT, names=("part",)),
    storage_options=OPTIONS,
)
rows(
    "posthoc.save_snapshot",
    state=STATE,
    engine=MODEL,
    snapshot_dir=R(  # as save's save_dir: a URL is a location
        STR_PATH, url="an fsspec URL: the snapshot is saved there", values={"url": lambda: "memory://fe-values/snaps"}
    ),
    schedules=R(names=("schedules",)),
    tag=R(NONE_DEFAULT, names=("tag",)),  # a str starting with 'snapshot_', the readers' prefix: no int tag
    dtype=EMA_DTYPE,
    storage_options=OPTIONS,
)
rows("posthoc.snapshot", state=STATE, schedules=R(names=("schedules",)), dtype=EMA_DTYPE, device=DEVICE)
rows("posthoc.snapshot_gammas", schedules=R(names=("schedules",)))
rows("posthoc.snapshot_tag", step=STEP)
rows("posthoc.synthesize", snapshots=SEQ, coeffs=SEQ, dtype=EMA_DTYPE, accumulate_dtype=R(names=("accumulate_dtype",)))

# --------------------------------------------------------------------------------------- open cases
# Parameters whose silent/crash cases are known and not yet fixed, with who owns the fix. Their cases
# are counted apart ("open"); an entry whose cases all pass now fails the test (remove it: the table
# only shrinks).
OPEN: dict[tuple[str, str], str] = {}


# ----------------------------------------------------------------------------------------- the tests


def test_every_public_parameter_has_a_row():
    """A public callable or parameter without a row (or a reason not to attack it) fails here: the next
    argument gets attacked the day it is written."""
    params = public_parameters()
    missing = sorted(
        f"{q}({p})"
        for (q, p), par in params.items()
        if not _not_attacked(q) and par.kind is not inspect.Parameter.VAR_KEYWORD and (q, p) not in ROWS
    )
    no_call = sorted({q for (q, p), par in params.items() if not _not_attacked(q) and CALLS.get(q) is None})
    assert not missing, f"parameters with no row in ROWS (add one: what may each hostile value do?): {missing}"
    assert not no_call, f"public callables with no entry in CALLS (how to call them validly): {no_call}"
    stale = sorted(f"{q}({p})" for q, p in ROWS if (q, p) not in params)
    assert not stale, f"rows for parameters that no longer exist: {stale}"


def test_values_table(tmp_path, monkeypatch, capsys):
    """Every hostile value of every row: refused naming the parameter before anything moved, or documented."""
    monkeypatch.chdir(tmp_path)
    public_parameters()  # a public parameter without a row fails here
    outcomes = run_table(tmp_path)
    by_class: dict[str, Counter] = {}
    failures, still_open = [], set()
    for o in outcomes:
        cls = o.qual.split(".")[0] if "." in o.qual else "functional_ema"
        counts = by_class.setdefault(cls, Counter())
        counts["cases"] += 1
        bad = o.kind in ("silent", "crash")
        if bad and (o.qual, o.param) in OPEN:
            counts["open"] += 1
            still_open.add((o.qual, o.param))
            continue
        counts[o.kind] += 1
        if bad:
            failures.append(f"{o.kind}: {o.qual}({o.param}={o.label}): {o.detail}")
    with capsys.disabled():
        print("\nvalues table: cases, refused, documented, silent, crash (open: known, not fixed yet)")
        total = Counter()
        for cls, c in sorted(by_class.items()):
            total.update(c)
            print(
                f"  {cls:14s} {c['cases']:5d} {c['refused']:5d} {c['documented']:5d} {c['silent']:3d} {c['crash']:3d}  open {c['open']}"
            )
        print(
            f"  {'total':14s} {total['cases']:5d} {total['refused']:5d} {total['documented']:5d} {total['silent']:3d} {total['crash']:3d}  open {total['open']}"
        )
    fixed = sorted(f"{q}({p})" for q, p in OPEN if (q, p) not in still_open)
    assert not failures, f"{len(failures)} silent/crash case(s):\n" + "\n".join(failures[:60])
    assert not fixed, f"OPEN entries whose cases all pass now (remove them): {fixed}"
