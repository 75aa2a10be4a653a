"""Hugging Face ``Trainer`` + DeepSpeed ZeRO-3 at 2 real ranks, gradient accumulation 2, the callback passed
in ``Trainer(..., callbacks=[...])`` (the DDP start-rule runs use ``attach`` and ``add_callback``).

Checked against a reference EMA of DeepSpeed's full fp32 weights (``safe_get_full_fp32_param``)
taken once per optimizer step by a second, test-only callback: bitwise, for two EMAs (a float decay
and a power schedule), started after step K, with the BatchNorm buffers averaged too. The EMA
evaluation is logged (``eval_ema_loss``). A run interrupted after its step-4 checkpoint and resumed
in fresh processes (from that checkpoint moved out of ``output_dir``) ends with the uninterrupted run's
EMA, bitwise.

The start rule (in the DDP launch, after its run): one trajectory trained at accumulation 1 and 2
(the same micro-batch twice) gives the same EMA, bitwise, started after optimizer step 1 (or step
K) as a reference EMA.

In one process (real Trainers, a few seconds): every ``evaluate`` call (the evaluation in training on a
dict of datasets, a second call at the same step, a dataset given to ``evaluate``, a dict given to it,
``metric_key_prefix="test"``) logs and returns the EMA loss of its own dataset, equal to that of a copy of
the model holding the EMA weights and unlike the other datasets'; one callback serves one Trainer.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from functional_ema._testing.multirank import run_ranks
from tests._integration_models import hf_reference_callback

DECAYS = (0.9, "power3")  # the power schedule is built in the worker (JSON-able arguments)
START = 2
STEPS = 8


def _decays():
    import functional_ema as fe

    return [0.9, fe.schedules.power(gamma=3.0)]


def _trainer(out: str, max_steps: int, extra_callbacks=(), export: str | None = None, deepspeed: bool = True):
    from transformers import Trainer, TrainingArguments

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import BNNet, RegressionData

    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    args = TrainingArguments(
        output_dir=out,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        per_device_eval_batch_size=8,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="steps",
        save_steps=4,
        eval_strategy="steps",
        eval_steps=4,
        logging_steps=4,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        deepspeed=ds_config if deepspeed else None,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        use_cpu=True,
    )
    torch.manual_seed(0)
    ema = EMACallback(decay=_decays(), start_step=START, buffers="average", export_path=export)
    trainer = Trainer(
        model=BNNet(),
        args=args,
        train_dataset=RegressionData(96, seed=1),
        eval_dataset=RegressionData(32, seed=2),
        callbacks=[ema, *extra_callbacks],  # the Trainer's own idiom: the callback finds its Trainer
    )
    return trainer, ema


def _start_rule(out: str) -> dict:
    """DDP, RULE_STEPS optimizer steps at accumulation 1 and 2 (each micro-batch twice), EMAs
    started at step 0 and at RULE_START; compared by tests._integration_models.start_rule_report."""
    from transformers import Trainer, TrainingArguments

    import functional_ema as fe
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import (
        RULE_START,
        RULE_STEPS,
        BNNet,
        ReferenceEMA,
        RegressionData,
        record_start,
        start_rule_report,
    )

    data = RegressionData(8 * RULE_STEPS, seed=3)  # micro-batch j of rank r: samples 4(2j + r) ..
    runs = {}
    for ga in (1, 2):
        # Sequential sampling; accelerate gives rank r the batches r, r + 2, ...: repeat each pair of batches.
        blocks = [b for j in range(RULE_STEPS) for _ in range(ga) for b in (2 * j, 2 * j + 1)]
        train = torch.utils.data.Subset(data, [4 * b + i for b in blocks for i in range(4)])
        args = TrainingArguments(
            output_dir=os.path.join(out, f"rule_ga{ga}"),
            max_steps=RULE_STEPS,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=ga,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            optim="adamw_torch",
            train_sampling_strategy="sequential",
            save_strategy="no",
            eval_strategy="no",
            logging_strategy="no",
            report_to=[],
            disable_tqdm=True,
            seed=0,
            data_seed=0,
            ddp_backend="gloo",
            dataloader_num_workers=0,
            use_cpu=True,
        )
        torch.manual_seed(0)
        model = BNNet()  # buffers=None: BatchNorm sees each micro-batch twice, the weights do not
        start_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = Trainer(model=model, args=args, train_dataset=train)
        # Both other ways in: attach (names the Trainer) and add_callback after the Trainer is built.
        emas = {0: EMACallback(decay=_decays(), start_step=0).attach(trainer)}
        emas[RULE_START] = EMACallback(decay=_decays(), start_step=RULE_START)
        trainer.add_callback(emas[RULE_START])
        refs = {k: ReferenceEMA(_decays(), start=max(1, k)) for k in emas}
        seen = {k: record_start(e.ema) for k, e in emas.items()}
        box = {"t": trainer}
        for ref in refs.values():
            trainer.add_callback(hf_reference_callback(box, ref))
        trainer.train()
        assert trainer.state.global_step == RULE_STEPS, trainer.state.global_step
        wrapped = trainer.model_wrapped
        runs[ga] = {
            "weights": {n: p.detach().clone() for n, p in wrapped.module.named_parameters()},
            "start_weights": start_weights,
            "refs": refs,
            "seen": seen,
            "emas": {k: [fe.gather_full(e.state, wrapped, index=i) for i in range(2)] for k, e in emas.items()},
        }
    return start_rule_report(runs)


class _Killed(Exception):
    pass


def hf_worker(out: str, phase: str, resume: str | None = None) -> dict:
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file
    from transformers import TrainerCallback

    import functional_ema as fe
    from tests._integration_models import BNNet, ReferenceEMA, deepspeed_full_fp32, equal, max_diff, quiet

    quiet()
    rank = dist.get_rank()
    report: dict = {}
    if phase == "full":
        ref = ReferenceEMA(_decays(), start=START)
        box: dict = {}
        trainer, ema = _trainer(
            os.path.join(out, "full"),
            STEPS,
            [hf_reference_callback(box, ref)],
            export=os.path.join(out, "export.safetensors"),
        )
        box["t"] = trainer
        trainer.train()
        engine = trainer.model_wrapped
        report["engine"] = type(engine).__name__
        report["stage"] = engine.zero_optimization_stage()
        report["gas"] = engine.gradient_accumulation_steps()
        report["global_steps"] = engine.global_steps
        report["ema_step"] = int(ema.state.step)
        full = [fe.gather_full(ema.state, engine, index=k) for k in range(2)]
        report["bitwise"] = [equal(full[k], ref.emas[k]) for k in range(2)]
        report["max_diff"] = [max_diff(full[k], ref.emas[k]) for k in range(2)]
        bs = ema.ema.buffer_state
        report["buffers_bitwise"] = [equal(bs.emas[k], ref.buffers[k]) for k in range(2)]
        report["num_batches_tracked"] = int(bs.copied["norm.num_batches_tracked"])
        report["ema_differs_from_live"] = not equal(full[0], deepspeed_full_fp32(engine))
        logs = trainer.state.log_history
        report["eval_ema_steps"] = [h["step"] for h in logs if "eval_ema_loss" in h]
        report["eval_steps"] = [h["step"] for h in logs if "eval_loss" in h]
        report["ema_vs_live_loss"] = [(h["eval_ema_loss"]) for h in logs if "eval_ema_loss" in h]
        report["live_loss"] = [(h["eval_loss"]) for h in logs if "eval_loss" in h]
        ckpt = Path(out, "full", "checkpoint-4")
        report["ckpt4_files"] = sorted(p.name for p in (ckpt / "ema").iterdir())
        if rank == 0:
            save_file(
                {f"{k}.{n}": t.contiguous() for k in range(2) for n, t in full[k].items()},
                os.path.join(out, "final.safetensors"),
            )
            exported = load_file(os.path.join(out, "export.safetensors"))
            net = BNNet()
            report["export_strict"] = str(net.load_state_dict(exported, strict=True))
            report["export_equal"] = all(torch.equal(exported[n], ref.emas[0][n]) for n in ref.emas[0]) and all(
                torch.equal(exported[n], ref.buffers[0][n]) for n in ref.buffers[0]
            )
            # offline consolidate of the step-4 checkpoint, buffers included, loads strictly
            sd = fe.buffers.consolidate(ckpt, "ema")
            report["ckpt4_strict"] = str(BNNet().load_state_dict(sd, strict=True))
        save_file(
            {f"{k}.{n}": t.contiguous() for k in range(2) for n, t in bs.emas[k].items()},
            os.path.join(out, f"buffers_final_{rank}.safetensors"),
        )
    elif phase == "ddp":
        ref = ReferenceEMA(_decays(), start=START)
        box = {}
        trainer, ema = _trainer(os.path.join(out, "ddp"), STEPS, [hf_reference_callback(box, ref)], deepspeed=False)
        box["t"] = trainer
        trainer.train()
        wrapped = trainer.model_wrapped
        report["engine"] = type(wrapped).__name__
        full = [fe.gather_full(ema.state, wrapped, index=k) for k in range(2)]
        report["bitwise"] = [equal(full[k], ref.emas[k]) for k in range(2)]
        report["buffers_bitwise"] = [equal(ema.ema.buffer_state.emas[k], ref.buffers[k]) for k in range(2)]
        report["eval_ema_steps"] = [h["step"] for h in trainer.state.log_history if "eval_ema_loss" in h]
        report["ema_files"] = sorted(p.name for p in Path(out, "ddp", "checkpoint-4", "ema").iterdir())
        t0 = time.perf_counter()
        report["start_rule"] = _start_rule(out)
        report["start_rule_seconds"] = time.perf_counter() - t0
    elif phase == "interrupted":

        class Kill(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step == 6:  # after the step-4 checkpoint, before the step-8 one
                    raise _Killed()

        trainer, ema = _trainer(os.path.join(out, "resumed"), STEPS, [Kill()])
        try:
            trainer.train()
            report["killed"] = False
        except _Killed:
            report["killed"] = True
        report["checkpoints"] = sorted(
            p.name for p in Path(out, "resumed").iterdir() if p.name.startswith("checkpoint-")
        )
    elif phase == "resume":
        trainer, ema = _trainer(os.path.join(out, "resumed"), STEPS)
        trainer.train(resume_from_checkpoint=resume)  # a folder outside output_dir: found on the call stack
        engine = trainer.model_wrapped
        full = [fe.gather_full(ema.state, engine, index=k) for k in range(2)]
        want = load_file(os.path.join(out, "final.safetensors"))
        report["bitwise_vs_uninterrupted"] = [
            equal(full[k], {n[2:]: t for n, t in want.items() if n.startswith(f"{k}.")}) for k in range(2)
        ]
        wb = load_file(os.path.join(out, f"buffers_final_{rank}.safetensors"))
        bs = ema.ema.buffer_state
        report["buffers_vs_uninterrupted"] = [
            equal(bs.emas[k], {n[2:]: t for n, t in wb.items() if n.startswith(f"{k}.")}) for k in range(2)
        ]
        report["ema_step"] = int(ema.state.step)
        report["eval_ema_steps"] = [h["step"] for h in trainer.state.log_history if "eval_ema_loss" in h]
    return report


def test_trainer_deepspeed_zero3_grad_accum_resume(tmp_path):
    out = str(tmp_path)
    full = run_ranks("tests.test_integrations_transformers:hf_worker", world_size=2, timeout=600, out=out, phase="full")
    print(json.dumps(full[0]))
    for r in full:
        assert r["engine"] == "DeepSpeedEngine" and r["stage"] == 3 and r["gas"] == 2
        assert r["global_steps"] == STEPS and r["ema_step"] == STEPS
        assert r["bitwise"] == [True, True], r["max_diff"]
        assert r["buffers_bitwise"] == [True, True]
        assert r["ema_differs_from_live"]
        assert r["eval_ema_steps"] == [4, 8] and r["eval_steps"] == [4, 8]
        assert all(a != b for a, b in zip(r["ema_vs_live_loss"], r["live_loss"]))
        assert "ema_manifest.json" in r["ckpt4_files"] and "buffers_rank_00001_of_00002.safetensors" in r["ckpt4_files"]
    assert full[0]["export_equal"] is True
    assert full[0]["export_strict"] == "<All keys matched successfully>"
    assert full[0]["ckpt4_strict"] == "<All keys matched successfully>"

    killed = run_ranks(
        "tests.test_integrations_transformers:hf_worker", world_size=2, timeout=600, out=out, phase="interrupted"
    )
    assert all(r["killed"] for r in killed)
    assert killed[0]["checkpoints"] == ["checkpoint-4"]

    # Resume from the checkpoint moved out of output_dir: the callback (in callbacks=) must load the EMA
    # from the folder train() was given, which it reads on the call stack (output_dir has no checkpoint-4).
    moved = os.path.join(out, "moved", "checkpoint-4")
    shutil.move(os.path.join(out, "resumed", "checkpoint-4"), moved)
    resumed = run_ranks(
        "tests.test_integrations_transformers:hf_worker",
        world_size=2,
        timeout=600,
        out=out,
        phase="resume",
        resume=moved,
    )
    print(json.dumps(resumed[0]))
    for r in resumed:
        assert r["ema_step"] == STEPS
        assert r["bitwise_vs_uninterrupted"] == [True, True]
        assert r["buffers_vs_uninterrupted"] == [True, True]
        assert r["eval_ema_steps"] == [4, 8]  # step 4 from the restored log history, step 8 new


def test_trainer_ddp(tmp_path):
    from tests._integration_models import check_start_rule

    res = run_ranks(
        "tests.test_integrations_transformers:hf_worker", world_size=2, timeout=600, out=str(tmp_path), phase="ddp"
    )
    print(f"start-rule runs: {res[0]['start_rule_seconds']:.1f} s")
    for r in res:
        assert r["engine"] == "DistributedDataParallel"
        assert r["bitwise"] == [True, True] and r["buffers_bitwise"] == [True, True]
        assert r["eval_ema_steps"] == [4, 8]
        assert "ema_manifest.json" in r["ema_files"]
        check_start_rule(r["start_rule"], calls_at_0=False)  # the callback runs once per optimizer step


def test_callback_events_outside_a_trainer_say_how_to_name_it():
    from types import SimpleNamespace

    from functional_ema.integrations.transformers import EMACallback

    ema = EMACallback(decay=0.9)
    ema.on_train_begin(None, SimpleNamespace(global_step=0), None)  # no Trainer on the stack: nothing found
    with pytest.raises(RuntimeError, match=r"found no Trainer.*callbacks=\[ema\].*attach\(trainer\)"):
        ema.on_step_end(None, SimpleNamespace(global_step=1), None)


# ------------------------------------------------------------------------ one process: what evaluate answers
# Real Trainers in this process (no ranks): 4 optimizer steps, each evaluation one batch (eval batch 64 >
# 32 samples), so eval_loss is the mean squared error of the whole dataset in one forward pass.


def _one_process_trainer(out: Path, callbacks, eval_dataset, seed: int = 0, best: str | None = None):
    from transformers import Trainer

    from tests._integration_models import BNNet, RegressionData, cpu_training_args, quiet

    quiet()
    args = cpu_training_args(
        out,
        max_steps=4,
        per_device_eval_batch_size=64,
        eval_strategy="steps",
        eval_steps=4,  # the last step: the evaluation in training sees the final EMA
        metric_for_best_model=best,
        seed=seed,
    )
    torch.manual_seed(seed)
    return Trainer(
        model=BNNet(),
        args=args,
        train_dataset=RegressionData(64, seed=1),
        eval_dataset=eval_dataset,
        callbacks=list(callbacks),
    )


def _ema_loss(trainer, ema, dataset) -> float:
    """The loss of a copy of the trained model holding the EMA weights (the live BatchNorm statistics:
    ``buffers=None``), on all of ``dataset`` in one forward pass: the reference for ``*_ema_*_loss``."""
    import copy

    import functional_ema as fe

    full = fe.gather_full(ema.state, trainer.model_wrapped, index=0)
    net = copy.deepcopy(trainer.model)
    keys = net.load_state_dict(full, strict=False)
    buffers = {n for n, _ in net.named_buffers()}
    assert not keys.unexpected_keys and set(keys.missing_keys) <= buffers, keys
    assert not torch.equal(full["inp.weight"], trainer.model.inp.weight.detach())  # the EMA is not the live model
    return _loss(net, dataset)


def _loss(net, dataset) -> float:
    net.eval()
    with torch.no_grad():
        return net(x=dataset.x, labels=dataset.y)["loss"].item()


def _logged(trainer, key: str) -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def close(got, want) -> bool:
    """The Trainer's loss of one batch against the copy's: the same forward pass, up to float rounding."""
    return got == pytest.approx(want, rel=1e-6, abs=0)


def test_every_evaluate_call_gets_the_ema_metric_of_its_own_dataset(tmp_path):
    """trainer.evaluate(D), a second evaluate at the same step, a dict of datasets (the Trainer's and one
    given to evaluate), metric_key_prefix="test": each call logs and returns the EMA loss of the dataset
    it was given (a copy of the model with the EMA weights, evaluated here), not of trainer.eval_dataset;
    a second EMACallback (metric_prefix="ema") answers the same calls with its own EMA."""
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import RegressionData

    d1, d2, d3 = (RegressionData(32, seed=s) for s in (2, 3, 4))
    ema = EMACallback(decay=0.5, start_step=0)
    other = EMACallback(decay=0.9, start_step=0, metric_prefix="ema")
    trainer = _one_process_trainer(tmp_path, [ema, other], {"a": d1, "b": d2}, best="eval_ema_a_loss")
    trainer.train()
    ref = {name: _ema_loss(trainer, ema, d) for name, d in (("d1", d1), ("d2", d2), ("d3", d3))}
    ref_other = {name: _ema_loss(trainer, other, d) for name, d in (("d1", d1), ("d3", d3))}
    assert min(abs(ref["d1"] - ref["d2"]), abs(ref["d2"] - ref["d3"]), abs(ref["d1"] - ref["d3"])) > 1e-3
    assert abs(ref["d3"] - ref_other["d3"]) > 1e-3

    # The evaluation in training (the Trainer's dict, datasets named): one EMA metric per dataset, its own.
    assert close(_logged(trainer, "eval_ema_a_loss"), [ref["d1"]])
    assert close(_logged(trainer, "eval_ema_b_loss"), [ref["d2"]])
    assert close(_logged(trainer, "ema_a_loss"), [ref_other["d1"]])
    assert trainer.state.best_metric == _logged(trainer, "eval_ema_a_loss")[0]  # returned to the Trainer too

    again = trainer.evaluate()  # the same global step as the one in training: answered again
    assert trainer.state.global_step == 4
    assert close([again["eval_ema_a_loss"], again["eval_ema_b_loss"]], [ref["d1"], ref["d2"]])
    assert close(_logged(trainer, "eval_ema_a_loss"), [ref["d1"], ref["d1"]])

    for _ in range(2):  # an override dataset, twice at one step
        m = trainer.evaluate(eval_dataset=d3)
        assert close(m["eval_ema_loss"], ref["d3"]) and close(m["ema_loss"], ref_other["d3"])
        assert close(m["eval_loss"], _loss(trainer.model, d3))  # the live metric kept, beside it
    assert close(_logged(trainer, "eval_ema_loss"), [ref["d3"], ref["d3"]])

    m = trainer.evaluate(d3, metric_key_prefix="test")
    assert close(m["eval_ema_test_loss"], ref["d3"]) and close(m["ema_test_loss"], ref_other["d3"])
    assert close(m["test_loss"], _loss(trainer.model, d3))
    m = trainer.evaluate({"x": d2, "y": d3}, metric_key_prefix="test")  # a dict given to evaluate
    assert close([m["eval_ema_test_x_loss"], m["eval_ema_test_y_loss"]], [ref["d2"], ref["d3"]])
    assert close(_logged(trainer, "eval_ema_test_y_loss"), [ref["d3"]])
    assert not any(
        k.startswith("ema_ema") or k.startswith("eval_ema_ema") for h in trainer.state.log_history for k in h
    )


def _best_metric_trainer(out: Path, start_step: int, best: str, **evaluation):
    """One process, 8 optimizer steps per epoch, an EMA started after ``start_step``, ``metric_for_best_model=best``
    and the evaluation settings ``evaluation``; a reference EMA of every parameter fed after each optimizer step."""
    from transformers import Trainer, TrainerCallback

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import BNNet, ReferenceEMA, RegressionData, cpu_training_args, quiet

    quiet()
    ref = ReferenceEMA([0.9], start=start_step)

    class Reference(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if ref.due(state.global_step):
                ref.feed(state.global_step, {n: p.detach() for n, p in model.named_parameters()})

    args = cpu_training_args(out, metric_for_best_model=best, greater_is_better=False, seed=0, **evaluation)
    torch.manual_seed(0)
    ema = EMACallback(decay=0.9, start_step=start_step)
    trainer = Trainer(
        model=BNNet(),
        args=args,
        train_dataset=RegressionData(64, seed=1),
        eval_dataset=RegressionData(16, seed=2),
        callbacks=[ema, Reference()],
    )
    return trainer, ema, ref


def test_an_ema_best_metric_evaluated_before_the_ema_starts_is_refused_at_train_begin(tmp_path):
    """``metric_for_best_model`` naming an EMA metric, with a first evaluation (by steps, or at an epoch's end) before
    the EMA starts, is refused at ``on_train_begin``, before any step, naming the settings and the fix; delayed
    evaluations (``eval_on_start`` picks no best model) train, and the best metric is the EMA's, whose weights equal
    a reference EMA, bitwise."""
    steps = {"max_steps": 6, "eval_strategy": "steps", "eval_steps": 2}
    epochs = {"num_train_epochs": 2, "eval_strategy": "epoch"}
    for kind, start, best, evaluation, named in (
        ("steps", 3, "eval_ema_loss", steps, "after optimizer step 2 (eval_strategy='steps', eval_steps=2"),
        ("epoch", 9, "ema_loss", epochs, "after optimizer step 8 (eval_strategy='epoch', 8 optimizer steps per epoch"),
    ):
        trainer, _, _ = _best_metric_trainer(tmp_path / kind, start, best, **evaluation)
        with pytest.raises(ValueError, match=f"metric_for_best_model='{best}' is an EMA metric") as refused:
            trainer.train()
        fix = "eval_delay=3" if kind == "steps" else "eval_delay=2 epochs"
        for part in (f"first evaluation comes {named}", f"(start_step={start})", f"({fix})", "lower start_step to"):
            assert part in str(refused.value), (part, str(refused.value))
        assert trainer.state.global_step == 0 and not trainer.state.log_history
    trainer, ema, ref = _best_metric_trainer(
        tmp_path / "ok", 3, "eval_ema_loss", eval_delay=3, eval_on_start=True, **steps
    )
    trainer.train()
    assert trainer.state.best_metric == min(_logged(trainer, "eval_ema_loss"))
    assert len(_logged(trainer, "eval_ema_loss")) == 2  # steps 4 and 6
    assert int(ema.state.step) == 6 and all(torch.equal(ema.state.ema[n], t) for n, t in ref.emas[0].items())


def test_one_callback_serves_one_trainer(tmp_path):
    """A second Trainer given the callback while the first is alive is refused (in Trainer(callbacks=),
    at train or evaluate after add_callback, in attach), naming both, before anything changed: the
    first Trainer keeps its EMA and its EMA metric. Once the first one is garbage collected, a new
    Trainer is accepted and gets its own EMA (from a fresh start)."""
    import gc
    import re
    import weakref

    import functional_ema as fe
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import RegressionData, equal

    d1, d2 = RegressionData(32, seed=2), RegressionData(32, seed=3)
    ema = EMACallback(decay=0.5, start_step=0)
    first = _one_process_trainer(tmp_path / "first", [ema], d1)
    first.train()
    kept = fe.gather_full(ema.state, first.model_wrapped, index=0)
    named = re.escape(f"{type(first).__name__} at 0x{id(first):x} (output_dir='{tmp_path / 'first'}')")
    refusal = named + ".*Trainer at 0x.*create one EMACallback per Trainer"  # the first, then the second

    with pytest.raises(RuntimeError, match=refusal):
        _one_process_trainer(tmp_path / "second", [ema], d2, seed=1)
    second = _one_process_trainer(tmp_path / "second", [], d2, seed=1)
    second.add_callback(ema)
    with pytest.raises(RuntimeError, match=refusal):
        second.evaluate()
    with pytest.raises(RuntimeError, match=refusal):
        second.train()
    third = _one_process_trainer(tmp_path / "third", [], d2, seed=1)
    train = third.train
    with pytest.raises(RuntimeError, match=refusal):
        ema.attach(third)
    assert ema not in third.callback_handler.callbacks and third.train == train  # attach changed nothing
    assert second.state.global_step == 0 and not _logged(second, "eval_ema_loss")

    assert int(ema.state.step) == 4 and equal(fe.gather_full(ema.state, first.model_wrapped, index=0), kept)
    assert close(first.evaluate()["eval_ema_loss"], _ema_loss(first, ema, d1))  # the first one still works

    gone = weakref.ref(first)
    del first, second, third, train
    gc.collect()
    assert gone() is None
    fourth = _one_process_trainer(tmp_path / "fourth", [ema], d2, seed=3)  # accepted
    assert ema.state is None  # the collected Trainer's EMA is not swapped into this one's model
    fourth.train()
    assert int(ema.state.step) == 4
    assert not equal(fe.gather_full(ema.state, fourth.model_wrapped, index=0), kept)
    assert close(_logged(fourth, "eval_ema_loss"), [_ema_loss(fourth, ema, d2)])


def _unfreezing_trainer(out: Path, ref, start=None):
    """One process, 6 optimizer steps, a checkpoint every 2; a user's callback unfreezes the backbone before step 3
    (``global_step == 2`` at ``on_step_begin``: once, so not again after a later resume) into an optimizer built over
    every parameter; a reference EMA of every parameter (``start``: the snapshot a resume continues)."""
    import copy

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import Backboned, RegressionData, quiet

    quiet()

    class Unfreeze(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kwargs):
            if state.global_step == 2:
                model.backbone.requires_grad_(True)

    class Reference(TrainerCallback):
        def __init__(self):
            self.ref, self.at = (copy.deepcopy(start) if start is not None else ref), {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            self.ref.feed(state.global_step, {n: p.detach() for n, p in model.named_parameters()})
            self.at[state.global_step] = copy.deepcopy(self.ref)

    args = TrainingArguments(
        output_dir=str(out),
        max_steps=6,
        per_device_train_batch_size=4,
        lr_scheduler_type="constant",
        save_strategy="steps",
        save_steps=2,
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
    )
    model = Backboned(frozen=True)
    reference = Reference()
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=RegressionData(24, seed=1),
        callbacks=[EMACallback(decay=0.9), Unfreeze(), reference],
        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-2), None),
    )
    return trainer, reference


def test_a_backbone_unfrozen_by_a_callback_joins_the_ema(tmp_path, recwarn):
    """Progressive unfreezing under the Trainer: a backbone frozen when the EMA starts and unfrozen by a user's
    callback before step 3 joins the EMA at ``on_pre_optimizer_step``; the EMA equals, bitwise, a reference of every
    parameter averaged from step 1, with no warning. Resumed from checkpoint-2 (no backbone in its EMA) the run equals
    the uninterrupted one; resumed from checkpoint-4 into the model frozen as built (the callback unfreezes at step 2
    only), the EMA keeps the backbone, read although frozen, and equals the reference continued over that run."""
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA

    trainer, reference = _unfreezing_trainer(tmp_path / "run", ReferenceEMA([0.9]))
    trainer.train()
    ema = next(c for c in trainer.callback_handler.callbacks if isinstance(c, EMACallback)).ema
    assert int(ema.state.step) == 6 and set(ema.state.ema) == set(reference.ref.emas[0])
    assert all(torch.equal(ema.state.ema[n], t) for n, t in reference.ref.emas[0].items())
    assert not [w for w in recwarn if "EMA" in str(w.message)]
    for step, trained in ((2, True), (4, False)):
        again, ref_again = _unfreezing_trainer(tmp_path / f"from{step}", None, start=reference.at[step])
        again.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{step}"))
        got = next(c for c in again.callback_handler.callbacks if isinstance(c, EMACallback)).ema.state
        assert again.model.backbone.weight.requires_grad is trained
        assert set(got.ema) == set(ref_again.ref.emas[0])
        assert all(torch.equal(got.ema[n], t) for n, t in ref_again.ref.emas[0].items()), step
        if trained:  # the same trajectory as the uninterrupted run
            assert all(torch.equal(got.ema[n], t) for n, t in ema.state.ema.items())


# ------------------------------------------------------------------------ one process: the EMA evaluation is invisible


class _DropNet(torch.nn.Module):
    """BNNet's sizes with dropout 0.5: its training draws from the global torch generator at every step."""

    def __init__(self):
        super().__init__()
        from tests._integration_models import BNNet

        self.net, self.drop = BNNet(), torch.nn.Dropout(0.5)

    def forward(self, x, labels=None):
        y = self.net.out(self.drop(torch.tanh(self.net.mid(torch.tanh(self.net.norm(self.net.inp(x)))))))
        return {"logits": y} if labels is None else {"loss": ((y - labels) ** 2).mean(), "logits": y}


def _reference(ref, at: dict | None = None):
    """A callback feeding ``ref`` (a ReferenceEMA) the plain module's parameters after each optimizer step; ``at``
    keeps a copy of its first EMA per step."""
    from transformers import TrainerCallback

    class Reference(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if ref.due(state.global_step):
                ref.feed(state.global_step, {n: p.detach() for n, p in model.named_parameters()})
            if at is not None and ref.emas is not None:
                at[state.global_step] = {n: t.clone() for n, t in ref.emas[0].items()}

    return Reference()


def test_the_ema_evaluation_changes_neither_the_training_nor_the_events(tmp_path):
    """A model with dropout, evaluated at every step: the run with the EMA evaluation trains bitwise as the run
    without it (the random generators are put back), and its EMA equals a reference EMA of the live weights. Every
    other callback hears one on_evaluate per evaluation (whose metrics hold the EMA loss), on_log still carries the EMA
    metrics, and a callback's on_log during the EMA evaluation changes no control flag: EarlyStoppingCallback on
    eval_ema_loss stops where its rule, applied once per evaluation to the logged losses, stops."""
    from transformers import EarlyStoppingCallback, Trainer, TrainerCallback

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA, RegressionData, cpu_training_args, equal, quiet

    quiet()

    class Record(TrainerCallback):  # after the EMA callback: sees the events other callbacks see
        def __init__(self):
            self.evaluated, self.logged = [], []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.evaluated.append((state.global_step, "eval_ema_loss" in metrics))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if "eval_ema_loss" in logs:  # the EMA evaluation's own log: nothing set here may reach the training
                self.logged.append(state.global_step)
                control.should_training_stop = control.should_save = True

    def run(name, eval_index, lr, decay=0.9, stop=None, early_first=False):
        ref, record = ReferenceEMA([0.9]), Record()
        early = [] if stop is None else [EarlyStoppingCallback(early_stopping_patience=stop)]
        first, early = (early, []) if early_first else ([], early)
        args = cpu_training_args(
            tmp_path / name, max_steps=10, eval_strategy="steps", eval_steps=1, learning_rate=lr, seed=0,
            metric_for_best_model="eval_ema_loss" if stop else None, greater_is_better=False if stop else None,
        )  # fmt: skip
        torch.manual_seed(0)
        ema = EMACallback(decay=decay, eval_index=eval_index)
        trainer = Trainer(
            model=_DropNet(),
            args=args,
            train_dataset=RegressionData(64, seed=1),
            eval_dataset=RegressionData(16, seed=2),
            callbacks=[*first, ema, *early, record, _reference(ref)],
        )
        trainer.train()
        return trainer, ema, ref, record

    without, _, _, _ = run("without", None, 1e-2)
    with_ema, ema, ref, record = run("with", 0, 1e-2)
    live = {n: p.detach() for n, p in with_ema.model.named_parameters()}
    assert equal(live, {n: p.detach() for n, p in without.model.named_parameters()})
    assert with_ema.state.global_step == 10 and int(ema.state.step) == 10
    assert all(torch.equal(ema.state.ema[n], t) for n, t in ref.emas[0].items())
    assert record.evaluated == [(s, True) for s in range(1, 11)] and record.logged == list(range(1, 11))

    stopped, _, _, record = run("early", 0, 1.0, decay=0.6, stop=2)
    losses = _logged(stopped, "eval_ema_loss")
    best, waited, expected = float("inf"), 0, None
    for step, loss in enumerate(losses, start=1):  # EarlyStoppingCallback's rule, once per evaluation
        best, waited = (loss, 0) if loss < best else (best, waited + 1)
        if waited >= 2:
            expected = step
            break
    assert expected is not None and expected < 10, losses  # the run stops early: the test sees the counting
    assert stopped.state.global_step == expected == len(losses)
    assert record.evaluated == [(s, True) for s in range(1, expected + 1)]
    # EarlyStoppingCallback placed before the EMA callback (trainer.add_callback(ema) puts it last) meets the outer
    # event before the EMA metrics are added: it finds them in the EMA evaluation's own event, which it still hears
    # (it heard none, and never stopped, when no callback heard that event), and the stop it decides there stands
    stopped, _, _, record = run("early_first", 0, 1.0, decay=0.6, stop=2, early_first=True)
    assert _logged(stopped, "eval_ema_loss") == losses and stopped.state.global_step == expected
    assert record.evaluated == [(s, True) for s in range(1, expected + 1)]


def test_early_stopping_on_the_live_loss_before_the_callback_stops_as_without_it_and_warns_nothing(tmp_path):
    """An EarlyStoppingCallback on the live eval_loss placed before EMACallback hears the live event only: the EMA
    evaluation's own on_evaluate (whose metrics hold no eval_loss) would make it warn at every evaluation that early
    stopping is disabled. It stops at the step a run without the EMA evaluation stops at, and nothing is warned."""
    import logging

    from transformers import EarlyStoppingCallback, Trainer
    from transformers.utils import logging as hf_logging

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import RegressionData, cpu_training_args, quiet

    quiet()
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            said.append(record.getMessage())

    def run(name, eval_index):
        args = cpu_training_args(
            tmp_path / name, max_steps=12, eval_strategy="steps", eval_steps=1, learning_rate=1.0, seed=0,
            metric_for_best_model="eval_loss", greater_is_better=False,
        )  # fmt: skip
        torch.manual_seed(0)
        trainer = Trainer(
            model=_DropNet(),
            args=args,
            train_dataset=RegressionData(64, seed=1),
            eval_dataset=RegressionData(16, seed=2),
            callbacks=[EarlyStoppingCallback(early_stopping_patience=2), EMACallback(decay=0.6, eval_index=eval_index)],
        )
        trainer.train()
        return trainer.state.global_step

    logger = hf_logging.get_logger("transformers.trainer_callback")
    handler, level = Keep(logging.WARNING), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)  # quiet() raised the transformers loggers' level
    try:
        without = run("without", None)
        with_ema = run("with", 0)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert without < 12, "the run should stop early for the test to see the counting"
    assert with_ema == without
    assert not [m for m in said if "did not find" in m], said


def test_seq2seq_ema_evaluation_generates_with_the_calls_settings(tmp_path):
    """Seq2SeqTrainer.evaluate(max_new_tokens=2) with predict_with_generate: the EMA evaluation generates with the
    call's settings (2 tokens generated, as for the live metrics; 11 with the model's default),
    and the Trainer keeps the call's generation settings afterwards."""
    import numpy as np
    from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import quiet

    quiet()

    class Pairs(torch.utils.data.Dataset):
        def __init__(self, n, seed):
            g = torch.Generator().manual_seed(seed)
            self.x, self.y = torch.randint(2, 32, (n, 6), generator=g), torch.randint(2, 32, (n, 5), generator=g)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"input_ids": self.x[i], "labels": self.y[i]}

    config = T5Config(
        vocab_size=32, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(config)
    gen = model.generation_config  # by default 11 tokens after the start one, never the pad (0) or eos (1)
    gen.max_length, gen.eos_token_id, gen.suppress_tokens = 12, None, [0, 1]

    def length(p):
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        return {"gen_len": float((np.asarray(preds) > 1).sum(1).mean())}  # the tokens generated, padding left out

    args = Seq2SeqTrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, per_device_eval_batch_size=8,
        predict_with_generate=True, report_to=[], disable_tqdm=True, use_cpu=True, save_strategy="no",
    )  # fmt: skip
    trainer = Seq2SeqTrainer(
        model=model, args=args, train_dataset=Pairs(8, 1), eval_dataset=Pairs(8, 2), compute_metrics=length,
        callbacks=[EMACallback(decay=0.8)],
    )  # fmt: skip
    trainer.train()
    m = trainer.evaluate(max_new_tokens=2)
    assert m["eval_gen_len"] == m["eval_ema_gen_len"] == 2.0
    assert trainer._gen_kwargs == {"max_new_tokens": 2}


