"""``EMAController`` (functional_ema/integrations/_common.py), what every framework callback drives:
its arguments are checked at construction and at each call, before anything moves.

The issue this guards against: a bad ``decay`` (``1.5``, ``"0.9"``, ``None``, a dict) used to be accepted
by every integration and refused only at the first update after the start, possibly hours in; and
``save(framework_step=2.7 | -3 | True | 10**40)`` wrote a checkpoint that its own ``load`` refused.
In process, one rank, a plain module; the callbacks' construction too (they all build an ``EMAController``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import functional_ema as fe
from functional_ema._testing.multirank import full_tensor_of, run_ranks
from functional_ema.integrations import EMAController
from tests._integration_models import Backboned, ReferenceEMA

POWER = fe.schedules.power(sigma_rel=0.1)
BAD_CONSTRUCTION = [
    # (keyword arguments, error class, words of the message)
    ({"decay": 1.5}, ValueError, "decay must be in [0, 1], got 1.5"),
    ({"decay": "0.9"}, TypeError, "decay must be a float"),
    ({"decay": None}, TypeError, "decay must be a float"),
    ({"decay": {"a": 0.9}}, TypeError, "decay must be a float"),
    ({"decay": float("nan")}, ValueError, "decay must be in [0, 1]"),
    ({"decay": [0.9, 2.0]}, ValueError, "decay[1] must be in [0, 1], got 2.0"),
    ({"decay": []}, ValueError, "decay: give at least one decay"),
    ({"every_n_steps": 0}, ValueError, "every_n_steps must be >= 1"),
    ({"every_n_steps": 2.5}, TypeError, "every_n_steps must be an int"),
    ({"every_n_steps": True}, TypeError, "every_n_steps must be an int, got a bool"),
    ({"start_step": -1}, ValueError, "start_step=-1"),
    ({"start_step": "3"}, TypeError, "start_step must be an int"),
    ({"eval_index": 0.5}, TypeError, "eval_index must be an int"),
    ({"eval_index": 2}, ValueError, "eval_index=2 is not one of the 1 EMAs"),
    ({"posthoc_dir": "snaps", "posthoc_every": 0}, ValueError, "posthoc_every must be >= 1"),
    ({"posthoc_dir": 5, "posthoc_every": 2}, TypeError, "posthoc_dir must be a path"),
    # Snapshots are taken where the EMA moves: posthoc_every=2 with every_n_steps=3 wrote only steps 6, 12, ...
    (
        {"decay": POWER, "posthoc_dir": "snaps", "posthoc_every": 2, "every_n_steps": 3},
        ValueError,
        "posthoc_every=2 is not a multiple of every_n_steps=3",
    ),
    ({"decay": POWER, "posthoc_dir": "snaps", "posthoc_every": 4, "every_n_steps": 6}, ValueError, "(e.g. 12)"),
    ({"export_path": 3.0}, TypeError, "export_path must be a path"),
    ({"copy_to_model": "yes"}, TypeError, "copy_to_model must be True or False"),
    ({"async_save": 1}, TypeError, "async_save must be True or False"),
    ({"tag": 5.0}, TypeError, "tag must be a str"),
    ({"tag": "latest"}, fe.CheckpointError, "tag 'latest'"),
    ({"buffers": "mean"}, ValueError, "buffers must be None"),
    ({"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
]


def _callbacks():
    """Every integration's constructor, as ``f(**kwargs)`` (the framework objects they need made here)."""
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.lightning import EMACallback as LightningEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    class Accelerator:  # the two hooks AcceleratorEMA registers (nothing is registered when it refuses)
        registered = 0

        def register_save_state_pre_hook(self, hook):
            Accelerator.registered += 1

        def register_load_state_pre_hook(self, hook):
            Accelerator.registered += 1

    model = torch.nn.Linear(3, 2)
    return {
        "EMAController": EMAController,
        "lightning": LightningEMA,
        "transformers": HFEMA,
        "accelerate": lambda **kw: AcceleratorEMA(Accelerator(), model, **kw),
    }, Accelerator


@pytest.mark.parametrize("kwargs, err, words", BAD_CONSTRUCTION, ids=[repr(c[0])[:40] for c in BAD_CONSTRUCTION])
def test_every_integration_refuses_bad_arguments_at_construction(kwargs, err, words):
    makers, accelerator = _callbacks()
    for name, make in makers.items():
        with pytest.raises(err) as e:
            make(**kwargs)
        assert words in str(e.value), (name, str(e.value))
    assert accelerator.registered == 0  # refused before any hook was registered


