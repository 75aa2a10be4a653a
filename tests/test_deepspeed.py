"""local_shards / update / gather_full on real multi-rank DeepSpeed engines, checked against an
EMA of DeepSpeed's own full fp32 weights computed in plain torch."""

from __future__ import annotations

import contextlib

import torch

from functional_ema._testing.multirank import (
    OddNet,
    count_collectives,
    forward_weights,
    full_fp32_reference,
    make_engine,
    run_ranks,
    train_step,
)


def equivalence_worker(configs, steps=4):
    import functional_ema as fe
    from functional_ema import schedules

    decays = (0.7, schedules.power(gamma=3.0), 0.0)
    report = []
    for stage, dtype, offload in configs:
        engine = make_engine(stage, dtype, offload)
        shards = fe.local_shards(engine)
        layout = fe.shard_layout(engine)
        state = fe.init_ema(shards, num_emas=len(decays))
        ref = [{n: t.clone() for n, t in full_fp32_reference(engine).items()} for _ in decays]
        every3 = fe.init_ema(shards)
        ref3 = {n: t.clone() for n, t in full_fp32_reference(engine).items()}
        collective_calls, mismatches, local_mismatches = 0, [], []
        for _ in range(steps):
            train_step(engine, engine.global_steps)
            step = engine.global_steps
            with count_collectives() as counts:
                shards = fe.local_shards(engine)
                state = fe.update(state, shards, step, decay=decays)
                if step % 3 == 0:
                    every3 = fe.update(every3, shards, step, decay=0.7)
            collective_calls += counts["calls"]
            full = full_fp32_reference(engine)
            for k, d in enumerate(decays):
                w = 1.0 - schedules.interval_decay(d, step - 1, step)
                for n in ref[k]:
                    ref[k][n].lerp_(full[n], w)
            if step % 3 == 0:
                for n in ref3:
                    ref3[n].lerp_(full[n], 1.0 - 0.7**3)
            # Local pieces equal the reference's slice, on every step.
            for k in range(len(decays)):
                for n, spec in layout.specs.items():
                    want = ref[k][n].reshape(-1)[spec.offset : spec.offset + spec.numel]
                    if not torch.equal(state.emas[k][n].cpu(), want):
                        local_mismatches.append((stage, dtype, offload, step, k, n))
        gathered = [fe.gather_full(state, engine, index=k) for k in range(len(decays))]
        for k in range(len(decays)):
            for n in ref[k]:
                if not torch.equal(gathered[k][n].cpu(), ref[k][n]):
                    diff = (gathered[k][n].cpu() - ref[k][n]).abs().max().item()
                    mismatches.append((k, n, diff))
        g3 = fe.gather_full(every3, engine)
        mismatches += [("every3", n) for n in ref3 if not torch.equal(g3[n].cpu(), ref3[n])]
        on_dst = fe.gather_full(state, engine, dst=0)
        same_dict, reread = _local_shards_cache_checks(engine, stage)
        masters_copied, forward_copied = _copy_to_model_checks(engine, state, gathered[0])
        module_refused = _engine_module_refused(engine, state)
        report.append(
            {
                "config": [stage, dtype, offload],
                "keys": list(shards),
                "numels": {n: spec.numel for n, spec in layout.specs.items()},
                "offsets": {n: spec.offset for n, spec in layout.specs.items()},
                "mismatches": mismatches,
                "local_mismatches": local_mismatches[:5],
                "collective_calls": collective_calls,
                "decay0_equals_weights": all(torch.equal(gathered[2][n].cpu(), full[n]) for n in full),
                "ema_moved": all(not torch.equal(gathered[0][n].cpu(), full[n]) for n in full),
                "dst_keys": sorted(on_dst),
                "step": int(state.step),
                "same_dict": same_dict,
                "reread_after_move": reread,
                "copy_to_model_masters": masters_copied,
                "copy_to_model_forward": forward_copied,
                "module_refused": module_refused,
            }
        )
        del engine
    return report


