"""Accelerate with its DeepSpeed plugin (ZeRO-3, gradient accumulation 2) at 2 real CPU ranks, run
through ``examples/accelerate_ema.py`` as written: a run stopped after its step-4 ``save_state`` and
resumed with ``load_state`` in fresh processes ends with the uninterrupted run's EMA, bitwise; the
EMA is checked against DeepSpeed's full fp32 weights at the save step; the export loads strictly.

The start rule, in the same processes after the example: one trajectory trained at gradient
accumulation 1 and 2 (the same micro-batch twice), under DeepSpeed (``engine.global_steps``) and
under DDP (the helper's own count), gives the same EMA bitwise, started after optimizer step 1 (or
step K), as a reference EMA of the full weights.
"""

from __future__ import annotations

import runpy
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("accelerate")

from functional_ema._testing.multirank import ROOT, run_ranks

EXAMPLE = str(ROOT / "examples" / "accelerate_ema.py")


def example_worker(argv: list[str], start_rule: bool = False) -> dict:
    from tests._integration_models import quiet

    quiet()
    sys.argv = [EXAMPLE, *argv]
    try:
        runpy.run_path(EXAMPLE, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    out: dict = {"ok": True}
    if start_rule:
        t0 = time.perf_counter()
        out["start_rule"] = {kind: _start_rule(kind) for kind in ("deepspeed", "ddp")}
        out["start_rule_seconds"] = time.perf_counter() - t0
    return out


def _start_rule(kind: str) -> dict:
    """Train RULE_STEPS optimizer steps at accumulation 1 and 2 (each micro-batch twice), with an
    EMA started at step 0 and one at RULE_START, and compare (tests._integration_models)."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from torch import nn

    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from tests._integration_models import (
        RULE_START,
        RULE_STEPS,
        ReferenceEMA,
        deepspeed_full_fp32,
        record_start,
        start_rule_report,
    )

    decays = [0.9, fe.schedules.power(sigma_rel=0.1)]
    runs = {}
    for ga in (1, 2):
        AcceleratorState._reset_state(reset_partial_state=True)  # a new Accelerator with other settings
        GradientState._reset_state()
        PartialState(cpu=True)
        if kind == "deepspeed":
            cfg = {
                "train_micro_batch_size_per_gpu": 4,
                "gradient_accumulation_steps": ga,
                "steps_per_print": 10**9,
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
                "zero_allow_untested_optimizer": True,
            }
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), gradient_accumulation_steps=ga)
        else:
            acc = Accelerator(cpu=True, gradient_accumulation_steps=ga)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
        model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
        assert acc.distributed_type == ("DEEPSPEED" if kind == "deepspeed" else "MULTI_CPU"), acc.distributed_type

        def full():
            if kind == "deepspeed":
                return deepspeed_full_fp32(model)
            return {n: p.detach().clone() for n, p in model.module.named_parameters()}

        emas = {k: AcceleratorEMA(acc, model, decay=decays, start_step=k, tag=f"ema{k}") for k in (0, RULE_START)}
        refs = {k: ReferenceEMA(decays, start=max(1, k)) for k in emas}
        seen = {k: record_start(e.ema) for k, e in emas.items()}
        start_weights = full()
        for micro in range(RULE_STEPS * ga):
            g = torch.Generator().manual_seed(1000 * (micro // ga) + acc.process_index)  # each batch ga times
            x = torch.randn(4, 16, generator=g)
            y = x.sum(1, keepdim=True) + 0.3 * torch.randn(4, 1, generator=g)
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), y))
                optimizer.step()
                optimizer.zero_grad()
            for e in emas.values():
                e.step()
            if (micro + 1) % ga == 0:  # the optimizer stepped: the test's own count, from 1
                step = (micro + 1) // ga
                weights = full()
                for ref in refs.values():
                    if ref.due(step):
                        ref.feed(step, weights)
        runs[ga] = {
            "weights": full(),
            "start_weights": start_weights,
            "refs": refs,
            "seen": seen,
            "emas": {k: [fe.gather_full(e.state, model, index=i) for i in range(2)] for k, e in emas.items()},
            "optimizer_step": {k: e.optimizer_step for k, e in emas.items()},
        }
        for e in emas.values():
            e.remove_hooks()
    report = start_rule_report(runs)
    report["optimizer_step"] = {f"ga{ga}": sorted(set(run["optimizer_step"].values())) for ga, run in runs.items()}
    return report


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """The uninterrupted example run, then the start-rule runs in the same processes."""
    root = tmp_path_factory.mktemp("accelerate")
    res = run_ranks(
        "tests.test_integrations_accelerate:example_worker",
        world_size=2,
        timeout=600,
        argv=["--out", str(root / "full")],
        start_rule=True,
    )
    return root, res


def test_accelerate_start_rule_same_ema_with_and_without_accumulation(full_run):
    from tests._integration_models import RULE_STEPS, check_start_rule

    print(f"start-rule runs: {full_run[1][0]['start_rule_seconds']:.1f} s")
    for rank_report in full_run[1]:
        for kind, report in rank_report["start_rule"].items():
            assert report["optimizer_step"] == {"ga1": [RULE_STEPS], "ga2": [RULE_STEPS]}, (kind, report)
            check_start_rule(report, calls_at_0=True)


def test_accelerate_deepspeed_save_load_state_resume(full_run, tmp_path):
    from safetensors.torch import load_file
    from torch import nn

    import functional_ema as fe
    from functional_ema.checkpoint import read_manifest

    root, _ = full_run
    full, part = str(root / "full"), str(tmp_path / "part")
    # The interrupted run writes its EMA in the background (async_save) and exits one step after
    # the save: the process waits for the write, and the resumed run ends bitwise as the full one.
    # (The harness ends a rank with os._exit; before it, it waits for the rank's async saves as an
    # interpreter exit would: functional_ema._testing.multirank._finish_async_saves. tests/test_exit.py checks both.)
    run_ranks(
        "tests.test_integrations_accelerate:example_worker",
        world_size=2,
        timeout=600,
        argv=["--out", part, "--stop-at", "5", "--async-save"],
    )
    assert not (tmp_path / "part" / "ema.safetensors").exists()  # stopped before the end
    assert read_manifest(tmp_path / "part" / "ckpt", "ema")["step"] == 4
    run_ranks(
        "tests.test_integrations_accelerate:example_worker",
        world_size=2,
        timeout=600,
        argv=["--out", part, "--resume", "--async-save"],
    )
    a, b = load_file(f"{full}/ema.safetensors"), load_file(f"{part}/ema.safetensors")
    assert sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)
    # strict load into the plain model (parameters and BatchNorm buffers)
    net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))
    assert str(net.load_state_dict(a, strict=True)) == "<All keys matched successfully>"
    # the step-4 checkpoint: every rank's pieces inside accelerate's folder, consolidated offline
    ckpt = root / "full" / "ckpt"
    names = sorted(p.name for p in (ckpt / "ema").iterdir())
    assert "ema_rank_00000_of_00002.safetensors" in names and "ema_rank_00001_of_00002.safetensors" in names
    m = read_manifest(ckpt, "ema")
    assert m["step"] == 4 and m["zero_stage"] == 3 and m["world_size"] == 2
    sd = fe.buffers.consolidate(ckpt, "ema")
    assert (
        str(
            nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1)).load_state_dict(
                sd, strict=True
            )
        )
        == "<All keys matched successfully>"
    )


def unfreezing_worker() -> dict:
    """One process, accumulation 2: a first layer frozen when the EMA starts and unfrozen before optimizer step 3,
    ``before_step()`` before each ``optimizer.step()``; the EMAs against a reference of every parameter."""
    import warnings

    from accelerate import Accelerator
    from torch import nn

    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from tests._integration_models import ReferenceEMA

    decays = [0.9, fe.schedules.power(sigma_rel=0.1)]
    acc = Accelerator(cpu=True, gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    model[0].requires_grad_(False)
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    ema, ref, net = AcceleratorEMA(acc, model, decay=decays), ReferenceEMA(decays), acc.unwrap_model(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for micro in range(12):
            if micro == 4:  # the first micro-batch of optimizer step 3
                net[0].requires_grad_(True)
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(micro // 2))
            with acc.accumulate(model):
                acc.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
                ema.before_step()
                optimizer.step()
                optimizer.zero_grad()
            if ema.step():
                ref.feed(ema.optimizer_step, {n: p.detach() for n, p in net.named_parameters()})
    got = [fe.gather_full(ema.state, model, index=k) for k in range(2)]
    return {
        "steps": ema.optimizer_step,
        "names": sorted(got[0]) == sorted(ref.emas[0]),
        "exact": all(torch.equal(got[k][n], t) for k in range(2) for n, t in ref.emas[k].items()),
        "warnings": [str(w.message) for w in caught if "EMA" in str(w.message)],
    }


def test_accelerate_unfreezing_joins_before_the_step():
    """``AcceleratorEMA.before_step()``: a layer unfrozen mid-run joins both EMAs before the step that first trains
    it, bitwise equal to a reference of every parameter averaged from step 1, with no warning (one process)."""
    (got,) = run_ranks("tests.test_integrations_accelerate:unfreezing_worker", world_size=1, timeout=300)
    assert got == {"steps": 6, "names": True, "exact": True, "warnings": []}


def test_a_loop_that_accumulates_by_hand_counts_its_real_optimizer_steps():
    """``optimizer.step()`` every 2nd micro-batch, no ``accelerator.accumulate``, ``ema.step()`` every iteration, and
    beside it a second prepared optimizer (of another model) stepping at every micro-batch: the EMA counts the 4 steps
    of its own model's optimizer and equals, bitwise, a reference EMA fed after each of them (one process)."""
    from accelerate import Accelerator
    from torch import nn

    from functional_ema.integrations.accelerate import AcceleratorEMA
    from tests._integration_models import ReferenceEMA

    acc = Accelerator(cpu=True, gradient_accumulation_steps=1)
    torch.manual_seed(0)
    model, other = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1)), nn.Linear(16, 1)
    model, optimizer, other, other_optimizer = acc.prepare(
        model, torch.optim.AdamW(model.parameters(), lr=3e-3), other, torch.optim.SGD(other.parameters(), lr=1e-2)
    )
    ema, ref = AcceleratorEMA(acc, model, decay=0.9), ReferenceEMA([0.9])
    for micro in range(8):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(micro))
        acc.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)) / 2)
        acc.backward(other(x).pow(2).mean())
        other_optimizer.step()
        other_optimizer.zero_grad()
        if micro % 2 == 1:
            optimizer.step()
            optimizer.zero_grad()
            ref.feed(micro // 2 + 1, {n: p.detach() for n, p in model.named_parameters()})
        ema.step()
    assert ema.optimizer_step == 4 and int(ema.state.step) == 4
    assert all(torch.equal(ema.state.ema[n], t) for n, t in ref.emas[0].items())
    # A second stage with an optimizer prepared after the helper (one rebuilt after unfreezing, say): its steps
    # count from its first one on, also the one it took before the helper saw it (the EMA stood still).
    second = acc.prepare(torch.optim.SGD(model.parameters(), lr=1e-2))
    for step in range(5, 8):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 + step))
        acc.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
        second.step()
        second.zero_grad()
        ref.feed(step, {n: p.detach() for n, p in model.named_parameters()})
        ema.step()
    ema.remove_hooks()
    assert ema.optimizer_step == 7 and int(ema.state.step) == 7
    assert all(torch.equal(ema.state.ema[n], t) for n, t in ref.emas[0].items())


