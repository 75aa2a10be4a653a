"""``functional_ema.integrations.diffusers.EMAModel`` against diffusers' own ``EMAModel`` (0.42).

One process: both EMAs follow the same 1,000 optimizer steps of a small diffusers model (a frozen
parameter, one frozen half-way) under three settings: ``get_decay`` bitwise at every step, the EMA
bitwise equal to a plain-torch ``lerp_`` reference with those decays and within fp32 rounding of
diffusers' ``s -= (1 - d) * (s - p)`` (the maximum difference is printed), and every method
(store / copy_to / restore on the trained model and on another one, save_pretrained / from_pretrained
both ways between the two classes, state_dict / load_state_dict, to, pin_memory); 40 seeded sequences
of the calls scripts make, compared with diffusers after every call.

Two ranks: Accelerate + DeepSpeed ZeRO-3 (CPU, gloo, ``torch.optim.AdamW``) running the loop of
diffusers' ``train_text_to_image.py --use_ema`` on a tiny ``UNet2DConditionModel``: the EMA bitwise
equal to a reference EMA of ``safe_get_full_fp32_param`` in plain torch; a validation forward between
store / copy_to / restore equal to a plain model holding that EMA, the live forward after it equal to
the full live weights, and the run with validation ending bitwise as the run without; save_pretrained
loading into ``UNet2DConditionModel.from_pretrained`` as the EMA bitwise; ``save_state`` /
``load_state`` through the script's hooks resuming bitwise. Then FSDP2 at 2 ranks (``fully_shard``):
the same EMA checks against ``full_tensor()``, and mismatched collective calls refused on both ranks naming
them. Accelerate's DDP at 2 ranks: the script as written (its main-process blocks on rank 0 alone), the same
checks against the DDP model's own weights.
"""

from __future__ import annotations

import copy
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("diffusers")

from functional_ema._testing.multirank import run_ranks

SETTINGS = {  # name -> EMAModel keyword arguments (diffusers' and ours alike)
    "defaults": {},
    "warmup": {"use_ema_warmup": True, "power": 3 / 4, "inv_gamma": 2, "decay": 0.999, "update_after_step": 7},
    "clamped": {"decay": 0.95, "min_decay": 0.5, "update_after_step": 3},
}
STEPS = 1000
FREEZE_AT = 500

TINY_UNET = {
    "block_out_channels": (4, 8),
    "layers_per_block": 1,
    "sample_size": 8,
    "in_channels": 4,
    "out_channels": 4,
    "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
    "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
    "cross_attention_dim": 8,
    "norm_num_groups": 4,
    "attention_head_dim": 2,
}


def tiny_net_class() -> type:
    """A small diffusers model (``ModelMixin`` + ``ConfigMixin``): what ``model_cls`` names."""
    from diffusers import ConfigMixin, ModelMixin
    from diffusers.configuration_utils import register_to_config

    class TinyNet(ModelMixin, ConfigMixin):
        @register_to_config
        def __init__(self, d_in: int = 6, hidden: int = 10, d_out: int = 3):
            super().__init__()
            self.inp = nn.Linear(d_in, hidden)
            self.norm = nn.LayerNorm(hidden)
            self.frozen = nn.Linear(hidden, hidden)
            self.out = nn.Linear(hidden, d_out)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.out(self.frozen(torch.tanh(self.norm(self.inp(x)))))

    return TinyNet


# ------------------------------------------------------------------------------------ one process


def _train_both(kwargs: dict, net_cls: type) -> dict:
    """Train a TinyNet 1,000 steps with diffusers' EMA and ours side by side (and a plain-torch lerp
    reference with diffusers' decays): the decays, the EMAs and the reference, compared at every step."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    torch.manual_seed(0)
    model = net_cls()
    model.frozen.bias.requires_grad_(False)  # frozen from the start: diffusers copies it, ours reads it live
    start = copy.deepcopy(model)
    theirs = DiffusersEMA(copy.deepcopy(start).parameters(), model_cls=net_cls, model_config=start.config, **kwargs)
    ours = EMAModel(copy.deepcopy(start).parameters(), model_cls=net_cls, model_config=start.config, **kwargs)
    ref = [p.detach().clone() for p in start.parameters()]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    g = torch.Generator().manual_seed(1)
    decays_equal, max_diff, t_ours = True, 0.0, 0.0
    for step in range(1, STEPS + 1):
        if step == FREEZE_AT:
            model.frozen.weight.requires_grad_(False)  # frozen half-way: both copy it from now on
        x = torch.randn(16, 6, generator=g)
        (model(x) - x[:, :3].sin()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        theirs.step(model.parameters())
        t0 = time.perf_counter()
        ours.step(model.parameters())
        t_ours += time.perf_counter() - t0
        d = theirs.cur_decay_value
        decays_equal &= type(ours.cur_decay_value) is float and ours.cur_decay_value == d
        for r, p in zip(ref, model.parameters()):  # the reference: one lerp_ per tensor, weight 1 - d
            if p.requires_grad:
                r.lerp_(p.detach(), 1.0 - d)
            else:
                r.copy_(p.detach())
        diff = max((a - b).abs().max().item() for a, b in zip(theirs.shadow_params, ours.shadow_params))
        max_diff = max(max_diff, diff)
    return {
        "model": model,
        "theirs": theirs,
        "ours": ours,
        "ref": ref,
        "decays_equal": decays_equal,
        "max_diff": max_diff,
        "ours_ms_per_step": 1e3 * t_ours / STEPS,
        "scale": max(p.abs().max().item() for p in model.parameters()),
    }


@pytest.fixture(scope="module")
def trained():
    torch.set_num_threads(1)
    net_cls = tiny_net_class()
    return net_cls, {name: _train_both(kw, net_cls) for name, kw in SETTINGS.items()}


def test_get_decay_bitwise_with_diffusers():
    """get_decay equals diffusers' at every step 0..1100, under many settings (int and float arguments)."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    p = [nn.Parameter(torch.zeros(2))]
    grid = [
        {},
        {"use_ema_warmup": True},
        {"use_ema_warmup": True, "power": 1, "inv_gamma": 1},
        {"use_ema_warmup": True, "power": 0.75, "inv_gamma": 3.5, "min_decay": 0.3, "decay": 0.99},
        {"update_after_step": 100, "decay": 0.9},
        {"update_after_step": 10, "min_decay": 0.8, "decay": 0.8},
        {"decay": 1.0},
        {"decay": 0.0},
    ]
    for kw in grid:
        theirs, ours = DiffusersEMA(p, **kw), EMAModel(p, **kw)
        for s in range(0, 1101):
            a, b = theirs.get_decay(s), ours.get_decay(s)
            assert type(b) is float and a == b, (kw, s, a, b)


def test_ema_against_diffusers_1000_steps(trained):
    """The decays at every step bitwise; the EMA bitwise equal to the lerp reference, within fp32 rounding of
    diffusers' EMA (the frozen parameters copied as diffusers does)."""
    _, runs = trained
    for name, run in runs.items():
        ours, theirs, ref = run["ours"], run["theirs"], run["ref"]
        assert run["decays_equal"], name
        assert ours.optimization_step == theirs.optimization_step == STEPS
        assert all(torch.equal(a, b) for a, b in zip(ours.shadow_params, ref)), name
        frozen = [i for i, p in enumerate(run["model"].parameters()) if not p.requires_grad]
        assert frozen and all(torch.equal(ours.shadow_params[i], theirs.shadow_params[i]) for i in frozen), name
        # diffusers' subtraction and our lerp round differently: a few fp32 ulps of the weights' scale
        assert run["max_diff"] <= 8 * torch.finfo(torch.float32).eps * run["scale"], (name, run["max_diff"])
        print(
            f"{name}: max |ours - diffusers| over {STEPS} steps = {run['max_diff']:.3g} (weights up to "
            f"{run['scale']:.3g}); ours {run['ours_ms_per_step']:.3f} ms/step"
        )


def test_store_copy_to_restore(trained):
    """The trained model: the EMA swapped in (its forward equals a copy loaded with the EMA), training refused
    inside, the trained weights back bitwise after restore. Another model: copied in and back, as diffusers."""
    import functional_ema as fe

    net_cls, runs = trained
    run = runs["defaults"]
    model, ours, theirs = run["model"], run["ours"], run["theirs"]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(7))
    live = [p.detach().clone() for p in model.parameters()]
    twin = net_cls()
    with torch.no_grad():
        for p, v in zip(twin.parameters(), ours.shadow_params):
            p.copy_(v)
    ours.store(model.parameters())
    ours.copy_to(model.parameters())
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), ours.shadow_params))
    assert torch.equal(model(x), twin(x))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(fe.SwappedTrainingError):
        opt.step()
    with pytest.raises(RuntimeError, match="restore"):
        ours.step(model.parameters())
    ours.restore(model.parameters())
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), live))
    # another model (full tensors): diffusers' semantics, compared with diffusers itself
    other_a, other_b = net_cls(), net_cls()
    other_b.load_state_dict(other_a.state_dict())
    before = [p.detach().clone() for p in other_a.parameters()]
    ours.store(other_a.parameters())
    theirs.store(other_b.parameters())
    ours.copy_to(other_a.parameters())
    theirs.copy_to(other_b.parameters())
    assert all(torch.equal(p, v) for p, v in zip(other_a.parameters(), ours.shadow_params))
    assert max((a - b).abs().max().item() for a, b in zip(other_a.parameters(), other_b.parameters())) < 1e-5
    ours.restore(other_a.parameters())
    assert all(torch.equal(p, v) for p, v in zip(other_a.parameters(), before))
    with pytest.raises(RuntimeError, match="no `store\\(\\)`ed weights"):
        ours.restore(other_a.parameters())


def test_save_pretrained_from_pretrained_both_ways(trained, tmp_path):
    """save_pretrained writes a folder model_cls.from_pretrained loads as the EMA (bitwise) with the EMA's
    settings in its config; EMAModel.from_pretrained resumes it (ours and diffusers' read each other's)."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import FIELDS, EMAModel

    net_cls, runs = trained
    run = runs["warmup"]
    ours, theirs = run["ours"], run["theirs"]
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(str(tmp_path / "theirs"))
    loaded = net_cls.from_pretrained(tmp_path / "ours")
    assert all(torch.equal(p, v) for p, v in zip(loaded.parameters(), ours.shadow_params))
    for f in FIELDS:
        assert loaded.config[f] == getattr(theirs, f) == getattr(ours, f), f
    for cls in (EMAModel, DiffusersEMA):
        for folder, src in (("ours", ours), ("theirs", theirs)):
            back = cls.from_pretrained(str(tmp_path / folder), net_cls)
            sd, want = back.state_dict(), src.state_dict()
            assert {k: sd[k] for k in FIELDS} == {k: want[k] for k in FIELDS}, (cls, folder)
            assert all(torch.equal(a, b) for a, b in zip(sd["shadow_params"], want["shadow_params"])), (cls, folder)


def test_state_dict_load_state_dict_resume(trained):
    """load_state_dict(state_dict()) into a fresh EMA (before its first step, as the resume hook does) and
    into a bound one: both continue bitwise with the original; diffusers' state_dict loads into ours."""
    from functional_ema.integrations.diffusers import EMAModel

    net_cls, runs = trained
    run = runs["clamped"]
    model, ours = run["model"], run["ours"]
    kw = SETTINGS["clamped"]
    fresh = EMAModel(net_cls().parameters(), **kw)
    fresh.load_state_dict(ours.state_dict())
    bound = EMAModel(net_cls().parameters(), **kw)
    bound.step(model.parameters())  # bound to the model, at another step, with other values
    bound.load_state_dict(ours.state_dict())
    interop = EMAModel(net_cls().parameters(), **kw)
    interop.load_state_dict(run["theirs"].state_dict())
    assert interop.optimization_step == STEPS and interop.decay == kw["decay"]
    assert all(torch.equal(a, b) for a, b in zip(interop.shadow_params, run["theirs"].shadow_params))
    for ema in (ours, fresh, bound):
        ema.step(model.parameters())
    assert fresh.optimization_step == bound.optimization_step == STEPS + 1
    for ema in (fresh, bound):
        assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, ours.shadow_params))
    with pytest.raises(ValueError, match="unknown key"):
        fresh.load_state_dict({"decay": 0.9, "max_value": 0.9})
    with pytest.raises(ValueError, match="shape"):
        fresh.load_state_dict({"shadow_params": [torch.zeros(3)] * len(ours.shadow_params)})
    assert fresh.decay == kw["decay"]  # nothing changed by the refused loads
    # to / pin_memory: the same values afterwards (CPU here: a move to the same device, pinning needs CUDA)
    before = [t.clone() for t in fresh.shadow_params]
    fresh.to("cpu")
    fresh.to(torch.device("cpu"), dtype=torch.float32, non_blocking=True)
    fresh.pin_memory()
    assert all(torch.equal(a, b) for a, b in zip(fresh.shadow_params, before))
    with pytest.raises(ValueError, match="fp32"):
        fresh.to(dtype=torch.bfloat16)