def _engine_module_refused(engine, state) -> dict:
    """``engine.module`` passed instead of the engine: {verb: the TypeError's message, or None if accepted}.
    Only ``local_shards`` is tried when it is accepted (ZeRO-0 fp32: the module's parameters are the weights)."""
    import tempfile
    import warnings

    import functional_ema as fe

    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with contextlib.suppress(TypeError):
            fe.local_shards(engine.module)
    out["warned"] = [w.category.__name__ for w in caught if issubclass(w.category, fe.LowPrecisionWeightsWarning)]
    with tempfile.TemporaryDirectory(prefix="refused") as folder:  # removed after, refused or not
        for verb, call in (
            ("local_shards", lambda: fe.local_shards(engine.module)),
            ("shard_layout", lambda: fe.shard_layout(engine.module)),
            ("gather_full", lambda: fe.gather_full(state, engine.module)),
            ("swapped", lambda: fe.swapped(engine.module, state).__enter__()),
            ("save", lambda: fe.save(state, engine.module, folder)),
        ):
            try:
                call()
                out[verb] = None
                break
            except TypeError as e:
                out[verb] = str(e)
    return out


def _local_shards_cache_checks(engine, stage):
    """local_shards hands out one dict per engine, and reads again once a master buffer moves."""
    import functional_ema as fe
    from functional_ema.engines.deepspeed import _master_buffers

    first = fe.local_shards(engine)
    same_dict = fe.local_shards(engine) is first
    if stage == 0:  # per-parameter fp32 tensors, no flat buffer to move
        return same_dict, None
    bufs = _master_buffers(engine.optimizer, stage)
    old = bufs[0]
    bufs[0] = old.clone()  # as if DeepSpeed had reallocated it
    try:
        moved = fe.local_shards(engine)
        lo = bufs[0].data_ptr()
        hi = lo + bufs[0].numel() * bufs[0].element_size()
        # ZeRO-3 pieces are cut from that buffer; ZeRO-1/2 ones come from the parameters' hp
        # mappings, which DeepSpeed would rebuild with it (this test does not), so only the new read shows.
        inside = any(lo <= t.data_ptr() < hi for t in moved.values() if t.numel())
        reread = moved is not first and (inside or stage in (1, 2))
    finally:
        bufs[0] = old
    reread = reread and all(
        a.data_ptr() == b.data_ptr() for a, b in zip(fe.local_shards(engine).values(), first.values())
    )
    return same_dict, bool(reread)


def _copy_to_model_checks(engine, state, ema_full):
    """The integrations' end-of-training copy (``EMAController.copy_to_model``), last in a config
    since it overwrites the weights: DeepSpeed's fp32 masters become the EMA bitwise, and the
    weights the forward uses become the EMA cast to their dtype (gathered under ZeRO-3)."""
    from functional_ema.integrations._common import EMAController

    controller = EMAController(0.7)
    controller.state = state
    controller.copy_to_model(engine)
    masters = full_fp32_reference(engine)
    masters_ok = sorted(masters) == sorted(ema_full) and all(
        torch.equal(masters[n], ema_full[n].cpu()) for n in masters
    )
    live = forward_weights(engine, list(masters))
    forward_ok = all(torch.equal(live[n], ema_full[n].cpu().to(live[n].dtype).view(live[n].shape)) for n in masters)
    return masters_ok, forward_ok


CONFIGS_2 = [
    (0, "fp32", None),
    (0, "bf16", None),
    (1, "fp32", None),
    (1, "bf16", None),
    (2, "fp32", None),
    (2, "bf16", None),
    (3, "fp32", None),
    (3, "bf16", None),
    (2, "bf16", "optimizer"),
    (3, "bf16", "optimizer"),
    (3, "bf16", "param"),
    (3, "fp32", "param"),
]
CONFIGS_1 = [(3, "bf16", None), (2, "fp32", None)]