def _plain_trainer(out: Path, callbacks, max_steps: int, **overrides):
    """One process, BNNet, 64 samples (8 optimizer steps per epoch), a checkpoint every 2 steps (``overrides`` win)."""
    from transformers import Trainer

    from tests._integration_models import BNNet, RegressionData, cpu_training_args, quiet

    quiet()
    args = cpu_training_args(
        out, **{"max_steps": max_steps, "save_strategy": "steps", "save_steps": 2, "seed": 0, **overrides}
    )
    torch.manual_seed(0)
    return Trainer(
        model=BNNet(),
        args=args,
        train_dataset=RegressionData(64, seed=1),
        eval_dataset=RegressionData(16, seed=2),
        callbacks=list(callbacks),
    )


@pytest.mark.filterwarnings("ignore:`get_trial_id` is meant to only be called")  # outside a Ray trial, as intended
def test_a_hyperparameter_search_trial_keeps_its_ema_in_its_own_checkpoints(tmp_path):
    """Under hyperparameter_search the Trainer saves a trial's checkpoints into output_dir/<run name>/ (the Trainer's
    own code path, with the Ray backend set and a dict trial: no Ray cluster): the EMA goes into the same folders,
    is rotated with them (save_total_limit), nothing lands in output_dir/checkpoint-N, and a resume from the trial's
    checkpoint ends with the uninterrupted trial's EMA, bitwise."""
    from transformers.trainer_utils import HPSearchBackend

    from functional_ema.integrations.transformers import EMACallback

    def trial_run(out, max_steps, resume=None):
        ema = EMACallback(decay=0.8)
        trainer = _plain_trainer(out, [ema], max_steps, save_total_limit=2)
        trainer.hp_search_backend, trainer.hp_name = HPSearchBackend.RAY, lambda trial: "run-A"
        trainer.train(resume_from_checkpoint=resume, trial={"learning_rate": 1e-2})
        return ema

    # the Trainer names a Ray trial's folder with ray.tune's context: without the ray extra (make test), skipped here and run
    # by make test-ray, whose tier installs it
    pytest.importorskip("ray.tune", reason="the ray extra is not installed: make test-ray runs this test")
    full = trial_run(tmp_path / "full", 6)
    run = tmp_path / "full" / "run-A"
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["run-A"]
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint-4", "checkpoint-6"]  # checkpoint-2 rotated, EMA too
    assert all((run / c / "ema" / "ema_manifest.json").is_file() for c in ("checkpoint-4", "checkpoint-6"))
    resumed = trial_run(tmp_path / "again", 6, resume=str(run / "checkpoint-4"))
    assert int(resumed.state.step) == int(full.state.step) == 6
    assert all(torch.equal(resumed.state.ema[n], t) for n, t in full.state.ema.items())