def test_arguments_refused_where_they_enter():
    """diffusers' constructor accepts anything; ours names the argument. Deprecated kwargs work as there."""
    from functional_ema.integrations.diffusers import EMAModel

    params = list(nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match="unexpected keyword"):
        EMAModel(params, decya=0.9)
    with pytest.raises(ValueError, match="update_after_step"):
        EMAModel(params, update_after_step=-1)
    with pytest.raises(ValueError, match="min_decay"):
        EMAModel(params, decay=0.9, min_decay=0.95)
    with pytest.raises(TypeError, match=r"parameters\[0\]"):
        EMAModel([1.0])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ema = EMAModel(params, max_value=0.5, min_value=0.25)
        module_ema = EMAModel(nn.Linear(2, 2))
    assert (ema.decay, ema.min_decay) == (0.5, 0.25) and module_ema.use_ema_warmup is True
    assert sum(issubclass(w.category, FutureWarning) for w in caught) == 3
    with pytest.raises(ValueError, match="max_value"):
        EMAModel(params, max_value=2.0)
    other = nn.Linear(2, 2)
    ema.step(other.parameters())
    with pytest.raises(ValueError, match="not the ones this EMA averages"):
        ema.step(nn.Linear(2, 2).parameters())
    with pytest.raises(ValueError, match="model_cls"):
        ema.save_pretrained("x")
    # a list (not the generator): the module is found among the live ones; loose tensors belong to none
    net = nn.Sequential(nn.Linear(2, 3), nn.Linear(3, 2))
    by_list = EMAModel(copy.deepcopy(net).parameters())
    by_list.step(list(net.parameters()))
    assert by_list._x is net and all(torch.equal(a, b) for a, b in zip(by_list.shadow_params, net.parameters()))
    loose = EMAModel([torch.zeros(2)])
    with pytest.raises(TypeError, match=r"parameters\[0\] belongs to no module in this process"):
        loose.step([torch.ones(2)])


def _scripted_pair(seed: int, kwargs: dict) -> tuple:
    """A small diffusers model, a twin trained identically, and an EMA of each: ours over the model, diffusers'
    over the twin, both started from one copy (the script's ``ema_unet``)."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    net_cls = tiny_net_class()
    torch.manual_seed(seed)
    model = net_cls()
    if seed % 3 == 0:
        model.frozen.bias.requires_grad_(False)  # frozen from the start
    twin, start = copy.deepcopy(model), copy.deepcopy(model)
    kwargs = {"model_cls": net_cls, "model_config": start.config, **kwargs}
    ours = EMAModel(copy.deepcopy(start).parameters(), **kwargs)
    return model, twin, ours, DiffusersEMA(start.parameters(), **kwargs)


def _move_both(model, twin, still: set[int] | None = None) -> None:
    """An optimizer step's stand-in: the same random move of every trainable parameter of the model and its twin
    (``still``: positions left where they are)."""
    with torch.no_grad():
        for i, (p, q) in enumerate(zip(model.parameters(), twin.parameters())):
            if p.requires_grad and i not in (still or ()):
                d = torch.randn_like(p)
                p.add_(d)
                q.add_(d)


def _agree(what: str, model, twin, ours, theirs, exact: bool = True) -> None:
    """Ours and diffusers' EMA agree: the shadows within fp32 rounding, the settings, decays and steps exactly,
    and the models bitwise (within rounding while each holds its EMA, or once each copied its EMA in)."""
    from functional_ema.integrations.diffusers import FIELDS

    for i, (a, b) in enumerate(zip(ours.shadow_params, theirs.shadow_params, strict=True)):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-5), (what, i, (a - b).abs().max().item())
    for f in ("optimization_step", "cur_decay_value", *FIELDS):
        assert getattr(ours, f) == getattr(theirs, f), (what, f)
    same = torch.equal if exact else lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-5)
    assert all(same(p, q) for p, q in zip(model.parameters(), twin.parameters())), what


SCRIPT_CALLS = ("step",) * 6 + (  # the calls of the sequences, steps the most frequent
    "module_step",
    "freeze",
    "validate",
    "copy_other",
    "resume",
    "save_load",
    "set_step",
    "set_setting",
    "to",
    "final_copy",
)
SETTINGS_BY_HAND = {  # what scripts set between steps, and the values tried
    "decay": (0.9, 0.99),
    "update_after_step": (0, 3),
    "use_ema_warmup": (False, True),
    "min_decay": (0.0, 0.2),
    "power": (0.5, 0.75),
    "inv_gamma": (1.0, 3.0),
}


def _scripted_call(call: str, rng, both: tuple, start, folder: Path) -> bool:
    """Make ``call`` on both EMAs (``both``: model, twin, ours, theirs); returns whether the models now hold
    values that differ by rounding (each copied its own EMA in for good)."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    model, twin, ours, theirs = both
    if call == "validate":  # store, copy_to, (validation), restore on the trained model
        ours.store(model.parameters())
        theirs.store(twin.parameters())
        ours.copy_to(model.parameters())
        theirs.copy_to(twin.parameters())
        _agree("inside the swap", *both, exact=False)
        ours.restore(model.parameters())
        theirs.restore(twin.parameters())
    elif call == "copy_other":
        a, b = copy.deepcopy(start), copy.deepcopy(start)
        ours.copy_to(a.parameters())
        theirs.copy_to(b.parameters())
        assert all(torch.allclose(p, q, rtol=1e-5, atol=1e-5) for p, q in zip(a.parameters(), b.parameters()))
    elif call == "resume":  # the script's hooks through state_dict (each its own, or each the other's)
        mine, want = ours.state_dict(), theirs.state_dict()
        assert {k: v for k, v in mine.items() if k != "shadow_params"} == {
            k: v for k, v in want.items() if k != "shadow_params"
        }
        crossed = rng.random() < 0.5
        ours.load_state_dict(want if crossed else mine)
        theirs.load_state_dict(mine if crossed else want)
    elif call == "save_load":  # the script's hooks through save_pretrained / from_pretrained
        ours.save_pretrained(folder / "ours")
        theirs.save_pretrained(str(folder / "theirs"))
        ours.load_state_dict(EMAModel.from_pretrained(folder / "ours", type(start)).state_dict())
        theirs.load_state_dict(DiffusersEMA.from_pretrained(str(folder / "theirs"), type(start)).state_dict())
    elif call == "set_step":  # train_unconditional.py on resume; forks after every step (also backwards)
        ours.optimization_step = theirs.optimization_step = rng.choice(
            [0, 3, 10, ours.optimization_step + 5, max(0, ours.optimization_step - 2)]
        )
    elif call == "set_setting":
        field = rng.choice(sorted(SETTINGS_BY_HAND))
        value = rng.choice(SETTINGS_BY_HAND[field])
        setattr(ours, field, value)
        setattr(theirs, field, value)
    elif call == "to":
        ours.to("cpu")
        theirs.to("cpu")
        ours.pin_memory()  # diffusers' needs an accelerator
    elif call == "final_copy":  # end of training: the EMA into the trained model for good
        ours.copy_to(model.parameters())
        theirs.copy_to(twin.parameters())
        return True
    return False


def _scripted_run(seed: int, folder: Path) -> list[str]:
    """One seeded sequence of 25 calls as diffusers scripts and their forks make them, on both EMAs, compared
    after each call. Returns the calls made."""
    import random

    rng = random.Random(seed)
    kwargs = {
        "decay": rng.choice([0.9, 0.5, 0.999]),
        "update_after_step": rng.choice([0, 2]),
        "use_ema_warmup": rng.random() < 0.5,
        "power": rng.choice([2 / 3, 0.75]),
        "inv_gamma": rng.choice([1.0, 2.0]),
        "min_decay": rng.choice([0.0, 0.1]),
        "foreach": rng.random() < 0.5,
    }
    both = _scripted_pair(seed, kwargs)
    model, twin, ours, theirs = both
    start, exact = copy.deepcopy(model), True
    still: set[int] = set()  # unfrozen just now: kept still until the next step (see the unfreezing test)
    calls: list[str] = []
    for _ in range(25):
        call = rng.choice(SCRIPT_CALLS)
        calls.append(call)
        if call in ("step", "module_step"):
            _move_both(model, twin, still)
            still.clear()
            if call == "step":
                ours.step(model.parameters())
                theirs.step(twin.parameters())
            else:  # a module, deprecated in diffusers
                ours.step(model)
                theirs.step(twin)
        elif call == "freeze":
            i, flag = rng.randrange(len(list(model.parameters()))), rng.random() < 0.5
            p, q = list(model.parameters())[i], list(twin.parameters())[i]
            if flag and not p.requires_grad:
                still.add(i)
            p.requires_grad_(flag)
            q.requires_grad_(flag)
        else:
            exact &= not _scripted_call(call, rng, both, start, folder)
        _agree(call, *both, exact=exact)
    return calls


def test_finding_the_model_on_the_heap_warns_nothing():
    """The drop-in finds the trained model among the objects alive in the process; reading them must not set off
    their own warnings (``torch.distributed.reduce_op``'s FutureWarning showed in users' logs at the first step)."""
    import torch.distributed  # its deprecated reduce_op object on the heap

    from functional_ema.integrations.diffusers import _search_heap

    net = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _search_heap(list(net.parameters()), "step") is net


def test_call_sequences_agree_with_diffusers(tmp_path):
    """40 seeded sequences of 25 calls (steps, with parameters or the module; validation swaps; copies into
    another model; resumes through state_dict, each its own or the other's, and through save_pretrained /
    from_pretrained; optimization_step and the settings set by hand; freezing and unfreezing; moves; the
    end-of-training copy_to): after every call, ours agrees with diffusers' EMAModel fed the same calls (the
    shadows within fp32 rounding, settings, decays and steps exactly, the models bitwise)."""
    from diffusers.utils import logging as diffusers_logging

    kinds: set[str] = set()
    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()  # from_pretrained names the EMA's settings in the config, each time
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # diffusers' deprecations and ours for unfreezing (tested below)
            for seed in range(40):
                kinds.update(_scripted_run(seed, tmp_path / str(seed)))
    finally:
        diffusers_logging.set_verbosity(verbosity)
    assert kinds == set(SCRIPT_CALLS), sorted(kinds)


def test_optimization_step_set_by_hand_applies_one_decay():
    """diffusers' train_unconditional.py sets ``ema_model.optimization_step = global_step`` when it resumes, and
    forks set it after every step: the next step applies ``get_decay(optimization_step + 1)`` once, as
    diffusers does (before, the decay was compounded over the skipped steps, and a step set backwards was
    refused naming an update() the script never called)."""
    for kwargs in ({"decay": 0.9}, {"decay": 0.999, "use_ema_warmup": True}):
        model, twin, ours, theirs = _scripted_pair(1, kwargs)
        for set_to in (None, 50, 52, 2, 0):
            if set_to is not None:
                ours.optimization_step = theirs.optimization_step = set_to
            _move_both(model, twin)
            ours.step(model.parameters())
            theirs.step(twin.parameters())
            assert ours.cur_decay_value == theirs.get_decay(ours.optimization_step)
            _agree(f"after setting {set_to}", model, twin, ours, theirs)
        assert ours.state is not None and int(ours.state.step) == ours.optimization_step == 1


