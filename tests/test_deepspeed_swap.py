"""Evaluating with EMA weights swapped in (functional_ema.swapped) on real 2-rank DeepSpeed."""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from functional_ema._testing.multirank import (
    OddNet,
    batch,
    change_inside_swapped,
    forward_weights,
    full_fp32_reference,
    make_engine,
    run_ranks,
    train_step,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _reference_model(seed, dtype, ema_full):
    torch.manual_seed(seed)
    ref = OddNet().to(DTYPES[dtype])
    with torch.no_grad():
        for n, p in ref.named_parameters():
            if n in ema_full:
                p.copy_(ema_full[n].to(p.dtype))
    return ref.eval()


def swap_worker(configs, steps=3):
    import functional_ema as fe

    out = []
    for stage, dtype, offload in configs:
        engine = make_engine(stage, dtype, offload, seed=0)
        state = fe.init_ema(fe.local_shards(engine))
        for _ in range(steps):
            train_step(engine, engine.global_steps)
            state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
        x, _ = batch(engine, 999)
        ema_full = fe.gather_full(state, engine)
        ref = _reference_model(0, dtype, ema_full)
        engine.eval()
        with torch.no_grad():
            live_before = engine(x).float().clone()
            with fe.swapped(engine, state) as stats:
                inside = engine(x).float().clone()
                inside_again = engine(x).float().clone()  # second call: cached gathers must hold EMA too
            live_after = engine(x).float().clone()
            raised = False
            try:
                with fe.swapped(engine, state):
                    engine(x)
                    raise KeyError("boom")
            except KeyError:
                raised = True
            live_after_raise = engine(x).float().clone()
            want = ref(x).float()
        changed = _changed_inside(engine, state, x, live_before)
        engine.train()
        out.append(
            {
                "config": [stage, dtype, offload],
                "inside_equals_reference": torch.equal(inside, want),
                "inside_max_diff": (inside - want).abs().max().item(),
                "inside_repeat_equal": torch.equal(inside, inside_again),
                "differs_from_live": not torch.equal(inside, live_before),
                "restored": torch.equal(live_after, live_before),
                "restored_after_raise": raised and torch.equal(live_after_raise, live_before),
                "swapped_params": stats.swapped_params,
                "extra_bytes": stats.extra_bytes,
                "local_partition_bytes": sum(t.numel() for t in fe.local_shards(engine).values())
                * (2 if dtype == "bf16" else 4),
                "changed_inside": changed,
            }
        )
        engine = None  # drop this configuration's engine before the next one is built
    return out


def _module_values(engine) -> dict[str, torch.Tensor]:
    """What the forward computes from, per parameter: ZeRO-3's local partitions, else the module's tensors."""
    return {
        n: (p.ds_tensor if hasattr(p, "ds_tensor") else p).detach().clone() for n, p in engine.module.named_parameters()
    }


_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bit pattern. Not ``torch.equal``: a ZeRO-3 partition's padding tail is uninitialized
    memory and can hold NaN bit patterns, which ``torch.equal`` calls unequal to themselves."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _SAME_WIDTH_INT[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


def _changed_inside(engine, state, x, live_before) -> dict:
    """A block that re-types the module (``.to(float16)``), loads with ``assign=True`` or sets a new parameter,
    normally and raising: the trained weights come back bitwise (fp32 masters, the module's parameter objects,
    dtype and values, the forward), and the change is named by ``SwappedParametersChangedError`` (or a note)."""

    module = engine.module
    masters = full_fp32_reference(engine)
    objects = dict(module.named_parameters())
    values = _module_values(engine)
    shapes = {n: tuple(getattr(p, "ds_shape", p.shape)) for n, p in objects.items()}

    def retype():
        module.to(torch.float16)

    def assign():
        module.load_state_dict({n: torch.zeros(shapes[n]) for n in objects}, strict=False, assign=True)

    def new_parameter():
        module.mid.weight = torch.nn.Parameter(torch.zeros(shapes["mid.weight"]))

    out = {}
    for kind, change in (("retype", retype), ("assign", assign), ("new", new_parameter)):
        for raising in (False, True):
            caught = change_inside_swapped(engine, state, lambda: engine(x), change, raising)
            now = dict(module.named_parameters())
            after = _module_values(engine)
            with torch.no_grad():
                forward = engine(x).float()
            back = full_fp32_reference(engine)
            out[f"{kind}{'_raising' if raising else ''}"] = {
                "caught": caught,
                "objects": list(now) == list(objects) and all(now[n] is objects[n] for n in objects),
                "values": all(_same_bits(after[n], values[n]) for n in values),
                "masters": all(torch.equal(masters[n], back[n]) for n in masters),
                "forward": torch.equal(forward, live_before),
            }
    return out


def training_unchanged_worker(configs, steps=3):
    """Training after an eval block continues bitwise as a run without it."""
    return [_training_unchanged(*cfg, steps=steps) for cfg in configs]


def _training_unchanged(stage, dtype, offload, steps):
    import functional_ema as fe

    finals, losses = [], []
    for with_eval in (True, False):
        engine = make_engine(stage, dtype, offload, seed=0)
        state = fe.init_ema(fe.local_shards(engine))
        run_losses = []
        for i in range(2 * steps):
            run_losses.append(train_step(engine, engine.global_steps))
            state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
            if with_eval and i == steps - 1:
                engine.eval()
                with torch.no_grad(), fe.swapped(engine, state):
                    engine(batch(engine, 777)[0])
                engine.train()
        finals.append(full_fp32_reference(engine))
        losses.append(run_losses)
        engine = None  # drop this configuration's engine before the next one is built
    return {
        "config": [stage, dtype, offload],
        "weights_equal": all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0]),
        "losses_equal": losses[0] == losses[1],
    }