def _prepared(seed: int = 0, optimizer: type = torch.optim.SGD, **accelerator_kwargs):
    """A fresh CPU accelerator with a small model and its optimizer (SGD) prepared (one process)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch import nn

    AcceleratorState._reset_state(reset_partial_state=True)  # a new Accelerator, whatever the previous test made
    GradientState._reset_state()
    acc = Accelerator(cpu=True, **accelerator_kwargs)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model, optimizer = acc.prepare(model, optimizer(model.parameters(), lr=0.1))
    return acc, model, optimizer


def _train(acc, model, optimizer, helpers, steps: int = 3) -> None:
    for k in range(steps):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(k))
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        for h in helpers:
            h.step()


def test_two_helpers_of_one_accelerator_need_their_own_tags(tmp_path):
    """A second live ``AcceleratorEMA`` of one accelerator with the tag of the first is refused (both would write
    ``<folder>/<tag>/`` at ``save_state``, the second overwriting the first), before registering any hook; with their
    own tags each resumes its own EMA; ``remove_hooks()`` frees a tag."""
    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared()
    fast = AcceleratorEMA(acc, model, decay=0.5)
    with pytest.raises(ValueError, match=r"tag='ema': another AcceleratorEMA of this accelerator .* own tag="):
        AcceleratorEMA(acc, model, decay=0.9)
    assert len(acc._save_model_state_pre_hook) == 1 and len(acc._load_model_state_pre_hook) == 1
    slow = AcceleratorEMA(acc, model, decay=0.9, tag="ema_slow")
    _train(acc, model, optimizer, (fast, slow))
    want = {h.ema.tag: fe.gather_full(h.state, model) for h in (fast, slow)}
    acc.save_state(str(tmp_path / "ckpt"))
    fast.remove_hooks(), slow.remove_hooks()
    acc, model, optimizer = _prepared(seed=1)
    helpers = [AcceleratorEMA(acc, model, decay=0.5), AcceleratorEMA(acc, model, decay=0.9, tag="ema_slow")]
    acc.load_state(str(tmp_path / "ckpt"))
    for h in helpers:
        got = fe.gather_full(h.state, model)
        assert all(torch.equal(got[n], t) for n, t in want[h.ema.tag].items()), h.ema.tag
    assert not torch.equal(want["ema"]["0.weight"], want["ema_slow"]["0.weight"])
    helpers[0].remove_hooks()
    AcceleratorEMA(acc, model, decay=0.5).remove_hooks()  # the removed helper's tag is free again


def test_a_helper_holds_its_tag_until_remove_hooks_and_the_accelerator_still_pickles():
    """With a real ``Accelerator``: the live helpers are found through the accelerator's own save-state pre-hooks,
    so a helper dropped by the user (still registered, still writing at ``save_state``) keeps its tag until its
    ``remove_hooks()``; nothing is set on the accelerator, which pickles as it did before the check."""
    import gc
    import pickle

    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared()
    before = set(vars(acc))
    first = AcceleratorEMA(acc, model, decay=0.5)
    assert set(vars(acc)) == before | {"save_state", "load_state"}  # only their wrappers (set once, by the first)
    copy = pickle.loads(pickle.dumps(acc))  # with a helper's hooks registered (its EMA not started), as before
    assert copy.save_state.accelerator is copy and copy.load_state.accelerator is copy  # bound to the copy
    ref = first
    del first
    gc.collect()
    msg = (
        r"tag='ema': another AcceleratorEMA .* Call remove_hooks\(\) on the other helper, or give this one its own tag="
    )
    with pytest.raises(ValueError, match=msg):
        AcceleratorEMA(acc, model, decay=0.9)  # still registered: it would still write <folder>/ema/ at save_state
    assert len(acc._save_model_state_pre_hook) == 1
    other = AcceleratorEMA(acc, model, decay=0.9, tag="ema_slow")
    pickle.dumps(acc)
    ref.remove_hooks()
    wrapper = acc.save_state
    again = AcceleratorEMA(acc, model, decay=0.9)  # freed by remove_hooks
    assert acc.save_state is wrapper  # wrapped once, whatever the number of helpers
    with pytest.raises(ValueError, match="tag='ema_slow'"):
        AcceleratorEMA(acc, model, decay=0.9, tag="ema_slow")
    _train(acc, model, optimizer, (again, other))
    again.remove_hooks(), other.remove_hooks()
    assert len(acc._save_model_state_pre_hook) == 0 and len(acc._load_model_state_pre_hook) == 0


@pytest.mark.parametrize(
    "tag",
    [
        "model.safetensors",
        "model_1.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "sampler.bin",
        "random_states_0.pkl",
        "custom_checkpoint_0.pkl",
        "pytorch_model",
        "pytorch_model_fsdp_0",
        "optimizer_0",
        "Optimizer_1",
    ],
)
def test_tags_named_like_what_save_state_writes_are_refused(tag):
    """A tag named like a file or folder ``accelerator.save_state`` writes into its folder (the model, optimizer,
    scheduler, sampler, random states, custom objects; DeepSpeed's checkpoint, FSDP's sharded folders) is refused at
    construction, before any hook is registered, not at the first save_state after training."""
    from functional_ema.checkpoint import InvalidTagError
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, _ = _prepared()
    with pytest.raises(InvalidTagError, match=rf"tag='{tag}' (looks like a file name|is the name of a folder)"):
        AcceleratorEMA(acc, model, decay=0.9, tag=tag)
    assert len(acc._save_model_state_pre_hook) == 0
    AcceleratorEMA(acc, model, decay=0.9, tag="ema_best").remove_hooks()


def test_export_of_a_compiled_model_loads_into_the_plain_model(tmp_path):
    """Over a ``torch.compile``'d model the EMA is named as the model it compiles (no ``_orig_mod.``): the export
    loads strict=True into the uncompiled model and holds the EMA."""
    from safetensors.torch import load_file
    from torch import nn

    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, _, _ = _prepared()
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model = torch.compile(plain, backend="eager")
    model, optimizer = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ema = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (ema,))
    averaged = fe.gather_full(ema.state, model)
    assert sorted(averaged) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    exported = load_file(ema.export(tmp_path / "ema.safetensors"))
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    assert str(fresh.load_state_dict(exported, strict=True)) == "<All keys matched successfully>"
    assert all(torch.equal(exported[n], t) for n, t in averaged.items())
    assert not torch.equal(exported["0.weight"], plain[0].weight.detach())  # the EMA, not the live weights


@pytest.mark.parametrize("wrapping", ["compile(m)", "compile(DDP(m))", "DDP(compile(m))"])
def test_export_drops_every_wrapper_prefix_the_names_carry(tmp_path, wrapping):
    """The EMA and the export are named as the plain model's parameters whatever the order of the wrappers:
    torch.compile(DDP(m)) (Accelerate's DDP with dynamo), DDP(torch.compile(m)) (a model compiled before
    ``prepare``), torch.compile(m); the adapter reads the model inside them (the names were ``_orig_mod.module.``,
    ``_orig_mod.`` and ``_orig_mod.``). The export loads strict=True into the plain model and holds the EMA. DDP over
    a one-rank gloo group."""
    import torch.distributed as dist
    from safetensors.torch import load_file
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, _, _ = _prepared()
    ours = not dist.is_initialized()
    if ours:
        dist.init_process_group("gloo", init_method=(tmp_path / "pg").as_uri(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        model = {
            "compile(m)": lambda: torch.compile(plain, backend="eager"),
            "compile(DDP(m))": lambda: torch.compile(DDP(plain), backend="eager"),
            "DDP(compile(m))": lambda: DDP(torch.compile(plain, backend="eager")),
        }[wrapping]()
        ema = AcceleratorEMA(acc, model, decay=0.5)
        for k in range(3):  # the parameters move (the wrappers share them); the helper counts one step per call
            with torch.no_grad():
                for p in plain.parameters():
                    p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)))
            ema.step()
        averaged = fe.gather_full(ema.state, model)
        assert sorted(averaged) == sorted(n for n, _ in plain.named_parameters())
        exported = load_file(ema.export(tmp_path / "ema.safetensors"))
        fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        assert str(fresh.load_state_dict(exported, strict=True)) == "<All keys matched successfully>"
        assert all(torch.equal(exported[n], t) for n, t in averaged.items())
        assert not torch.equal(exported["0.weight"], plain[0].weight.detach())  # the EMA, not the live weights
        ema.remove_hooks()
    finally:
        if ours:
            dist.destroy_process_group()


def _live(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_save_state_inside_swapped_writes_the_live_weights_and_keeps_the_ema_in(tmp_path):
    """``accelerator.save_state`` inside ``with ema.swapped():`` (save when the EMA validation improves): Accelerate
    gathers the model's state before its pre-hooks, so the helper's wrapper of ``save_state`` swaps the EMA out for
    the save. The folder holds the live weights and the EMA, bitwise: ``load_state`` into a fresh model gives the
    weights of the moment of the save (AdamW: its state too, training on equal); inside the block the model holds
    the EMA again after the save. A ``save_state`` past the wrapper is refused in the hook, before Accelerate writes
    the model's file, naming the folder."""
    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared(optimizer=torch.optim.AdamW)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (ema,), steps=4)
    live, averaged = _live(model), fe.gather_full(ema.state, model)
    assert not torch.equal(live["0.weight"], averaged["0.weight"])
    with ema.swapped() as entered, torch.no_grad():
        acc.save_state(str(tmp_path / "ckpt"))
        inside = _live(model)
    assert entered and all(torch.equal(inside[n], averaged[n]) for n in averaged)  # the EMA in again after the save
    assert all(torch.equal(p, live[n]) for n, p in _live(model).items())  # and out at the end of the block
    _train(acc, model, optimizer, (ema,), steps=2)
    after = _live(model), fe.gather_full(ema.state, model)
    ema.remove_hooks()

    acc, model, optimizer = _prepared(seed=1, optimizer=torch.optim.AdamW)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    acc.load_state(str(tmp_path / "ckpt"))
    assert all(torch.equal(p, live[n]) for n, p in _live(model).items())  # the live weights, not the EMA
    restored = fe.gather_full(ema.state, model)
    assert ema.optimizer_step == 4 and all(torch.equal(restored[n], t) for n, t in averaged.items())
    _train(acc, model, optimizer, (ema,), steps=2)  # the resume trains on as the uninterrupted run did
    assert all(torch.equal(p, after[0][n]) for n, p in _live(model).items())
    assert all(torch.equal(t, after[1][n]) for n, t in fe.gather_full(ema.state, model).items())
    refusal = r"save_state\('.*past'\) ran while the EMA is swapped .* Do not"
    with ema.swapped(), torch.no_grad(), pytest.raises(RuntimeError, match=refusal):
        type(acc).save_state(acc, str(tmp_path / "past"))  # past the wrapper: refused in the hook
    assert not (tmp_path / "past" / "model.safetensors").exists()  # before Accelerate wrote the model's weights
    ema.remove_hooks()