def test_other_integration_arguments_refused_at_construction():
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    with pytest.raises(TypeError, match="metric_prefix must be a str"):
        HFEMA(0.9, metric_prefix=None)
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate.Accelerator"):
        AcceleratorEMA(object(), torch.nn.Linear(3, 2))
    with pytest.raises(TypeError, match="model: functional_ema cannot read"):
        AcceleratorEMA(_callbacks()[1](), "model")
    with pytest.raises(TypeError, match=r"trainer must be a transformers.Trainer"):
        HFEMA(0.9).attach(object())


def _files(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "framework_step, err, words",
    [
        (2.7, TypeError, "framework_step must be an int, got float 2.7"),
        (-3, ValueError, "framework_step=-3 is outside [0, 2**63 - 1]"),
        (True, TypeError, "framework_step must be an int, got a bool (True)"),
        (10**40, ValueError, f"framework_step={10**40} is outside"),
        ("abc", TypeError, "framework_step must be an int, got str 'abc'"),
        (None, TypeError, "framework_step must be an int, got NoneType None"),
        (math.nan, TypeError, "framework_step must be an int, got float nan"),
        (math.inf, TypeError, "framework_step must be an int, got float inf"),
        (torch.tensor(2.0), TypeError, "framework_step must be an int, got a tensor of dtype torch.float32"),
        (4, ValueError, "framework_step=4: the rules (start_step=0, every_n_steps=1) put the EMA at step 4"),
        (0, ValueError, "framework_step=0: the rules (start_step=0, every_n_steps=1) put the EMA not started"),
    ],
)
def test_save_refuses_a_framework_step_its_load_would_refuse(tmp_path, framework_step, err, words):
    """Refused naming ``framework_step`` and the value, before anything is written (the folder's files and
    the EMA compared before and after); an earlier save in the folder stays and loads."""
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    c.on_step(model, 1)
    with torch.no_grad():
        model.weight.add_(1.0)
    c.on_step(model, 3)
    c.save(model, tmp_path, 3)
    before, ema = _files(tmp_path), [t.clone() for t in c.state.ema.values()]
    with pytest.raises(err) as e:
        c.save(model, tmp_path, framework_step)
    assert words in str(e.value), str(e.value)
    assert _files(tmp_path) == before
    assert all(torch.equal(a, b) for a, b in zip(c.state.ema.values(), ema))
    assert EMAController(0.9).load(model, tmp_path, framework_step=3) == 3


@pytest.mark.parametrize("framework_step", [3, np.int64(3), torch.tensor(3), torch.tensor([3])])
def test_save_accepts_integer_scalars(tmp_path, framework_step):
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    c.on_step(model, 3)
    c.save(model, tmp_path, framework_step)
    assert EMAController(0.9).load(model, tmp_path, framework_step=3) == 3


def test_calls_check_their_arguments():
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    with pytest.raises(TypeError, match="step must be an int, got str"):
        c.on_step(model, "5")  # int("5") used to be taken as step 5
    with pytest.raises(TypeError, match="step must be an int, got float"):
        c.on_step(model, 2.7)
    assert c.state is None
    c.on_step(model, 1)
    with pytest.raises(TypeError, match="index must be an int"), c.swapped(model, index=0.5):
        pass
    with pytest.raises(ValueError, match="index=3 is not one of the 1 EMA"):
        c.full_state_dict(model, index=3)
    with pytest.raises(TypeError, match="strip_prefix must be a str"):
        c.full_state_dict(model, strip_prefix=None)
    with pytest.raises(ValueError, match="dst=9 is not a rank of the group"):
        c.full_state_dict(model, dst=9)
    with pytest.raises(TypeError, match="framework_step must be an int"):
        c.load(model, "nowhere", framework_step=2.5)


# ---------------------------------------------------------------------------------- progressive unfreezing


def _fresh(frozen: bool) -> tuple[Backboned, torch.optim.Optimizer]:
    model = Backboned(frozen)
    return model, torch.optim.AdamW(model.parameters(), lr=0.05)  # AdamW skips a parameter without a gradient


def _train(c, model, opt, ref, steps, unfreeze_at=None, pre=True, full=torch.Tensor.detach):
    """Optimizer steps ``steps`` (numbered), the backbone unfrozen before step ``unfreeze_at``, as a callback-driven
    loop runs them: ``before_optimizer_step`` (unless ``pre=False``), the step, ``on_step``; the reference EMA fed
    every parameter, frozen or not (``full``: its whole value), at the controller's steps."""
    for step in steps:
        if step == unfreeze_at:
            model.backbone.requires_grad_(True)
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(step))).square().mean().backward()
        if pre:
            c.before_optimizer_step(model)
        opt.step()
        opt.zero_grad()
        c.on_step(model, step)
        if ref.due(step):
            ref.feed(step, {n: full(p) for n, p in model.named_parameters()})