def test_training_between_store_and_restore_is_refused():
    """diffusers' restore() undoes the training done since store(); ours keeps no copy (the EMA is swapped in,
    not copied), so training between them is refused, naming restore(), before anything changes: an optimizer
    step, a backward, EMAModel.step. After restore() training goes on as if store() had not been called."""
    import functional_ema as fe

    model, _, ours, _ = _scripted_pair(2, {"decay": 0.9})
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 6)
    ours.step(model.parameters())
    ema, live = [t.clone() for t in ours.shadow_params], [p.detach().clone() for p in model.parameters()]
    ours.store(model.parameters())
    with pytest.raises(fe.SwappedTrainingError, match=r"store\(parameters\) and restore\(parameters\)"):
        model(x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    with pytest.raises(fe.SwappedTrainingError, match=r"Call restore\(parameters\) first"):
        opt.step()
    with pytest.raises(RuntimeError, match=r"EMAModel.step: training between EMAModel.store"):
        ours.step(model.parameters())
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), live))
    assert all(torch.equal(a, b) for a, b in zip(ours.shadow_params, ema)) and ours.optimization_step == 1
    ours.store(model.parameters())  # twice: still one guard, left by one restore
    ours.restore(model.parameters())
    opt.step()
    ours.step(model.parameters())
    assert ours.optimization_step == 2
    other = copy.deepcopy(model)
    ours.store(other.parameters())  # another model: diffusers' copy, training is not refused
    opt.step()
    ours.restore(other.parameters())


def test_parameter_unfrozen_after_the_first_step_joins_the_ema():
    """A parameter frozen at the first step (its own EMA here, copied at every step by diffusers) and trained
    later joins the EMA, from its current value, with a warning naming it; every method sees it (before,
    step refused the state with a TreeMismatchError and the others with a StateMismatchError). Unfrozen and
    stepped before it moves, the EMA is diffusers'; moved first, it differs by that move (the warning says so)."""
    model, twin, ours, theirs = _scripted_pair(3, {"decay": 0.9})  # seed % 3 == 0: frozen.bias frozen
    assert not model.frozen.bias.requires_grad
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    for m in (model, twin):
        m.frozen.bias.requires_grad_(True)
    with pytest.warns(UserWarning, match=r"\['frozen.bias'\] were frozen when the EMA started"):
        _agree("shadow_params after unfreezing", model, twin, ours, theirs)
    for _ in range(3):
        _move_both(model, twin)
        ours.step(model.parameters())
        theirs.step(twin.parameters())
        _agree("steps after unfreezing", model, twin, ours, theirs)
    assert "frozen.bias" in ours.state.emas[0]


def _seq_pair(frozen: bool = False) -> tuple:
    """A small model and its twin (identical values), optionally with a frozen LayerNorm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 10), nn.LayerNorm(10), nn.Linear(10, 3))
    if frozen:
        model[1].requires_grad_(False)
    return model, copy.deepcopy(model)


def _train(*models: nn.Module, steps: int = 1) -> None:
    """The same AdamW steps on each of ``models`` (twins stay bitwise equal)."""
    for m in models:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.1)
        g = torch.Generator().manual_seed(5)
        for _ in range(steps):
            m(torch.randn(8, 6, generator=g)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()


def _close(ours, theirs, what: str) -> None:
    a, b = ours.shadow_params, theirs.shadow_params
    assert len(a) == len(b), what
    assert all(torch.allclose(x, y, rtol=1e-6, atol=1e-6) for x, y in zip(a, b)), what


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_starting_values_kept_where_they_count():
    """The constructor's parameters are the EMA's starting values, as diffusers' copies, though held by reference
    (no full copy) until they count: copied when optimization_step is set by hand (train_unconditional.py forks, on
    resume) or when read. Changed in place before that (training before the first EMA step, a hand edit), they are
    refused where the values count, and the fix the message names gives diffusers' values."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    kw = {"inv_gamma": 1.0, "power": 3 / 4, "max_value": 0.9999}
    model, twin = _seq_pair()
    ours, theirs = EMAModel(model, **kw), DiffusersEMA(twin, **kw)  # the fork's call: the trained model itself
    assert ours._pending[0].data_ptr() == model[0].weight.data_ptr()  # no copy at construction
    ours.optimization_step = theirs.optimization_step = 1000  # the resume, before training
    _train(model, twin)
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    assert ours.cur_decay_value == theirs.cur_decay_value > 0.99
    _close(ours, theirs, "first step after optimization_step set by hand")
    # read before any change: the values given, copied then (training after it leaves them as they were)
    model, twin = _seq_pair()
    ours, theirs = EMAModel(model.parameters()), DiffusersEMA(twin.parameters())
    assert all(torch.equal(a, b) for a, b in zip(ours.shadow_params, theirs.shadow_params))
    _train(model, twin, steps=2)
    mine, want = ours.state_dict()["shadow_params"], theirs.state_dict()["shadow_params"]
    assert all(torch.equal(a, b) for a, b in zip(mine, want))
    ours.update_after_step = theirs.update_after_step = -1  # by hand: the first decay is not 0
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    _close(ours, theirs, "first step with a nonzero decay after training")
    # trained (or changed by hand) before the first step, unread: refused where the values count; the fix works
    model, twin = _seq_pair()
    ours, theirs = EMAModel(model.parameters()), DiffusersEMA(twin.parameters())
    _train(model, twin)
    with pytest.raises(RuntimeError, match=r"pass copies: EMAModel\(\[p.detach\(\).clone\(\)"):
        ours.state_dict()
    model, twin = _seq_pair()
    ours, theirs = EMAModel(model.parameters()), DiffusersEMA(twin.parameters())
    with torch.no_grad():
        for p, q in zip(model.parameters(), twin.parameters()):
            p.add_(1.0)
            q.add_(1.0)
    with pytest.raises(RuntimeError, match=r"pass copies: EMAModel\(\[p.detach\(\).clone\(\)"):
        ours.state_dict()
    fixed = EMAModel([p.detach().clone() for p in _seq_pair()[0].parameters()])
    with torch.no_grad():
        for p in model.parameters():
            p.sub_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(fixed.shadow_params, theirs.shadow_params))
    ours.step(model.parameters())  # optimization_step 0: decay 0, the starting values do not count
    theirs.step(twin.parameters())
    assert ours.cur_decay_value == theirs.cur_decay_value == 0.0
    assert all(torch.equal(a, p) for a, p in zip(ours.shadow_params, model.parameters()))


def test_load_state_dict_copies_the_values():
    """load_state_dict before the first step copies shadow_params (diffusers deep-copies): a source EMA stepping
    on leaves the loaded one as it was, and both classes continue alike."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    model, _ = _seq_pair()
    src = DiffusersEMA(copy.deepcopy(model).parameters(), decay=0.9)
    src.step(model.parameters())
    sd = src.state_dict()
    loaded = [t.clone() for t in sd["shadow_params"]]
    ours, theirs = EMAModel(copy.deepcopy(model).parameters(), decay=0.9), DiffusersEMA(model.parameters(), decay=0.9)
    ours.load_state_dict(sd)
    theirs.load_state_dict(sd)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    src.step(model.parameters())  # changes sd["shadow_params"] in place
    assert all(torch.equal(a, b) for a, b in zip(ours.shadow_params, loaded))
    twin = copy.deepcopy(model)
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    _close(ours, theirs, "after loading")


def test_shadow_params_assigned_and_frozen_ones_copied():
    """``ema.shadow_params = [...]`` (public scripts) loads the values, checked as load_state_dict; the shadow of a
    frozen parameter is a copy, so editing the EMA in place leaves the model as diffusers does."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    model, twin = _seq_pair(frozen=True)
    ours, theirs = EMAModel(copy.deepcopy(model).parameters(), decay=0.9), DiffusersEMA(twin.parameters(), decay=0.9)
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    ours.shadow_params = [p.detach().clone() + 1 for p in model.parameters()]
    theirs.shadow_params = [p.detach().clone() + 1 for p in twin.parameters()]
    frozen = [i for i, p in enumerate(model.parameters()) if not p.requires_grad]
    assert all(
        torch.equal(a, b) for i, (a, b) in enumerate(zip(ours.shadow_params, theirs.shadow_params)) if i not in frozen
    )
    with pytest.raises(ValueError, match=r"EMAModel.shadow_params: EMAModel.shadow_params hold 1 tensors"):
        ours.shadow_params = [torch.zeros(2)]
    live = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        for a, b in zip(ours.shadow_params, theirs.shadow_params):
            a.zero_()
            b.zero_()
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), live))
    assert all(torch.equal(p, v) for p, v in zip(twin.parameters(), live))
    _train(model, twin)
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    _close(ours, theirs, "after assigning and editing")


def test_some_parameters_of_one_model():
    """``EMAModel([p for p in model.parameters() if p.requires_grad])`` averages those (the lowest module holding
    them all is the model), by position as diffusers, through every method; parameters of two models are refused
    naming one EMAModel per model, and that works."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    model, twin = _seq_pair()
    model[0].requires_grad_(False)
    twin[0].requires_grad_(False)
    mine = [p for p in model.parameters() if p.requires_grad][::-1]  # any order: positions are the list's
    theirs_p = [p for p in twin.parameters() if p.requires_grad][::-1]
    ours, theirs = EMAModel(mine, decay=0.9), DiffusersEMA(theirs_p, decay=0.9)
    for _ in range(3):
        _train(model, twin)
        ours.step(mine)
        theirs.step(theirs_p)
        assert ours.cur_decay_value == theirs.cur_decay_value
        _close(ours, theirs, "subset")
    assert ours._x is model and len(ours.state_dict()["shadow_params"]) == 4
    live = [p.detach().clone() for p in model.parameters()]
    ours.store(mine)
    ours.copy_to(mine)
    theirs.copy_to(theirs_p)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(model.parameters(), twin.parameters()))
    ours.restore(mine)
    assert all(torch.equal(p, v) for p, v in zip(model.parameters(), live))
    with pytest.raises(ValueError, match="pass the same ones every step"):
        ours.step(model.parameters())
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"different models .* one EMAModel per model"):
        EMAModel(list(a.parameters()) + list(b.parameters())).step(list(a.parameters()) + list(b.parameters()))
    for m in (a, b):  # the fix the message names
        EMAModel(copy.deepcopy(m).parameters()).step(m.parameters())


def test_refused_restore_leaves_the_ema_unstored():
    """restore() refusing a model re-typed inside the swap (fe.swapped puts the trained values back) leaves the
    EMA un-stored: the next step runs (diffusers' too) instead of asking for restore() again."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    import functional_ema as fe
    from functional_ema.integrations.diffusers import EMAModel

    model, twin = _seq_pair()
    ours, theirs = EMAModel(copy.deepcopy(model).parameters(), decay=0.9), DiffusersEMA(twin.parameters(), decay=0.9)
    for ema, m in ((ours, model), (theirs, twin)):
        ema.step(m.parameters())
        ema.store(m.parameters())
        ema.copy_to(m.parameters())
        m.half()
    with pytest.raises(fe.SwappedParametersChangedError):
        ours.restore(model.parameters())
    theirs.restore(twin.parameters())
    model.float()
    twin.float()
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    assert ours.optimization_step == theirs.optimization_step == 2
    assert all(torch.allclose(a, b, atol=1e-2) for a, b in zip(ours.shadow_params, theirs.shadow_params))


def test_load_state_dict_refuses_meta_tensors():
    """shadow_params on the meta device are refused at the load, naming the key and index (before, a bare torch
    error at the next step); nothing changes."""
    from functional_ema.integrations.diffusers import EMAModel

    model, _ = _seq_pair()
    meta = [t.to("meta") for t in model.parameters()]
    fresh, bound = EMAModel(copy.deepcopy(model).parameters()), EMAModel(copy.deepcopy(model).parameters())
    bound.step(model.parameters())
    for ema in (fresh, bound):
        before = [t.clone() for t in ema.shadow_params]
        with pytest.raises(ValueError, match=r"state_dict\['shadow_params'\]\[0\] is on the meta device"):
            ema.load_state_dict({"shadow_params": meta, "optimization_step": 5})
        assert ema.optimization_step == bound.optimization_step * (ema is bound)
        assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, before))