def test_load_state_inside_swapped_loads_the_live_weights_and_swaps_the_loaded_ema_in(tmp_path):
    """``accelerator.load_state`` inside ``with ema.swapped():``: the helper's wrapper swaps the EMA out first, so
    the load replaces the live weights (swapped in, the block's end would have put the weights of before the load
    back, silently undoing it), then swaps the loaded EMA in. Inside: the loaded EMA; after the block: the loaded
    live weights; both the saved ones, bitwise. A ``load_state`` past the wrapper is refused in the hook."""
    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared(optimizer=torch.optim.AdamW)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (ema,), steps=4)
    saved_live, saved_ema = _live(model), fe.gather_full(ema.state, model)
    acc.save_state(str(tmp_path / "ckpt"))
    _train(acc, model, optimizer, (ema,), steps=2)  # both move on past the save
    assert not torch.equal(_live(model)["0.weight"], saved_live["0.weight"])
    with ema.swapped() as entered, torch.no_grad():
        acc.load_state(str(tmp_path / "ckpt"))
        inside = _live(model)
    assert entered and all(torch.equal(inside[n], t) for n, t in saved_ema.items())  # the loaded EMA is in
    assert all(torch.equal(p, saved_live[n]) for n, p in _live(model).items())  # the load was not undone
    assert ema.optimizer_step == 4
    assert all(torch.equal(t, saved_ema[n]) for n, t in fe.gather_full(ema.state, model).items())
    refusal = r"load_state\('.*ckpt'\) ran while the EMA is swapped .* load outside"
    with ema.swapped(), torch.no_grad(), pytest.raises(RuntimeError, match=refusal):
        type(acc).load_state(acc, str(tmp_path / "ckpt"))  # past the wrapper: refused in the hook
    ema.remove_hooks()