def test_load_best_model_at_end_exports_and_copies_the_best_checkpoints_ema(tmp_path):
    """load_best_model_at_end: the export (and copy_to_model) hold the EMA saved in the best checkpoint, the one whose
    weights the Trainer loaded, equal to a reference EMA at that step, bitwise, whether the best metric is the EMA's
    or a live one. A best checkpoint saved before the EMA started keeps the final EMA, with a warning naming it."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA

    class Chosen(TrainerCallback):  # a metric whose best is the evaluation at step 2 (greater_is_better=False)
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_chosen"] = float(abs(state.global_step - 2))

    for name, best, start, copy in (
        ("ema_metric", "eval_ema_loss", 0, False),
        ("live_metric", "eval_loss", 0, True),
        ("before_start", "eval_chosen", 3, True),
    ):
        at: dict = {}
        ref, export = ReferenceEMA([0.7], start=start), tmp_path / f"{name}.safetensors"
        ema = EMACallback(decay=0.7, start_step=start, export_path=export, copy_to_model=copy)
        trainer = _plain_trainer(
            tmp_path / name, [ema, Chosen(), _reference(ref, at)], 12, learning_rate=3.0, eval_strategy="steps",
            eval_steps=2, load_best_model_at_end=True, metric_for_best_model=best, greater_is_better=False,
        )  # fmt: skip
        if start:
            with pytest.warns(UserWarning, match=r"best checkpoint .*checkpoint-2 holds no EMA.*final EMA"):
                trainer.train()
        else:
            trainer.train()
        step = int(Path(trainer.state.best_model_checkpoint).name.removeprefix("checkpoint-"))
        want = at[12] if start else at[step]
        assert (step == 2) if start else (2 < step < 12), (name, step)  # a checkpoint other than the last one
        exported = load_file(export)
        assert all(torch.equal(exported[n], t) for n, t in want.items()), name
        if copy:  # the model holds the same EMA (not the final one over the best weights)
            assert all(torch.equal(p.detach(), want[n]) for n, p in trainer.model.named_parameters()), name


def _slow_background_writes(monkeypatch, seconds: float = 0.5) -> None:
    """Every async EMA write sleeps first (a large EMA, a slow disk): the Trainer's next step, and its deletion of
    checkpoint folders, comes while the write is in flight, every time."""
    import functional_ema._async as background

    write = background._write_files

    def slow(job, names):
        time.sleep(seconds)
        return write(job, names)

    monkeypatch.setattr(background, "_write_files", slow)


def test_async_saves_survive_save_total_limit_1_and_load_best_model_at_end(tmp_path, monkeypatch):
    """async_save=True, save_total_limit=1, a checkpoint and an evaluation every step, load_best_model_at_end (the best:
    step 2 of 4), every background write slowed: the Trainer deletes the previous checkpoint in its rotation (before
    on_save) and, at the end, every checkpoint but the best (before on_train_end), both while an EMA save into it would
    be in flight; the callback waits for it before each. Training completes, the export is the best checkpoint's
    EMA, every surviving checkpoint's EMA loads (the reference EMA at its step, bitwise), and a resume from the last
    surviving checkpoint reaches the uninterrupted run's EMA at the last step, bitwise."""
    from safetensors.torch import load_file
    from transformers import TrainerCallback

    import functional_ema as fe
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA

    _slow_background_writes(monkeypatch)

    class Chosen(TrainerCallback):  # the best evaluation is step 2's (greater_is_better=False)
        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            metrics["eval_chosen"] = float(abs(state.global_step - 2))

    def run(name: str, resume: str | None = None):
        ref, at, seen = ReferenceEMA([0.7]), {}, {}
        ema = EMACallback(decay=0.7, async_save=True, export_path=tmp_path / f"{name}.safetensors")

        class Seen(TrainerCallback):  # the callback's own EMA after each step (it replaces it by the best's at the end)
            def on_step_end(self, args, state, control, **kwargs):
                seen[state.global_step] = {n: t.clone() for n, t in ema.state.ema.items()}

        trainer = _plain_trainer(
            tmp_path / "run", [ema, Seen(), Chosen(), _reference(ref, at)], 4, save_steps=1, save_total_limit=1,
            learning_rate=3.0, eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
            metric_for_best_model="eval_chosen", greater_is_better=False,
        )  # fmt: skip
        trainer.train(resume_from_checkpoint=resume)
        return trainer, load_file(tmp_path / f"{name}.safetensors"), at, seen

    trainer, exported, at, seen = run("full")
    run_dir = tmp_path / "run"
    assert trainer.state.best_model_checkpoint == str(run_dir / "checkpoint-2")
    assert sorted(p.name for p in run_dir.iterdir()) == ["checkpoint-2"]  # the Trainer kept the best one only
    assert all(torch.equal(exported[n], t) for n, t in at[2].items())
    assert all(torch.equal(seen[4][n], t) for n, t in at[4].items())  # the uninterrupted run's final EMA
    for folder in run_dir.iterdir():
        step = int(folder.name.removeprefix("checkpoint-"))
        saved = fe.load(trainer.model, folder, "ema")
        assert int(saved.step) == step and all(torch.equal(saved.ema[n], t) for n, t in at[step].items()), folder
    _, again, _, resumed = run("resumed", resume=str(run_dir / "checkpoint-2"))
    assert sorted(resumed) == [3, 4] and all(torch.equal(resumed[4][n], t) for n, t in seen[4].items())
    assert all(torch.equal(again[n], t) for n, t in exported.items())  # still the best checkpoint's (step 2) EMA