def test_deepcopy_and_pickling_of_a_bound_ema():
    """copy.deepcopy of a stepped EMA copies its values and averages the same trained model (diffusers' too);
    torch.save of one is refused naming state_dict() and save_pretrained, and the named way works."""
    import io

    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    model, twin = _seq_pair()
    ours, theirs = EMAModel(copy.deepcopy(model).parameters(), decay=0.9), DiffusersEMA(twin.parameters(), decay=0.9)
    ours.step(model.parameters())
    theirs.step(twin.parameters())
    best, best_theirs = copy.deepcopy(ours), copy.deepcopy(theirs)
    assert best._x is model
    _train(model, twin)
    for ema, m in ((best, model), (best_theirs, twin), (ours, model), (theirs, twin)):
        ema.step(m.parameters())
    _close(best, best_theirs, "the copy")
    _close(ours, theirs, "the original")
    assert all(a.data_ptr() != b.data_ptr() for a, b in zip(best.shadow_params, ours.shadow_params))
    with pytest.raises(TypeError, match=r"ema.state_dict\(\).*save_pretrained"):
        torch.save(ours, io.BytesIO())
    buf = io.BytesIO()
    torch.save(ours.state_dict(), buf)
    buf.seek(0)
    back = EMAModel(copy.deepcopy(model).parameters())
    back.load_state_dict(torch.load(buf))
    assert all(torch.equal(a, b) for a, b in zip(back.shadow_params, ours.shadow_params))
    fresh = EMAModel(copy.deepcopy(model).parameters())  # before the first step: pickles, as diffusers'
    buf = io.BytesIO()
    torch.save(fresh, buf)
    buf.seek(0)
    again = torch.load(buf, weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(again.shadow_params, fresh.shadow_params))


def test_model_taken_over_by_an_engine_after_the_first_step_is_named():
    """A first ``step`` before ``accelerator.prepare`` binds the EMA to the plain module. Once DeepSpeed has taken it
    over (ZeRO-1/2: its ``_hp_mapping`` marker on every parameter, which moved into its flat buffers), every later
    call is refused naming that binding and the fix, not ``local_shards`` and the other functions the user never
    called ("pass the engine to functional_ema")."""
    from functional_ema.integrations.diffusers import EMAModel

    model, twin = _seq_pair()
    ema = EMAModel(twin.parameters(), decay=0.9)
    _train(model)
    ema.step(model.parameters())  # the first step: bound to the plain module, its EMA the weights
    before = [t.clone() for t in ema.shadow_params]
    assert all(torch.equal(a, p.detach()) for a, p in zip(before, model.parameters()))
    for p in model.parameters():  # what deepspeed.initialize does to a ZeRO-1/2 model's parameters
        p.data = p.data.clone()
        p._hp_mapping = None
    calls = {
        "step": lambda: ema.step(model.parameters()),
        "state_dict": ema.state_dict,
        "copy_to": lambda: ema.copy_to(model.parameters()),
        "store": lambda: ema.store(model.parameters()),
        "to": lambda: ema.to("cpu"),
    }
    for verb, call in calls.items():
        with pytest.raises(TypeError) as e:
            call()
        msg = str(e.value)
        assert msg.startswith("EMAModel: this EMA bound itself to the Sequential it was given at its first step()"), msg
        assert "the module of a DeepSpeed engine" in msg and "after accelerator.prepare(...)" in msg, (verb, msg)
    for p in model.parameters():
        del p._hp_mapping  # the module alone again: the EMA is as it was, and steps on
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, before))
    ema.step(model.parameters())
    assert ema.optimization_step == 2


def test_warmup_settings_set_by_hand_are_named():
    """With the warm-up on, settings set by hand out of range are refused naming the attribute set (before:
    the schedule's max_decay / start_step); in range they give diffusers' decay."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    p = [nn.Parameter(torch.zeros(2))]
    for attr, value, name in (
        ("min_decay", 0.7, "EMAModel.min_decay"),
        ("decay", 1.5, "EMAModel.decay"),
        ("update_after_step", -1, "EMAModel.update_after_step"),
        ("power", 0.0, "EMAModel.power"),
    ):
        ema = EMAModel(p, decay=0.5, use_ema_warmup=True)
        setattr(ema, attr, value)
        with pytest.raises(ValueError, match=rf"^{name}\b") as e:
            ema.get_decay(10)
        assert "max_decay" not in str(e.value) and "start_step" not in str(e.value)
    ours, theirs = EMAModel(p, use_ema_warmup=True), DiffusersEMA(p, use_ema_warmup=True)
    for f, v in (("decay", 0.9), ("min_decay", 0.3), ("update_after_step", 4), ("inv_gamma", 2.0)):
        setattr(ours, f, v)
        setattr(theirs, f, v)
        assert all(ours.get_decay(s) == theirs.get_decay(s) for s in range(30)), f


def _sgd_step(model: nn.Module, opt: torch.optim.Optimizer, g: torch.Generator, d_in: int = 4) -> None:
    model(torch.randn(8, d_in, generator=g)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.parametrize("core_first", [False, True])
def test_selection_naming_frozen_parameters_survives_an_unfreezing(core_first):
    """``include=`` naming layers frozen at the start, unfrozen one by one (progressive unfreezing), and
    ``exclude=`` naming a part frozen throughout while another is unfrozen: the model's reading made anew after an
    unfreezing checked the patterns without the model's names, so a pattern naming a parameter still frozen was
    taken for a typo and step, state_dict and shadow_params all raised; whether a core ``local_shards`` with the
    same patterns had run first (filling the selection's cache) decided it. Now each unfrozen layer joins from its
    value at that step, with the warning naming it, either way; the EMA is a plain-torch ``lerp_`` of those names."""
    import functional_ema as fe
    from functional_ema.integrations.diffusers import EMAModel

    for kwargs, frozen, unfreeze, picked in (
        ({"include": ["2.*", "1.*", "0.*"]}, (0, 1), {4: 1, 6: 0}, ("0", "1", "2")),
        ({"exclude": "0.*"}, (0, 1), {3: 1}, ("1", "2")),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
        for i in frozen:
            model[i].requires_grad_(False)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        g = torch.Generator().manual_seed(1)
        ema = EMAModel(copy.deepcopy(model).parameters(), decay=0.8, **kwargs)
        ref: dict[str, torch.Tensor] = {}
        for step in range(1, 8):
            if step in unfreeze:
                model[unfreeze[step]].requires_grad_(True)
            _sgd_step(model, opt, g)
            if core_first:
                fe.local_shards(model, **kwargs)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                ema.step(model.parameters())
            joined = [str(w.message) for w in caught if "were frozen when the EMA started" in str(w.message)]
            if step in unfreeze and step > 1:
                assert len(joined) == 1 and f"'{unfreeze[step]}.weight'" in joined[0], (kwargs, step, joined)
            d = ema.cur_decay_value
            for n, p in model.named_parameters():
                if n.split(".")[0] in picked and p.requires_grad:
                    ref[n] = p.detach().clone() if n not in ref else ref[n].lerp_(p.detach(), 1 - d)
        names = [n for n, _ in model.named_parameters()]
        shadow = dict(zip(names, ema.state_dict()["shadow_params"]))
        assert all(torch.equal(a, b) for a, b in zip(ema.shadow_params, shadow.values()))
        live = {n: p.detach() for n, p in model.named_parameters()}
        for n in names:
            assert torch.equal(shadow[n], ref.get(n, live[n])), (kwargs, n)
        assert sorted(ema.state.emas[0]) == sorted(ref), kwargs


def test_some_parameters_with_a_selection_are_checked_as_all_of_them():
    """``EMAModel([p for p in model.parameters() if p.requires_grad], include=/exclude=)``: the patterns were folded
    into a predicate over the positions' names before any check, so a typo (``exclude="nrom.*"``, one pattern of an
    include list) was accepted silently, and a regular expression, ``exclude="*"`` and a predicate returning a numpy
    bool were refused naming the fold (``_Among``). Now each is refused with the message ``model.parameters()``
    gets; a selection that leaves none of the parameters given is refused naming it; a pattern naming a parameter
    outside the list (frozen) is accepted, as with the whole model."""
    import numpy as np

    from functional_ema.integrations.diffusers import EMAModel

    net_cls = tiny_net_class()
    torch.manual_seed(0)
    model = net_cls()
    model.frozen.bias.requires_grad_(False)

    def trainable(m: nn.Module) -> list[torch.Tensor]:
        return [p for p in m.parameters() if p.requires_grad]

    def refusal(params: Any, kwargs: dict) -> str:
        with pytest.raises((TypeError, ValueError)) as e:
            EMAModel(copy.deepcopy(params), **kwargs).step(params)
        return str(e.value)

    for kwargs in (
        {"exclude": "nrom.*"},
        {"include": ["inp.*", "out.*", "nrom.*"]},
        {"include": r"inp\..*"},
        {"exclude": "*"},
        {"include": lambda n: np.bool_(True)},
    ):
        whole = refusal(list(model.parameters()), kwargs)
        some = refusal(trainable(model), kwargs)
        assert some == whole and "_Among" not in some, (kwargs, some, whole)
    assert "regular expression" in refusal(trainable(model), {"include": r"inp\..*"})
    some = [p for n, p in model.named_parameters() if not n.startswith("frozen")]
    msg = refusal(some, {"include": "frozen.*"})
    assert "(include='frozen.*', exclude=None) leaves none of the 6 parameters given" in msg, msg
    ema = EMAModel(copy.deepcopy(trainable(model)), exclude=["frozen.*", "*.bias"])  # frozen.bias is not given
    ema.step(trainable(model))
    assert list(ema.state.emas[0]) == ["inp.weight", "norm.weight", "out.weight"]


def _selected_run(frozen: bool = False, **sel: Any) -> Any:
    """A TinyNet (``frozen`` frozen before the first step when ``frozen``) trained 3 SGD steps with an
    ``EMAModel(decay=0.8, **sel)`` stepped after each, and a plain-torch ``lerp_`` EMA of every trainable parameter
    with its decays (``ref``). ``new(bound=False, **kwargs)`` makes another EMAModel from the starting copy (bound:
    stepped once on the model, decay 0)."""
    from types import SimpleNamespace

    from functional_ema.integrations.diffusers import EMAModel

    net_cls = tiny_net_class()
    torch.manual_seed(0)
    model = net_cls()
    if frozen:
        model.frozen.requires_grad_(False)
    start = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)

    def new(bound: bool = False, **kwargs: Any) -> EMAModel:
        ema = EMAModel(
            copy.deepcopy(start).parameters(), decay=0.8, model_cls=net_cls, model_config=start.config, **kwargs
        )
        if bound:
            ema.step(model.parameters())
        return ema

    ema, ref = new(**sel), {}
    for _ in range(3):
        _sgd_step(model, opt, g, d_in=6)
        ema.step(model.parameters())
        for n, p in model.named_parameters():
            if p.requires_grad:
                ref[n] = p.detach().clone() if n not in ref else ref[n].lerp_(p.detach(), 1 - ema.cur_decay_value)
    return SimpleNamespace(net_cls=net_cls, model=model, new=new, ema=ema, ref=ref)


def _same_values(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def test_resume_with_another_selection_is_refused(tmp_path):
    """After the first step ``state_dict()`` records the selection (its patterns and ``mask``, one character per
    position: averaged ``1``, left out ``0``, not read ``.``) and ``save_pretrained`` writes it to
    ``ema_selection.json``. Values saved with a selection that averaged other positions are refused naming them
    (they loaded silently, by position: the parameters the save did not average started from the live values it
    kept): by ``load_state_dict`` after the first step, else at the first step, before anything is made. The same
    positions by other patterns load; diffusers' own ``EMAModel`` loads the dict and the folder, and its dict, without
    a record, loads as before. Without a selection the dict is diffusers' own."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema import MismatchError
    from functional_ema.integrations.diffusers import FIELDS, SELECTION_KEY, EMAModel

    r = _selected_run(include=["inp.*", "out.*"], exclude="*.bias")
    sd = r.ema.state_dict()
    assert sd[SELECTION_KEY] == {"include": ["inp.*", "out.*"], "exclude": ["*.bias"], "mask": "10000010"}
    assert set(r.new(bound=True).state_dict()) == {*FIELDS, "shadow_params"}  # no selection: diffusers' dict
    r.ema.save_pretrained(tmp_path / "ema")
    loaded = EMAModel.from_pretrained(tmp_path / "ema", r.net_cls)
    assert loaded.state_dict()[SELECTION_KEY] == sd[SELECTION_KEY]  # passed on with the values
    every = r"(?s)selects every parameter .*averaged by this EMA, left out by the save .*'inp\.bias' \(#1\)"
    with pytest.raises(MismatchError, match=every):
        r.new(bound=True).load_state_dict(sd)
    with pytest.raises(MismatchError, match=r"averaged by the save, not by this EMA: 'inp\.weight' \(#0\), 'out"):
        r.new(bound=True, include="norm.*").load_state_dict(loaded.state_dict())
    late = r.new(include="norm.*")  # before the first step: the positions are known at it
    late.load_state_dict(loaded.state_dict())
    with pytest.raises(MismatchError, match=r"before EMAModel\.step were saved with the selection include=\['inp"):
        late.step(r.model.parameters())
    assert late.state is None
    for bound in (False, True):
        for same in ({"include": ["out.*", "inp.*"], "exclude": "*.bias"}, {"include": ["out.weight", "inp.weight"]}):
            resumed = r.new(bound, **same)
            resumed.load_state_dict(loaded.state_dict())
            assert _same_values(resumed.state_dict()["shadow_params"], sd["shadow_params"]), (bound, same)
            resumed.step(r.model.parameters())
    theirs = DiffusersEMA(copy.deepcopy(r.model).parameters(), model_cls=r.net_cls, model_config=r.model.config)
    theirs.load_state_dict(sd)
    assert _same_values(theirs.shadow_params, sd["shadow_params"])
    theirs = DiffusersEMA.from_pretrained(tmp_path / "ema", r.net_cls)
    assert theirs.optimization_step == 3 and _same_values(theirs.shadow_params, sd["shadow_params"])
    for bound in (False, True):  # no record: as before
        r.new(bound, include="norm.*").load_state_dict(theirs.state_dict())