def test_save_and_load_inside_two_helpers_nested_blocks_keep_each_block_and_the_live_weights(tmp_path):
    """Two helpers of one accelerator, ``with a.swapped(): with b.swapped(): save_state / load_state``: every swap in
    force is taken out newest first (b's, then a's) and put back in opening order, whichever helper was made
    first. The checkpoint holds the live weights; inside the inner block b's EMA is in again, in the outer a's;
    after both the live (or loaded) weights. A block entered before its EMA started swaps nothing and does not
    make a save past the wrapper refused."""
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared()
    late = AcceleratorEMA(acc, model, decay=0.5, tag="ema_late", start_step=100)
    with late.swapped() as entered:  # nothing to swap in yet: not a swap in force
        assert not entered
        type(acc).save_state(acc, str(tmp_path / "early"))  # past the wrapper, but no EMA in the model: taken
    late.remove_hooks()
    a = AcceleratorEMA(acc, model, decay=0.5)
    b = AcceleratorEMA(acc, model, decay=0.9, tag="ema_slow")
    _train(acc, model, optimizer, (a, b), steps=4)
    live, ema_a, ema_b = _live(model), fe.gather_full(a.state, model), fe.gather_full(b.state, model)
    for verb in ("save", "load"):
        with a.swapped(), torch.no_grad():
            with b.swapped():
                if verb == "save":
                    acc.save_state(str(tmp_path / "ckpt"))
                else:
                    acc.load_state(str(tmp_path / "ckpt"))
                assert all(torch.equal(p, ema_b[n]) for n, p in _live(model).items()), verb  # b's EMA in again
            assert all(torch.equal(p, ema_a[n]) for n, p in _live(model).items()), verb  # a's in the outer block
        assert all(torch.equal(p, live[n]) for n, p in _live(model).items()), verb  # the live weights after both
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")
    assert all(torch.equal(saved[n], live[n]) for n in live)
    a.remove_hooks(), b.remove_hooks()


def test_async_saves_with_total_limit_rotation_keep_the_newest_checkpoint_whole(tmp_path):
    """``AcceleratorEMA(async_save=True)`` with ``ProjectConfiguration(automatic_checkpoint_naming=True,
    total_limit=1)``, ``save_state()`` every step, each EMA write slowed down: Accelerate deletes the previous
    checkpoint folder at the start of the next ``save_state``, before its hooks; the helper's wrapper commits the
    EMA save in flight into it first. No error, only the newest folder left, holding a complete EMA equal to a
    reference EMA (lerp of the live weights) at its step, bitwise; every save was complete before its folder went."""
    import shutil
    from pathlib import Path

    from accelerate.utils import ProjectConfiguration

    import functional_ema as fe
    import functional_ema._async as fe_async
    from functional_ema.integrations.accelerate import AcceleratorEMA

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=1)
    acc, model, optimizer = _prepared(project_config=project)
    ema = AcceleratorEMA(acc, model, decay=0.5, async_save=True)
    write, removed = fe_async._write_files, []

    def slow_write(job, names):
        time.sleep(0.3)  # the next save_state comes (and would delete this folder) before the write is done
        return write(job, names)

    rmtree = shutil.rmtree

    def seen_rmtree(path, *args, **kwargs):
        if Path(path).parent == tmp_path / "checkpoints":  # Accelerate's rotation
            removed.append((Path(path).name, (Path(path) / "ema" / "ema_manifest.json").is_file()))
        return rmtree(path, *args, **kwargs)

    reference = None
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fe_async, "_write_files", slow_write)
        mp.setattr(shutil, "rmtree", seen_rmtree)
        for _ in range(4):
            _train(acc, model, optimizer, (ema,), steps=1)
            weights = _live(model)
            reference = weights if reference is None else {n: reference[n].lerp(w, 0.5) for n, w in weights.items()}
            acc.save_state()
        ema.wait()
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_3"], names
    # each folder deleted with its EMA complete
    assert removed == [(f"checkpoint_{k}", True) for k in range(3)], removed
    ckpt = tmp_path / "checkpoints" / "checkpoint_3"
    assert fe.checkpoint.read_manifest(ckpt, "ema")["step"] == 4
    saved = fe.checkpoint.consolidate(ckpt, "ema")
    assert sorted(saved) == sorted(reference) and all(torch.equal(saved[n], t) for n, t in reference.items())
    ema.remove_hooks()


def _own(model) -> dict:
    """The weights under the model's own names (a DDP's ``module.`` dropped), as the EMA names them."""
    return {n: p.detach().clone() for n, p in getattr(model, "module", model).named_parameters()}


def _same_folder_run(
    folder, *, async_save: bool, fail_at: int | None = None, rank_fails: int | None = None, save_at=(3, 6)
):
    """A run of 6 optimizer steps saving into ``folder`` every 3 (the docs' idiom), with a reference EMA of the live
    weights (plain torch lerp, decay 0.5); ``fail_at``: the save_state of that step fails inside, after the EMA's
    hook and before Accelerate writes its own files (``save_accelerator_state`` raises: what a kill there leaves).
    ``rank_fails``: only that rank's does. Returns the accelerator, model, helper, weights and EMAs by step."""
    import accelerate.accelerator as accelerator_module

    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared()
    ema = AcceleratorEMA(acc, model, decay=0.5, async_save=async_save)
    real, weights, emas, reference = accelerator_module.save_accelerator_state, {}, {}, None

    def stopped(*args, **kwargs):
        if rank_fails is None or acc.process_index == rank_fails:
            raise RuntimeError("stopped inside save_state (injected)")
        return real(*args, **kwargs)

    for step in range(1, 7):
        _train(acc, model, optimizer, (ema,), steps=1)
        weights[step] = _own(model)
        reference = (
            weights[step] if reference is None else {n: reference[n].lerp(w, 0.5) for n, w in weights[step].items()}
        )
        emas[step] = reference
        if step in save_at:
            with pytest.MonkeyPatch.context() as mp:
                if step == fail_at:
                    mp.setattr(accelerator_module, "save_accelerator_state", stopped)
                try:
                    acc.save_state(str(folder))
                except RuntimeError as e:
                    assert "injected" in str(e)
    return acc, model, ema, weights, emas