def _check_report(reports, world_size):
    expected = [n for n, p in OddNet().named_parameters() if n not in ("frozen", "not_optimized")]
    assert "table" in expected and len(expected) == 9
    by_rank = list(zip(*reports))
    for per_rank in by_rank:
        cfg = per_rank[0]["config"]
        for rank, rep in enumerate(per_rank):
            where = f"config {cfg} rank {rank}"
            assert rep["keys"] == expected, where  # frozen / not-optimized params are left out
            assert rep["mismatches"] == [], f"{where}: gathered EMA differs from reference: {rep['mismatches'][:5]}"
            assert rep["local_mismatches"] == [], f"{where}: {rep['local_mismatches']}"
            assert rep["collective_calls"] == 0, f"{where}: update communicated"
            assert rep["decay0_equals_weights"], where
            assert rep["ema_moved"], where
            assert rep["step"] == 4
            assert rep["same_dict"], f"{where}: local_shards should return the same dict every call"
            assert rep["reread_after_move"] in ((None,) if cfg[0] == 0 else (True,)), where
            assert rep["dst_keys"] == (sorted(expected) if rank == 0 else []), where
            assert rep["copy_to_model_masters"] and rep["copy_to_model_forward"], f"{where}: copy_to_model"
            # engine.module instead of the engine: refused by every verb, naming the engine to pass (ZeRO-0 fp32
            # is accepted: the module's parameters are the weights the optimizer updates; ZeRO-0 16-bit, whose
            # masters DeepSpeed marks nowhere on the parameters, is accepted with a LowPrecisionWeightsWarning)
            refused = rep["module_refused"]
            warned = refused.pop("warned")
            if cfg[0] == 0:
                assert refused == {"local_shards": None}, where
                assert warned == ([] if cfg[1] == "fp32" else ["LowPrecisionWeightsWarning"]), (where, warned)
            else:
                assert list(refused) == ["local_shards", "shard_layout", "gather_full", "swapped", "save"], where
                kind = "ZeRO-3" if cfg[0] == 3 else "fp32 master partitions"
                for verb, msg in refused.items():
                    assert msg and kind in msg and "the object deepspeed.initialize returned" in msg, (where, verb, msg)
                    assert "parameter 'table'" in msg, (where, verb, msg)
        if cfg[0] == 0:  # replicated: every rank holds whole parameters
            assert all(r["offsets"][n] == 0 and r["numels"][n] > 0 for r in per_rank for n in expected)
            continue
        # Pieces tile each parameter exactly once across ranks.
        for name in expected:
            cover = sorted((r["offsets"][name], r["numels"][name]) for r in per_rank if r["numels"][name])
            pos = 0
            for off, numel in cover:
                assert off == pos, (cfg, name, cover)
                pos += numel
            assert pos == {"table": 111}.get(name, pos) and pos > 0


def test_equals_unsharded_reference_world2():
    reports = run_ranks("tests.test_deepspeed:equivalence_worker", world_size=2, configs=CONFIGS_2)
    _check_report(reports, 2)
    # On stages 1-3 at least one parameter is split between the two ranks (uneven partitions).
    for rep0, rep1 in zip(*reports):
        if rep0["config"][0] in (1, 2, 3):
            assert any(rep0["numels"][n] and rep1["numels"][n] for n in rep0["keys"]), rep0["config"]


def test_equals_unsharded_reference_world1():
    reports = run_ranks("tests.test_deepspeed:equivalence_worker", world_size=1, configs=CONFIGS_1)
    _check_report(reports, 1)


def test_an_optimizer_read_as_holding_nothing_is_refused_naming_it():
    """An engine whose optimizer wrapper functional_ema does not understand (here: flat fp32 copies at ZeRO-0, as
    DeepSpeed's BF16_Optimizer keeps for a bf16 PipelineEngine) must not read as "no parameter": that gave empty
    EMAs and empty saves, exit 0. Refused, naming the optimizer; a module that trains nothing still reads empty."""
    import pytest
    from torch import nn

    import functional_ema as fe

    class Wrapper:  # fp32 copies in one flat tensor: not the module's parameters
        def __init__(self, params):
            self.param_groups = [{"params": [torch.cat([p.detach().reshape(-1) for p in params]).float()]}]

    class DeepSpeedEngine:  # what the adapter reads of an engine, without DeepSpeed
        global_steps = 0

        def __init__(self):
            self.module = nn.Linear(3, 2)
            self.optimizer = Wrapper(list(self.module.parameters()))

        def zero_optimization_stage(self):
            return 0

    Wrapper.__module__ = DeepSpeedEngine.__module__ = "deepspeed.runtime.fake"
    engine = DeepSpeedEngine()
    with pytest.raises(NotImplementedError) as info:
        fe.local_shards(engine)
    msg = str(info.value)
    assert "ZeRO stage 0" in msg and "none of the 2 trained parameters" in msg, msg
    assert "optimizer deepspeed.runtime.fake." in msg and "Wrapper" in msg, msg
    engine.module.requires_grad_(False)
    assert len(fe.local_shards(engine)) == 0