def test_a_checkpoint_folder_deleted_under_an_async_ema_save_is_named_with_the_cause(tmp_path, monkeypatch):
    """A checkpoint folder deleted by something else while its EMA is written in the background (here a callback
    after EMACallback): the failure is a CheckpointError naming the folder and the cause, not the background's raw
    FileNotFoundError, whether the next save (step 2) or the end of training (step 1, the last) meets it."""
    from transformers import TrainerCallback

    from functional_ema.checkpoint import CheckpointError
    from functional_ema.integrations.transformers import EMACallback

    _slow_background_writes(monkeypatch)

    class Deleting(TrainerCallback):
        def on_save(self, args, state, control, **kwargs):
            if state.global_step == 1:
                shutil.rmtree(Path(args.output_dir) / "checkpoint-1")

    for name, steps in (("next_save", 2), ("train_end", 1)):
        ema = EMACallback(decay=0.7, async_save=True)
        trainer = _plain_trainer(tmp_path / name, [ema, Deleting()], steps, save_steps=1)
        folder = tmp_path / name / "checkpoint-1"
        with pytest.raises(CheckpointError) as failed:
            trainer.train()
        assert not isinstance(failed.value, FileNotFoundError), name
        assert str(failed.value).startswith(
            f"the async EMA save of step 1 into {folder / 'ema'} failed: {folder} was deleted while the EMA was being "
            "written into it in the background (FileNotFoundError: "
        ), (name, str(failed.value))
        assert "resume from another one" in str(failed.value)