def _load_refused(folder, match: str, error: type | None = None):
    """``load_state(folder)`` into a fresh accelerator and helper: refused (``error``, default
    ``CheckpointMismatchError``), and nothing loaded (no EMA, the step counter and the model's weights as they were)."""
    from functional_ema.checkpoint import CheckpointMismatchError
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, _ = _prepared(seed=1)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    before = _own(model)
    with pytest.raises(error or CheckpointMismatchError, match=match) as refused:
        acc.load_state(str(folder))
    assert ema.state is None and ema.optimizer_step == 0
    assert all(torch.equal(p, before[n]) for n, p in _own(model).items())
    ema.remove_hooks()
    return str(refused.value)


def _load_whole(folder, weights: dict, ema_at: dict, step: int) -> None:
    """``load_state(folder)``: the model's weights of the folder's own save (the oracle, as saved) and the
    uninterrupted run's EMA at that step, bitwise; the helper's counter at that step."""
    import functional_ema as fe
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, _ = _prepared(seed=1)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    acc.load_state(str(folder))
    assert ema.optimizer_step == step and int(ema.state.step) == step
    assert all(torch.equal(p, weights[n]) for n, p in _own(model).items())
    got = fe.gather_full(ema.state, model)
    assert sorted(got) == sorted(ema_at) and all(torch.equal(got[n], t) for n, t in ema_at.items())
    ema.remove_hooks()


def test_a_folder_whose_ema_save_failed_or_was_cut_off_is_refused_and_a_whole_one_resumes(tmp_path):
    """``save_state(folder)`` into one folder every 3 steps (the docs' idiom). The folder's record of each
    ``save_state`` (written once it returned) lets ``load_state`` tell a folder whose EMA is of another save:
    (a) ``async_save=True``, the step-6 EMA write fails in the background after Accelerate wrote its step-6 files;
    (b) ``async_save=True``, the process killed after the step-6 ``save_state`` with its EMA write in flight (the
    folder copied while the write is held); (c) ``async_save=False``, killed inside the step-6 ``save_state`` after the
    EMA's hook and before Accelerate's own files (step 3's model, step 6's EMA), into a used folder and a new one.
    Each is refused naming the folder and both steps, loading nothing; a whole folder resumes the uninterrupted
    run's EMA bitwise, also without the record (saved by an earlier version) and after a save past the wrapper."""
    import errno
    import re
    import shutil
    import threading

    from safetensors.torch import load_file

    import functional_ema as fe
    import functional_ema._async as fe_async
    from functional_ema.checkpoint import read_manifest
    from functional_ema.integrations.accelerate import AcceleratorEMA

    write, calls, held, release = fe_async._write_files, [0], threading.Event(), threading.Event()

    def failing(job, names):
        calls[0] += 1
        if calls[0] == 2:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return write(job, names)

    with pytest.MonkeyPatch.context() as mp:  # (a)
        mp.setattr(fe_async, "_write_files", failing)
        acc, model, ema, weights, emas = _same_folder_run(tmp_path / "a", async_save=True)
        with pytest.raises(OSError, match="No space left"):  # raised at the next wait or save, as documented
            ema.wait()
        ema.remove_hooks()
    saved = load_file(tmp_path / "a" / "model.safetensors")  # the oracle: the folder's own weights are step 6's
    assert all(torch.equal(saved[n], t) for n, t in weights[6].items())
    assert read_manifest(tmp_path / "a", "ema")["step"] == 3
    message = _load_refused(tmp_path / "a", r"optimizer step 6 .* EMA .* save_state of optimizer step 3: .* Nothing")
    assert str(tmp_path / "a") in message and "async_save write" in message

    hold_at = 2

    def held_write(job, names):
        calls[0] += 1
        if calls[0] == hold_at:
            held.set()
            release.wait(60)  # the step-6 write in flight while the folder is copied: what a kill leaves
        return write(job, names)

    calls[0] = 0
    with pytest.MonkeyPatch.context() as mp:  # (b)
        mp.setattr(fe_async, "_write_files", held_write)
        acc, model, ema, weights, emas = _same_folder_run(tmp_path / "b", async_save=True)
        assert held.wait(60)
        shutil.copytree(tmp_path / "b", tmp_path / "b_killed")
        release.set()
        ema.wait()
        ema.remove_hooks()
    _load_refused(tmp_path / "b_killed", r"optimizer step 6 .* save_state of optimizer step 3")
    calls[0], hold_at = 0, 1  # (b) into a new folder: no EMA checkpoint in the copy at all
    held.clear(), release.clear()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fe_async, "_write_files", held_write)
        *_, ema, _, _ = _same_folder_run(tmp_path / "b_new", async_save=True, save_at=(6,))
        assert held.wait(60)
        shutil.copytree(tmp_path / "b_new", tmp_path / "b_new_killed")
        release.set()
        ema.wait()
        ema.remove_hooks()
    folder, incomplete = tmp_path / "b_new_killed", fe.checkpoint.IncompleteCheckpointError
    _load_refused(folder, r"holds no complete EMA .* optimizer step 6 .* earlier checkpoint folder", incomplete)
    (folder / "ema_save_state.json").unlink()  # without the record: the same refusal, with no step to name
    where = re.escape(f"accelerator.load_state('{folder}'): {folder / 'ema'} holds no complete EMA")
    message = _load_refused(folder, where + ".* earlier checkpoint folder", incomplete)
    assert "None" not in message
    _load_whole(tmp_path / "b", weights[6], emas[6], 6)  # the write finished: the folder is whole
    (tmp_path / "b" / "ema_save_state.json").unlink()  # as saved by an earlier version: loads as before
    _load_whole(tmp_path / "b", weights[6], emas[6], 6)

    for folder, save_at in (("c", (3, 6)), ("c_new", (6,))):  # (c): a folder saved into at step 3, and a new one
        *_, ema, weights, emas = _same_folder_run(tmp_path / folder, async_save=False, fail_at=6, save_at=save_at)
        ema.remove_hooks()
        assert read_manifest(tmp_path / folder, "ema")["step"] == 6
        message = _load_refused(tmp_path / folder, r"save_state of optimizer step 6 into this folder did not finish")
        assert str(tmp_path / folder) in message and "ema_save_state.json" in message

    acc, model, optimizer = _prepared()  # a save past the wrapper leaves no record: checked as before
    past = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (past,), steps=2)
    type(acc).save_state(acc, str(tmp_path / "c"))
    past.remove_hooks()
    assert not (tmp_path / "c" / "ema_save_state.json").exists()
    _load_whole(tmp_path / "c", _own(model), fe.gather_full(past.state, model), 2)


def same_folder_worker(root: str) -> dict:
    """At 2 DDP ranks: (a) the step-6 EMA write of rank 0 (the one that writes the replicated EMA's file and
    Accelerate's) fails in the background; (c) rank 0 stops inside the step-6 ``save_state`` after the EMA's hook; both
    refused on every rank, loading nothing; a whole folder resumes the uninterrupted run's EMA bitwise on every
    rank. (Rank 1 writes no file of a replicated EMA: a failure there may come after rank 0 committed the save
    whole, a race whose both outcomes load right.)"""
    import contextlib
    import errno
    from pathlib import Path

    import functional_ema as fe
    import functional_ema._async as fe_async

    folder, write, calls = Path(root), fe_async._write_files, [0]

    def failing(job, names):
        calls[0] += 1
        if calls[0] == 2 and job.rank == 0:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        return write(job, names)

    fe_async._write_files = failing
    try:
        *_, ema, weights, emas = _same_folder_run(folder / "a", async_save=True)
        with contextlib.suppress(OSError, fe.CheckpointError):  # the failure (rank 1 may not have heard of it yet)
            ema.wait()
        ema.remove_hooks()
    finally:
        fe_async._write_files = write
    assert fe.checkpoint.read_manifest(folder / "a", "ema")["step"] == 3  # the oracle: the EMA is step 3's
    refused = {"a": _load_refused(folder / "a", r"optimizer step 6 .* save_state of optimizer step 3: ")}
    *_, ema, weights, emas = _same_folder_run(folder / "c", async_save=False, fail_at=6, rank_fails=0)
    ema.remove_hooks()
    refused["c"] = _load_refused(folder / "c", r"save_state of optimizer step 6 into this folder did not finish")
    *_, ema, weights, emas = _same_folder_run(folder / "whole", async_save=True)
    ema.wait()
    ema.remove_hooks()
    _load_whole(folder / "whole", weights[6], emas[6], 6)
    return refused