def test_the_selection_record_is_a_file_beside_diffusers_config(tmp_path):
    """The record was an entry of config.json: ``from_config`` kept it in ``model.config``, so diffusers' EMA loaded
    from the folder wrote it again with values averaging everything, and a later load into an EMA without a
    selection was refused; every ``from_pretrained`` of the folder logged it as an unexpected config attribute. Now
    it is ``ema_selection.json`` (written only with a selection; a save without one into the folder removes an
    earlier one), and config.json is diffusers' own."""
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import SELECTION_KEY, EMAModel

    r = _selected_run(include="inp.*")
    r.ema.save_pretrained(tmp_path / "ema")
    config = json.loads((tmp_path / "ema" / "config.json").read_text())
    assert SELECTION_KEY not in config and config["optimization_step"] == 3
    assert json.loads((tmp_path / "ema" / "ema_selection.json").read_text())["mask"] == "11000000"
    theirs = DiffusersEMA.from_pretrained(tmp_path / "ema", r.net_cls)
    assert SELECTION_KEY not in theirs.model_config
    theirs.save_pretrained(tmp_path / "theirs")  # diffusers' EMA averages every parameter
    assert not (tmp_path / "theirs" / "ema_selection.json").exists()
    back = EMAModel.from_pretrained(tmp_path / "theirs", r.net_cls).state_dict()
    assert SELECTION_KEY not in back
    resumed = r.new(bound=True)
    resumed.load_state_dict(back)
    assert _same_values(resumed.state_dict()["shadow_params"], r.ema.state_dict()["shadow_params"])
    r.new(bound=True).save_pretrained(tmp_path / "ema")  # no selection, into the same folder
    assert not (tmp_path / "ema" / "ema_selection.json").exists()
    assert SELECTION_KEY not in EMAModel.from_pretrained(tmp_path / "ema", r.net_cls).state_dict()
    # a file of that name that save_pretrained did not write is never removed: refused, naming it
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "ema_selection.json").write_text("my notes")
    with pytest.raises(ValueError, match=r"ema_selection\.json is not valid JSON"):
        r.ema.save_pretrained(mine)
    assert (mine / "ema_selection.json").read_text() == "my notes" and not (mine / "config.json").exists()


def test_save_pretrained_never_leaves_weights_that_load_unchecked(tmp_path, monkeypatch):
    """``save_pretrained`` removed an earlier ``ema_selection.json`` before writing the weights: a failure (or kill)
    while diffusers wrote them left weights beside no record, which loaded without the selection check; a folder
    named ``ema_selection.json`` passed the existing-record check, the weights were rewritten, then a raw
    ``IsADirectoryError`` was raised. Now the earlier record is checked before anything is written (a folder is
    refused naming it, the folder's files unchanged); a save whose record is the earlier one writes the weights alone,
    any other first replaces the record by the mark of an unfinished save, which every load refuses until a save
    completes (no temporary file is open while the weights are written)."""
    from functional_ema._testing.files import hashes
    from functional_ema.integrations.diffusers import SELECTION_FILE, EMAModel

    r = _selected_run(include="inp.*")
    r.ema.save_pretrained(tmp_path / "ema")
    record = (tmp_path / "ema" / SELECTION_FILE).read_bytes()
    r.ema.step(r.model.parameters())  # the values a later save writes differ from the saved ones
    seen: list[list[str]] = []

    def failing(self: Any, save_directory: str, **kwargs: Any) -> None:
        seen.append(sorted(p.name for p in Path(save_directory).iterdir()))
        seen.append(json.loads((Path(save_directory) / SELECTION_FILE).read_text()))
        (Path(save_directory) / "diffusion_pytorch_model.safetensors").write_bytes(b"partial")
        raise OSError(28, "No space left on device")

    mark = {"incomplete": "EMAModel.save_pretrained into this folder did not finish: save again"}
    with monkeypatch.context() as patch:
        patch.setattr(r.net_cls, "save_pretrained", failing)
        for ema, folder, left in (
            (r.ema, "ema", json.loads(record)),
            (r.new(bound=True), "ema", mark),
            (r.ema, "new", mark),
        ):
            with pytest.raises(OSError, match="No space left"):
                ema.save_pretrained(tmp_path / folder)
            assert json.loads((tmp_path / folder / SELECTION_FILE).read_text()) == left, folder
    saved = ["config.json", "diffusion_pytorch_model.safetensors", SELECTION_FILE]
    assert seen == [saved, json.loads(record), saved, mark, [SELECTION_FILE], mark]  # no temporary file among them
    assert sorted(os.listdir(tmp_path / "ema")) == saved
    for folder in ("ema", "new"):
        with pytest.raises(
            ValueError,
            match=f"{tmp_path / folder / SELECTION_FILE} marks an EMAModel.save_pretrained "
            "that did not finish .* Save again",
        ):
            EMAModel.from_pretrained(tmp_path / folder, r.net_cls)
    (tmp_path / "ema" / SELECTION_FILE).unlink()
    (tmp_path / "ema" / SELECTION_FILE).mkdir()
    before = hashes(tmp_path / "ema")
    for call in (
        lambda: r.ema.save_pretrained(tmp_path / "ema"),
        lambda: EMAModel.from_pretrained(tmp_path / "ema", r.net_cls),
    ):
        with pytest.raises(ValueError, match=f"{tmp_path / 'ema' / SELECTION_FILE} is a folder, not the selection"):
            call()
    assert hashes(tmp_path / "ema") == before and (tmp_path / "ema" / SELECTION_FILE).is_dir()
    (tmp_path / "ema" / SELECTION_FILE).rmdir()
    r.ema.save_pretrained(tmp_path / "ema")  # a whole save: the new record and values, bitwise
    loaded = EMAModel.from_pretrained(tmp_path / "ema", r.net_cls).state_dict()
    assert loaded["ema_selection"] == json.loads(record) and _same_values(
        loaded["shadow_params"], r.ema.state_dict()["shadow_params"]
    )


def test_a_save_stopped_between_its_weights_and_its_record_loads_nothing(tmp_path, monkeypatch):
    """An EMA with ``include="out.*"`` saved into the folder of one with ``include="inp.*"``; stopped (a kill, an
    error) after its weights were written and before its record replaced the earlier one, it left the ``out.*``
    save's weights beside the ``inp.*`` record: an ``inp.*`` EMA loaded them unrefused and went on from live values
    of ``inp.*`` as if they were its EMA (writing the new record first had the mirror problem). Now the folder holds
    the mark of an unfinished save meanwhile: refused at every load, naming the record, until a save completes; no
    temporary file is left. Stopped in the weights, then at the rename of the record; saved again, the folder is the
    ``out.*`` EMA's, bitwise, and an ``inp.*`` EMA refuses it."""
    from functional_ema import MismatchError
    from functional_ema.integrations.diffusers import SELECTION_FILE, EMAModel

    r1, r2 = _selected_run(include="inp.*"), _selected_run(include="out.*")
    save, replace = r2.net_cls.save_pretrained, os.replace

    def weights_then_killed(self: Any, save_directory: str, **kwargs: Any) -> None:
        save(self, save_directory, **kwargs)
        raise KeyboardInterrupt("killed")

    def killed_at_the_record(src: Any, dst: Any, *args: Any, **kwargs: Any) -> None:
        if Path(dst).name == SELECTION_FILE and b"incomplete" not in Path(src).read_bytes():
            raise KeyboardInterrupt("killed")
        replace(src, dst, *args, **kwargs)

    for target, name, stop in (
        (r2.net_cls, "save_pretrained", weights_then_killed),
        (os, "replace", killed_at_the_record),
    ):
        folder = tmp_path / name
        r1.ema.save_pretrained(folder)
        with monkeypatch.context() as patch:
            patch.setattr(target, name, stop)
            with pytest.raises(KeyboardInterrupt):
                r2.ema.save_pretrained(folder)
        assert sorted(os.listdir(folder)) == ["config.json", "diffusion_pytorch_model.safetensors", SELECTION_FILE]
        for load in (
            lambda: EMAModel.from_pretrained(folder, r1.net_cls),
            lambda: EMAModel.from_pretrained(folder, r1.net_cls, include="inp.*"),
        ):
            with pytest.raises(ValueError, match=f"{folder / SELECTION_FILE} marks an .* did not finish.* Save again"):
                load()
        r2.ema.save_pretrained(folder)  # saved again: the out.* EMA's folder, bitwise
        loaded = EMAModel.from_pretrained(folder, r1.net_cls).state_dict()
        assert loaded["ema_selection"] == r2.ema.state_dict()["ema_selection"], name
        assert _same_values(loaded["shadow_params"], r2.ema.state_dict()["shadow_params"]), name
        live = dict(r2.model.named_parameters())
        for n, v in zip(live, loaded["shadow_params"]):  # the plain-torch EMA of out.*, live values elsewhere
            assert torch.equal(v, r2.ref[n] if n.startswith("out.") else live[n].detach()), (name, n)
        with pytest.raises(MismatchError, match="averaged by this EMA, left out by the save"):
            r1.new(bound=True, include="inp.*").load_state_dict(loaded)


def test_save_pretrained_leaves_no_temporary_file_and_removes_dead_ones(tmp_path, monkeypatch):
    """A kill while ``save_pretrained`` wrote the weights left ``ema_selection.json.tmp-<pid>-<hex>`` in the folder
    for good (the new record's temporary file was open across the weights' write), shipped by ``push_to_hub``. Now
    none is open then, and a save removes those of processes that no longer run (that exact name only; a live
    process's, and other names, are kept)."""
    import subprocess
    import sys

    from functional_ema.integrations.diffusers import SELECTION_FILE

    r, other = _selected_run(include="inp.*"), _selected_run(include="out.*")
    folder = tmp_path / "ema"
    other.ema.save_pretrained(folder)  # an earlier record the save replaces
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = f"{SELECTION_FILE}.tmp-{gone.pid}-0123456789ab"
    kept = [
        f"{SELECTION_FILE}.tmp-{os.getpid()}-0123456789ab",  # a live process's
        f"{SELECTION_FILE}.tmp-{gone.pid}-0123456789abc",
        f"{SELECTION_FILE}.tmp-{gone.pid}-0123456789AB",
        f"{SELECTION_FILE}.tmp-notes",
        f"x{SELECTION_FILE}.tmp-{gone.pid}-0123456789ab",
    ]
    for n in (dead, *kept):
        (folder / n).write_text("{")
    save, seen = r.net_cls.save_pretrained, []

    def watched(self: Any, save_directory: str, **kwargs: Any) -> None:
        seen.append(sorted(os.listdir(save_directory)))
        save(self, save_directory, **kwargs)

    monkeypatch.setattr(r.net_cls, "save_pretrained", watched)
    r.ema.save_pretrained(folder)
    weights = ["config.json", "diffusion_pytorch_model.safetensors", SELECTION_FILE]
    assert seen == [sorted([*weights, *kept])]  # the dead one removed first; no temporary file of this save's
    assert sorted(os.listdir(folder)) == sorted([*weights, *kept])
    assert json.loads((folder / SELECTION_FILE).read_text()) == r.ema.state_dict()["ema_selection"]