def unfreeze_worker(configs, steps=2):
    """``frozen`` is in the client optimizer (an AdamW over every parameter but ``not_optimized``) but frozen when
    the EMA starts; after a step it is unfrozen (and, at ZeRO-0 fp32, ``mid.weight`` frozen) and training goes on.
    Per configuration: whether DeepSpeed trains it, what ``local_shards`` reads, what ``update`` of the first state
    says, and (where it is read) the EMA of a state made afterwards against plain-torch lerps of the weights
    DeepSpeed steps (at ZeRO-0 fp32, the module parameters themselves)."""
    import deepspeed

    import functional_ema as fe
    from functional_ema._testing.multirank import ds_config, raised

    out = []
    for stage, dtype in configs:
        torch.manual_seed(0)
        model = OddNet()
        params = [p for n, p in model.named_parameters() if n != "not_optimized"]
        opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(stage, dtype))
        state = fe.init_ema(fe.local_shards(engine))
        train_step(engine, 0)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
        before = forward_weights(engine, ["frozen"])["frozen"]
        model.frozen.requires_grad_(True)
        if (stage, dtype) == (0, "fp32"):  # frozen after the first reading: stays in the EMA
            model.mid.weight.requires_grad_(False)
        for i in range(1, 1 + steps):
            train_step(engine, i)
        report = {
            "config": [stage, dtype],
            "trained": not torch.equal(forward_weights(engine, ["frozen"])["frozen"], before),
            "read": sorted(fe.local_shards(engine)),
            "update": raised(lambda: fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)),
        }
        if "frozen" in report["read"]:
            named = dict(model.named_parameters())
            state = fe.init_ema(fe.local_shards(engine), step=engine.global_steps)
            oracle = {n: named[n].detach().clone().float() for n in report["read"]}
            for i in range(1 + steps, 1 + 2 * steps):
                train_step(engine, i)
                state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
                for n, t in oracle.items():
                    t.lerp_(named[n].detach().float(), 0.5)
            ema = fe.gather_full(state, engine)
            report["ema_is_oracle"] = sorted(ema) == sorted(oracle) and all(
                torch.equal(ema[n], oracle[n]) for n in oracle
            )
        out.append(report)
        engine = None  # drop this configuration's engine before the next one is built
    return out


def test_unfreezing_a_parameter_deepspeed_then_trains_is_noticed():
    """docs/core.md: "Unfreezing a parameter that was left out is noticed: local_shards reads it in and update
    refuses the state that lacks it, naming it." DeepSpeed trains such a parameter only at ZeRO-0 fp32, where the
    client optimizer steps the module parameters themselves; the 16-bit wrappers and ZeRO-1/2/3 build their groups
    from the parameters trainable at ``deepspeed.initialize`` and never train it (checked here, so a DeepSpeed that
    starts to is seen). Unfixed, ZeRO-0 fp32 trained it while local_shards never read it and update accepted."""
    configs = [(0, "fp32"), (0, "bf16"), (1, "fp32"), (2, "bf16"), (3, "bf16")]
    reports = run_ranks("tests.test_deepspeed:unfreeze_worker", world_size=2, configs=configs)
    nine = sorted(n for n, _ in OddNet().named_parameters() if n not in ("frozen", "not_optimized"))
    for rank, per_rank in enumerate(reports):
        assert [r["config"] for r in per_rank] == [list(c) for c in configs]
        for r in per_rank:
            where = (rank, r["config"])
            if r["config"] == [0, "fp32"]:
                assert r["trained"], where
                assert r["read"] == sorted([*nine, "frozen"]), where  # mid.weight, frozen since, stays in
                kind, message = r["update"]
                assert kind == "TreeMismatchError" and "not in state.emas[0]: 'frozen'" in message, (where, r["update"])
                assert r["ema_is_oracle"], where
            else:
                assert not r["trained"] and r["read"] == nine and r["update"] is None, (where, r)