def _matches(c, ref) -> bool:
    return all(
        set(c.state.emas[k]) == set(want) and all(torch.equal(c.state.emas[k][n], t) for n, t in want.items())
        for k, want in enumerate(ref.emas)
    )


def _resumed(saved: tuple) -> tuple[Backboned, torch.optim.Optimizer]:
    """A fresh process's model and optimizer (the backbone frozen at setup) from a save's ``(_, optimizer, model)``
    states; copies: ``Optimizer.load_state_dict`` keeps the tensors it is given, and another resume reuses them."""
    import copy

    model, opt = _fresh(frozen=True)
    model.load_state_dict(saved[2])
    opt.load_state_dict(copy.deepcopy(saved[1]))
    return model, opt


@pytest.mark.parametrize("every", [1, 2])
def test_parameters_unfrozen_mid_run_join_the_ema_as_if_averaged_all_along(tmp_path, every, recwarn):
    """A backbone frozen at the EMA's start and unfrozen before step 4 joins the EMA at that step's
    ``before_optimizer_step``: both EMAs equal, bitwise, a reference that averaged every parameter from step 1
    (a frozen parameter's EMA is its constant value), with nothing to warn about. Resumes equal the uninterrupted
    run, bitwise: from a save before the unfreezing (it joins after the resume), and from one after it into a model
    frozen again at setup (the checkpoint's parameters are read although frozen; unfrozen again, the run goes on as
    if never stopped); kept frozen after such a resume, it stays in the EMA, averaged at its constant value."""
    import copy

    decays = [0.8, fe.schedules.power(gamma=3.0)]
    model, opt = _fresh(frozen=True)
    c, ref = EMAController(decays, every_n_steps=every), ReferenceEMA(decays, every=every)
    _train(c, model, opt, ref, range(1, 3), unfreeze_at=4)
    assert set(c.state.ema) == {"head.weight", "head.bias"}
    early = (c.save(model, tmp_path / "s2", 2), copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
    ref_early = copy.deepcopy(ref)
    _train(c, model, opt, ref, range(3, 7), unfreeze_at=4)
    assert _matches(c, ref) and "backbone.weight" in c.state.ema
    late = (c.save(model, tmp_path / "s6", 6), copy.deepcopy(opt.state_dict()), copy.deepcopy(model.state_dict()))
    ref_late = copy.deepcopy(ref)
    with c.swapped(model):
        assert torch.equal(model.backbone.weight, c.state.ema["backbone.weight"])
    _train(c, model, opt, ref, range(7, 9))
    assert _matches(c, ref)
    assert not [w for w in recwarn if "EMA" in str(w.message)]

    # From step 2 (no backbone in the EMA), frozen at the resume as it was then: it joins at step 4.
    m2, o2 = _resumed(early)
    c2, r2 = EMAController(decays, every_n_steps=every), copy.deepcopy(ref_early)
    assert c2.load(m2, tmp_path / "s2", framework_step=2) == 2
    _train(c2, m2, o2, r2, range(3, 9), unfreeze_at=4)
    assert _matches(c2, ref) and _matches(c2, r2)
    # From step 6 (backbone in the EMA) into a model frozen again, as Lightning's BackboneFinetuning does at setup.
    m3, o3 = _resumed(late)
    c3 = EMAController(decays, every_n_steps=every)
    assert c3.load(m3, tmp_path / "s6", framework_step=6) == 6
    assert "backbone.weight" in c3.state.ema
    r3 = copy.deepcopy(ref_late)
    _train(c3, m3, o3, r3, range(7, 9))  # kept frozen: its EMA averages its constant value
    assert _matches(c3, r3) and not m3.backbone.weight.requires_grad
    m4, o4 = _resumed(late)
    c4 = EMAController(decays, every_n_steps=every)
    c4.load(m4, tmp_path / "s6", framework_step=6)
    _train(c4, m4, o4, copy.deepcopy(ref_late), range(7, 9), unfreeze_at=7)  # unfrozen again: as never stopped
    assert _matches(c4, ref)
    # The first model object itself rolled back to step 2 (a rollback, a second fit in the same process), frozen as
    # it was then: the reading kept on it holds the backbone, trained since, and the resume was refused ("trained
    # now"); the resume reads the model afresh and goes on as the uninterrupted run.
    model.backbone.requires_grad_(False)
    model.load_state_dict(early[2])
    opt.load_state_dict(copy.deepcopy(early[1]))
    c5 = EMAController(decays, every_n_steps=every)
    assert c5.load(model, tmp_path / "s2", framework_step=2) == 2
    _train(c5, model, opt, copy.deepcopy(ref_early), range(3, 9), unfreeze_at=4)
    assert _matches(c5, ref)


def test_an_unfreezing_seen_only_after_the_optimizer_step_warns_and_starts_from_there(recwarn):
    """Without ``before_optimizer_step`` (a hand-written loop calling ``on_step`` alone), the backbone joins at
    ``on_step``, after the step that first trained it: a warning says so and names it, the head's EMA is exact and the
    backbone's starts from its value after that step."""

    model, opt = _fresh(frozen=True)
    c, ref = EMAController(0.8), ReferenceEMA([0.8])
    _train(c, model, opt, ref, range(1, 4), unfreeze_at=3, pre=False)
    (w,) = [w for w in recwarn if "EMA" in str(w.message)]
    assert "'backbone.weight', 'backbone.bias', frozen when the EMA started or resumed, are trained now" in str(
        w.message
    ) and "one step later" in str(w.message)
    for n in ("head.weight", "head.bias"):
        assert torch.equal(c.state.ema[n], ref.emas[0][n])
    for n in ("backbone.weight", "backbone.bias"):
        assert torch.equal(c.state.ema[n], model.get_parameter(n).detach())
        assert not torch.equal(c.state.ema[n], ref.emas[0][n])


def test_only_parameters_frozen_at_the_start_join(tmp_path):
    """What is not a parameter frozen when the EMA started is refused as before, naming it: a module added since
    (``update``'s refusal), and at a resume, parameters trained now that the checkpoint lacks (with how to resume a
    run that unfroze them after that save)."""
    model, _ = _fresh(frozen=True)
    c = EMAController(0.8)
    c.on_step(model, 1)
    c.save(model, tmp_path, 1)
    model.extra = torch.nn.Linear(2, 2)
    c.before_optimizer_step(model)  # nothing frozen was unfrozen: nothing joins
    with pytest.raises(fe.TreeMismatchError, match=r"not in state.emas\[0\]: 'extra.bias', 'extra.weight'"):
        c.on_step(model, 2)
    trained, _ = _fresh(frozen=False)
    with pytest.raises(
        fe.CheckpointError,
        match=r"(?s)in the model but not in the checkpoint: \['backbone.weight', 'backbone.bias'\].*"
        r"if they were frozen when it was saved, resume with them frozen",
    ):
        EMAController(0.8).load(trained, tmp_path, framework_step=1)


def test_a_frozen_module_replaced_is_let_go_and_its_successor_watched():
    """A frozen module replaced after the EMA started (same names): the update after it takes the frozen parameters
    again, so the old ones are not kept alive by the EMA, and the new one joins exactly when unfrozen."""
    import gc
    import weakref

    model = Backboned(frozen=True)
    c = EMAController(0.8)
    c.on_step(model, 1)
    old = weakref.ref(model.backbone.weight)
    model.backbone = torch.nn.Linear(7, 9).requires_grad_(False)
    c.on_step(model, 2)
    gc.collect()
    assert old() is None
    model.backbone.requires_grad_(True)
    c.before_optimizer_step(model)
    assert torch.equal(c.state.ema["backbone.weight"], model.backbone.weight.detach())
    assert torch.equal(c.state.ema["head.weight"], model.head.weight.detach())  # nothing trained: the weights


def test_a_frozen_module_replaced_by_a_trainable_one_is_named_as_new(recwarn):
    """A frozen module replaced by a trainable one between updates (a head swap): no hook watched the new parameters,
    so they join at the update after the step that trained them. The warning said to call the pre-step hook, which the
    loop did; it now says they are new parameters under names frozen when the EMA started."""
    model, opt = _fresh(frozen=True)
    c = EMAController(0.8)
    _train(c, model, opt, ReferenceEMA([0.8]), range(1, 3))
    model.backbone = torch.nn.Linear(7, 9)  # trainable
    opt.add_param_group({"params": list(model.backbone.parameters())})
    _train(c, model, opt, ReferenceEMA([0.8]), range(3, 4))
    (w,) = [w for w in recwarn if "EMA" in str(w.message)]
    assert (
        "'backbone.weight', 'backbone.bias' are new parameters, set since the EMA started under names that were "
        "frozen then (their module replaced)"
        in str(w.message)
        and "before_optimizer_step" not in str(w.message)
    )
    assert torch.equal(c.state.ema["backbone.weight"], model.backbone.weight.detach())  # from its value after step 3


def test_posthoc_snapshots_across_an_unfreezing_say_so(tmp_path):
    """Post-hoc snapshots written before a parameter joined the EMA lack it: synthesis refuses to mix them with the
    later ones, naming the parameters and why (not "different models"); the later ones alone synthesise."""
    import shutil

    decays = [fe.schedules.power(sigma_rel=0.05), fe.schedules.power(sigma_rel=0.2)]
    model, opt = _fresh(frozen=True)
    c = EMAController(decays, posthoc_dir=tmp_path / "snaps", posthoc_every=2)
    _train(c, model, opt, ReferenceEMA(decays), range(1, 9), unfreeze_at=4)
    with pytest.raises(
        fe.posthoc.ReconstructionError,
        match=r"'snapshot_000000002' and 'snapshot_000000004' hold different parameters \(\['backbone.bias', "
        r"'backbone.weight'\]\): parameters that joined the EMA at a step after 2 \(unfrozen mid-run",
    ):
        fe.posthoc.posthoc_offline(tmp_path / "snaps", sigma_rel=0.1)
    shutil.move(tmp_path / "snaps" / "snapshot_000000002", tmp_path / "snapshot_000000002")
    assert "backbone.weight" in fe.posthoc.posthoc_offline(tmp_path / "snaps", sigma_rel=0.1, max_profile_error=None)


def fsdp2_unfreezing_worker(out: str) -> dict:
    """On each of 2 ranks: the backbone and the root ``fully_shard``-ed (odd sizes: padded shards), the backbone frozen
    at the start and unfrozen before step 4; then a save at step 6 resumed into a model frozen again, kept frozen."""
    import copy
    from pathlib import Path

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(state=None):
        model, _ = _fresh(frozen=True)
        mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
        fully_shard(model.backbone, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if state is not None:
            model.load_state_dict(state)
        return model, torch.optim.AdamW(model.parameters(), lr=0.05)

    def agrees(c, model, ref) -> bool:
        full = c.full_state_dict(model, dst=None)
        return set(full) == set(ref.emas[0]) and all(torch.equal(full[n], t) for n, t in ref.emas[0].items())

    model, opt = build()
    c, ref = EMAController(0.8), ReferenceEMA([0.8])
    _train(c, model, opt, ref, range(1, 7), unfreeze_at=4, full=full_tensor_of)
    grown = agrees(c, model, ref)
    c.save(model, Path(out), 6)
    ref6, weights = copy.deepcopy(ref), copy.deepcopy(model.state_dict())
    again, opt2 = build(weights)
    c2 = EMAController(0.8)
    c2.load(again, Path(out), framework_step=6)
    _train(c2, again, opt2, ref6, range(7, 9), full=full_tensor_of)
    return {"grown": grown, "resumed": agrees(c2, again, ref6), "frozen": not again.backbone.weight.requires_grad}


def test_fsdp2_unfreezing_and_resume(tmp_path):
    """The same under FSDP2 at 2 ranks, against the full parameters (``full_tensor()``) averaged in plain torch: the
    backbone joins at ``before_optimizer_step``, bitwise; resumed into a model frozen again it stays in the EMA."""
    got = run_ranks(
        "tests.test_integrations_common:fsdp2_unfreezing_worker", world_size=2, timeout=300, out=str(tmp_path)
    )
    assert got == [{"grown": True, "resumed": True, "frozen": True}] * 2


def test_posthoc_snapshot_at_every_multiple_of_posthoc_every(tmp_path):
    """With ``every_n_steps=2`` (started at step 3) and ``posthoc_every=4`` each multiple of 4 gets its snapshot, and
    it holds the EMA of that step (the controller's after its update there; it moves at 3, 4, 6, 8, ...)."""
    import os

    decays = [fe.schedules.power(sigma_rel=0.05), fe.schedules.power(sigma_rel=0.2)]
    model = torch.nn.Linear(3, 2)
    c = EMAController(decays, every_n_steps=2, start_step=3, posthoc_dir=tmp_path, posthoc_every=4)
    emas: dict[int, torch.Tensor] = {}
    for step in range(1, 13):
        with torch.no_grad():
            model.weight.add_(0.25 * step)
        if c.on_step(model, step):
            emas[step] = c.state.emas[1]["weight"].clone()
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("snapshot_")) == [
        "snapshot_000000004",
        "snapshot_000000008",
        "snapshot_000000012",
    ]
    assert sorted(emas) == [3, 4, 6, 8, 10, 12]
    assert [i.step for i in fe.posthoc.list_snapshots(tmp_path)] == [4, 8, 12]
    for k in (4, 8, 12):
        assert torch.equal(fe.consolidate(tmp_path, f"snapshot_{k:09d}", index=1)["weight"], emas[k])