def decay0_offload_worker():
    """The seed's reproduction: decay 0, ZeRO-3 with parameter offload: EMA eval == raw eval."""
    import functional_ema as fe

    engine = make_engine(3, "bf16", "param", seed=0)
    state = fe.init_ema(fe.local_shards(engine))
    for _ in range(3):
        train_step(engine, engine.global_steps)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.0)
    x, _ = batch(engine, 5)
    engine.eval()
    with torch.no_grad():
        raw = engine(x).float().clone()
        with fe.swapped(engine, state):
            ema = engine(x).float().clone()
    return {"equal": torch.equal(raw, ema), "max_diff": (raw - ema).abs().max().item()}


CONFIGS = [(s, d, None) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")] + [(3, "bf16", "param")]


def test_swapped_forward_matches_plain_model_and_restores():
    reports = run_ranks("tests.test_deepspeed_swap:swap_worker", world_size=2, configs=CONFIGS)
    for rank, per_rank in enumerate(reports):
        for rep in per_rank:
            where = f"{rep['config']} rank {rank}"
            assert rep["inside_equals_reference"], f"{where}: max diff {rep['inside_max_diff']}"
            assert rep["inside_repeat_equal"], where
            assert rep["differs_from_live"], where
            assert rep["restored"], where
            assert rep["restored_after_raise"], where
            assert rep["swapped_params"] == 9, where
            # the block re-typed / re-assigned / replaced parameters: the trained weights are back bitwise
            for kind, got in rep["changed_inside"].items():
                how, message = got["caught"]
                assert how == ("raised" if kind.endswith("_raising") else "changed"), (where, kind, got)
                named = "'mid.weight' re-typed" if kind.startswith("retype") else "'mid.weight' replaced"
                assert named in message and ("restored" in message or "back in the model" in message), (
                    where,
                    kind,
                    got,
                )
                assert got["objects"] and got["values"] and got["masters"] and got["forward"], (where, kind, got)
            if rep["config"][0] == 3:
                # ZeRO-3: the temporary copy is this rank's partition in 16/32-bit (+ padding), not the model.
                print(
                    f"ZeRO-3 swap extra memory {where}: {rep['extra_bytes']} B for a local partition of {rep['local_partition_bytes']} B"
                )
                assert rep["extra_bytes"] <= rep["local_partition_bytes"] + 64 * 9, where


def test_training_after_eval_is_bitwise_unchanged():
    configs = [(3, "bf16", None), (2, "bf16", None), (0, "fp32", None)]
    for rank, per_rank in enumerate(
        run_ranks("tests.test_deepspeed_swap:training_unchanged_worker", world_size=2, configs=configs)
    ):
        for r in per_rank:
            assert r["weights_equal"] and r["losses_equal"], (rank, r)


def test_decay0_ema_eval_equals_raw_eval_zero3_param_offload():
    for rank, r in enumerate(run_ranks("tests.test_deepspeed_swap:decay0_offload_worker", world_size=2)):
        assert r["equal"], (rank, r)


def test_functional_call_with_full_ema_weights():
    """The torch.func path for unsharded use: full EMA weights + functional_call on a plain module."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = OddNet()
    shards = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    state = fe.init_ema(shards)
    for step in range(1, 4):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * step)
        state = fe.update(state, {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}, decay=0.5)
    x = torch.randn(3, 7)
    out = torch.func.functional_call(model, dict(state.ema), (x,), strict=False)
    ref = copy.deepcopy(model)
    ref.load_state_dict(state.ema, strict=False)
    assert torch.equal(out, ref(x))
    assert not torch.equal(out, model(x))


def misuse_worker(configs, steps=2):
    """Training inside ``swapped`` is refused on every rank and leaves the run as if never tried;
    a state cut for another world size or model is refused by every verb that takes one."""
    import torch.distributed as dist

    import functional_ema as fe

    out = []
    for stage, dtype in configs:
        finals, report = [], {"config": [stage, dtype]}
        for misuse in (True, False):
            engine = make_engine(stage, dtype, seed=0)
            state = fe.init_ema(fe.local_shards(engine))
            for i in range(2 * steps):
                train_step(engine, engine.global_steps)
                state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
                if misuse and i == steps - 1:
                    before_step = engine.global_steps
                    masters = full_fp32_reference(engine)
                    refused = []
                    x, y = batch(engine, 555)
                    with fe.swapped(engine, state):
                        loss = ((engine(x).float() - y.float()) ** 2).mean()
                        for name, call in (
                            ("engine.backward", lambda: engine.backward(loss)),
                            ("loss.backward", loss.backward),
                            ("engine.step", engine.step),
                            # refused on every engine (here the masters stay live, elsewhere they hold the EMA)
                            ("fe.update", lambda: fe.update(state, fe.local_shards(engine), engine.global_steps + 1)),
                        ):
                            try:
                                call()
                            except fe.SwappedTrainingError as e:
                                refused.append([name, "swapped" in str(e)])
                    engine.optimizer.zero_grad() if hasattr(engine.optimizer, "zero_grad") else None
                    report["refused"] = refused
                    report["step_unchanged"] = engine.global_steps == before_step
                    after = full_fp32_reference(engine)
                    report["masters_unchanged"] = all(torch.equal(masters[n], after[n]) for n in masters)
            finals.append(full_fp32_reference(engine))
            if not misuse and stage != 0:  # ZeRO-0 pieces are whole parameters: a whole-model state fits
                # A state cut for one rank (whole parameters) used with this 2-rank engine.
                whole = {n: t.reshape(-1).clone() for n, t in full_fp32_reference(engine).items()}
                wrong = fe.init_ema(whole)
                errors = []
                for verb, call in (
                    ("gather_full", lambda: fe.gather_full(wrong, engine)),
                    ("swapped", lambda: fe.swapped(engine, wrong).__enter__()),
                ):
                    try:
                        call()
                        errors.append([verb, None])
                    except fe.StateMismatchError as e:
                        errors.append([verb, str(e)])
                report["wrong_state_errors"] = errors
                dist.barrier()
            engine = None  # drop this configuration's engine before the next one is built
        report["weights_equal_to_clean_run"] = all(torch.equal(finals[0][n], finals[1][n]) for n in finals[0])
        out.append(report)
    return out


def test_training_inside_swapped_is_refused_and_wrong_states_too():
    configs = [(0, "fp32"), (2, "bf16"), (3, "bf16")]
    for rank, per_rank in enumerate(
        run_ranks("tests.test_deepspeed_swap:misuse_worker", world_size=2, configs=configs)
    ):
        for r in per_rank:
            where = (rank, r["config"])
            assert r["refused"] == [
                ["engine.backward", True],
                ["loss.backward", True],
                ["engine.step", True],
                ["fe.update", True],
            ], where
            assert r["step_unchanged"] and r["masters_unchanged"], where
            assert r["weights_equal_to_clean_run"], where
            if r["config"][0] != 0:
                assert [v for v, _ in r["wrong_state_errors"]] == ["gather_full", "swapped"], where
                for verb, msg in r["wrong_state_errors"]:
                    assert msg is not None and "on rank" in msg and "elements but rank" in msg and "fe.load" in msg, (
                        where,
                        verb,
                        msg,
                    )


# --------------------------------------------- DeepSpeed's optimizers stepped directly inside swapped


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers: equal iff bitwise equal (NaN payloads and -0.0 included)."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.detach().clone().contiguous().view(ints[t.element_size()])


def _training_state(engine: Any) -> dict[str, torch.Tensor]:
    """Bits of what an optimizer step moves: the fp32 masters (a collective on ZeRO-1/2/3), the 16-bit (or fp32)
    weights the forward uses (ZeRO-3: the local partitions), and every tensor of the stepped optimizer's state."""
    out = {f"master {n}": _bits(t) for n, t in full_fp32_reference(engine).items()}
    for n, p in engine.module.named_parameters():
        weight = p
        if hasattr(p, "ds_tensor"):  # ZeRO-3: the partition without its padding (uninitialised memory)
            start = p.ds_tensor.numel() * engine.global_rank
            weight = p.ds_tensor.reshape(-1)[: max(0, min(p.ds_tensor.numel(), p.ds_numel - start))]
        out[f"weight {n}"] = _bits(weight)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for i, st in enumerate(inner.state.values()):
        for k, v in sorted(st.items()):
            if torch.is_tensor(v):
                out[f"optimizer state {i} {k}"] = _bits(v)
    return out


def _optimizer_paths(engine: Any) -> dict[str, Any]:
    """Each distinct optimizer object a user can reach on the engine, by the first name reaching it."""
    found: dict[str, Any] = {}
    for path, opt in (
        ("engine.optimizer", engine.optimizer),
        ("engine.optimizer.optimizer", getattr(engine.optimizer, "optimizer", None)),
        ("engine.basic_optimizer", getattr(engine, "basic_optimizer", None)),
    ):
        if opt is not None and all(opt is not o for o in found.values()):
            found[path] = opt
    return found


def _step_inside_swapped(engine: Any, state: Any) -> dict[str, Any]:
    """Call each optimizer's ``step()`` inside the block: what each raised, whether the training state moved, and
    whether every ``step`` attribute is the one it was on entry after a clean exit and after an exception."""
    import functional_ema as fe

    opts = _optimizer_paths(engine)
    had = {path: opt.__dict__.get("step") for path, opt in opts.items()}
    before = _training_state(engine)
    raised: dict[str, str] = {}
    with fe.swapped(engine, state):
        for path, opt in opts.items():
            try:
                opt.step()
                raised[path] = "not refused"
            except Exception as e:  # noqa: BLE001 - the parent asserts which error
                raised[path] = f"{type(e).__name__}: {e}"
    after = _training_state(engine)
    restored = [opt.__dict__.get("step") is had[p] for p, opt in opts.items()]
    try:
        with fe.swapped(engine, state):
            raise KeyError("boom")
    except KeyError:
        restored += [opt.__dict__.get("step") is had[p] for p, opt in opts.items()]
    return {
        "raised": raised,
        "moved": [k for k in before if not torch.equal(before[k], after[k])],
        "attributes_restored": all(restored),
    }


def optimizer_step_worker(configs, steps=2):
    """Per configuration, two runs: one calls every DeepSpeed optimizer's ``step()`` inside ``swapped`` after
    ``steps`` training steps, one does not; both then train ``steps`` more."""
    import functional_ema as fe

    out = []
    for stage, dtype in configs:
        report: dict[str, Any] = {"config": [stage, dtype]}
        runs = []
        for misuse in (True, False):
            engine = make_engine(stage, dtype, seed=0)
            state = fe.init_ema(fe.local_shards(engine))
            losses = []
            for i in range(2 * steps):
                losses.append(train_step(engine, i))
                state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
                if misuse and i == steps - 1:
                    report.update(_step_inside_swapped(engine, state))
            runs.append((losses, _training_state(engine)))
            engine = None  # drop this configuration's engine before the next one is built
        report["losses_equal"] = runs[0][0] == runs[1][0]
        report["final_differs"] = [k for k in runs[1][1] if not torch.equal(runs[0][1][k], runs[1][1][k])]
        out.append(report)
    return out


def test_optimizer_step_inside_swapped_is_refused_on_every_stage():
    """``engine.optimizer.step()`` (DeepSpeed's wrapper: FP16_UnfusedOptimizer at ZeRO-0 bf16, the ZeRO optimizers)
    and the step of the optimizer it wraps are refused inside ``swapped`` with SwappedTrainingError naming the call,
    before anything changes: the fp32 masters, the 16-bit weights and the optimizer state stay bitwise, each ``step``
    attribute is put back (also after an exception), and training goes on bitwise as in a run without the block.
    Unfixed, ZeRO-0 bf16 moved the masters (the 16-bit weights did not follow) and ZeRO-1/2/3 raised TypeError."""
    configs = [(s, d) for s in (0, 1, 2, 3) for d in ("fp32", "bf16")]
    reports = run_ranks("tests.test_deepspeed_swap:optimizer_step_worker", world_size=2, timeout=400, configs=configs)
    for rank, per_rank in enumerate(reports):
        assert [r["config"] for r in per_rank] == [list(c) for c in configs]
        for r in per_rank:
            where = (rank, r["config"])
            stage, dtype = r["config"]
            wrapped = dtype == "bf16" or stage > 0  # fp32 ZeRO-0 steps the client optimizer itself
            assert ("engine.optimizer.optimizer" in r["raised"]) == wrapped, (where, r["raised"])
            for path, got in r["raised"].items():
                assert got.startswith(f"SwappedTrainingError: {path}.step() inside fe.swapped(...)"), (where, got)
            assert r["moved"] == [], where
            assert r["attributes_restored"], where
            assert r["losses_equal"] and r["final_differs"] == [], where


# ------------------------------------------- ZeRO++ hpZ: the secondary partitions the gather prefers


def _plain_forward(x: torch.Tensor, weights: dict[str, torch.Tensor]) -> torch.Tensor:
    """The forward of a plain bf16 ``OddNet`` (seed 0, as ``make_engine``'s) holding ``weights``."""
    with torch.no_grad():
        return _reference_model(0, "bf16", weights)(x).float()


def hpz_worker(steps=3):
    """ZeRO-3 bf16 with ZeRO++ hpZ (``zero_hpz_partition_size=2``): DeepSpeed's gather reads a parameter's
    ``ds_secondary_tensor`` whenever one exists, and releasing a gathered parameter builds one from the gathered
    values. Two runs: one evaluates with the EMA right after a step (the README loop: no forward in between), one
    does not and ends with ``EMAController.copy_to_model`` after an evaluation forward. Oracle: an EMA of
    DeepSpeed's own full fp32 masters (``safe_get_full_fp32_param``) lerped in plain torch, in a plain model."""
    import functional_ema as fe
    from functional_ema.integrations._common import EMAController

    report: dict[str, Any] = {}
    runs = []
    for with_eval in (True, False):
        engine = make_engine(3, "bf16", seed=0, zero_hpz_partition_size=2)
        state = fe.init_ema(fe.local_shards(engine))
        oracle = full_fp32_reference(engine)
        losses = []
        for i in range(2 * steps):
            losses.append(train_step(engine, i))
            state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.5)
            for n, w in full_fp32_reference(engine).items():
                oracle[n].lerp_(w, 0.5)
            if with_eval and i == steps - 1:
                x = batch(engine, 999)[0]
                engine.eval()
                with torch.no_grad():
                    with fe.swapped(engine, state):
                        inside = engine(x).float()
                    after = engine(x).float()
                engine.train()
                report["inside_is_ema"] = torch.equal(inside, _plain_forward(x, oracle))
                report["after_is_live"] = torch.equal(after, _plain_forward(x, full_fp32_reference(engine)))
        ema = fe.gather_full(state, engine)
        report["ema_is_oracle"] = all(torch.equal(ema[n], oracle[n]) for n in oracle)
        runs.append((losses, full_fp32_reference(engine)))
        if not with_eval:  # a final validation forward, then the integrations' end-of-training copy
            x = batch(engine, 998)[0]
            engine.eval()
            with torch.no_grad():
                engine(x)
            controller = EMAController(0.5)
            controller.state = state
            controller.copy_to_model(engine)
            with torch.no_grad():
                copied = engine(x).float()
            masters = full_fp32_reference(engine)
            gathered = forward_weights(engine, list(oracle))
            report["copy_masters"] = all(torch.equal(masters[n], oracle[n]) for n in oracle)
            report["copy_forward"] = torch.equal(copied, _plain_forward(x, oracle))
            report["copy_gathered"] = all(
                torch.equal(gathered[n], oracle[n].to(torch.bfloat16).view(gathered[n].shape)) for n in oracle
            )
        engine = None  # drop this run's engine before the next one is built
    report["losses_equal"] = runs[0][0] == runs[1][0]
    report["weights_equal"] = all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    return report