def test_an_ema_metric_named_as_another_datasets_live_one_is_refused(tmp_path):
    """trainer.evaluate({"b": B, "ema_b": E}): B's EMA metrics (eval_ema_b_*) would be E's live ones. Refused at the
    call's first dataset, whichever comes first, naming both datasets and metric_prefix, before any EMA metric is
    logged; the Trainer's own dict of datasets too."""
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import RegressionData

    b, e = RegressionData(16, seed=3), RegressionData(16, seed=4)
    trainer = _one_process_trainer(tmp_path, [EMACallback(decay=0.7, start_step=0)], {"b": b, "ema_b": e})
    trainer.args.eval_strategy = "no"  # trained without evaluating; then each call below
    trainer.train()
    for datasets in ({"b": b, "ema_b": e}, {"ema_b": e, "b": b}, None):
        with pytest.raises(ValueError, match=r"metric_prefix='eval_ema': the EMA metrics of dataset 'b' \(eval_ema_b_\*\)"
                           r" would take the names of the live metrics of dataset 'ema_b'"):  # fmt: skip
            trainer.evaluate(datasets)
    # Logged: the live metrics only (E's are named eval_ema_b_*), no EMA metric of either dataset.
    assert not any(k.startswith("eval_ema_ema_b") for h in trainer.state.log_history for k in h)
    assert close(_logged(trainer, "eval_ema_b_loss"), [_loss(trainer.model, e)])  # the call evaluating "ema_b" first
    m = trainer.evaluate({"b": b, "e": e})  # no clash: answered
    assert {"eval_ema_b_loss", "eval_ema_e_loss", "eval_b_loss", "eval_e_loss"} <= set(m)