def controller_unfreeze_worker(out: str, unfreeze_at: int = 3, last: int = 5) -> dict:
    """At ZeRO-0 fp32, driven as the integration callbacks drive it (``EMAController``: ``before_optimizer_step``
    between backward and the step, ``on_step`` after it): ``frozen`` (in the client optimizer, frozen at the start)
    is unfrozen before step ``unfreeze_at``; a save at ``last`` is then resumed into a new engine with it frozen
    again (a fresh process's model: no reading kept on it) and trained on, kept frozen. Against plain-torch lerps
    of the module parameters, which ZeRO-0 fp32 steps itself; ``frozen``'s from its value at the unfreeze."""
    import copy
    import warnings
    from pathlib import Path

    import deepspeed

    from functional_ema._testing.multirank import batch, ds_config, raised
    from functional_ema.integrations import EMAController

    def build(weights=None):
        torch.manual_seed(0)
        model = OddNet()
        if weights is not None:
            model.load_state_dict(weights)  # ``frozen`` keeps requires_grad=False, as OddNet builds it
        opt = torch.optim.AdamW([p for n, p in model.named_parameters() if n != "not_optimized"], lr=1e-2)
        return deepspeed.initialize(model=model, optimizer=opt, config=ds_config(0, "fp32"))[0]

    def train(c, engine, oracle, steps, unfreeze_at=None) -> None:
        named = dict(engine.module.named_parameters())
        for step in steps:
            if step == unfreeze_at:
                engine.module.frozen.requires_grad_(True)
                oracle["frozen"] = named["frozen"].detach().clone()  # its EMA starts from its value at the unfreeze
            x, y = batch(engine, step)
            engine.backward(((engine(x) - y) ** 2).mean())
            c.before_optimizer_step(engine)
            if c.state is not None and "frozen" in c.state.emas[0]:
                grown_at.append(step)  # in the EMA before the step that first trains it
            engine.step()
            c.on_step(engine, step)
            if step == 1:  # the EMA starts equal to the weights after the first step
                oracle.update({n: named[n].detach().clone() for n in c.state.emas[0]})
            else:
                for n, t in oracle.items():
                    t.lerp_(named[n].detach(), 0.5)

    def agrees(c, engine, oracle) -> bool:
        ema = c.full_state_dict(engine, dst=None)  # full shapes (the state holds flat pieces)
        return sorted(ema) == sorted(oracle) and all(torch.equal(ema[n], oracle[n]) for n in oracle)

    def resume(engine, c, oracle) -> dict:
        """The save at ``last`` loaded into a new engine, ``frozen`` frozen again, trained two steps on."""
        c.save(engine, Path(out), last)
        again, c2 = build(copy.deepcopy(engine.module.state_dict())), EMAController(0.5)
        got: dict = {"resume": raised(lambda: c2.load(again, Path(out), framework_step=last))}
        if got["resume"] is None:
            got["resumed_as_saved"] = agrees(c2, again, oracle)
            oracle2 = {n: t.clone() for n, t in oracle.items()}
            got["after_resume"] = raised(lambda: train(c2, again, oracle2, range(last + 1, last + 3)))
            got["resumed"] = got["after_resume"] is None and agrees(c2, again, oracle2)
        got["still_frozen"] = not again.module.frozen.requires_grad
        return got

    report: dict = {}
    grown_at: list[int] = []
    engine, c, oracle = build(), EMAController(0.5), {}
    before = engine.module.frozen.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report["grow"] = raised(lambda: train(c, engine, oracle, range(1, last + 1), unfreeze_at))
        report["grown_at"] = list(grown_at)
        if report["grow"] is None:
            report["grown"] = agrees(c, engine, oracle)
            report["trained"] = not torch.equal(engine.module.frozen.detach(), before)
            report.update(resume(engine, c, oracle))
    report["warned"] = [str(w.message) for w in caught if "EMA" in str(w.message)]
    return report


def test_unfreezing_at_zero0_fp32_grows_the_controllers_ema_and_resumes_frozen(tmp_path):
    """docs/integrations.md, progressive unfreezing: "a parameter frozen when the EMA started joins it when
    unfrozen, as if averaged all along". ZeRO-0 fp32 trains a parameter of its client optimizer unfrozen later, so the
    callbacks' ``EMAController`` adds it at the unfreeze (``before_optimizer_step``) from its value then, bitwise
    against plain torch, the others a plain lerp of the masters; resumed into a fresh engine with it frozen again,
    the checkpoint's parameter stays in the EMA (averaging its constant value) as with a plain module. Unfixed, the
    controller saw no joinable parameter at DeepSpeed (update then refused 'frozen'), and the resume left it out of
    the reading (the checkpoint then mismatched)."""
    got = run_ranks("tests.test_deepspeed:controller_unfreeze_worker", world_size=2, timeout=300, out=str(tmp_path))
    for rank, r in enumerate(got):
        assert r["grow"] is None and r["grown_at"] == [3, 4, 5], (rank, r)
        assert r["grown"] and r["trained"], (rank, r)
        assert r["resume"] is None and r["resumed_as_saved"], (rank, r)
        assert r["after_resume"] is None and r["resumed"] and r["still_frozen"], (rank, r)
        assert r["warned"] == [], (rank, r)