def test_recording_the_selection_asks_the_predicate_about_no_new_name(tmp_path):
    """The record was made by calling the user's predicate on every position's name, frozen ones included, which
    it had never been asked about: a predicate that raises there (or returns a numpy bool) made ``state_dict`` and
    ``save_pretrained`` fail where they had worked. Now the record is what the steps decided: the names read
    (asked already) averaged or left out, the frozen ones ``.``. The values: a plain-torch ``lerp_`` EMA of the
    names picked, the others live (bitwise)."""
    import numpy as np

    from functional_ema.integrations.diffusers import SELECTION_KEY

    def raising(name: str) -> bool:
        if name.startswith("frozen."):
            raise KeyError(name)
        return name.endswith(".weight")

    def numpy_there(name: str) -> bool:
        return np.bool_(True) if name.startswith("frozen.") else name.endswith(".weight")  # type: ignore[return-value]

    for predicate in (raising, numpy_there):
        r = _selected_run(frozen=True, include=predicate)
        sd = r.ema.state_dict()
        assert sd[SELECTION_KEY]["mask"] == "1010..10", predicate
        live = {n: p.detach() for n, p in r.model.named_parameters()}
        names = list(live)
        for n, v in zip(names, sd["shadow_params"]):
            assert torch.equal(v, r.ref[n] if n.endswith(".weight") and n in r.ref else live[n]), (predicate, n)
        r.ema.save_pretrained(tmp_path / predicate.__name__)
        assert json.loads((tmp_path / predicate.__name__ / "ema_selection.json").read_text())["mask"] == "1010..10"


def test_a_resume_whose_names_changed_is_compared_by_position():
    """Values load by position, but the selections were compared as sets of names: a legitimate resume where a
    submodule was compiled in place (its parameters named ``out._orig_mod.*``) was refused. Now the positions
    averaged are compared; the names only name them in a refusal."""
    from functional_ema.integrations.diffusers import SELECTION_KEY

    r = _selected_run(include=["inp.*", "out.*"])
    sd = r.ema.state_dict()
    r.model.out = torch.compile(r.model.out)  # wrapped only: nothing is compiled before a forward
    assert "out._orig_mod.weight" in dict(r.model.named_parameters())
    for bound in (True, False):
        resumed = r.new(bound, include=["inp.*", "out.*"])
        resumed.load_state_dict(sd)
        if not bound:
            resumed.optimization_step = 2  # one step back: this step's decay is the saved EMA's last
            resumed.step(r.model.parameters())
            assert resumed.cur_decay_value == r.ema.cur_decay_value
        assert resumed.state_dict()[SELECTION_KEY]["mask"] == sd[SELECTION_KEY]["mask"] == "11000011"
        if bound:
            assert _same_values(resumed.state_dict()["shadow_params"], sd["shadow_params"])


def test_from_pretrained_then_step_keeps_or_refuses_the_saved_selection(tmp_path):
    """``EMAModel.from_pretrained(dir, cls)`` stepped itself averaged every parameter, the positions the save had
    not averaged starting from the live values it kept, silently. Now its first step refuses, naming them, and
    ``from_pretrained(..., include=, exclude=)`` resumes the selection (bitwise the uninterrupted EMA). A folder
    without a record resumed with a selection is accepted (as documented)."""
    from functional_ema import MismatchError
    from functional_ema.integrations.diffusers import EMAModel

    r = _selected_run(include="inp.*")
    r.ema.save_pretrained(tmp_path / "ema")
    plain = EMAModel.from_pretrained(tmp_path / "ema", r.net_cls)
    with pytest.raises(MismatchError, match=r"(?s)selects every parameter .*'norm\.weight' \(#2\), 'norm\.bias' \(#3"):
        plain.step(r.model.parameters())
    assert plain.state is None
    same = EMAModel.from_pretrained(tmp_path / "ema", r.net_cls, include=["inp.weight", "inp.bias"])
    same.step(r.model.parameters())
    r.ema.step(r.model.parameters())
    assert same.optimization_step == 4 and _same_values(
        same.state_dict()["shadow_params"], r.ema.state_dict()["shadow_params"]
    )
    r.new(bound=True).save_pretrained(tmp_path / "plain")
    EMAModel.from_pretrained(tmp_path / "plain", r.net_cls, include="inp.*").step(r.model.parameters())


def test_selection_records_without_positions_are_not_compared():
    """A record made before the first step held the patterns alone, and was compared as text: equivalent patterns
    were refused, and two predicates of one name (two lambdas) passed whatever they picked. Now no record is made
    before the positions are known, a record without ``mask`` is not compared, and a predicate's is compared by the
    positions it averaged."""
    from functional_ema import MismatchError
    from functional_ema.integrations.diffusers import FIELDS, SELECTION_KEY

    r = _selected_run()
    assert set(r.new(include="inp.*").state_dict()) == {*FIELDS, "shadow_params"}
    old = {**r.ema.state_dict(), SELECTION_KEY: {"include": ["inp.*"], "exclude": None}}
    for bound in (True, False):
        resumed = r.new(bound, include=["inp.weight", "inp.bias"])
        resumed.load_state_dict(old)
        resumed.step(r.model.parameters())
    one, two = (lambda n: n.startswith("inp.")), (lambda n: n.startswith("out."))
    r = _selected_run(include=one)
    sd = r.ema.state_dict()
    assert sd[SELECTION_KEY]["include"] == r.new(bound=True, include=two).state_dict()[SELECTION_KEY]["include"]
    with pytest.raises(MismatchError, match=r"averaged by the save, not by this EMA: 'inp\.weight' \(#0\)"):
        r.new(bound=True, include=two).load_state_dict(sd)


# ------------------------------------------------------------------------------------------ ranks


def _reset_accelerate(ga: int, deepspeed: bool):
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)  # a new Accelerator in the same process
    GradientState._reset_state()
    PartialState(cpu=True)
    if not deepspeed:
        return Accelerator(cpu=True, gradient_accumulation_steps=ga)
    cfg = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    return Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=ga)


def _batch(micro: int, rank: int) -> tuple[torch.Tensor, ...]:
    """The script's inputs for one micro-batch (latents, noise, timesteps, text states), seeded by step and rank."""
    g = torch.Generator().manual_seed(1000 * micro + rank)
    latents, noise = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 4, 8, 8, generator=g)
    t = torch.randint(0, 1000, (2,), generator=g)
    enc = torch.randn(2, 3, 8, generator=g)
    noisy = latents + 0.5 * noise  # the noise scheduler's add_noise, reduced to what the test needs
    return noisy, t, enc, noise


def _fsdp2_unet(mesh: Any, frozen: tuple[str, ...] = ()) -> tuple[nn.Module, nn.Module]:
    """A tiny UNet (seed 0, ``frozen`` parameters frozen) under FSDP2 (``fully_shard`` on each block and the root),
    and a plain copy of its starting weights."""
    from diffusers import UNet2DConditionModel
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_UNET)
    for name in frozen:
        unet.get_parameter(name).requires_grad_(False)
    start = copy.deepcopy(unet)
    for block in [*unet.down_blocks, *unet.up_blocks]:
        fully_shard(block, mesh=mesh)
    fully_shard(unet, mesh=mesh)
    return unet, start


def _train_step(unet: nn.Module, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    """One step of the script's loss on :func:`_batch`'s inputs."""
    import torch.nn.functional as F

    noisy, t, enc, target = _batch(step, rank)
    F.mse_loss(unet(noisy, t, enc).sample, target).backward()
    optimizer.step()
    optimizer.zero_grad()


def _plain_unet(weights: dict[str, torch.Tensor]) -> nn.Module:
    from diffusers import UNet2DConditionModel

    with torch.random.fork_rng(devices=[]):  # its initialisation must not move the training's random state
        net = UNet2DConditionModel(**TINY_UNET)
    net.load_state_dict(weights, strict=True)
    return net.eval()


def _prepare(accelerator, unet, ema_unet, hooks: tuple, resume: Path | None) -> tuple:
    """The script's setup after the EMA is made: its save and load hooks registered, the unet and its AdamW
    prepared, the EMA moved to the device, and the state loaded from ``resume`` (a ``checkpoint-<step>``
    folder). Returns the prepared unet and optimizer and the step to go on from."""
    accelerator.register_save_state_pre_hook(hooks[0])
    accelerator.register_load_state_pre_hook(hooks[1])
    unet, optimizer = accelerator.prepare(unet, torch.optim.AdamW(unet.parameters(), lr=1e-2))
    ema_unet.to(accelerator.device)
    if resume is None:
        return unet, optimizer, 0
    accelerator.load_state(str(resume))
    return unet, optimizer, int(resume.name.split("-")[1])


def _script_run(
    out: Path, steps: int, ga: int, save_at: int | None, val_at: int | None, resume: Path | None, list_ema: bool = False
) -> dict:
    """diffusers' train_text_to_image.py --use_ema, its loop and hooks, under Accelerate + DeepSpeed ZeRO-3.

    Departures from the script, each forced by DeepSpeed rather than by this EMA, except the first:
    ``ema_unet.save_pretrained`` runs on every rank (sharded, it gathers the EMA: rank 0 writes); the
    unet itself is saved and loaded by DeepSpeed's own checkpoint (``models`` is empty in the load hook
    under DeepSpeed); validation runs on every rank (a ZeRO-3 forward is collective)."""
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel
    from tests._integration_models import deepspeed_full_fp32

    accelerator = _reset_accelerate(ga, deepspeed=True)
    rank = accelerator.process_index
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_UNET)
    ema_unet = UNet2DConditionModel(**TINY_UNET)  # the script: from_pretrained of the same weights
    ema_unet.load_state_dict(unet.state_dict())
    # a second EMA stepped with a list of the unwrapped module's parameters: found by the heap search
    by_list = EMAModel(copy.deepcopy(ema_unet).parameters()) if list_ema else None
    ema_unet = EMAModel(ema_unet.parameters(), model_cls=UNet2DConditionModel, model_config=ema_unet.config)

    def save_model_hook(models, weights, output_dir):
        ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))  # every rank (was: main process only)

    def load_model_hook(models, input_dir):
        load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
        ema_unet.load_state_dict(load_model.state_dict())
        ema_unet.to(accelerator.device)
        del load_model

    unet, optimizer, global_step = _prepare(accelerator, unet, ema_unet, (save_model_hook, load_model_hook), resume)
    decays = DiffusersEMA([nn.Parameter(torch.zeros(1))])  # diffusers' rule, for the reference
    ref: dict[str, torch.Tensor] | None = None
    report: dict = {"validated": False}
    for micro in range(global_step * ga, steps * ga):
        noisy, t, enc, target = _batch(micro, rank)
        with accelerator.accumulate(unet):
            model_pred = unet(noisy, t, enc).sample
            loss = F.mse_loss(model_pred.float(), target.float(), reduction="mean")
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema_unet.step(unet.parameters())
            if by_list is not None:
                by_list.step(list(accelerator.unwrap_model(unet).parameters()))
            global_step += 1
            full = deepspeed_full_fp32(unet)
            d = decays.get_decay(global_step)
            if ref is None:
                ref = {n: v.clone() for n, v in full.items()} if global_step == 1 else None
            else:
                for n, v in full.items():
                    ref[n].lerp_(v, 1.0 - d)
            if global_step == save_at:
                accelerator.save_state(str(out / f"checkpoint-{global_step}"))
                report["saved_ref"] = None if ref is None else {n: v.clone() for n, v in ref.items()}
            if global_step == val_at:
                report.update(_validate(accelerator, unet, ema_unet, ref, full))
    report.update(ref=ref, weights=deepspeed_full_fp32(unet), ema=_ema_by_name(ema_unet, unet))
    if by_list is not None:
        report["list_ema"] = _ema_by_name(by_list, unet)
        report["list_ema_bound_to_engine"] = by_list._x is unet
    report["unet"], report["ema_unet"], report["accelerator"] = unet, ema_unet, accelerator
    return report


def _ema_by_name(ema_unet, engine) -> dict[str, torch.Tensor]:
    """The gathered EMA (state_dict: collective) by parameter name."""
    shadow = ema_unet.state_dict()["shadow_params"]
    return {n: v.clone() for (n, _), v in zip(engine.module.named_parameters(), shadow)}