def test_a_tag_or_export_path_the_trainer_would_collide_with_is_refused_at_construction(tmp_path):
    """A tag named like a file the Trainer writes into each checkpoint folder, and an export_path that is a folder,
    are refused when the callback is built, not at the first save or after the whole run; the export_path refusal
    is the end-of-training one, word for word."""
    from functional_ema.checkpoint import InvalidTagError, OutputPathError
    from functional_ema.integrations.transformers import EMACallback

    for tag in ("model.safetensors", "trainer_state.json", "rng_state.pth", "scheduler.pt", "optimizer.pt",
                "training_args.bin", "config.json", "spiece.model", "pytorch_model_fsdp_0"):  # fmt: skip
        with pytest.raises(InvalidTagError, match=rf"tag='{tag}' (looks like a file name|is the name of a folder)"):
            EMACallback(decay=0.9, tag=tag)
    assert EMACallback(decay=0.9, tag="ema_best").ema.tag == "ema_best"
    (tmp_path / "final").mkdir()
    for folder in (tmp_path / "final", Path("/"), Path("/tmp")):
        message = f"export_path: refusing to write {folder}: it is a directory; give a .safetensors file name"
        with pytest.raises(OutputPathError) as refused:
            EMACallback(decay=0.9, export_path=folder)
        assert str(refused.value) == message
    assert EMACallback(decay=0.9, export_path=tmp_path / "final.safetensors").ema.export_path is not None