def test_at_two_ranks_a_folder_whose_ema_is_of_another_save_is_refused_on_every_rank(tmp_path):
    """:func:`same_folder_worker` at 2 DDP ranks: each refusal names the folder, on both ranks alike."""
    got = run_ranks(
        "tests.test_integrations_accelerate:same_folder_worker",
        world_size=2,
        timeout=300,
        env={"FE_DIST_INIT": "torch"},
        root=str(tmp_path),
    )
    for case in ("a", "c"):
        assert got[0][case] == got[1][case] and str(tmp_path / case) in got[0][case], got


# The Files table of the save record (damaged, forged, foreign records): tests/test_hostile_files.py.


def _ds_prepared(seed: int, **accelerator_kwargs):
    """A fresh DeepSpeed ZeRO-2 accelerator (CPU ranks) with a small model and AdamW prepared."""
    from accelerate import Accelerator, DeepSpeedPlugin
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from torch import nn

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState(cpu=True)
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
    }
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg), **accelerator_kwargs)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 1))
    model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=3e-3))
    assert acc.distributed_type == "DEEPSPEED", acc.distributed_type
    return acc, model, optimizer


def _ds_train_step(acc, model, optimizer, ema, step: int) -> None:
    from torch import nn

    g = torch.Generator().manual_seed(1000 * step + acc.process_index)  # the same batch for the same step
    x = torch.randn(4, 16, generator=g)
    acc.backward(nn.functional.mse_loss(model(x), x.sum(1, keepdim=True)))
    optimizer.step()
    optimizer.zero_grad()
    ema.step()


def _flat(obj, prefix: str = "") -> dict:
    """Every leaf of a nested state (dicts, lists, tensors, numbers), by path: compared bitwise."""
    if isinstance(obj, dict):
        return {k: v for key, sub in obj.items() for k, v in _flat(sub, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, sub in enumerate(obj) for k, v in _flat(sub, f"{prefix}/{i}").items()}
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    if hasattr(obj, "__dict__"):  # an object in the state (DeepSpeed's loss scaler): by its fields
        return _flat(vars(obj), f"{prefix}:{type(obj).__name__}")
    return {prefix: obj}


def _ds_snapshot(model, ema) -> dict:
    """This rank's model weights, ZeRO optimizer state (fp32 partitions, AdamW moments), DeepSpeed's step and the
    full EMA (a collective)."""
    import functional_ema as fe

    return {
        "weights": _flat({n: p for n, p in model.module.named_parameters()}),
        "optimizer": _flat(model.optimizer.state_dict()),
        "global_steps": model.global_steps,
        "ema": None if ema.state is None else _flat(fe.gather_full(ema.state, model)),
    }


def _same_flat(a: dict, b: dict) -> bool:
    def eq(x, y):
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)
        return x == y

    return a.keys() == b.keys() and all(eq(a[k], b[k]) for k in a)


def _same_snapshot(a: dict, b: dict) -> dict:
    """Per part: True when bitwise equal, else the paths that differ (a few)."""

    def diff(x, y):
        if not isinstance(x, dict) or not isinstance(y, dict):
            return x == y or f"{x!r} != {y!r}"
        keys = sorted(set(x) ^ set(y)) + [k for k in x if k in y and not _same_flat({k: x[k]}, {k: y[k]})]
        return not keys or keys[:4]

    return {k: diff(a[k], b[k]) for k in a}


def deepspeed_refusal_worker(root: str) -> dict:
    """At 2 DeepSpeed ZeRO-2 ranks (Accelerate loads the engine before its load-state pre-hooks): a run saves at step
    3 into ``good`` and ``reused``, at step 6 into ``unfinished`` (its record then marked unfinished, as a save cut
    off after it leaves it) and into ``reused`` again, killed after DeepSpeed wrote the step-6 model and optimizer
    and before the EMA's hook. At step 7 each bad folder's ``load_state`` is refused, and the model, the ZeRO optimizer,
    DeepSpeed's step and the EMA are bitwise what they were; ``load_state(good)`` then gives the step-3 state bitwise,
    and the step after it the uninterrupted run's step 4, bitwise."""
    from pathlib import Path

    import functional_ema as fe
    from functional_ema._checkpoint.format import read_record, record_bytes
    from functional_ema.integrations.accelerate import AcceleratorEMA

    folder = Path(root)
    acc, model, optimizer = _ds_prepared(0)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    snaps, out = {}, {}
    for step in range(1, 8):
        _ds_train_step(acc, model, optimizer, ema, step)
        if step in (3, 4):
            snaps[step] = _ds_snapshot(model, ema)
        if step == 3:
            acc.save_state(str(folder / "good"))
            acc.save_state(str(folder / "reused"))
        if step == 6:
            acc.save_state(str(folder / "unfinished"))
            record = folder / "unfinished" / "ema_save_state.json"
            if acc.is_main_process:
                fields = read_record(record)
                body = {k: v for k, v in fields.items() if k not in ("format", "checksum")}
                record.write_bytes(record_bytes({**body, "complete": False}))
            acc.wait_for_everyone()
            out["killed"] = _killed_after_save_checkpoint(acc, model, str(folder / "reused"))
    states = torch.load(folder / "reused" / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False)
    out["reused_model_is_step_6"] = (  # the oracle of the kill: DeepSpeed's files of step 6 beside step 3's EMA
        states["global_steps"] == 6 and fe.checkpoint.read_manifest(folder / "reused", "ema")["step"] == 3
    )
    before = _ds_snapshot(model, ema)
    out["refused"], out["unchanged"] = {}, {}
    for name in ("unfinished", "reused"):
        try:
            acc.load_state(str(folder / name))
            out["refused"][name] = None
        except fe.checkpoint.CheckpointMismatchError as e:
            out["refused"][name] = str(e)
        out["unchanged"][name] = _same_snapshot(_ds_snapshot(model, ema), before)
    acc.load_state(str(folder / "good"))
    out["good"] = _same_snapshot(_ds_snapshot(model, ema), snaps[3])
    out["good_step"] = ema.optimizer_step
    _ds_train_step(acc, model, optimizer, ema, 4)
    out["resumed"] = _same_snapshot(_ds_snapshot(model, ema), snaps[4])
    ema.remove_hooks()
    return out