def test_hpz_swap_and_copy_to_model_leave_no_stale_secondary_partition():
    """hpZ: after ``swapped`` the forward computes with the trained weights again, and training goes on bitwise as
    in a run without the block; after ``copy_to_model`` the forward and ``GatheredParameters`` give the EMA.
    Unfixed, the release on exit left secondary partitions built from the EMA (the next forward and the training
    step computed with the EMA), and copy_to_model left ones built from the trained weights (the forward ignored
    the copy). Its own launch: an hpZ engine leaves DeepSpeed's global hpZ group behind for later engines."""
    for rank, r in enumerate(run_ranks("tests.test_deepspeed_swap:hpz_worker", world_size=2)):
        assert r["ema_is_oracle"] and r["inside_is_ema"], (rank, r)
        assert r["after_is_live"], (rank, r)
        assert r["losses_equal"] and r["weights_equal"], (rank, r)
        assert r["copy_masters"] and r["copy_forward"] and r["copy_gathered"], (rank, r)


# --------------------------------------------- update of the swapped state, whatever weights it is given


def swapped_state_update_worker(configs):
    """Inside ``fe.swapped(engine, state)``: ``update(state, ...)`` with a dict of the engine's pieces (read before the
    block) and with ``local_shards`` (also under ``nonfinite="skip"``, which decides over the group) is refused on every
    rank, the state unchanged; after the block the same dict updates bitwise as ``torch.lerp`` per piece."""
    import functional_ema as fe

    out = []
    for stage, dtype in configs:
        engine = make_engine(stage, dtype, seed=0)
        state = fe.init_ema(fe.local_shards(engine))
        train_step(engine, 1)
        pieces = dict(fe.local_shards(engine))  # a plain dict over the engine's fp32 pieces
        live = {n: t.detach().clone() for n, t in pieces.items()}
        ema0 = {n: t.clone() for n, t in state.ema.items()}
        refused = []
        with torch.no_grad(), fe.swapped(engine, state):
            for name, call in (
                ("dict", lambda: fe.update(state, pieces, 1, decay=0.5)),
                ("dict inplace=False", lambda: fe.update(state, pieces, 1, decay=0.5, inplace=False)),
                ("skip", lambda: fe.update(state, fe.local_shards(engine), 1, decay=0.5, nonfinite="skip")),
            ):
                try:
                    call()
                    refused.append([name, None])
                except fe.SwappedTrainingError as e:
                    refused.append(
                        [name, "swapped into a model" in str(e) or "weights read inside fe.swapped" in str(e)]
                    )
        unchanged = int(state.step) == 0 and all(torch.equal(state.ema[n], ema0[n]) for n in ema0)
        state = fe.update(state, pieces, 1, decay=0.5)
        after = all(torch.equal(state.ema[n], torch.lerp(ema0[n], live[n], 0.5)) for n in ema0)
        out.append({"config": [stage, dtype], "refused": refused, "unchanged": unchanged, "after": after})
        engine = None  # drop this configuration's engine before the next one is built
    return out