class _Shaped(torch.nn.Module):
    """A weight of a given shape (and a bias): two of these, same names, other shapes (see other_shapes_worker)."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(*shape))
        self.b = torch.nn.Parameter(torch.randn(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1)[:, : self.w.numel()] * self.w.reshape(-1) + self.b.sum()


def other_shapes_worker(cases, save_dir):
    """Per (made from, used with) shapes of ``w``: ``update`` at ZeRO-3 of a state ``init_ema`` made from another
    engine, with this rank's piece lengths, what it raised, and whether the state moved; then a state of the engine
    itself updated and gathered (a collective: the ranks still agree) against the plain-torch lerp."""
    import deepspeed

    import functional_ema as fe
    from functional_ema._testing.multirank import ds_config, raised

    out = []
    for made, used in cases:

        def engine_of(shape):
            torch.manual_seed(0)
            m = _Shaped(tuple(shape))
            return deepspeed.initialize(
                model=m, optimizer=torch.optim.AdamW(m.parameters(), 1e-2), config=ds_config(3)
            )[0]

        other = engine_of(made)
        state = fe.init_ema(fe.local_shards(other))
        del other  # the other model is gone: only its state is left
        before = {n: t.clone() for n, t in state.ema.items()}
        engine = engine_of(used)
        shards = fe.local_shards(engine)
        report = {
            "pieces": [list(state.ema["w"].shape), list(shards["w"].shape)],
            "update": raised(lambda: fe.update(state, shards, 1, decay=0.5)),
            "step": int(state.step),
            "unchanged": all(torch.equal(state.ema[n], before[n]) for n in before),
        }

        def swap():
            with fe.swapped(engine, state):
                pass

        # the collective verbs check the state too (agreed over the ranks): each refuses alike on every rank
        report["verbs"] = [
            (raised(fn) or [None])[0]
            for fn in (swap, lambda: fe.gather_full(state, engine), lambda: fe.save(state, engine, save_dir))
        ]
        own = fe.init_ema(shards)
        full = {n: p.clone() for n, p in fe.gather_full(own, engine).items()}
        with torch.no_grad():  # new weights: the masters doubled, through the views
            for t in shards.values():
                t.mul_(2)
        own = fe.update(own, fe.local_shards(engine), 1, decay=0.5)
        ema = fe.gather_full(own, engine)
        report["own"] = int(own.step) == 1 and all(torch.equal(ema[n], full[n].lerp(full[n] * 2, 0.5)) for n in full)
        out.append(report)
        engine = None
    return out


def test_zero3_state_of_other_whole_shapes_refused_on_every_rank(tmp_path):
    """README: update raises TreeMismatchError when "names or shapes differ". At ZeRO-3 a rank's pieces of a
    (4, 6) and a (6, 4) weight have one length, and of a 23- and a 24-element one on rank 0 only. Unfixed, update
    accepted both on rank 0 (its state moved to step 1) and the second on rank 1 raised: the ranks diverged. Now
    every rank refuses alike, naming the parameter and both whole shapes, and the state stays as it was."""
    cases = [[[4, 6], [6, 4]], [[23], [24]]]
    reports = run_ranks(
        "tests.test_deepspeed:other_shapes_worker", world_size=2, timeout=300, cases=cases, save_dir=str(tmp_path)
    )
    assert [r["pieces"] for r in reports[0]] == [[[12], [12]], [[12], [12]]]  # rank 0's pieces agree in both
    assert reports[1][1]["pieces"] == [[11], [12]]
    for rank, per_rank in enumerate(reports):
        for (made, used), r in zip(cases, per_rank):
            full_shapes = (
                f"shards['w'] is a piece of a parameter of shape {tuple(used)} but the EMA (emas[0]) was made for one "
                f"of shape {tuple(made)}; was the state made from another model? Make the state with "
                "init_ema(local_shards(model)) from the model as it trains (functional_ema.load reshards a saved one)"
            )
            if r["pieces"][0] == r["pieces"][1]:  # the pieces agree: only the whole shapes tell
                assert r["update"] == ["TreeMismatchError", full_shapes], (rank, r)
            else:  # rank 1 of 23 against 24: its pieces differ, said first
                assert r["update"][0] == "TreeMismatchError" and "shards['w'] has shape (12,)" in r["update"][1], r
            assert r["step"] == 0 and r["unchanged"] and r["own"], (rank, r)
            assert r["verbs"] == ["StateMismatchError"] * 2 + ["CheckpointMismatchError"], (
                rank,
                r,
            )  # swap, gather, save
    assert not any(tmp_path.iterdir())  # nothing saved