def test_deepspeed_a_refused_folder_loads_nothing_and_a_cut_off_save_into_a_used_folder_is_refused(tmp_path):
    """:func:`deepspeed_refusal_worker`: under DeepSpeed Accelerate loads the engine before its load-state pre-hooks;
    the helper's wrapper of ``load_state`` checks the save record (and the EMA's step against it) first, so a folder
    whose save did not finish is refused with the model, optimizer, DeepSpeed's step and EMA untouched, bitwise; and a
    ``save_state`` into a used folder marks it unfinished before DeepSpeed writes its files, so one killed after them
    is refused naming the unfinished save (not loaded as step 6's model with step 3's EMA)."""
    got = run_ranks(
        "tests.test_integrations_accelerate:deepspeed_refusal_worker", world_size=2, timeout=600, root=str(tmp_path)
    )
    for out in got:
        assert out["killed"] and out["reused_model_is_step_6"], out
        for name in ("unfinished", "reused"):
            message = out["refused"][name]
            assert message is not None, (name, out)
            assert str(tmp_path / name) in message and "Nothing was loaded" in message, (name, message)
            assert "save_state of optimizer step 6 into this folder did not finish" in message, (name, message)
            assert "loaded already" not in message and "load another folder now" not in message, (name, message)
            assert out["unchanged"][name] == {"weights": True, "optimizer": True, "global_steps": True, "ema": True}, (
                name,
                out["unchanged"],
            )
        assert out["good"] == {"weights": True, "optimizer": True, "global_steps": True, "ema": True}, out["good"]
        assert out["good_step"] == 3
        assert out["resumed"] == {"weights": True, "optimizer": True, "global_steps": True, "ema": True}, out
    assert got[0]["refused"] == got[1]["refused"]


def test_a_save_cut_off_before_the_ema_hook_in_a_used_folder_is_refused(tmp_path, monkeypatch):
    """A save-state pre-hook registered before the helper's (so it runs first) writes the model's file and raises:
    what a kill leaves under DeepSpeed, FSDP and Megatron-LM, which write the model before the pre-hooks (taken as
    such here: ``_writes_model_first``). ``ckpt``, saved into at step 3, gets step 6's model beside step 3's EMA and
    record: the wrapper marked the save unfinished before Accelerate started, so ``load_state`` refuses it naming the
    unfinished step-6 save, loading nothing (it loaded step 6's model with step 3's EMA); a folder of a clean save
    resumes bitwise (one process)."""
    from safetensors.torch import load_file, save_file

    import functional_ema as fe
    import functional_ema.integrations.accelerate as integration
    from functional_ema.integrations.accelerate import AcceleratorEMA

    monkeypatch.setattr(integration, "_writes_model_first", lambda accelerator: True)
    acc, model, optimizer = _prepared()
    stop = [False]

    def writes_the_model_then_stops(models, weights, output_dir):
        if stop[0]:
            save_file(weights[0], f"{output_dir}/model.safetensors")
            raise RuntimeError("stopped after the model's file (injected)")

    first = acc.register_save_state_pre_hook(writes_the_model_then_stops)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (ema,), steps=3)
    at3 = _own(model), fe.gather_full(ema.state, model)
    acc.save_state(str(tmp_path / "ckpt"))
    acc.save_state(str(tmp_path / "clean"))
    _train(acc, model, optimizer, (ema,), steps=3)
    stop[0] = True
    with pytest.raises(RuntimeError, match="injected"):
        acc.save_state(str(tmp_path / "ckpt"))
    first.remove()
    ema.remove_hooks()
    saved = load_file(tmp_path / "ckpt" / "model.safetensors")  # the oracle: step 6's model beside step 3's EMA
    assert all(torch.equal(saved[n], t) for n, t in _own(model).items())
    assert fe.checkpoint.read_manifest(tmp_path / "ckpt", "ema")["step"] == 3
    message = _load_refused(tmp_path / "ckpt", r"save_state of optimizer step 6 into this folder did not finish")
    assert str(tmp_path / "ckpt") in message and "Nothing was loaded" in message
    _load_whole(tmp_path / "clean", *at3, 3)


def test_a_refused_or_failed_ema_save_into_a_used_folder_leaves_its_earlier_save_loadable(tmp_path, monkeypatch):
    """One process (as DDP: Accelerate writes nothing of its own before its save-state pre-hooks). ``save_state`` into
    ``refused`` and ``full`` at step 3 (the docs' same-folder idiom); at step 6 the EMA's save into ``refused`` is
    refused (the EMA's save raises, as the failure of the previous async save surfacing in the next does) and into
    ``full`` fails at its manifest (disk full, the new rank file written). Accelerate wrote nothing: each folder's
    record is step 3's, finished, and ``load_state`` gives step 3's model and the plain EMA of step 3, bitwise."""
    import errno
    from pathlib import Path

    import functional_ema as fe
    import functional_ema._io as fe_io
    from functional_ema._checkpoint.format import read_record
    from functional_ema.integrations.accelerate import AcceleratorEMA

    acc, model, optimizer = _prepared()
    ema = AcceleratorEMA(acc, model, decay=0.5)
    weights, emas = {}, {}
    for step in range(1, 7):
        _train(acc, model, optimizer, (ema,), steps=1)
        weights[step] = _own(model)
        emas[step] = (
            weights[step] if step == 1 else {n: emas[step - 1][n].lerp(w, 0.5) for n, w in weights[step].items()}
        )
        if step == 3:
            acc.save_state(str(tmp_path / "refused"))
            acc.save_state(str(tmp_path / "full"))

    def refuse(*args, **kwargs):
        raise fe.checkpoint.CheckpointError("refused (injected: the previous async save's failure)")

    with monkeypatch.context() as mp, pytest.raises(fe.checkpoint.CheckpointError, match="injected"):
        mp.setattr(ema.ema, "save", refuse)
        acc.save_state(str(tmp_path / "refused"))
    real = fe_io.atomic_write_bytes

    def disk_full(path, data, *args, **kwargs):
        if Path(path).name == "ema_manifest.json":
            raise OSError(errno.ENOSPC, "No space left on device (injected)", str(path))
        return real(path, data, *args, **kwargs)

    with monkeypatch.context() as mp, pytest.raises(Exception, match=r"injected|No space"):
        mp.setattr(fe_io, "atomic_write_bytes", disk_full)
        acc.save_state(str(tmp_path / "full"))
    ema.remove_hooks()
    for name in ("refused", "full"):
        record = read_record(tmp_path / name / "ema_save_state.json")
        assert record["optimizer_step"] == 3 and record["complete"] is True, (name, record)
        _load_whole(tmp_path / name, weights[3], emas[3], 3)


def test_load_state_with_automatic_naming_checks_the_folder_accelerate_picks_before_loading(tmp_path):
    """``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``save_state()`` twice (``checkpoint_0`` and
    ``checkpoint_1``, made by Accelerate: the wrapper does not make them first), the newest one's record then marked
    unfinished; ``load_state()`` picks ``checkpoint_1`` and the wrapper refuses it before anything is loaded, naming
    it; with that folder gone it loads ``checkpoint_0`` bitwise (one process)."""
    import shutil

    from accelerate.utils import ProjectConfiguration

    import functional_ema as fe
    from functional_ema._checkpoint.format import read_record, record_bytes
    from functional_ema.integrations.accelerate import AcceleratorEMA

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc, model, optimizer = _prepared(project_config=project)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    _train(acc, model, optimizer, (ema,), steps=2)
    at2 = _own(model), fe.gather_full(ema.state, model)
    acc.save_state()
    _train(acc, model, optimizer, (ema,), steps=2)
    acc.save_state()
    ema.remove_hooks()
    newest = tmp_path / "checkpoints" / "checkpoint_1"
    fields = read_record(newest / "ema_save_state.json")
    assert fields["optimizer_step"] == 4 and fields["complete"] is True
    body = {k: v for k, v in fields.items() if k not in ("format", "checksum")}
    (newest / "ema_save_state.json").write_bytes(record_bytes({**body, "complete": False}))

    acc, model, _ = _prepared(seed=1, project_config=project)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    with pytest.raises(fe.checkpoint.CheckpointMismatchError, match=r"step 4 into this folder did not finish") as e:
        acc.load_state()
    assert str(newest) in str(e.value) and "Nothing was loaded" in str(e.value)  # refused by the wrapper, first
    assert ema.state is None
    shutil.rmtree(newest)
    acc.load_state()
    got = fe.gather_full(ema.state, model)
    assert ema.optimizer_step == 2 and all(torch.equal(got[n], t) for n, t in at2[1].items())
    assert all(torch.equal(p, at2[0][n]) for n, p in _own(model).items())
    ema.remove_hooks()