def test_update_of_the_swapped_state_is_refused_on_every_rank_whatever_weights():
    configs = [(0, "fp32"), (3, "fp32")]
    reports = run_ranks(
        "tests.test_deepspeed_swap:swapped_state_update_worker", world_size=2, timeout=300, configs=configs
    )
    for rank, per_rank in enumerate(reports):
        for r in per_rank:
            where = (rank, r["config"])
            assert r["refused"] == [["dict", True], ["dict inplace=False", True], ["skip", True]], (where, r)
            assert r["unchanged"] and r["after"], (where, r)


# ------------------------------------------------------------------- Ctrl-C landing in the exit of swapped


def _live_memory(engine: Any, stage: int) -> dict[str, torch.Tensor]:
    """What the forward computes with, by name: ZeRO-3's local partitions (``ds_tensor``), else the parameters."""
    return {n: p.ds_tensor if stage == 3 else p for n, p in engine.module.named_parameters()}


def ctrl_c_worker(configs):
    """Each rank interrupts its own exits of ``fe.swapped(engine, state)`` (``ctrl_c_in_exits``: a KeyboardInterrupt
    at another moment of the exit each trial, the exit has no collective) and reports what was wrong after any."""
    import functional_ema as fe
    from tests.test_swap_edits import ctrl_c_in_exits

    out = []
    for stage, dtype, trials in configs:
        t0 = time.perf_counter()
        torch.manual_seed(0)
        engine = make_engine(
            stage, dtype, seed=0, model=torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(60)])
        )
        state = fe.init_ema(fe.local_shards(engine))
        with torch.no_grad():
            for t in state.ema.values():
                t.add_(1.0)  # the EMA differs from every weight
        x = torch.randn(4, 4, dtype=DTYPES[dtype])
        engine.eval()
        with torch.no_grad():
            forward = engine(x).float().clone()
        live = {n: (t, t.detach().clone(), t.data_ptr()) for n, t in _live_memory(engine, stage).items()}
        problems: list[str] = []

        def run_block(arm, engine=engine, state=state):
            with fe.swapped(engine, state):
                arm()

        def check(trial, engine=engine, stage=stage, live=live, problems=problems):
            now = _live_memory(engine, stage)
            wrong = [n for n, (t, v, ptr) in live.items() if not (_same_bits(now[n], v) and now[n].data_ptr() == ptr)]
            refusers = [v for v in ("backward", "step", "train_batch") if v in vars(engine)]
            if wrong or refusers or not torch.is_grad_enabled():
                problems.append(
                    f"trial {trial}: {len(wrong)} wrong, e.g. {wrong[:2]}; refusers left {refusers}; "
                    f"gradients on: {torch.is_grad_enabled()}"
                )

        landed = ctrl_c_in_exits(run_block, check, trials=trials)
        with torch.no_grad():
            same_forward = torch.equal(engine(x).float(), forward)
        out.append(
            {
                "config": [stage, dtype, trials],
                "landed": landed,
                "problems": problems[:5],
                "forward": same_forward,
                "seconds": time.perf_counter() - t0,
            }
        )
        engine = None  # drop this configuration's engine before the next one is built
    return out


def test_ctrl_c_landing_anywhere_in_the_exit_of_swapped_restores_every_rank_bitwise():
    """Probe AO F1 on DeepSpeed (2 ranks, ZeRO-2 and ZeRO-3): the exits' loops putting back each parameter's memory
    (ZeRO-1/2's ``.data``, ZeRO-3's partitions) and the engine's own verbs stopped half-way on Ctrl-C. Now every
    rank has its live memory and values back, bitwise, and ``engine.backward``/``step`` its own again."""
    reports = run_ranks(
        "tests.test_deepspeed_swap:ctrl_c_worker", world_size=2, timeout=400, configs=[(2, "fp32", 60), (3, "fp32", 6)]
    )
    for rank, per_rank in enumerate(reports):
        for r in per_rank:
            where = (rank, r["config"])
            assert not r["problems"] and r["forward"], (where, r)
            print(
                f"rank {rank} ZeRO-{r['config'][0]}: {r['landed']} of {r['config'][2]} in the exit, {r['seconds']:.1f} s"
            )
            assert r["landed"] >= r["config"][2] // 3, (where, "too few interruptions landed in the exit")