def _validation(ema_unet, unet, net, ref: dict, live: dict) -> dict:
    """The script's validation: ``store``, ``copy_to``, a forward of ``net`` (the model as log_validation's
    pipeline runs it), ``restore``, a forward again; the outputs against plain models holding the reference
    EMA (``ref``) and the live weights (``live``)."""
    noisy, t, enc, _ = _batch(10**6, 0)
    ema_unet.store(unet.parameters())
    ema_unet.copy_to(unet.parameters())
    with torch.no_grad():
        out_ema = net(noisy, t, enc).sample
    ema_unet.restore(unet.parameters())
    with torch.no_grad():
        out_live = net(noisy, t, enc).sample
        return {
            "val_ema_equal": torch.equal(out_ema, _plain_unet(ref)(noisy, t, enc).sample),
            "val_live_equal": torch.equal(out_live, _plain_unet(live)(noisy, t, enc).sample),
            "val_ema_differs": not torch.equal(out_ema, out_live),
        }


def _validate(accelerator, unet, ema_unet, ref, full) -> dict:
    """The script's validation under ZeRO-3, on every rank (a ZeRO-3 forward is collective); the full weights
    unchanged by it."""
    from tests._integration_models import deepspeed_full_fp32

    res = _validation(ema_unet, unet, accelerator.unwrap_model(unet), ref, full)
    after = deepspeed_full_fp32(unet)
    return {**res, "validated": True, "val_full_unchanged": all(torch.equal(full[n], v) for n, v in after.items())}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def zero3_worker(root: str, steps: int, ga: int, save_at: int, val_at: int) -> dict:
    """Runs A (checkpoint at ``save_at``, validation at ``val_at``), B (neither), C (resumed from A's
    checkpoint), in these processes, then save_pretrained and the end-of-training copy_to on A."""
    from diffusers import UNet2DConditionModel

    from tests._integration_models import deepspeed_full_fp32, quiet

    quiet()
    torch.set_num_threads(1)
    out = Path(root)
    t0 = time.perf_counter()
    a = _script_run(out / "a", steps, ga, save_at, val_at, None)
    b = _script_run(out / "b", steps, ga, None, None, None, list_ema=True)
    c = _script_run(out / "c", steps, ga, None, None, out / "a" / f"checkpoint-{save_at}")
    res = {k: a[k] for k in ("validated", "val_ema_equal", "val_live_equal", "val_ema_differs", "val_full_unchanged")}
    res["a_ema_is_ref"] = _equal(a["ema"], a["ref"])
    res["b_ema_is_ref"] = _equal(b["ema"], b["ref"])
    res["list_ema_is_ref"] = _equal(b["list_ema"], b["ref"]) and b["list_ema_bound_to_engine"]
    res["a_is_b"] = _equal(a["ema"], b["ema"]) and _equal(a["weights"], b["weights"])
    res["c_is_b"] = _equal(c["ema"], b["ema"]) and _equal(c["weights"], b["weights"])
    unet, ema_unet, accelerator = a["unet"], a["ema_unet"], a["accelerator"]
    ema_unet.save_pretrained(out / "final_ema")  # every rank: rank 0 writes
    rank = accelerator.process_index
    if rank == 0:
        saved = UNet2DConditionModel.from_pretrained(out / "a" / f"checkpoint-{save_at}" / "unet_ema")
        res["checkpoint_ema_is_ref"] = _equal(dict(saved.named_parameters()), a["saved_ref"])
        res["checkpoint_step"] = saved.config["optimization_step"]
        final = UNet2DConditionModel.from_pretrained(out / "final_ema")
        res["final_ema_is_ref"] = _equal({n: p.detach() for n, p in final.named_parameters()}, a["ref"])
    ema_unet.copy_to(unet.parameters())  # end of training, every rank: the weights become the EMA for good
    res["copied_is_ref"] = _equal(deepspeed_full_fp32(unet), a["ref"])
    res["ema_pieces_numel"] = sum(t.numel() for t in ema_unet.state.emas[0].values())
    res["model_numel"] = sum(v.numel() for v in a["ref"].values())
    res["model_tensors"] = len(a["ref"])
    res["seconds"] = time.perf_counter() - t0
    return res


def _ranks_agree(what: str, worker: str, timeout: float, **kwargs) -> list[dict]:
    """``worker`` of this module at 2 ranks; every flag it returns (a bool) must hold on every rank."""
    t0 = time.perf_counter()
    results = run_ranks(f"tests.test_integrations_diffusers:{worker}", world_size=2, timeout=timeout, **kwargs)
    print(f"{what}: {results[0]['seconds']:.1f} s in the ranks, {time.perf_counter() - t0:.1f} s in all")
    for rank, res in enumerate(results):
        flags = {k: v for k, v in res.items() if isinstance(v, bool)}
        assert all(flags.values()), (rank, flags)
    return results


def test_accelerate_deepspeed_zero3_train_text_to_image_loop(tmp_path):
    results = _ranks_agree("ZeRO-3 runs", "zero3_worker", 840, root=str(tmp_path), steps=5, ga=2, save_at=2, val_at=3)
    for res in results:
        # this rank's pieces: about half of the model (ceil or floor of each parameter's half)
        assert abs(2 * res["ema_pieces_numel"] - res["model_numel"]) <= res["model_tensors"], res
    assert results[0]["checkpoint_step"] == 2
    assert {"checkpoint_ema_is_ref", "final_ema_is_ref"} <= set(results[0])


def _ddp_script_run(out: Path, steps: int, save_at: int | None, val_at: int | None, resume: Path | None) -> dict:
    """diffusers' train_text_to_image.py --use_ema under Accelerate's DDP (CPU: ``MULTI_CPU``) as written: the
    EMA's ``save_pretrained`` in the save hook, ``save_state``, the validation and the end-of-training ``copy_to``
    on the main process only; the load hook and the rest on every rank."""
    import torch.nn.functional as F
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel as DiffusersEMA

    from functional_ema.integrations.diffusers import EMAModel

    accelerator = _reset_accelerate(1, deepspeed=False)
    rank = accelerator.process_index
    torch.manual_seed(0)
    unet = UNet2DConditionModel(**TINY_UNET)
    ema_unet = UNet2DConditionModel(**TINY_UNET)
    ema_unet.load_state_dict(unet.state_dict())
    ema_unet = EMAModel(ema_unet.parameters(), model_cls=UNet2DConditionModel, model_config=ema_unet.config)

    def save_model_hook(models, weights, output_dir):
        if accelerator.is_main_process:
            ema_unet.save_pretrained(os.path.join(output_dir, "unet_ema"))
            for model in models:
                model.save_pretrained(os.path.join(output_dir, "unet"))
                weights.pop()

    def load_model_hook(models, input_dir):
        load_model = EMAModel.from_pretrained(os.path.join(input_dir, "unet_ema"), UNet2DConditionModel)
        ema_unet.load_state_dict(load_model.state_dict())
        ema_unet.to(accelerator.device)
        del load_model
        for _ in range(len(models)):
            model = models.pop()
            load_model = UNet2DConditionModel.from_pretrained(input_dir, subfolder="unet")
            model.register_to_config(**load_model.config)
            model.load_state_dict(load_model.state_dict())
            del load_model

    unet, optimizer, global_step = _prepare(accelerator, unet, ema_unet, (save_model_hook, load_model_hook), resume)
    assert accelerator.distributed_type == "MULTI_CPU", accelerator.distributed_type
    net = accelerator.unwrap_model(unet)
    decays = DiffusersEMA([nn.Parameter(torch.zeros(1))])  # diffusers' rule, for the reference
    ref: dict[str, torch.Tensor] | None = None
    report: dict = {}
    for step in range(global_step, steps):
        noisy, t, enc, target = _batch(step, rank)
        with accelerator.accumulate(unet):
            accelerator.backward(F.mse_loss(unet(noisy, t, enc).sample.float(), target.float()))
            optimizer.step()
            optimizer.zero_grad()
        if accelerator.sync_gradients:
            ema_unet.step(unet.parameters())
            global_step += 1
            full = {n: p.detach().clone() for n, p in net.named_parameters()}
            if global_step == 1:
                ref = full
            elif ref is not None:
                for n, v in full.items():
                    ref[n].lerp_(v, 1.0 - decays.get_decay(global_step))
            if global_step == save_at and accelerator.is_main_process:
                accelerator.save_state(str(out / f"checkpoint-{global_step}"))
                report["saved_ref"] = None if ref is None else {n: v.clone() for n, v in ref.items()}
            if global_step == val_at and accelerator.is_main_process:
                report.update(_validation(ema_unet, unet, net, ref, full))
    shadow = ema_unet.shadow_params  # every rank holds the whole EMA: no collective, as with diffusers
    report.update(ref=ref, weights={n: p.detach().clone() for n, p in net.named_parameters()})
    report["ema"] = {n: v.clone() for (n, _), v in zip(net.named_parameters(), shadow)}
    report["unet"], report["ema_unet"], report["accelerator"] = net, ema_unet, accelerator
    return report


def ddp_worker(root: str, steps: int, save_at: int, val_at: int) -> dict:
    """Runs A (checkpoint at ``save_at`` and validation at ``val_at``, on the main process), B (neither), C
    (resumed from A's checkpoint on every rank), then the end of training on the main process of A."""
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel

    from tests._integration_models import quiet

    quiet()
    torch.set_num_threads(1)
    out, t0 = Path(root), time.perf_counter()
    a = _ddp_script_run(out / "a", steps, save_at, val_at, None)
    b = _ddp_script_run(out / "b", steps, None, None, None)
    c = _ddp_script_run(out / "c", steps, None, None, out / "a" / f"checkpoint-{save_at}")
    res = {k: a[k] for k in ("val_ema_equal", "val_live_equal", "val_ema_differs") if k in a}
    res["a_ema_is_ref"], res["b_ema_is_ref"] = _equal(a["ema"], a["ref"]), _equal(b["ema"], b["ref"])
    res["a_is_b"] = _equal(a["ema"], b["ema"]) and _equal(a["weights"], b["weights"])
    res["c_is_b"] = _equal(c["ema"], b["ema"]) and _equal(c["weights"], b["weights"])
    mine = torch.cat([v.reshape(-1) for v in a["ema"].values()])
    theirs = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(theirs, mine)
    res["ranks_hold_one_ema"] = all(torch.equal(mine, x) for x in theirs)
    accelerator, unet, ema_unet = a["accelerator"], a["unet"], a["ema_unet"]
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:  # the script's end of training
        saved = UNet2DConditionModel.from_pretrained(out / "a" / f"checkpoint-{save_at}" / "unet_ema")
        res["checkpoint_ema_is_ref"] = _equal({n: p.detach() for n, p in saved.named_parameters()}, a["saved_ref"])
        res["checkpoint_step"] = saved.config["optimization_step"]
        ema_unet.copy_to(unet.parameters())
        res["copied_is_ref"] = _equal({n: p.detach() for n, p in unet.named_parameters()}, a["ref"])
    res["seconds"] = time.perf_counter() - t0
    return res


def test_accelerate_ddp_train_text_to_image_loop_as_written(tmp_path):
    """Under DDP every rank holds its whole EMA, as with diffusers, so the script runs unchanged: its main-process
    blocks (validation, the EMA's save_pretrained, save_state, the final copy_to) call on rank 0 alone."""
    results = _ranks_agree("DDP runs", "ddp_worker", 600, root=str(tmp_path), steps=5, save_at=2, val_at=3)
    assert results[0]["checkpoint_step"] == 2
    assert {"val_ema_equal", "checkpoint_ema_is_ref", "copied_is_ref"} <= set(results[0])
    assert "val_ema_equal" not in results[1]  # the main process only