def deepspeed_automatic_naming_worker(root: str) -> dict:
    """At 2 DeepSpeed ZeRO-2 ranks with ``ProjectConfiguration(automatic_checkpoint_naming=True)``: ``save_state()``
    at step 3 (``checkpoint_0``); at step 6 one killed after DeepSpeed wrote its model and optimizer into
    ``checkpoint_1`` and before the EMA's hook. At step 7 ``load_state()`` picks ``checkpoint_1`` and must refuse it,
    the model, ZeRO optimizer, DeepSpeed's step and EMA bitwise unchanged; with it gone, ``checkpoint_0`` loads step 3's
    state bitwise."""
    import shutil
    from pathlib import Path

    from accelerate.utils import ProjectConfiguration

    import functional_ema as fe
    from functional_ema._checkpoint.format import read_record
    from functional_ema.integrations.accelerate import AcceleratorEMA

    project = ProjectConfiguration(project_dir=root, automatic_checkpoint_naming=True)
    acc, model, optimizer = _ds_prepared(0, project_config=project)
    ema = AcceleratorEMA(acc, model, decay=0.5)
    out, checkpoints = {}, Path(root) / "checkpoints"
    for step in range(1, 7):
        _ds_train_step(acc, model, optimizer, ema, step)
        if step == 3:
            at3 = _ds_snapshot(model, ema)
            acc.save_state()
    out["killed"] = _killed_after_save_checkpoint(acc, model, None)
    states = torch.load(
        checkpoints / "checkpoint_1" / "pytorch_model" / "mp_rank_00_model_states.pt", weights_only=False
    )
    out["model_is_step_6"] = states["global_steps"] == 6 and not (checkpoints / "checkpoint_1" / "ema").exists()
    first = read_record(checkpoints / "checkpoint_0" / "ema_save_state.json")
    out["first_record"] = [first["optimizer_step"], first["complete"]]
    _ds_train_step(acc, model, optimizer, ema, 7)  # a load of checkpoint_1's step-6 model would show
    before = _ds_snapshot(model, ema)
    try:
        acc.load_state()
        out["refused"] = None
    except fe.checkpoint.CheckpointError as e:  # any refusal: which one, and what it left loaded, is checked
        out["refused"] = f"{type(e).__name__}: {e}"
    out["unchanged"] = _same_snapshot(_ds_snapshot(model, ema), before)
    acc.wait_for_everyone()
    if acc.is_main_process:
        shutil.rmtree(checkpoints / "checkpoint_1")
    acc.wait_for_everyone()
    acc.load_state()
    out["earlier"] = _same_snapshot(_ds_snapshot(model, ema), at3)
    ema.remove_hooks()
    return out


def test_deepspeed_automatic_naming_a_save_cut_off_before_the_ema_hook_is_refused(tmp_path):
    """:func:`deepspeed_automatic_naming_worker`: with ``automatic_checkpoint_naming`` the folder (``checkpoint_<n>``)
    is new and made by Accelerate, so the wrapper marks it unfinished once Accelerate has named it, before DeepSpeed
    writes into it: a save killed between DeepSpeed's write and the EMA's hook leaves it refused by ``load_state``
    (naming it and the unfinished save, before anything is loaded), not loaded as step 6's model without its EMA."""
    got = run_ranks(
        "tests.test_integrations_accelerate:deepspeed_automatic_naming_worker",
        world_size=2,
        timeout=600,
        root=str(tmp_path),
    )
    for out in got:
        assert out["killed"] and out["model_is_step_6"] and out["first_record"] == [3, True], out
        message = out["refused"]
        assert message is not None, out
        assert out["unchanged"] == {"weights": True, "optimizer": True, "global_steps": True, "ema": True}, out
        assert str(tmp_path / "checkpoints" / "checkpoint_1") in message and "Nothing was loaded" in message, message
        assert message.startswith("CheckpointMismatchError"), message
        assert "save_state of optimizer step 6 into this folder did not finish" in message, message
        assert out["earlier"] == {"weights": True, "optimizer": True, "global_steps": True, "ema": True}, out


def test_automatic_naming_marks_at_accelerates_own_barrier_not_at_a_subclass_barrier_before_it(tmp_path, monkeypatch):
    """An ``Accelerator`` subclass whose ``save_state`` calls ``wait_for_everyone()`` before ``super().save_state()``,
    with ``automatic_checkpoint_naming`` where Accelerate writes the model first (taken as such: ``_writes_model_first``):
    that barrier passes through (a mark there would make ``checkpoint_<n>`` before Accelerate checks that it is new, and
    every save would raise "already exists"); Accelerate's own barrier after the naming marks the folder unfinished
    before anything is written into it (a save-state pre-hook registered before the helper's, so run first, reads the
    unfinished record); each save's record is finished afterwards, at its optimizer step (one process)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration
    from torch import nn

    import functional_ema.integrations.accelerate as integration
    from functional_ema._checkpoint.format import read_record
    from functional_ema.integrations.accelerate import AcceleratorEMA

    monkeypatch.setattr(integration, "_writes_model_first", lambda accelerator: True)
    barriers = []

    class Barriered(Accelerator):
        def save_state(self, *args, **kwargs):
            self.wait_for_everyone()  # "every rank finished its step": before Accelerate names the folder
            barriers.append(sorted(p.name for p in (tmp_path / "checkpoints").glob("checkpoint_*")))
            return super().save_state(*args, **kwargs)

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
    acc = Barriered(cpu=True, project_config=project)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    model, optimizer = acc.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    seen = []  # (folder, the record there) when Accelerate's first save-state hook runs
    first = acc.register_save_state_pre_hook(
        lambda models, weights, output_dir: seen.append((Path(output_dir).name, _record_of(Path(output_dir))))
    )
    ema = AcceleratorEMA(acc, model, decay=0.5)
    for steps in (3, 2):
        _train(acc, model, optimizer, (ema,), steps=steps)
        acc.save_state()
    first.remove()
    ema.remove_hooks()
    assert barriers == [[], ["checkpoint_0"]] and acc.save_iteration == 2 and "wait_for_everyone" not in vars(acc)
    assert [(name, r["optimizer_step"], r["complete"]) for name, r in seen] == [
        ("checkpoint_0", 3, False),
        ("checkpoint_1", 5, False),
    ], seen
    records = [read_record(tmp_path / "checkpoints" / f"checkpoint_{i}" / "ema_save_state.json") for i in (0, 1)]
    assert [(r["optimizer_step"], r["complete"]) for r in records] == [(3, True), (5, True)], records


def _record_of(folder: Path) -> dict | None:
    from functional_ema._checkpoint.format import read_record

    return read_record(folder / "ema_save_state.json") if (folder / "ema_save_state.json").is_file() else None


def _killed_after_save_checkpoint(acc: Any, model: Any, folder: str | None) -> bool:
    """``acc.save_state(folder)`` cut off right after DeepSpeed's ``save_checkpoint`` (its model and optimizer files
    written, the EMA's hook not reached), as a kill there would; whether the injected stop was what ended it."""
    real = model.save_checkpoint

    def killed(*args: Any, **kwargs: Any) -> None:
        real(*args, **kwargs)
        raise RuntimeError("killed after DeepSpeed's save_checkpoint (injected)")

    model.save_checkpoint = killed
    try:
        acc.save_state(folder)
    except RuntimeError as e:
        return "injected" in str(e)
    finally:
        del model.save_checkpoint
    return False