def test_the_trainers_own_callbacks_do_not_hear_the_ema_evaluations_event(tmp_path, monkeypatch):
    """The EMA evaluation's own ``on_evaluate`` goes to the user's callbacks before ``EMACallback`` only: the
    Trainer's flow and progress callbacks (DefaultFlowCallback, PrinterCallback here) and a ``report_to``
    integration, which come first in the handler's list, hear one ``on_evaluate`` per evaluation (the live one; a
    progress bar would write an extra row, Comet's checkpoint logging would fail), and still get ``on_log`` of the
    EMA metrics; a user's callback placed before ``EMACallback`` hears the inner event with the EMA metrics."""
    from transformers import Trainer, TrainerCallback
    from transformers.integrations import integration_utils
    from transformers.trainer_callback import DefaultFlowCallback, PrinterCallback

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import RegressionData, cpu_training_args, quiet

    quiet()

    class Recording(TrainerCallback):
        def __init__(self):
            self.evaluated, self.logged = [], []

        def on_evaluate(self, args, state, control, metrics=None, **kwargs):
            self.evaluated.append((state.global_step, "eval_ema_loss" in metrics))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.logged.append((state.global_step, "eval_ema_loss" in logs))

    class Reporting(Recording):  # made by the Trainer from report_to, as its reporting integrations are
        pass

    monkeypatch.setitem(integration_utils.INTEGRATION_TO_CALLBACK, "recording_integration", Reporting)
    user = Recording()
    args = cpu_training_args(
        tmp_path / "run", max_steps=3, eval_strategy="steps", eval_steps=1, report_to=["recording_integration"]
    )
    torch.manual_seed(0)
    trainer = Trainer(
        model=_DropNet(),
        args=args,
        train_dataset=RegressionData(32, seed=1),
        eval_dataset=RegressionData(8, seed=2),
        callbacks=[user, EMACallback(decay=0.9, eval_index=0)],
    )
    handler = trainer.callback_handler
    reporting = next(c for c in handler.callbacks if isinstance(c, Reporting))
    heard: dict[str, list[int]] = {}
    for cls in (DefaultFlowCallback, PrinterCallback):
        (own,) = [c for c in handler.callbacks if type(c) is cls]
        inner = own.on_evaluate

        def on_evaluate(args, state, control, _inner=inner, _name=cls.__name__, **kwargs):
            heard.setdefault(_name, []).append(state.global_step)
            return _inner(args, state, control, **kwargs)

        own.on_evaluate = on_evaluate  # recorded on the instance: the handler calls it by name
    assert handler.callbacks.index(reporting) < handler.callbacks.index(user)  # the Trainer's own come first
    trainer.train()
    assert heard == {"DefaultFlowCallback": [1, 2, 3], "PrinterCallback": [1, 2, 3]}  # one event per evaluation
    assert reporting.evaluated == [(1, False), (2, False), (3, False)]  # the live event only
    assert (1, True) in reporting.logged and (3, True) in reporting.logged  # the EMA metrics logged to it
    assert user.evaluated == [(s, m) for s in (1, 2, 3) for m in (False, True)]  # live event, then the EMA one