def fsdp2_worker(root: str, steps: int) -> dict:
    """The same loop on a tiny UNet with FSDP2 (``fully_shard`` on each block and the root; one parameter
    frozen from the start), no Accelerate: the EMA against a reference of ``full_tensor()``, the swapped and
    live forwards against plain models, save_pretrained, and shadow_params refused (each rank holds pieces)."""
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel as DiffusersEMA
    from torch.distributed.device_mesh import init_device_mesh

    from functional_ema.integrations.diffusers import EMAModel

    torch.set_num_threads(1)
    rank, t0 = dist.get_rank(), time.perf_counter()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # frozen: its own EMA, gathered live when the EMA is written
    unet, start = _fsdp2_unet(mesh, frozen=("conv_out.bias",))
    ema_unet = EMAModel(start.parameters(), model_cls=UNet2DConditionModel, model_config=start.config)
    del start
    own = EMAModel(unet.parameters())  # the trained model's own (sharded) parameters: bound at once, no full copy
    optimizer = torch.optim.AdamW([p for p in unet.parameters() if p.requires_grad], lr=1e-2)
    decays = DiffusersEMA([nn.Parameter(torch.zeros(1))])
    ref: dict[str, torch.Tensor] = {}
    for step in range(1, steps + 1):
        _train_step(unet, optimizer, step, rank)
        ema_unet.step(unet.parameters())
        own.step(unet.parameters())
        full = {n: p.full_tensor().detach().clone() for n, p in unet.named_parameters()}
        trained = {n for n, p in unet.named_parameters() if p.requires_grad}
        for n, v in full.items():
            if step == 1 or n not in trained:  # decay 0 at step 1; a frozen parameter is its own EMA
                ref[n] = v.clone()
            else:
                ref[n].lerp_(v, 1.0 - decays.get_decay(step))
    names = [n for n, _ in unet.named_parameters()]
    res = {"ema_is_ref": _equal(dict(zip(names, ema_unet.state_dict()["shadow_params"])), ref)}
    res["own_is_ref"] = _equal(dict(zip(names, own.state_dict()["shadow_params"])), ref)
    res.update(_validation(ema_unet, unet, unet, ref, full))
    ema_unet.save_pretrained(Path(root) / "fsdp2_ema")
    if rank == 0:
        saved = UNet2DConditionModel.from_pretrained(Path(root) / "fsdp2_ema")
        res["saved_is_ref"] = _equal({n: p.detach() for n, p in saved.named_parameters()}, ref)
    try:
        _ = ema_unet.shadow_params
        res["shadow_params_refused"] = False
    except RuntimeError as e:
        res["shadow_params_refused"] = "state_dict()" in str(e)
    # End of training after a validation forward (no backward), which leaves FSDP2's root holding its gathered
    # weights: copy_to must make the next forward compute with the EMA (it reused the gathered trained weights)
    noisy, t, enc, _ = _batch(steps + 1, rank)
    twin = UNet2DConditionModel(**TINY_UNET)
    twin.load_state_dict(ref)
    with torch.no_grad():
        live = unet(noisy, t, enc).sample
        ema_unet.copy_to(unet.parameters())
        after, expect = unet(noisy, t, enc).sample, twin(noisy, t, enc).sample
    res["copy_to_after_eval_forward_is_ema"] = (after - expect).abs().max().item() <= 1e-5
    res["copy_to_after_eval_forward_moved"] = (after - live).abs().max().item() > 1e-4
    res["seconds"] = time.perf_counter() - t0
    return res


def test_fsdp2_train_text_to_image_loop(tmp_path):
    env = {"FE_DIST_INIT": "torch"}
    results = _ranks_agree("FSDP2 run", "fsdp2_worker", 600, env=env, root=str(tmp_path), steps=4)
    assert "saved_is_ref" in results[0]


#: FUNCTIONAL_EMA_TIMEOUT of the mismatched-calls launch, seconds: the bound on each rank's wait for the other.
ALONE_S = 4.0


def _fsdp2_trained(rank: int, steps: int) -> tuple:
    """A tiny UNet under FSDP2 (each block and the root) trained ``steps`` steps, its EMAModel (decay 0.9, from a
    copy of the start) stepped after each, and the plain-torch reference EMA of ``full_tensor()``."""
    from diffusers import UNet2DConditionModel
    from diffusers.training_utils import EMAModel as DiffusersEMA
    from torch.distributed.device_mesh import init_device_mesh

    from functional_ema.integrations.diffusers import EMAModel

    mesh = init_device_mesh("cpu", (2,))
    unet, start = _fsdp2_unet(mesh)
    ema = EMAModel(start.parameters(), decay=0.9, model_cls=UNet2DConditionModel, model_config=start.config)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-2)
    decays = DiffusersEMA([nn.Parameter(torch.zeros(1))], decay=0.9)
    ref: dict[str, torch.Tensor] = {}
    for step in range(1, steps + 1):
        _train_step(unet, optimizer, step, rank)
        ema.step(unet.parameters())
        for n, p in unet.named_parameters():
            v = p.full_tensor().detach().clone()
            ref[n] = v if step == 1 else ref[n].lerp_(v, 1.0 - decays.get_decay(step))
    return unet, ema, ref


def mismatched_calls_worker(root: str) -> dict:
    """Two FSDP2 ranks making different collective EMAModel calls (``state_dict`` on rank 0 alone, as in an
    ``if accelerator.is_main_process:`` block, meeting ``save_pretrained`` on rank 1; ``copy_to`` another model vs
    ``save_pretrained``; ``copy_to`` after ``store`` vs the end of training's ``copy_to``), each outcome on this rank
    (error class, message, seconds); then the same calls on both ranks, against the reference; ``save_pretrained``
    whose write fails on rank 0; and ``state_dict`` on rank 0 alone (last: the timeout leaves the group unusable)."""
    import torch.distributed as dist
    from diffusers import UNet2DConditionModel

    from functional_ema._testing.multirank import attempt

    torch.set_num_threads(1)
    rank, t0 = dist.get_rank(), time.perf_counter()
    unet, ema, ref = _fsdp2_trained(rank, steps=2)
    names = [n for n, _ in unet.named_parameters()]
    other = UNet2DConditionModel(**TINY_UNET)
    folder = Path(root) / "ema"
    res: dict = {}
    res["sd_vs_save"] = attempt(ema.state_dict if rank == 0 else lambda: ema.save_pretrained(folder))
    res["other_vs_save"] = attempt(
        (lambda: ema.copy_to(other.parameters())) if rank == 0 else lambda: ema.save_pretrained(folder)
    )
    live = {n: p.full_tensor() for n, p in unet.named_parameters()}
    if rank == 0:
        ema.store(unet.parameters())
    res["swap_vs_final"] = attempt(lambda: ema.copy_to(unet.parameters()))
    if rank == 0:
        ema.restore(unet.parameters())
    res["weights_untouched"] = _equal({n: p.full_tensor() for n, p in unet.named_parameters()}, live)
    res["nothing_saved"] = not folder.exists()
    # the group is usable after a mismatch: the same calls on both ranks, bitwise the reference
    res["state_dict_is_ref"] = _equal(dict(zip(names, ema.state_dict()["shadow_params"])), ref)
    ema.copy_to(other.parameters())
    res["copy_to_other_is_ref"] = _equal({n: p.detach() for n, p in other.named_parameters()}, ref)
    ema.save_pretrained(folder)
    if rank == 0:
        saved = UNet2DConditionModel.from_pretrained(folder)
        res["saved_is_ref"] = _equal({n: p.detach() for n, p in saved.named_parameters()}, ref)
    (Path(root) / "a_file").write_text("not a folder")
    res["write_fails"] = attempt(lambda: ema.save_pretrained(Path(root) / "a_file" / "ema"))
    res["after_failed_write"] = _equal(dict(zip(names, ema.state_dict()["shadow_params"])), ref)
    res["seconds"] = time.perf_counter() - t0
    if rank == 0:
        res["alone"] = attempt(ema.state_dict)
    else:
        time.sleep(ALONE_S + 1)  # alive meanwhile, in no collective
    return res


def test_fsdp2_mismatched_collective_calls_fail_on_every_rank_naming_them(tmp_path):
    """Ranks in two different collective EMAModel calls (or one call two ways) fail at once on every rank, naming
    each rank's call, instead of pairing their gathers (an all_gather meeting a gather) and blocking both for ever;
    nothing is written or changed, and the group stays usable: the same calls afterwards are bitwise the reference.
    A save_pretrained whose write fails on rank 0 raises on both ranks (rank 1 waited in a barrier for ever); one
    on rank 0 alone fails within FUNCTIONAL_EMA_TIMEOUT naming it. One launch."""
    env = {"FE_DIST_INIT": "torch", "FUNCTIONAL_EMA_TIMEOUT": f"{ALONE_S:g}"}
    results = _ranks_agree("mismatched calls", "mismatched_calls_worker", 240, env=env, root=str(tmp_path))
    differ = "the ranks called different collective verbs"
    sd_vs_save = f"{differ} (rank 0: 'EMAModel.state_dict', rank 1: 'EMAModel.save_pretrained')"
    other_vs_save = f"{differ} (rank 0: 'EMAModel.copy_to(another model)', rank 1: 'EMAModel.save_pretrained')"
    swap_vs_final = (
        "EMAModel.copy_to: the ranks called it with arguments that lead to different collectives (rank 0: "
        "'EMAModel.copy_to(the trained model, after store())', rank 1: 'EMAModel.copy_to(the trained model, for "
        "good)'); make the same call on every rank"
    )
    cases = {  # each rank's verb, and the message
        "sd_vs_save": (("EMAModel.state_dict", "EMAModel.save_pretrained"), sd_vs_save),
        "other_vs_save": (("EMAModel.copy_to", "EMAModel.save_pretrained"), other_vs_save),
    }
    for rank, res in enumerate(results):
        for case, (verbs, msg) in cases.items():
            got = res[case]
            assert got["error"] == "StateMismatchError" and got["msg"].startswith(f"{verbs[rank]}: {msg};"), got
            assert got["s"] < ALONE_S, (rank, got)
        got = res["swap_vs_final"]
        assert got["error"] == "StateMismatchError" and got["msg"] == swap_vs_final and got["s"] < ALONE_S, got
        assert res["saved_is_ref"] if rank == 0 else "saved_is_ref" not in res
        got = res["write_fails"]
        assert got["error"] == "CheckpointIOError" and "Not a directory" in got["msg"], (rank, got)
        if rank == 1:
            assert "EMAModel.save_pretrained failed on rank 0 of 2 (CheckpointIOError)" in got["msg"], got
        assert got["s"] < ALONE_S, (rank, got)
    got = results[0]["alone"]
    assert got["error"] == "CheckpointTimeoutError", got
    assert got["msg"].startswith("functional_ema.EMAModel.state_dict: rank 0 waited "), got
    assert f"(limit {ALONE_S:g} s)" in got["msg"] and got["s"] <= ALONE_S + 3, got


def compiled_ddp_worker(steps: int) -> dict:
    """diffusers' EMAModel stepped with ``torch.compile(DDP(m)).parameters()`` (Accelerate's order with a
    dynamo_backend), then ``state_dict()`` on rank 0 alone (the scripts' save hook under ``is_main_process``)."""
    import torch.distributed as dist

    from functional_ema.integrations.diffusers import EMAModel

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    ref = [p.detach().clone() for p in m.parameters()]
    ema = EMAModel(m.parameters())
    model = torch.compile(torch.nn.parallel.DistributedDataParallel(m), backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1 + dist.get_rank())  # the ranks' batches differ; DDP averages the grads
    for step in range(1, steps + 1):
        model(torch.randn(8, 4, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ema.step(model.parameters())
        k = step - 1  # diffusers' get_decay, defaults (decay 0.9999, no warmup, update_after_step 0)
        decay = 0.0 if k <= 0 else min((1 + k) / (10 + k), 0.9999)
        for r, p in zip(ref, m.parameters()):
            r.lerp_(p.detach(), 1.0 - decay)
    res: dict = {}
    if dist.get_rank() == 0:
        t = time.perf_counter()
        sd = ema.state_dict()  # waited FUNCTIONAL_EMA_TIMEOUT for rank 1 when the job was read as two ranks
        res["state_dict_prompt"] = time.perf_counter() - t < 5
        res["state_dict_is_ref"] = all(torch.equal(a, b) for a, b in zip(sd["shadow_params"], ref))
        res["step_in_state_dict"] = sd["optimization_step"] == steps
    dist.barrier()
    res["seconds"] = time.perf_counter() - t0
    return res


def test_rank0_state_dict_under_torch_compile_of_ddp():
    """``torch.compile(DDP(m))`` is DDP: every rank holds its whole EMA, and rank 0 alone reads it (it was taken
    for a two-rank job, and rank 0's state_dict waited for rank 1)."""
    results = _ranks_agree(
        "compile(DDP) runs", "compiled_ddp_worker", 240, env={"FUNCTIONAL_EMA_TIMEOUT": "20"}, steps=3
    )
    assert {"state_dict_prompt", "state_dict_is_ref", "step_in_state_dict"} <= set(results[0])
