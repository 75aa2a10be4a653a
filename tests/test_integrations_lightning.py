"""PyTorch Lightning at 2 real CPU ranks: DDP, FSDP2 (``ModelParallelStrategy``) and DeepSpeed ZeRO-2/3;
at 4, FSDP2 over tensor parallelism (``ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)``).

Each run: gradient accumulation 2, two EMAs (a float decay and a power schedule), every 2 steps,
started after step K, buffers averaged (DDP, DeepSpeed). Checked against a reference EMA of the full
fp32 weights through the engine's own API (the DDP parameters, FSDP2 ``full_tensor()``, DeepSpeed
``safe_get_full_fp32_param``) taken once per optimizer step: bitwise. Validation logs the EMA's loss
(different from the live one). A run killed after its epoch-2 checkpoint and resumed in fresh
processes from that checkpoint ends with the uninterrupted run's EMA, bitwise.

The start rule (in the DDP launch, after its run): one trajectory trained at accumulation 1 and 2
(the same micro-batch twice) gives the same EMA, bitwise, started after optimizer step 1 (or step
K) as a reference EMA, although under accumulation the callback also sees step 0.

Lightning's ``DeepSpeedStrategy`` refuses CPU ("only supported on CUDA GPUs"): the DeepSpeed runs use
``CPUDeepSpeedStrategy`` below, a test-only subclass that lifts that check.
"""

from __future__ import annotations

import json
import os
import re
import time
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

from functional_ema._testing.multirank import run_ranks

START = 2
EVERY = 2
EPOCHS = 4  # 2 optimizer steps per epoch: 8 steps


def _decays():
    import functional_ema as fe

    return [0.8, fe.schedules.power(gamma=3.0)]


def _strategy(kind: str):
    import lightning.pytorch as pl

    if kind == "ddp":
        return pl.strategies.DDPStrategy(process_group_backend="gloo")
    if kind == "fsdp2":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    if kind == "fsdp2_tp":
        return pl.strategies.ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2)
    stage = int(kind[-1])
    return _cpu_deepspeed_strategy()(
        stage=stage,
        process_group_backend="gloo",
        logging_batch_size_per_gpu=4,
        params_buffer_count=0,
        allgather_bucket_size=1e6,
        reduce_bucket_size=1e6,
    )


def _cpu_deepspeed_strategy():
    """DeepSpeedStrategy on CPU, for tests only: Lightning refuses anything but CUDA."""
    from lightning.pytorch.strategies import DeepSpeedStrategy
    from lightning.pytorch.strategies.ddp import DDPStrategy

    class CPUDeepSpeedStrategy(DeepSpeedStrategy):
        def setup_environment(self) -> None:  # skip DeepSpeedStrategy's CUDA-only check
            DDPStrategy.setup_environment(self)

        def setup_distributed(self) -> None:  # skip the CUDA device-index check (CPU devices have none)
            from lightning.fabric.utilities.seed import reset_seed

            reset_seed()
            self.set_world_ranks()
            self._init_deepspeed_distributed()

        @property
        def root_device(self) -> torch.device:  # DeepSpeed takes root_device.index as its device rank
            return torch.device("cpu", self.local_rank)

    return CPUDeepSpeedStrategy


def _module(kind: str):
    import lightning.pytorch as pl

    from tests._integration_models import BNNet, RegressionData

    class LitNet(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            # under tensor parallelism 14 hidden units: DTensor's colwise -> rowwise needs an even split
            self.net = _NoBN(14 if kind.startswith("fsdp2_tp") else 13) if kind.startswith("fsdp2") else BNNet()

        def configure_model(self):
            if kind in ("fsdp2", "fsdp2_tp") and not getattr(self, "_sharded", False):
                from torch.distributed.fsdp import fully_shard

                if kind == "fsdp2_tp":
                    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

                    parallelize_module(
                        self.net,
                        self.device_mesh["tensor_parallel"],
                        {"inp": ColwiseParallel(), "mid": RowwiseParallel()},
                    )
                mesh = self.device_mesh["data_parallel"]
                for m in (self.net.inp, self.net.mid):
                    fully_shard(m, mesh=mesh)
                fully_shard(self.net, mesh=mesh)  # the root is the network Lightning calls, not the LightningModule
                self._sharded = True

        def training_step(self, batch, batch_idx):
            return self.net(batch["x"], batch["labels"])["loss"]

        def validation_step(self, batch, batch_idx):
            loss = self.net(batch["x"], batch["labels"])["loss"]
            self.log("val_loss", loss, sync_dist=True)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RegressionData(32, seed=1), batch_size=4, shuffle=False)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(RegressionData(16, seed=2), batch_size=8, shuffle=False)

    return LitNet()


class _NoBN(torch.nn.Module):
    """FSDP2 variant of the test net: uneven sizes, no BatchNorm."""

    def __init__(self, hidden: int = 13):
        super().__init__()
        self.inp = torch.nn.Linear(7, hidden)
        self.mid = torch.nn.Linear(hidden, 11)
        self.out = torch.nn.Linear(11, 5)

    def forward(self, x, labels=None):
        y = self.out(torch.tanh(self.mid(torch.tanh(self.inp(x)))))
        return {"loss": ((y - labels) ** 2).mean(), "logits": y}


def _full_weights(trainer, kind: str) -> dict:
    from tests._integration_models import deepspeed_full_fp32

    if kind.startswith("zero"):
        return deepspeed_full_fp32(trainer.strategy.model)
    out = {}
    for n, p in trainer.lightning_module.named_parameters():
        if p.requires_grad:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
            out[n] = t.detach().clone().float()
    return out


def _reference_callback(ref, kind: str):
    import lightning.pytorch as pl

    from tests._integration_models import float_buffers

    class Reference(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if ref.due(trainer.global_step):
                import functional_ema as fe

                bufs = (
                    None
                    if kind.startswith("fsdp2")
                    else float_buffers(fe.engines.adapter_for(trainer.strategy.model).module())
                )
                ref.feed(trainer.global_step, _full_weights(trainer, kind), bufs)

    return Reference()


class _Killed(Exception):
    pass


# A Trainer that prints nothing and runs no sanity validation (every Trainer here).
QUIET = {"logger": False, "enable_progress_bar": False, "enable_model_summary": False, "num_sanity_val_steps": 0}


def _trainer(kind: str, root: str, callbacks, max_epochs: int = EPOCHS, export: str | None = None):
    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback

    ema = EMACallback(
        decay=_decays(),
        start_step=START,
        every_n_steps=EVERY,
        buffers=None if kind.startswith("fsdp2") else "average",
        export_path=export,
    )
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), every_n_epochs=1, save_top_k=-1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=_world(kind),
        num_nodes=1,
        strategy=_strategy(kind),
        max_epochs=max_epochs,
        accumulate_grad_batches=2,
        callbacks=[ema, ckpt, *callbacks],
        **QUIET,
        default_root_dir=root,
        deterministic=False,
        use_distributed_sampler=True,
    )
    return trainer, ema


def lightning_worker(kind: str, out: str, phase: str) -> dict:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from safetensors.torch import load_file, save_file

    import functional_ema as fe
    from tests._integration_models import ReferenceEMA, equal, max_diff, quiet

    quiet()
    rank = dist.get_rank()
    report: dict = {"kind": kind}
    root = os.path.join(out, phase if phase != "resume" else "interrupted")
    if phase == "full":
        ref = ReferenceEMA(_decays(), start=START, every=EVERY)
        val_losses: list = []

        class Record(pl.Callback):
            def on_validation_epoch_end(self, trainer, pl_module):
                # runs after the EMA callback's hook (callbacks in order): the logged metric is the EMA's
                val_losses.append(float(trainer.callback_metrics["val_loss"]))

        trainer, ema = _trainer(
            kind, root, [_reference_callback(ref, kind), Record()], export=os.path.join(out, "export.safetensors")
        )
        module = _module(kind)
        trainer.fit(module)
        target = trainer.strategy.model
        report["target"] = type(target).__name__
        part = fe.shard_layout(target).part
        report["layout"] = [part.tp, part.tp_size, fe.shard_layout(target).world_size]
        report["global_step"] = trainer.global_step
        report["ema_step"] = int(ema.state.step)
        full = [fe.gather_full(ema.state, target, index=k, join_parts=True) for k in range(2)]
        report["bitwise"] = [equal(full[k], ref.emas[k]) for k in range(2)]
        report["max_diff"] = [max_diff(full[k], ref.emas[k]) for k in range(2)]
        live = _full_weights(trainer, kind)
        report["ema_differs_from_live"] = not equal(full[0], live)
        # the EMA validation loss, recomputed by hand from the reference EMA on rank 0's batch
        report["val_losses"] = val_losses
        if ema.ema.buffer_state is not None:
            report["buffers_bitwise"] = [equal(ema.ema.buffer_state.emas[k], ref.buffers[k]) for k in range(2)]
        report["ckpts"] = sorted(p.name for p in Path(root, "ckpt").iterdir())
        if rank == 0:
            save_file(
                {f"{k}.{n}": t.contiguous() for k in range(2) for n, t in full[k].items()},
                os.path.join(out, "final.safetensors"),
            )
        strip = lambda n: n.removeprefix("_forward_module.")  # noqa: E731 - Lightning's DeepSpeed wrapper
        exported = load_file(os.path.join(out, "export.safetensors"))
        report["export_equal"] = all(torch.equal(exported[strip(n)], ref.emas[0][n]) for n in ref.emas[0])
        net = _module(f"{kind}-plain" if kind.startswith("fsdp2") else "plain")
        report["export_strict"] = str(net.load_state_dict(exported, strict=True))
        # The EMA's validation loss computed independently on this rank's half of the data, by a
        # plain twin loaded with the export and this rank's buffer EMA: DeepSpeed does not
        # synchronise BatchNorm statistics between ranks, while DDP broadcasts rank 0's at every
        # forward (the export holds rank 0's).
        bs = ema.ema.buffer_state
        if bs is not None and kind != "ddp":
            net.load_state_dict(
                {**exported, **{strip(n): t for n, t in {**bs.emas[0], **bs.copied}.items()}}, strict=True
            )
        from tests._integration_models import RegressionData

        net.eval()
        vd = RegressionData(16, seed=2)
        dp_rank = rank // 2 if kind == "fsdp2_tp" else rank  # the tensor-parallel ranks of one group share its data
        idx = list(range(dp_rank, 16, 2))  # DistributedSampler without shuffle; one batch of 8 per rank
        with torch.no_grad():
            report["twin_val_loss"] = float(net.net(vd.x[idx], vd.y[idx])["loss"])
        if kind == "ddp":
            t0 = time.perf_counter()
            report["start_rule"] = _start_rule(rank)
            report["start_rule_seconds"] = time.perf_counter() - t0
    elif phase == "interrupted":

        class Kill(pl.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if trainer.global_step == 5:
                    raise _Killed()

        trainer, ema = _trainer(kind, root, [Kill()])
        try:
            trainer.fit(_module(kind))
            report["killed"] = False
        except _Killed:
            report["killed"] = True
        report["ckpts"] = sorted(p.name for p in Path(root, "ckpt").iterdir())
    elif phase == "resume":
        trainer, ema = _trainer(kind, root, [])
        ckpt = os.path.join(root, "ckpt", "epoch=1-step=4.ckpt")
        trainer.fit(_module(kind), ckpt_path=ckpt)
        target = trainer.strategy.model
        full = [fe.gather_full(ema.state, target, index=k, join_parts=True) for k in range(2)]
        want = load_file(os.path.join(out, "final.safetensors"))
        report["bitwise_vs_uninterrupted"] = [
            equal(full[k], {n[2:]: t for n, t in want.items() if n.startswith(f"{k}.")}) for k in range(2)
        ]
        report["ema_step"] = int(ema.state.step)
    return report


def _start_rule(rank: int) -> dict:
    """DDP, RULE_STEPS optimizer steps at accumulation 1 and 2 (each micro-batch twice), EMAs
    started at step 0 and at RULE_START; compared by tests._integration_models.start_rule_report."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import (
        RULE_START,
        RULE_STEPS,
        ReferenceEMA,
        RegressionData,
        record_start,
        start_rule_report,
    )

    data = RegressionData(4 * RULE_STEPS, seed=10 + rank)
    batches = [{"x": data.x[4 * j : 4 * j + 4], "labels": data.y[4 * j : 4 * j + 4]} for j in range(RULE_STEPS)]
    runs = {}
    for ga in (1, 2):
        callbacks, emas, refs, seen = [], {}, {}, {}
        for k in (0, RULE_START):
            # two EMA callbacks in one trainer need distinct state keys (Lightning refuses duplicates)
            cls = type(
                f"EMACallbackStart{k}", (EMACallback,), {"state_key": property(lambda self, k=k: f"EMA[start={k}]")}
            )
            emas[k] = cls(decay=_decays(), start_step=k)
            refs[k] = ReferenceEMA(_decays(), start=max(1, k))
            seen[k] = record_start(emas[k].ema)
            callbacks += [emas[k], _reference_callback(refs[k], "ddp")]
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            num_nodes=1,
            strategy=_strategy("ddp"),
            max_steps=RULE_STEPS,
            max_epochs=1,
            accumulate_grad_batches=ga,
            callbacks=callbacks,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            default_root_dir=None,
            use_distributed_sampler=False,
        )
        module = _module("fsdp2-plain")  # no BatchNorm: its statistics would see each micro-batch twice
        start_weights = {n: p.detach().clone() for n, p in module.named_parameters()}
        trainer.fit(
            module,
            train_dataloaders=torch.utils.data.DataLoader([b for b in batches for _ in range(ga)], batch_size=None),
        )
        assert trainer.global_step == RULE_STEPS, trainer.global_step
        target = trainer.strategy.model
        runs[ga] = {
            "weights": _full_weights(trainer, "ddp"),
            "start_weights": start_weights,
            "refs": refs,
            "seen": seen,
            "emas": {k: [fe.gather_full(e.state, target, index=i) for i in range(2)] for k, e in emas.items()},
        }
    return start_rule_report(runs)


def _world(kind: str) -> int:
    return 4 if kind == "fsdp2_tp" else 2


def _run(kind: str, tmp_path, resume: bool = True):
    """The full run (bitwise, buffers, export, the EMA-swapped validation); with ``resume``, also a run killed
    mid-way and resumed (bitwise against the full run): ZeRO-3, FSDP2 and FSDP2 x TP resume, DDP and ZeRO-2
    (the same callback paths as ZeRO-3's) run only the full launch, to keep the suite's time."""
    out = str(tmp_path)
    full = run_ranks(
        "tests.test_integrations_lightning:lightning_worker",
        world_size=_world(kind),
        timeout=600,
        kind=kind,
        out=out,
        phase="full",
    )
    print(json.dumps(full[0]))
    for r in full:
        assert r["global_step"] == 2 * EPOCHS and r["ema_step"] == 2 * EPOCHS
        assert r["bitwise"] == [True, True], r["max_diff"]
        assert r["ema_differs_from_live"]
        assert len(r["val_losses"]) == EPOCHS
        if not kind.startswith("fsdp2"):
            assert r["buffers_bitwise"] == [True, True]
        assert r["export_equal"] is True
        assert r["export_strict"] == "<All keys matched successfully>"
    # the last validation ran with the EMA swapped in: its logged loss (mean over ranks) is the twins'
    twin = sum(r["twin_val_loss"] for r in full) / len(full)
    assert abs(full[0]["val_losses"][-1] - twin) < 1e-5, (full[0]["val_losses"], twin)
    if not resume:
        return full, [], []
    killed = run_ranks(
        "tests.test_integrations_lightning:lightning_worker",
        world_size=_world(kind),
        timeout=600,
        kind=kind,
        out=out,
        phase="interrupted",
    )
    assert all(r["killed"] for r in killed)
    resumed = run_ranks(
        "tests.test_integrations_lightning:lightning_worker",
        world_size=_world(kind),
        timeout=600,
        kind=kind,
        out=out,
        phase="resume",
    )
    for r in resumed:
        assert r["ema_step"] == 2 * EPOCHS
        assert r["bitwise_vs_uninterrupted"] == [True, True]
    return full, killed, resumed


def test_lightning_ddp(tmp_path):
    from tests._integration_models import check_start_rule

    full, _, _ = _run("ddp", tmp_path, resume=False)
    for r in full:
        check_start_rule(r["start_rule"], calls_at_0=True)


def test_lightning_fsdp2(tmp_path):
    pytest.importorskip("torch.distributed.fsdp")
    _run("fsdp2", tmp_path)


def test_lightning_model_parallel_fsdp2_over_tensor_parallel(tmp_path):
    """ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=2) at 4 ranks: the EMA joined from
    the tensor-parallel parts is the reference's, the export is the whole model's, the resume bitwise."""
    pytest.importorskip("torch.distributed.fsdp")
    full, _, _ = _run("fsdp2_tp", tmp_path)
    assert [r["layout"] for r in full] == [[0, 2, 2], [1, 2, 2], [0, 2, 2], [1, 2, 2]], [r["layout"] for r in full]


@pytest.mark.parametrize("stage", [2, 3])
def test_lightning_deepspeed_cpu(tmp_path, stage):
    _run(f"zero{stage}", tmp_path, resume=stage == 3)


def _one_process_trainer(root: Path, max_epochs: int, every_n_steps: int = 1):
    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback

    ema = EMACallback(decay=0.9, every_n_steps=every_n_steps, buffers="average")
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1, save_top_k=-1)
    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=[ema, ckpt],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )


def test_ema_folder_of_another_checkpoint_refused(tmp_path):
    """One process, no ranks: a ``.ckpt.ema`` folder that is not the one saved with the checkpoint is refused
    at resume, naming both steps: one of another epoch (its record names another framework step), and one of
    another run at the same step (the callback state inside the ``.ckpt`` names another EMA step)."""
    import shutil

    import functional_ema as fe
    from tests._integration_models import quiet

    quiet()
    _one_process_trainer(tmp_path / "a", 2).fit(_module("ddp"))  # 8 optimizer steps per epoch
    ck = tmp_path / "a" / "ckpt"
    first, second = ck / "epoch=0-step=8.ckpt", ck / "epoch=1-step=16.ckpt"
    assert (Path(str(first) + ".ema") / "ema" / "ema_manifest.json").is_file()
    shutil.rmtree(str(second) + ".ema")
    shutil.copytree(str(first) + ".ema", str(second) + ".ema")
    with pytest.raises(
        fe.CheckpointError, match="saved with the checkpoint of framework step 8, but the training resumed at step 16"
    ):
        _one_process_trainer(tmp_path / "a", 3).fit(_module("ddp"), ckpt_path=str(second))
    # Another run (updating every 3 steps: its EMA is at step 15 at step 16) beside this run's step-16 checkpoint.
    _one_process_trainer(tmp_path / "b", 2, every_n_steps=3).fit(_module("ddp"))
    _one_process_trainer(tmp_path / "c", 2).fit(_module("ddp"))
    theirs, ours = (
        tmp_path / "b" / "ckpt" / "epoch=1-step=16.ckpt.ema",
        tmp_path / "c" / "ckpt" / "epoch=1-step=16.ckpt.ema",
    )
    shutil.rmtree(ours)
    shutil.copytree(theirs, ours)
    with pytest.raises(fe.CheckpointError, match=r"own EMACallback state says the EMA was at step 16 .* at step 15"):
        _one_process_trainer(tmp_path / "c", 3, every_n_steps=3).fit(
            _module("ddp"), ckpt_path=str(ours)[: -len(".ema")]
        )
    # Untouched, it resumes.
    _one_process_trainer(tmp_path / "b", 3, every_n_steps=3).fit(_module("ddp"), ckpt_path=str(theirs)[: -len(".ema")])


def test_resume_from_a_save_last_link_equals_the_uninterrupted_run(tmp_path):
    """``ModelCheckpoint(save_last="link")`` makes ``last.ckpt`` a symbolic link to the newest checkpoint without
    saving it; ``fit(ckpt_path="last")`` reads the EMA saved beside the link's target, and the resumed run ends with
    the uninterrupted run's EMA, bitwise."""
    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()

    def fit(root: Path, max_epochs: int, ckpt_path: str | None = None) -> EMACallback:
        ema = EMACallback(decay=0.9, buffers="average")
        ckpt = pl.callbacks.ModelCheckpoint(
            dirpath=str(root / "ckpt"), every_n_epochs=1, save_top_k=-1, save_last="link"
        )
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=max_epochs,
            callbacks=[ema, ckpt],
            default_root_dir=str(root),
            **QUIET,
        )
        trainer.fit(_module("ddp"), ckpt_path=ckpt_path)
        return ema

    whole = fit(tmp_path / "whole", 3)
    fit(tmp_path / "cut", 2)
    last = tmp_path / "cut" / "ckpt" / "last.ckpt"
    assert last.is_symlink() and not Path(str(last) + ".ema").exists()
    resumed = fit(tmp_path / "cut", 3, ckpt_path="last")
    assert resumed.state is not None and whole.state is not None
    assert int(resumed.state.step) == int(whole.state.step) == 24
    assert all(torch.equal(resumed.state.ema[n], t) for n, t in whole.state.ema.items())
    got, want = resumed.ema.buffer_state, whole.ema.buffer_state
    assert got is not None and want is not None
    assert all(torch.equal(got.emas[0][n], t) for n, t in want.emas[0].items())


def test_a_validation_before_the_ema_starts_warns_once(tmp_path):
    """A validation before the EMA starts evaluates the live weights under the metric names the EMA's validations use
    later: one ``UserWarning`` names start_step and the step of that validation (8 optimizer steps per epoch: the
    validations at steps 8 and 16, the EMA started after step 10); none when the EMA has started by the first one."""
    import warnings

    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    for start, expected in ((10, 1), (8, 0)):
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_epochs=2,
            callbacks=[EMACallback(decay=0.9, start_step=start)],
            enable_checkpointing=False,
            default_root_dir=str(tmp_path),
            **QUIET,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_module("ddp"))
        seen = [
            str(w.message) for w in caught if w.category is UserWarning and "before the EMA starts" in str(w.message)
        ]
        assert len(seen) == expected, seen
        if expected:
            assert "the validation at step 8 runs before the EMA starts (start_step=10" in seen[0], seen[0]


def _finetuned_module():
    """A ``backbone`` that Lightning's ``BackboneFinetuning`` freezes at setup and unfreezes at epoch 1, and a head."""
    import lightning.pytorch as pl

    from tests._integration_models import RegressionData

    class Finetuned(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.backbone = torch.nn.Linear(7, 9)
            self.head = torch.nn.Linear(9, 5)

        def training_step(self, batch, batch_idx):
            return ((self.head(torch.tanh(self.backbone(batch["x"]))) - batch["labels"]) ** 2).mean()

        def configure_optimizers(self):  # the trainable ones, as BackboneFinetuning's docs say
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RegressionData(16, seed=1), batch_size=4, shuffle=False)

    return Finetuned()


def _finetuning_trainer(root: Path, max_epochs: int, ref, start=None):
    """One process: the EMA callback, ``BackboneFinetuning``, a checkpoint every epoch, and a reference EMA of every
    parameter (frozen or not) fed after each optimizer step; ``start``: the reference snapshot a resume continues."""
    import copy

    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback

    class Reference(pl.Callback):
        def __init__(self):
            self.ref, self.at = (copy.deepcopy(start) if start is not None else ref), {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ref.feed(trainer.global_step, {n: p.detach() for n, p in pl_module.named_parameters()})
            self.at[trainer.global_step] = copy.deepcopy(self.ref)

    reference = Reference()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=[
            EMACallback(decay=0.9),
            pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1),
            pl.callbacks.ModelCheckpoint(dirpath=str(root / "ckpt"), every_n_epochs=1, save_top_k=-1),
            reference,
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=str(root),
    )
    return trainer, reference


def test_backbone_finetuning_unfreezes_into_the_ema(tmp_path, recwarn):
    """Lightning's own ``BackboneFinetuning``: the backbone, frozen at setup, joins the EMA when the callback
    unfreezes it (epoch 1, before its first optimizer step), and the EMA equals, bitwise, a reference of every
    parameter averaged from step 1 (frozen ones are constant); no warning. Resumed from the epoch-0 checkpoint (no
    backbone in its EMA), the run equals the uninterrupted one. Resumed from the epoch-1 checkpoint, Lightning leaves the
    backbone frozen (its setup freezes it and only epoch 1 unfreezes it): the EMA keeps it, read although frozen, and
    equals the reference continued over that run."""
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import ReferenceEMA, quiet

    quiet()
    trainer, reference = _finetuning_trainer(tmp_path, 3, ReferenceEMA([0.9]))
    trainer.fit(_finetuned_module())
    ema = next(c for c in trainer.callbacks if isinstance(c, EMACallback)).ema
    assert int(ema.state.step) == 12 and set(ema.state.ema) == set(reference.ref.emas[0])
    assert all(torch.equal(ema.state.ema[n], t) for n, t in reference.ref.emas[0].items())
    assert trainer.lightning_module.backbone.weight.requires_grad
    assert not [w for w in recwarn if "EMA" in str(w.message)]
    ck = tmp_path / "ckpt"
    for epoch, step, trained in ((0, 4, True), (1, 8, False)):
        again, ref_again = _finetuning_trainer(tmp_path / f"from{step}", 3, None, start=reference.at[step])
        again.fit(_finetuned_module(), ckpt_path=str(ck / f"epoch={epoch}-step={step}.ckpt"))
        got = next(c for c in again.callbacks if isinstance(c, EMACallback)).ema.state
        assert again.lightning_module.backbone.weight.requires_grad is trained
        assert all(torch.equal(got.ema[n], t) for n, t in ref_again.ref.emas[0].items()), step
        assert set(got.ema) == set(ref_again.ref.emas[0])
        if trained:  # the same trajectory as the uninterrupted run
            assert all(torch.equal(got.ema[n], t) for n, t in ema.state.ema.items())


def backbone_ddp_worker(root: str) -> dict:
    """``BackboneFinetuning`` under ``strategy="ddp"`` (Lightning issue #20340): the backbone is frozen when Lightning
    wraps the model, so DDP never all-reduces it. Returns the ``UnsyncedReplicasWarning`` texts seen and whether the
    ranks agree, at the end, on the backbone and on the head."""
    import warnings

    import lightning.pytorch as pl
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy("ddp"),
        max_epochs=2,
        callbacks=[EMACallback(decay=0.9), pl.callbacks.BackboneFinetuning(unfreeze_backbone_at_epoch=1)],
        enable_checkpointing=False,
        **QUIET,
        default_root_dir=root,
        use_distributed_sampler=True,
    )
    module = _finetuned_module()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module)

    def agree(t: torch.Tensor) -> bool:
        seen = [torch.empty_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(seen, t.detach().contiguous())
        return torch.equal(seen[0], seen[1])

    return {
        "warnings": [str(w.message) for w in caught if w.category is fe.UnsyncedReplicasWarning],
        "agree": [agree(module.backbone.weight), agree(module.head.weight)],
        "trains_backbone": module.backbone.weight.requires_grad,
    }


def test_backbone_finetuning_under_ddp_warns_that_the_ranks_drift(tmp_path):
    """The warning reaches a Lightning user in the flow that needs it, and its claim holds: after the unfreezing the
    ranks' backbones differ (DDP does not reduce it) while their heads agree."""
    reports = run_ranks(
        "tests.test_integrations_lightning:backbone_ddp_worker", world_size=2, timeout=300, root=str(tmp_path)
    )
    for r in reports:
        assert r["trains_backbone"] and r["agree"] == [False, True], r
        assert len(r["warnings"]) == 1, r["warnings"]
        text = r["warnings"][0]
        assert "trains 4 parameters but all-reduces the gradients of 2" in text, text
        assert "(new in this reading: 'backbone.weight', 'backbone.bias')" in text, text


def _tiny_module(save_in_validation: str | None = None):
    """A linear network without dropout or batch norm (its losses are plain functions of its weights), logging
    ``val_loss`` and ``test_loss`` over two batches of 8; ``save_in_validation``: a checkpoint path the first
    validation step saves to (``trainer.save_checkpoint`` inside the EMA evaluation)."""
    import lightning.pytorch as pl

    from tests._integration_models import RegressionData

    class Tiny(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.Tanh(), torch.nn.Linear(12, 5))

        def loss(self, batch):
            return torch.nn.functional.mse_loss(self.net(batch["x"]), batch["labels"])

        def training_step(self, batch, batch_idx):
            return self.loss(batch)

        def validation_step(self, batch, batch_idx):
            if save_in_validation is not None and batch_idx == 0:
                self.trainer.save_checkpoint(save_in_validation)
            self.log("val_loss", self.loss(batch))

        def test_step(self, batch, batch_idx):
            self.log("test_loss", self.loss(batch))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(RegressionData(32, seed=1), batch_size=4)

        def val_dataloader(self):
            return torch.utils.data.DataLoader(RegressionData(16, seed=2), batch_size=8)

        test_dataloader = val_dataloader

    return Tiny()


def _tiny_loss(weights: dict) -> float:
    """The validation (and test) loss of ``_tiny_module`` holding ``weights``: the mean of its two batches'."""
    from tests._integration_models import RegressionData

    module = _tiny_module()
    module.load_state_dict(weights, strict=True)
    data = RegressionData(16, seed=2)
    with torch.no_grad():
        return sum(float(module.loss(data[8 * k : 8 * k + 8])) for k in range(2)) / 2


def _tiny_trainer(root: Path, callbacks: list, max_epochs: int = 1):
    import lightning.pytorch as pl

    return pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=max_epochs,
        callbacks=callbacks,
        default_root_dir=str(root),
        enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks),
        **QUIET,
    )


def test_validate_and_test_with_a_ckpt_path_evaluate_the_ema_saved_beside_it(tmp_path):
    """``validate``/``test(ckpt_path=...)`` after a fit, and on a fresh trainer: the metrics are those of the EMA saved
    beside that checkpoint (not the final EMA in memory, nor the live weights), which is the callback's EMA afterwards;
    the model holds the checkpoint's live weights after each. A checkpoint without an EMA beside it evaluates the live
    weights, with a warning naming it (not the 'before the EMA starts' one)."""
    import shutil
    import warnings

    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback, ema_dir_for
    from tests._integration_models import quiet

    quiet()
    ema = EMACallback(decay=0.8)
    saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_epochs=1, save_top_k=-1)
    trainer, module = _tiny_trainer(tmp_path, [ema, saves], max_epochs=3), _tiny_module()
    trainer.fit(module)
    first = tmp_path / "ckpt" / "epoch=0-step=8.ckpt"
    saved = fe.checkpoint.load_checkpoint(module, ema_dir_for(first), "ema").state
    best, live = fe.gather_full(saved, module), torch.load(first, weights_only=False)["state_dict"]
    assert int(ema.state.step) == 24 and _tiny_loss(best) != pytest.approx(_tiny_loss(live), rel=1e-3)
    got = trainer.validate(module, ckpt_path=str(first), verbose=False)[0]["val_loss"]
    assert got == pytest.approx(_tiny_loss(best), rel=1e-6)
    assert int(ema.state.step) == 8 and all(torch.equal(ema.state.ema[n], t) for n, t in saved.ema.items())
    got = trainer.test(module, ckpt_path=str(first), verbose=False)[0]["test_loss"]
    assert got == pytest.approx(_tiny_loss(best), rel=1e-6)
    assert all(torch.equal(p, live[n]) for n, p in module.state_dict().items())  # swapped out again

    shutil.rmtree(str(tmp_path / "ckpt" / "epoch=1-step=16.ckpt") + ".ema")
    for verb, metric in (("validate", "val_loss"), ("test", "test_loss")):
        fresh = EMACallback(decay=0.8)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = getattr(_tiny_trainer(tmp_path, [fresh]), verb)
            got = run(_tiny_module(), ckpt_path=str(first), verbose=False)[0][metric]
            assert got == pytest.approx(_tiny_loss(best), rel=1e-6), verb
            second = tmp_path / "ckpt" / "epoch=1-step=16.ckpt"
            got = run(_tiny_module(), ckpt_path=str(second), verbose=False)[0][metric]
        live_second = torch.load(second, weights_only=False)["state_dict"]
        assert got == pytest.approx(_tiny_loss(live_second), rel=1e-6), verb
        seen = [str(w.message) for w in caught if w.category is UserWarning and "EMACallback" in str(w.message)]
        assert len(seen) == 1 and f"trainer.{verb}(ckpt_path='{second}')" in seen[0], seen
        assert "no EMA was saved beside that checkpoint" in seen[0], seen
        assert int(fresh.state.step) == 8  # the live evaluation kept the EMA it had


def test_a_save_during_the_ema_validation_writes_the_live_weights(tmp_path):
    """``trainer.save_checkpoint`` inside the EMA validation (a validation_step, and a callback before EMACallback in
    on_validation_epoch_end): the checkpoints hold the live weights bitwise, and the validation goes on with the EMA
    (its loss is the EMA's)."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()

    class SaveAtEpochEnd(pl.Callback):
        def on_validation_epoch_end(self, trainer, pl_module):
            trainer.save_checkpoint(tmp_path / "epoch_end.ckpt")
            self.after = {n: t.detach().clone() for n, t in pl_module.state_dict().items()}

    ema, saver = EMACallback(decay=0.8), SaveAtEpochEnd()
    module = _tiny_module(save_in_validation=str(tmp_path / "in_step.ckpt"))
    trainer = _tiny_trainer(tmp_path, [saver, ema])
    trainer.fit(module)
    live = {n: t.detach().clone() for n, t in module.state_dict().items()}  # 1 epoch: the validation's live weights
    averaged = fe.gather_full(ema.state, module)
    assert _tiny_loss(averaged) != pytest.approx(_tiny_loss(live), rel=1e-3)
    for name in ("in_step.ckpt", "epoch_end.ckpt"):
        written = torch.load(tmp_path / name, weights_only=False)["state_dict"]
        assert sorted(written) == sorted(live) and all(torch.equal(written[n], t) for n, t in live.items()), name
    assert float(trainer.callback_metrics["val_loss"]) == pytest.approx(_tiny_loss(averaged), rel=1e-6)
    assert all(torch.equal(saver.after[n], t) for n, t in averaged.items())  # the EMA swapped in again


@pytest.mark.parametrize(
    "tag",
    ["checkpoint", "Checkpoint", "latest", "zero_to_fp32", "zero_to_fp32.py", ".metadata", "__0_0.distcp", "meta.pt"],
)
def test_tags_named_like_what_lightning_writes_into_a_folder_checkpoint_are_refused(tag):
    """Under the DeepSpeed strategy (and a distributed checkpoint's folder) the EMA goes inside the checkpoint folder,
    beside what Lightning writes there: DeepSpeed's ``checkpoint/`` folder, ``latest`` and ``zero_to_fp32.py``;
    torch.distributed.checkpoint's ``.metadata`` and ``__<rank>_<n>.distcp``, Lightning's ``meta.pt``. A tag named
    like one is refused at construction; plain names are accepted."""
    from functional_ema.checkpoint import InvalidTagError
    from functional_ema.integrations.lightning import EMACallback

    with pytest.raises(InvalidTagError, match=rf"tag[= ]'{re.escape(tag)}' "):
        EMACallback(decay=0.9, tag=tag)
    for ok in ("ema", "ema.v2", "ema_0", "checkpoints", "latest_ema"):
        assert EMACallback(decay=0.9, tag=ok).ema.tag == ok


def test_checkpoint_paths_given_as_file_urls_are_their_local_paths(tmp_path, monkeypatch):
    """``file:///abs/...`` checkpoint paths (Lightning reads and writes them through fsspec) name local files: removing
    such a checkpoint (``remove_checkpoint``, what a rotation calls) removes the EMA beside it; ``fit(ckpt_path="file://...")`` resumes bitwise on the uninterrupted run (EMA and weights);
    ``validate(ckpt_path="file://...")`` evaluates the EMA saved beside it, with no warning; ``save_checkpoint`` to one
    writes the EMA beside it; nothing is written under the working directory (a relative ``file:/...`` folder).
    (``ModelCheckpoint(dirpath="file://...")`` itself writes under the working directory: Lightning's realpath.)"""
    import warnings

    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback, ema_dir_for
    from tests._integration_models import quiet

    quiet()
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    ema, module = EMACallback(decay=0.8), _tiny_module()
    _tiny_trainer(tmp_path / "full", [ema], max_epochs=3).fit(module)
    full, live = fe.gather_full(ema.state, module), {n: t.detach().clone() for n, t in module.state_dict().items()}

    url = (tmp_path / "ckpt").as_uri()
    saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_epochs=1, save_top_k=-1)
    part = _tiny_trainer(tmp_path / "part", [EMACallback(decay=0.8), saves], max_epochs=2)
    part.fit(_tiny_module())
    part.strategy.remove_checkpoint(f"{url}/epoch=0-step=8.ckpt")  # what a rotation calls, given a file:// path
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=1-step=16.ckpt", "epoch=1-step=16.ckpt.ema"], names  # the removed one's EMA with it
    second = f"{url}/epoch=1-step=16.ckpt"
    assert ema_dir_for(second) == tmp_path / "ckpt" / "epoch=1-step=16.ckpt.ema"

    ema, module = EMACallback(decay=0.8), _tiny_module()
    _tiny_trainer(tmp_path / "resumed", [ema], max_epochs=3).fit(module, ckpt_path=second)
    assert all(torch.equal(t, full[n]) for n, t in fe.gather_full(ema.state, module).items())
    assert all(torch.equal(t, live[n]) for n, t in module.state_dict().items())

    fresh = EMACallback(decay=0.8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tiny_trainer(tmp_path / "eval", [fresh]).validate(_tiny_module(), ckpt_path=second, verbose=False)
    assert not [str(w.message) for w in caught if "EMACallback" in str(w.message)]
    assert int(fresh.state.step) == 16
    trainer = _tiny_trainer(tmp_path / "manual", [EMACallback(decay=0.8)])
    trainer.fit(_tiny_module())
    trainer.save_checkpoint((tmp_path / "manual.ckpt").as_uri())
    assert fe.checkpoint.read_manifest(tmp_path / "manual.ckpt.ema", "ema")["step"] == 8
    assert not [str(p) for p in cwd.rglob("*")]  # nothing under a relative file:/ folder


def test_rotation_keeps_a_folder_beside_a_folder_checkpoint(tmp_path):
    """The EMA of a folder checkpoint (DeepSpeed, a distributed FSDP2 checkpoint) lives inside it, so a ``<ckpt>.ema``
    folder beside one is not the callback's: removing the checkpoint (``ModelCheckpoint``'s rotation, through the
    strategy's ``remove_checkpoint``) keeps it. Beside a file checkpoint, the EMA folder goes with the checkpoint."""
    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    saves = pl.callbacks.ModelCheckpoint(
        dirpath=str(tmp_path / "ckpt"), every_n_epochs=1, save_top_k=1, monitor="step", mode="max"
    )
    trainer = _tiny_trainer(tmp_path, [EMACallback(decay=0.8), saves], max_epochs=2)
    trainer.fit(_tiny_module())
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["epoch=1-step=16.ckpt", "epoch=1-step=16.ckpt.ema"], names
    folder = tmp_path / "ckpt" / "dist.ckpt"  # what a distributed checkpoint looks like: a folder
    (folder / "ema").mkdir(parents=True)
    (folder / ".metadata").write_text("x")
    mine = tmp_path / "ckpt" / "dist.ckpt.ema"
    mine.mkdir()
    (mine / "my_eval_results.json").write_text("{}")
    trainer.strategy.remove_checkpoint(str(folder))
    assert not folder.exists() and (mine / "my_eval_results.json").read_text() == "{}"
    trainer.strategy.remove_checkpoint(str(tmp_path / "ckpt" / "epoch=1-step=16.ckpt"))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["dist.ckpt.ema"]


def test_a_save_before_the_ema_update_of_its_step(tmp_path):
    """A callback listed before EMACallback calls ``trainer.save_checkpoint`` in ``on_train_batch_end`` (the optimizer
    stepped, the EMA not updated for that step yet; at the end of the first epoch): the save first gives the EMA that step, so the checkpoint's EMA
    is a plain lerp of the live weights at its step, bitwise, and a resume from it ends on the uninterrupted run's
    EMA. Under manual optimization the save is refused, naming the callback order, before Lightning writes."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback, ema_dir_for
    from tests._integration_models import quiet

    quiet()
    decay = 0.7
    snaps: dict[int, dict] = {}

    class Oracle(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            step = trainer.global_step
            if step in snaps:
                return
            weights = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            before = snaps.get(step - 1)
            snaps[step] = weights if before is None else {n: before[n].lerp(w, 1 - decay) for n, w in weights.items()}

    class SaveAt8(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            if trainer.global_step == 8 and not (tmp_path / "at8.ckpt").exists():
                trainer.save_checkpoint(tmp_path / "at8.ckpt")

    def trainer(callbacks):
        return pl.Trainer(
            accelerator="cpu", devices=1, max_steps=16, callbacks=callbacks, enable_checkpointing=False, **QUIET
        )

    ema, module = EMACallback(decay=decay), _tiny_module()
    trainer([SaveAt8(), ema, Oracle()]).fit(module)
    full, live = fe.gather_full(ema.state, module), {n: t.detach().clone() for n, t in module.state_dict().items()}
    where = ema_dir_for(tmp_path / "at8.ckpt")
    assert fe.checkpoint.read_manifest(where, "ema")["extra"]["framework_step"] == 8
    saved = fe.checkpoint.consolidate(where, "ema")
    assert sorted(saved) == sorted(snaps[8]) and all(torch.equal(saved[n], t) for n, t in snaps[8].items())
    assert all(torch.equal(t, snaps[16][n]) for n, t in full.items())
    resumed, module = EMACallback(decay=decay), _tiny_module()
    trainer([resumed]).fit(module, ckpt_path=str(tmp_path / "at8.ckpt"))
    assert all(torch.equal(t, full[n]) for n, t in fe.gather_full(resumed.state, module).items())
    assert all(torch.equal(t, live[n]) for n, t in module.state_dict().items())

    class Manual(type(_tiny_module())):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

        def training_step(self, batch, batch_idx):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.loss(batch))
            opt.step()

    (tmp_path / "at8.ckpt").unlink()
    with pytest.raises(RuntimeError, match=r"at8\.ckpt'\) at global step 8: .* listed before EMACallback .* Nothing"):
        trainer([SaveAt8(), EMACallback(decay=decay)]).fit(Manual())
    assert not (tmp_path / "at8.ckpt").exists()


def _oracle(decay: float, snaps: dict):
    """A plain EMA of the weights, in ``snaps[step]`` at each new global step (a step-1 EMA equals the weights), as
    ``EMACallback(decay=decay)`` keeps it (every step, from step 1). Under FSDP2, on every rank."""
    import lightning.pytorch as pl

    class Oracle(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            step = trainer.global_step
            if step in snaps:
                return
            weights = {
                n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                for n, p in pl_module.named_parameters()
            }  # an FSDP2 parameter: its whole tensor (collective, on every rank)
            before = snaps.get(step - 1)
            snaps[step] = weights if before is None else {n: before[n].lerp(w, 1 - decay) for n, w in weights.items()}

    return Oracle()


def _slow_async_writes(seconds: float, rank: int | None = None) -> None:
    """Every background EMA write (of ``rank``'s files only, if given) takes ``seconds`` more: a large EMA, a slow
    disk. Shared folders' writes and ``shared=False`` ones (``_async_private``)."""
    import functional_ema._async as fa
    import functional_ema._async_private as fap

    write, write_private = fa._write_files, fap.write_private

    def slow(job, names):
        if rank is None or job.rank == rank:
            time.sleep(seconds)
        return write(job, names)

    def slow_private(prep, emas, buffers):
        if rank is None or prep.job[2] == rank:
            time.sleep(seconds)
        return write_private(prep, emas, buffers)

    fa._write_files, fap.write_private = slow, slow_private


def killed_rotating_run(root: str, save_last: bool) -> None:
    """The child process of ``test_async_save_with_rotation_leaves_a_complete_ema_through_a_sigkill``: ``fit`` with
    ``EMACallback(async_save=True)`` and ``ModelCheckpoint(save_top_k=1)`` rotating at every epoch end (8 steps), each
    EMA write 2 s slow, SIGKILLed at the first step after the step-16 checkpoint (its EMA still being written when
    nothing waits for it)."""
    import signal

    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    _slow_async_writes(2.0)

    class Kill(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 17:
                os.kill(os.getpid(), signal.SIGKILL)

    saves = pl.callbacks.ModelCheckpoint(
        dirpath=os.path.join(root, "ckpt"),
        every_n_epochs=1,
        save_top_k=1,
        monitor="step",
        mode="max",
        save_last=save_last,
    )
    _tiny_trainer(Path(root), [EMACallback(decay=0.8, async_save=True), saves, Kill()], max_epochs=3).fit(
        _tiny_module()
    )


def test_async_save_with_rotation_leaves_a_complete_ema_through_a_sigkill(tmp_path):
    """``ModelCheckpoint(save_top_k=1)`` removes the step-8 checkpoint right after saving the step-16 one; with
    ``async_save=True`` the callback completes the step-16 EMA before that removal, so a process SIGKILLed one step
    later (a real kill, in a subprocess) leaves the step-16 checkpoint with its whole EMA: a plain EMA of the weights at
    step 16, bitwise, and a resume from it ends on the uninterrupted run's EMA and weights. With
    ``save_last=True``, ``last.ckpt`` is rewritten at step 16 while its EMA is still the step-8 one at the kill: its
    resume is refused, naming both steps and the checkpoint to resume from instead."""
    import signal
    import subprocess
    import sys

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback, ema_dir_for
    from tests._integration_models import quiet

    quiet()
    snaps: dict[int, dict] = {}
    whole_ema, whole = EMACallback(decay=0.8), _tiny_module()
    _tiny_trainer(tmp_path / "whole", [whole_ema, _oracle(0.8, snaps)], max_epochs=3).fit(whole)
    final, live = fe.gather_full(whole_ema.state, whole), {n: t.detach().clone() for n, t in whole.state_dict().items()}
    assert all(torch.equal(t, snaps[24][n]) for n, t in final.items())
    repo = str(Path(__file__).resolve().parents[1])
    for save_last in (False, True):
        root = tmp_path / f"killed_last{int(save_last)}"
        code = f"from tests.test_integrations_lightning import killed_rotating_run as f; f({str(root)!r}, {save_last})"
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=repo,
            env={**os.environ, "PYTHONPATH": repo},
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-4000:]
        ck = root / "ckpt"
        best = ck / "epoch=1-step=16.ckpt"
        want = ["epoch=1-step=16.ckpt", "epoch=1-step=16.ckpt.ema"] + (
            ["last.ckpt", "last.ckpt.ema"] if save_last else []
        )
        assert sorted(p.name for p in ck.iterdir()) == want
        saved = fe.checkpoint.consolidate(ema_dir_for(best), "ema")
        assert sorted(saved) == sorted(snaps[16]) and all(torch.equal(saved[n], t) for n, t in snaps[16].items())
        if save_last:
            with pytest.raises(
                fe.checkpoint.CheckpointMismatchError,
                match=r"last\.ckpt was saved at step 16 over a checkpoint of step 8 .* the EMA beside it is still the "
                r"overwritten checkpoint's\. Resume from a checkpoint whose EMA is complete \(\S*epoch=1-step=16\.ckpt\)",
            ):
                _tiny_trainer(root, [EMACallback(decay=0.8)], max_epochs=3).fit(
                    _tiny_module(), ckpt_path=str(ck / "last.ckpt")
                )
        resumed, module = EMACallback(decay=0.8), _tiny_module()
        _tiny_trainer(root, [resumed], max_epochs=3).fit(module, ckpt_path=str(best))
        assert all(torch.equal(t, final[n]) for n, t in fe.gather_full(resumed.state, module).items())
        assert all(torch.equal(t, live[n]) for n, t in module.state_dict().items())


def _tiny_fsdp2_module():
    """``_tiny_module`` with its network sharded over the 2 ranks (FSDP2, ``ModelParallelStrategy``)."""
    cls = type(_tiny_module())

    class Sharded(cls):
        def configure_model(self):
            from torch.distributed.fsdp import fully_shard

            if not getattr(self, "_sharded", False):
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])
                self._sharded = True

    return Sharded()


def rotation_ddp_worker(root: str, shared: bool = True) -> dict:
    """2 ranks, ``EMACallback(async_save=True, shared=shared)``, ``ModelCheckpoint(save_top_k=1)`` every 2 steps; rank
    1's EMA writes 1.5 s slow. Shared: DDP. ``shared=False``: FSDP2 (a sharded EMA, whose ``shared=False`` commit is
    collective; under DDP each rank's whole EMA commits alone), file checkpoints, each rank's own folder (Ray's
    per-worker ones). Rank 0 looks into its folder at every batch start: once a checkpoint was removed, one with a
    complete EMA (its manifest) must be there. Then a save and a removal on rank 0 only. Shared: no collective there,
    the save's EMA is complete when that removal returns. ``shared=False``: the removal returns at once, the checkpoint
    still there (with its EMA) until the next collective point (a save on every rank), after which it is gone and the
    save's EMA is complete."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback, ema_dir_for
    from tests._integration_models import quiet

    quiet()
    _slow_async_writes(1.5, rank=1)
    rank = dist.get_rank()
    own = Path(root) if shared else Path(root) / f"rank{rank}"
    ck = own / "ckpt"
    seen: set[str] = set()
    bare: list[tuple[int, list[str]]] = []  # (step, the checkpoints there) with none complete after a removal
    most = [0]  # the most checkpoints seen at once: 1, ModelCheckpoint's removals are not put off

    class Look(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            names = sorted(p.name for p in ck.glob("*.ckpt")) if rank == 0 and ck.is_dir() else []
            seen.update(names)
            most[0] = max(most[0], len(names))
            if seen - set(names) and not [n for n in names if has(ck / n)]:
                bare.append((trainer.global_step, names))

    def has(ckpt: Path) -> bool:
        return (ema_dir_for(ckpt) / "ema" / "ema_manifest.json").is_file()

    class Saves(pl.callbacks.ModelCheckpoint):
        def setup(self, trainer, pl_module, stage):
            super().setup(trainer, pl_module, stage)
            self.dirpath = str(ck)  # not rank 0's (broadcast): each rank's own folder when not shared

    snaps: dict[int, dict] = {}
    saves = Saves(dirpath=str(ck), save_top_k=1, monitor="step", mode="max", every_n_train_steps=2)
    ema = EMACallback(decay=0.8, async_save=True, shared=shared)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy("ddp")
        if shared
        else pl.strategies.ModelParallelStrategy(2, 1, save_distributed_checkpoint=False),
        max_epochs=2,
        callbacks=[ema, saves, Look(), _oracle(0.8, snaps)],
        **QUIET,
        default_root_dir=root,
        use_distributed_sampler=True,
    )
    trainer.fit(_tiny_module() if shared else _tiny_fsdp2_module())  # 4 steps an epoch: checkpoints at 2, 4, 6, 8
    last = ck / "epoch=1-step=8.ckpt"
    out = {"bare": bare, "looked": sorted(seen), "most": most[0], "names": sorted(p.name for p in ck.iterdir())}
    if not shared:  # each folder holds its rank's shards: the EMA the step-8 save wrote, gathered
        full = fe.gather_full(ema.state, trainer.strategy.model)
        out["bitwise"] = sorted(full) == sorted(snaps[8]) and all(torch.equal(full[n], snaps[8][n]) for n in full)
    elif rank == 0:
        saved = fe.checkpoint.consolidate(ema_dir_for(last), "ema")
        out["bitwise"] = sorted(saved) == sorted(snaps[8]) and all(torch.equal(saved[n], snaps[8][n]) for n in saved)
    extra = own / "extra.ckpt"
    trainer.save_checkpoint(extra)  # every rank; rank 1's write still going on after it
    if rank == 0:
        t0 = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.strategy.remove_checkpoint(str(last))
        out["removal_s"] = time.monotonic() - t0
        out["warned"] = [str(w.message) for w in caught if "outside ModelCheckpoint" in str(w.message)]
        out["complete_at_removal"] = has(extra) and not last.exists()
        out["kept_at_removal"] = last.exists() and has(last)
    dist.barrier()
    if not shared:  # the next collective point commits the save, then removes what waited for it
        trainer.save_checkpoint(own / "extra2.ckpt")
        out["after_next_save"] = [has(extra), last.exists(), ema_dir_for(last).exists()]
        ema.ema.wait()
        dist.barrier()
    return out


@pytest.mark.parametrize("shared", [True, False])
def test_async_save_with_rotation_under_ddp_completes_the_ema_before_a_removal(tmp_path, shared):
    """Two ranks, rank 1's writes slow: ``ModelCheckpoint``'s rotation (on every rank) never leaves the folder without
    a checkpoint whose EMA is complete, the kept checkpoint's EMA is the plain EMA of the weights at its step, bitwise.
    A removal on rank 0 alone: shared, it waits for the commit that rank 0 writes (no collective: no deadlock);
    ``shared=False`` (a collective commit), it returns at once (not after the commit's arrival limit, 60 s here, then a
    failure) and the checkpoint goes after the next save on every rank, once the EMA saved before it is complete."""
    reports = run_ranks(
        "tests.test_integrations_lightning:rotation_ddp_worker",
        world_size=2,
        timeout=300,
        env={"FUNCTIONAL_EMA_TIMEOUT": "60"},
        root=str(tmp_path),
        shared=shared,
    )
    r = reports[0]
    # looked at each batch start: the step-8 checkpoint comes after the last one
    assert r["looked"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt", "epoch=1-step=6.ckpt"], r
    assert r["bare"] == [] and r["most"] == 1 and r["bitwise"] is True, r
    assert r["names"] == ["epoch=1-step=8.ckpt", "epoch=1-step=8.ckpt.ema"], r
    if shared:
        assert r["complete_at_removal"] is True and r["warned"] == [], r
    else:
        assert r["removal_s"] < 20 and r["kept_at_removal"] is True, r
        assert len(r["warned"]) == 1 and "epoch=1-step=8.ckpt') was called outside ModelCheckpoint" in r["warned"][0]
        assert r["after_next_save"] == [True, False, False], r


def _dip_module():
    """``_tiny_module`` logging ``dip``: the global step before each optimizer step, but 0 at step 16 (the first batch
    after a resume from the step-16 checkpoint), so the first save after that resume is no new best."""
    module = _tiny_module()
    cls = type(module)

    class Dip(cls):
        def training_step(self, batch, batch_idx):
            step = self.trainer.global_step
            self.log("dip", 0.0 if step == 16 else float(step))
            return super().training_step(batch, batch_idx)

    return Dip()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_file_checkpoint_replaced_by_a_save_last_link_loses_its_ema_folder(tmp_path, async_save):
    """``ModelCheckpoint(save_top_k=1, monitor="dip", save_last="link")`` resumed from ``last``: the first save after the
    resume is no new best, so Lightning saves ``last.ckpt`` as a file (the EMA beside it); at the next new best it
    removes that file itself and links ``last.ckpt`` to the best one. The callback then removes the EMA folder it wrote
    beside the file (nobody's now): the folder holds the best checkpoint, its EMA and the link, and the resumed run
    ends on the uninterrupted run's EMA (a plain EMA of the weights), bitwise. Only what the callback wrote goes: a
    file of the user's in such a folder stays, as does a ``.ema`` folder beside a link that the callback never saved."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()

    def fit(root: Path, max_epochs: int, ckpt_path: str | None = None, snaps: dict | None = None):
        ema = EMACallback(decay=0.8, async_save=async_save)
        saves = pl.callbacks.ModelCheckpoint(
            dirpath=str(root / "ckpt"), every_n_train_steps=1, save_top_k=1, monitor="dip", mode="max", save_last="link"
        )
        extra = [] if snaps is None else [_oracle(0.8, snaps)]
        trainer = _tiny_trainer(root, [ema, saves, *extra], max_epochs=max_epochs)
        module = _dip_module()
        trainer.fit(module, ckpt_path=ckpt_path)
        return trainer, ema, module

    snaps: dict[int, dict] = {}
    _, whole, module = fit(tmp_path / "whole", 3, snaps=snaps)
    final = fe.gather_full(whole.state, module)
    assert all(torch.equal(t, snaps[24][n]) for n, t in final.items())
    fit(tmp_path / "cut", 2)
    trainer, ema, module = fit(tmp_path / "cut", 3, ckpt_path="last")
    ck = tmp_path / "cut" / "ckpt"
    assert sorted(p.name for p in ck.iterdir()) == ["epoch=2-step=24.ckpt", "epoch=2-step=24.ckpt.ema", "last.ckpt"]
    assert (ck / "last.ckpt").is_symlink() and os.readlink(ck / "last.ckpt") == "epoch=2-step=24.ckpt"
    assert all(torch.equal(t, final[n]) for n, t in fe.gather_full(ema.state, module).items())

    # A file checkpoint the callback saved, with a file of the user's in its EMA folder, then replaced by a link; and
    # a link with an EMA folder beside it that the callback never wrote.
    mine, theirs = ck / "mine.ckpt", ck / "theirs.ckpt"
    trainer.save_checkpoint(mine)
    ema.ema.wait()
    (ck / "mine.ckpt.ema" / "notes.txt").write_text("keep")
    mine.unlink()
    mine.symlink_to("epoch=2-step=24.ckpt")
    theirs.symlink_to("epoch=2-step=24.ckpt")
    (ck / "theirs.ckpt.ema" / "ema").mkdir(parents=True)
    ema.on_train_end(trainer, module)  # the callback's next look (as at the end of a fit)
    assert sorted(p.name for p in (ck / "mine.ckpt.ema").iterdir()) == ["notes.txt"]
    assert (ck / "theirs.ckpt.ema" / "ema").is_dir()


def test_rotation_removes_the_ema_folders_an_earlier_process_saved(tmp_path):
    """Run 1: ``ModelCheckpoint(every_n_train_steps=2, save_top_k=2, save_last=True)`` for 8 steps. Run 2, a new
    callback and trainer (as a new process), resumes from its ``last.ckpt`` with ``save_last="link"`` to step 16: the
    rotation removes run 1's checkpoints and the link replaces run 1's ``last.ckpt`` file, and the EMA folders run 1
    saved beside them go with them. The kept checkpoints' EMAs are the plain EMA of the weights at their steps, bitwise.
    Only what is verifiably this library's EMA save goes: a user's folder named like a rotated checkpoint's EMA folder
    (no EMA files in it) stays whole, and a user's file in an EMA folder stays; each is warned about."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    ck, snaps = tmp_path / "ckpt", {}

    def fit(max_epochs: int, save_last: bool | str, ckpt_path: str | None = None) -> None:
        saves = pl.callbacks.ModelCheckpoint(
            dirpath=str(ck), every_n_train_steps=2, save_top_k=2, monitor="step", mode="max", save_last=save_last
        )
        trainer = _tiny_trainer(tmp_path, [EMACallback(decay=0.8), saves, _oracle(0.8, snaps)], max_epochs=max_epochs)
        trainer.fit(_tiny_module(), ckpt_path=ckpt_path)

    fit(1, True)  # 8 steps: checkpoints at steps 6 and 8 kept, last.ckpt a file
    assert sorted(p.name for p in ck.iterdir()) == [
        f"{n}{e}" for n in ("epoch=0-step=6.ckpt", "epoch=0-step=8.ckpt", "last.ckpt") for e in ("", ".ema")
    ]
    theirs = ck / "epoch=0-step=6.ckpt.ema"  # a user's folder in place of the EMA folder: no EMA save in it
    for f in theirs.rglob("*"):
        if f.is_file():
            f.unlink()
    (theirs / "ema" / "notes.txt").write_text("keep")
    (ck / "epoch=0-step=8.ckpt.ema" / "results.json").write_text("{}")  # a user's file beside an EMA save
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(2, "link", ckpt_path=str(ck / "last.ckpt"))  # steps 9 to 16
    assert sorted(p.name for p in ck.iterdir()) == [
        "epoch=0-step=6.ckpt.ema",
        "epoch=0-step=8.ckpt.ema",
        "epoch=1-step=14.ckpt",
        "epoch=1-step=14.ckpt.ema",
        "epoch=1-step=16.ckpt",
        "epoch=1-step=16.ckpt.ema",
        "last.ckpt",
    ]
    assert os.readlink(ck / "last.ckpt") == "epoch=1-step=16.ckpt"
    assert sorted(str(f.relative_to(theirs)) for f in theirs.rglob("*")) == ["ema", "ema/notes.txt"]
    assert [f.name for f in (ck / "epoch=0-step=8.ckpt.ema").iterdir()] == ["results.json"]
    for step in (14, 16):
        saved = fe.checkpoint.consolidate(ck / f"epoch=1-step={step}.ckpt.ema", "ema")
        assert sorted(saved) == sorted(snaps[step]) and all(torch.equal(saved[n], snaps[step][n]) for n in saved)
    left = sorted(str(w.message) for w in caught if "did not write there" in str(w.message))
    assert len(left) == 2, [str(w.message) for w in caught]
    assert "epoch=0-step=6.ckpt.ema beside it holds ['ema']" in left[0], left
    assert "epoch=0-step=8.ckpt.ema beside it holds ['results.json']" in left[1], left


def test_a_removal_outside_model_checkpoint_waits_only_while_an_async_save_awaits_its_commit(tmp_path):
    """One process, ``EMACallback(async_save=True, shared=False, start_step=5)`` (a collective commit) and a callback
    that saves at every step and then removes the checkpoint before (``strategy.remove_checkpoint`` outside
    ModelCheckpoint, as a rank-0-only one calls it). Steps 2 to 4, before the EMA starts, a save writes its not-started
    record at once: nothing awaits a commit, so each removal is done at once (the checkpoint and its EMA folder gone),
    no warning. From step 5 each save is in flight: the removal waits for its commit, the checkpoint kept (one more
    on disk) until the next save, then removed; warned once, saying so. At the end of fit the last one is removed,
    and the step-8 checkpoint's EMA is the plain EMA of the weights from step 5, bitwise."""
    import lightning.pytorch as pl

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    ck, listed, weights = tmp_path / "ckpt", {}, {}

    class Rotate(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, *args):
            step = trainer.global_step
            weights[step] = {n: p.detach().clone() for n, p in pl_module.named_parameters()}
            trainer.save_checkpoint(ck / f"s{step}.ckpt")
            if step > 1:
                trainer.strategy.remove_checkpoint(str(ck / f"s{step - 1}.ckpt"))
            listed[step] = sorted(p.name for p in ck.iterdir())

    ema = EMACallback(decay=0.8, async_save=True, shared=False, start_step=5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _tiny_trainer(tmp_path, [ema, Rotate()]).fit(_tiny_module())  # 8 steps
    pair = lambda step: [f"s{step}.ckpt", f"s{step}.ckpt.ema"]  # noqa: E731
    assert listed[1] == pair(1)
    assert [listed[s] for s in (2, 3, 4)] == [pair(2), pair(3), pair(4)], listed
    assert [listed[s] for s in (5, 6, 7, 8)] == [pair(s - 1) + pair(s) for s in (5, 6, 7, 8)], listed
    assert sorted(p.name for p in ck.iterdir()) == pair(8)
    put_off = [str(w.message) for w in caught if "outside ModelCheckpoint" in str(w.message)]
    assert len(put_off) == 1 and "s4.ckpt" in put_off[0] and "one checkpoint more" in put_off[0], put_off
    plain = weights[5]
    for step in (6, 7, 8):
        plain = {n: plain[n].lerp(w, 0.2) for n, w in weights[step].items()}
    saved = fe.checkpoint.consolidate(ck / "s8.ckpt.ema", "ema")
    assert sorted(saved) == sorted(plain) and all(torch.equal(saved[n], plain[n]) for n in saved)


def test_rotation_removes_only_the_exact_files_of_a_verified_ema_save(tmp_path):
    """What a removal of a file checkpoint takes from ``<ckpt>.ema``, by the library's readers and exact names (one
    process). ``a``: a saved EMA with crash-left temporaries of the library's own files (a rank file's, the manifest's,
    an async marker's, ``ema_latest``'s beside the tag folder), a crash-left ``shared=False`` marker, and a user's
    ``ema_notes.tmp-1``, ``integration.json`` (not a record) and ``.ema_present.notes`` (named like a marker, not one):
    the library's files all go, the user's three stay, warned. ``b``: a tag folder holding a user's
    ``integration.json`` alone (no valid record: no proof of a save) stays whole, warned. ``c``: a saved EMA plus a
    crash-left ``ema_latest`` temporary: all gone, no warning. ``u``: a not-started record (a save before the EMA
    starts), a valid record: all gone, no warning."""
    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    ck = tmp_path / "ckpt"
    trainer = _tiny_trainer(tmp_path / "run", [EMACallback(decay=0.8)])
    trainer.fit(_tiny_module())
    for name in ("a", "b", "c"):
        trainer.save_checkpoint(ck / f"{name}.ckpt")
    late = _tiny_trainer(tmp_path / "late", [EMACallback(decay=0.8, start_step=100)])
    late.fit(_tiny_module())
    late.save_checkpoint(ck / "u.ckpt")
    assert (ck / "u.ckpt.ema" / "ema" / "integration.json").is_file()  # the oracle: a not-started record alone
    assert fe.checkpoint.read_manifest(ck / "a.ckpt.ema", "ema")["step"] == 8

    tag = ck / "a.ckpt.ema" / "ema"
    rank_file = next(p.name for p in tag.iterdir() if p.name.startswith("ema_rank_"))
    crash_left = [
        f"{rank_file}.tmp-123-0123456789ab",
        "ema_manifest.json.tmp-77",
        "ema_async.0123456789abcdef.rank00000.done.tmp-5-0123456789ab",
        ".ema_present.0123456789abcdef.000001",
    ]
    for name in [*crash_left, "ema_notes.tmp-1", ".ema_present.notes"]:
        (tag / name).write_bytes(b"x")
    (tag / "integration.json").write_text('{"mine": 1}')
    (ck / "a.ckpt.ema" / "ema_latest.tmp-9-0123456789ab").write_text("ema\n")
    for f in (ck / "b.ckpt.ema").rglob("*"):
        if f.is_file():
            f.unlink()
    (ck / "b.ckpt.ema" / "ema" / "integration.json").write_text('{"mine": 2}')
    (ck / "c.ckpt.ema" / "ema_latest.tmp-9-0123456789ab").write_text("ema\n")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("a", "b", "c", "u"):
            trainer.strategy.remove_checkpoint(str(ck / f"{name}.ckpt"))
    assert sorted(str(f.relative_to(ck)) for f in ck.rglob("*")) == [
        "a.ckpt.ema",
        "a.ckpt.ema/ema",
        "a.ckpt.ema/ema/.ema_present.notes",
        "a.ckpt.ema/ema/ema_notes.tmp-1",
        "a.ckpt.ema/ema/integration.json",
        "b.ckpt.ema",
        "b.ckpt.ema/ema",
        "b.ckpt.ema/ema/integration.json",
    ]
    left = sorted(str(w.message) for w in caught if "did not write there" in str(w.message))
    assert len(left) == 2, [str(w.message) for w in caught]
    assert "a.ckpt.ema beside it holds ['ema']" in left[0] and "b.ckpt.ema beside it holds ['ema']" in left[1], left


def test_rotation_at_a_url_removes_only_the_exact_objects_of_a_verified_ema_save(tmp_path):
    """A checkpoint at a URL (``memory://``, one process) loses, with the checkpoint, only what the library's saves
    write under ``<ckpt>.ema/``, by exact names, as a local folder does. ``a``: a saved EMA plus a failed save's
    leftovers of the library's names (a rank file of a later generation, a save marker) and a user's objects (one
    beside the tag, one in it, one named like a marker but not one, one in a sub-prefix of the tag): the library's
    all go, the user's stay, warned. ``b``: a tag holding a user's ``integration.json`` (no valid record) and a user's
    object named like a rank file (no library header): no proof of a save, all stays, warned. ``u``: a not-started
    record, valid: all gone, no warning."""
    import fsspec

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    fs = fsspec.filesystem("memory")
    base = f"memory://fe-rotation-{tmp_path.name}/ck"
    trainer = _tiny_trainer(tmp_path / "run", [EMACallback(decay=0.8)])
    trainer.fit(_tiny_module())
    for name in ("a", "b"):
        trainer.save_checkpoint(f"{base}/{name}.ckpt")
    late = _tiny_trainer(tmp_path / "late", [EMACallback(decay=0.8, start_step=100)])
    late.fit(_tiny_module())
    late.save_checkpoint(f"{base}/u.ckpt")
    root = base.removeprefix("memory://")

    def listing() -> list[str]:
        return sorted(p.removeprefix("/").removeprefix(root + "/") for p in fs.find(root))

    saved = listing()  # the oracle: what the saves wrote
    assert "a.ckpt.ema/ema/ema_manifest.json" in saved and "u.ckpt.ema/ema/integration.json" in saved, saved
    assert fe.checkpoint.read_manifest(f"{base}/a.ckpt.ema", "ema")["step"] == 8
    rank_file = next(n for n in saved if n.startswith("a.ckpt.ema/ema/ema_rank_")).rsplit("/", 1)[1]
    leftovers = [rank_file.replace(".safetensors", ".gen9.safetensors"), ".ema_store.0123456789abcdef.gen9"]
    users = ["a.ckpt.ema/notes.txt", "a.ckpt.ema/ema/results.json", "a.ckpt.ema/ema/.ema_store.mine"]
    users += ["a.ckpt.ema/ema/sub/x.bin"]
    for name in leftovers:
        fs.pipe_file(f"{root}/a.ckpt.ema/ema/{name}", b"x")
    for name in users:
        fs.pipe_file(f"{root}/{name}", b"mine")
    for name in [n for n in saved if n.startswith("b.ckpt.ema/")]:
        fs.rm_file(f"{root}/{name}")
    theirs = ["b.ckpt.ema/ema/integration.json", f"b.ckpt.ema/ema/{rank_file}"]
    for name in theirs:
        fs.pipe_file(f"{root}/{name}", b'{"mine": 2}')

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("a", "b", "u"):
            trainer.strategy.remove_checkpoint(f"{base}/{name}.ckpt")
    assert listing() == sorted(users + theirs)
    left = sorted(str(w.message) for w in caught if "did not write there" in str(w.message))
    assert len(left) == 2, [str(w.message) for w in caught]
    assert "a.ckpt.ema beside it holds ['ema', 'notes.txt']" in left[0], left
    assert "b.ckpt.ema beside it holds ['ema']" in left[1], left
    fs.rm(root, recursive=True)


def test_rotation_at_a_url_removes_a_failed_saves_marker_left_alone_and_not_a_forged_one(tmp_path):
    """A failed save at a URL whose late rank may still upload keeps rank 0's marker (``bucket.abandon_bucket``),
    for the tag's next commit; Lightning saves a checkpoint's tag once, so the marker can be all that is left of the
    save. ``f``: that marker (named ``.ema_store.<token>.gen<N>``, holding its token, as ``bucket`` publishes it)
    beside a user's object: the rotation removes the marker by its name, the user's object stays, warned. ``g``:
    objects named like markers whose content is not their token (another token; the token and more) are no proof
    of a save: all stay, warned."""
    import fsspec

    from functional_ema._checkpoint import bucket
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    fs = fsspec.filesystem("memory")
    base = f"memory://fe-marker-rotation-{tmp_path.name}/ck"
    root = base.removeprefix("memory://")
    trainer = _tiny_trainer(tmp_path / "run", [EMACallback(decay=0.8)])
    trainer.fit(_tiny_module())
    token = "0123456789abcdef"
    marker = ".ema_store.0123456789abcdef.gen0"
    assert bucket.marker_name(token, 0) == marker  # the name the library gives it
    planted = {
        "f.ckpt": b"ckpt",
        f"f.ckpt.ema/ema/{marker}": token.encode(),
        "f.ckpt.ema/ema/results.json": b"mine",
        "g.ckpt": b"ckpt",
        "g.ckpt.ema/ema/.ema_store.fedcba9876543210.gen0": token.encode(),
        "g.ckpt.ema/ema/.ema_store.0123456789abcdef.gen1": token.encode() + b"\n",
    }
    for name, data in planted.items():
        fs.pipe_file(f"{root}/{name}", data)

    def listing() -> list[str]:
        return sorted(p.removeprefix("/").removeprefix(root + "/") for p in fs.find(root))

    assert listing() == sorted(planted)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name in ("f", "g"):
            trainer.strategy.remove_checkpoint(f"{base}/{name}.ckpt")
    kept = sorted(n for n in planted if n.startswith(("f.ckpt.ema/ema/results", "g.ckpt.ema/")))
    assert listing() == kept
    left = sorted(str(w.message) for w in caught if "did not write there" in str(w.message))
    assert len(left) == 2, [str(w.message) for w in caught]
    assert "f.ckpt.ema beside it holds ['ema']" in left[0] and "g.ckpt.ema beside it holds ['ema']" in left[1], left
    fs.rm(root, recursive=True)


def private_rotation_worker(root: str) -> dict:
    """2 ranks (DDP), ``EMACallback(shared=False)``, ``ModelCheckpoint(save_top_k=1)`` every 2 steps, 6 steps (saves
    at 2, 4, 6). ``own``: each rank's own folder (Ray's per-worker ones, node-local disks); ``one``: one folder both
    ranks write (the ranks of a node). After the step-2 save a user's files are put beside the checkpoints and into
    the step-2 EMA folder. Returns each case's listing (from this rank), the step-6 EMA of this rank's folder against
    a plain EMA of the weights, and the warnings about files left in place."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    rank, out = dist.get_rank(), {}
    early: list[str] = []  # an EMA folder removal begun while its checkpoint was still there
    _slow_checkpoint_removal(early)
    for case in ("own", "one"):
        ck = Path(root) / case / (f"rank{rank}" if case == "own" else "all") / "ckpt"

        class Saves(pl.callbacks.ModelCheckpoint):
            def setup(self, trainer, pl_module, stage):
                super().setup(trainer, pl_module, stage)
                self.dirpath = str(ck)  # this rank's own folder, not rank 0's (broadcast)

        class Plant(pl.Callback):
            def on_train_batch_start(self, trainer, *args):
                if trainer.global_step == 2 and (case == "own" or rank == 0):  # the step-2 checkpoint is saved
                    (ck / "keep.txt").write_text("mine")
                    (ck / "epoch=0-step=2.ckpt.ema" / "ema" / "results.json").write_text("{}")

        snaps: dict[int, dict] = {}
        saves = Saves(dirpath=str(ck), save_top_k=1, monitor="step", mode="max", every_n_train_steps=2)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=_strategy("ddp"),
            max_steps=6,
            callbacks=[EMACallback(decay=0.8, shared=False), saves, Plant(), _oracle(0.8, snaps)],
            default_root_dir=root,
            **QUIET,
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(_tiny_module())
        dist.barrier()
        saved = fe.checkpoint.consolidate(ck / "epoch=1-step=6.ckpt.ema", "ema")
        out[case] = {
            "names": sorted(n for n in (str(p.relative_to(ck)) for p in ck.rglob("*")) if "step=6" not in n),
            "top": sorted(p.name for p in ck.iterdir()),
            "bitwise": sorted(saved) == sorted(snaps[6]) and all(torch.equal(saved[n], snaps[6][n]) for n in saved),
            "left": [str(w.message) for w in caught if "did not write there" in str(w.message)],
        }
    out["early"] = early
    return out


def _slow_checkpoint_removal(early: list[str]) -> None:
    """In this rank's process: Lightning's removal of a checkpoint file takes 0.5 s (a slow filesystem), and each
    removal of an EMA folder beside a checkpoint still there is noted in ``early``."""
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

    import functional_ema.integrations.lightning as integration

    remove, drop = TorchCheckpointIO.remove_checkpoint, integration._remove_companion

    def slow_remove(self, path):
        time.sleep(0.5)
        remove(self, path)

    def noted_drop(folder, tag):
        if Path(str(folder).removesuffix(".ema")).exists():
            early.append(str(folder))
        return drop(folder, tag)

    TorchCheckpointIO.remove_checkpoint = slow_remove
    integration._remove_companion = noted_drop


def test_rotation_with_private_folders_removes_every_ranks_ema_folder(tmp_path):
    """:func:`private_rotation_worker`: Lightning removes the rotated checkpoint on rank 0 only; with ``shared=False``
    each rank removes the EMA folder beside its own path (only the library's files), so after 3 saves each rank's
    folder holds only the last EMA (the plain EMA of the weights at step 6, bitwise) and the user's files, each
    warned about once per rank; in a folder both ranks share, the two removals together leave the same. The EMA
    folders go after the checkpoint, also when its removal is slow (no rank removes an EMA whose checkpoint is there)."""
    got = run_ranks(
        "tests.test_integrations_lightning:private_rotation_worker", world_size=2, timeout=300, root=str(tmp_path)
    )
    for rank, out in enumerate(got):
        assert out["early"] == [], (rank, out["early"])  # the checkpoint goes first, the EMA folders after it
        for case in ("own", "one"):
            r = out[case]
            last = ["epoch=1-step=6.ckpt"] if rank == 0 or case == "one" else []
            assert r["top"] == sorted(["epoch=0-step=2.ckpt.ema", *last, "epoch=1-step=6.ckpt.ema", "keep.txt"]), (
                rank,
                case,
                r,
            )
            assert r["names"] == [
                "epoch=0-step=2.ckpt.ema",
                "epoch=0-step=2.ckpt.ema/ema",
                "epoch=0-step=2.ckpt.ema/ema/results.json",
                "keep.txt",
            ], (rank, case, r)
            assert r["bitwise"] is True, (rank, case)
            assert len(r["left"]) == 1 and "epoch=0-step=2.ckpt.ema beside it holds ['ema']" in r["left"][0], r


def rank_zero_pruning_worker(root: str) -> dict:
    """2 ranks (DDP), ``EMACallback(shared=False)`` and a ``ModelCheckpoint`` subclass (save_top_k=-1, every 2 steps,
    4 steps) whose ``on_train_end`` prunes on rank 0 only through its ``_remove_checkpoint`` (rank-zero-only
    housekeeping), in a folder both ranks share. Then, on rank 0 alone, a removal taken as one of every rank's (as
    inside ``ModelCheckpoint``'s saves when the ranks decide differently), which must fail within the arrival limit
    (``FUNCTIONAL_EMA_TIMEOUT``), removing nothing. Returns the listing after each, the step-4 EMA against a plain EMA
    of the weights, and the failure."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import quiet

    quiet()
    rank, ck = dist.get_rank(), Path(root) / "ckpt"

    class Prune(pl.callbacks.ModelCheckpoint):
        def on_train_end(self, trainer, pl_module):
            if trainer.is_global_zero:
                for p in sorted(ck.glob("*.ckpt"))[:-1]:
                    self._remove_checkpoint(trainer, str(p))

    snaps: dict[int, dict] = {}
    ema = EMACallback(decay=0.8, shared=False)
    saves = Prune(dirpath=str(ck), save_top_k=-1, every_n_train_steps=2)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=_strategy("ddp"),
        max_steps=4,
        callbacks=[ema, saves, _oracle(0.8, snaps)],
        default_root_dir=root,
        **QUIET,
    )
    trainer.fit(_tiny_module())
    dist.barrier()
    saved = fe.checkpoint.consolidate(ck / "epoch=0-step=4.ckpt.ema", "ema")
    out: dict = {
        "pruned": sorted(p.name for p in ck.iterdir()),
        "bitwise": sorted(saved) == sorted(snaps[4]) and all(torch.equal(saved[n], snaps[4][n]) for n in saved),
    }
    dist.barrier()
    done = Path(root) / "rank0_done"
    if rank == 0:
        ema._every_rank = True  # as inside ModelCheckpoint's _save_topk_checkpoint, on this rank alone
        t0 = time.monotonic()
        try:
            trainer.strategy.remove_checkpoint(str(ck / "epoch=0-step=4.ckpt"))
            out["alone"] = None
        except Exception as e:  # noqa: BLE001 - which error, and its message, are checked
            out["alone"] = f"{type(e).__name__}: {e}"
        out["alone_s"] = time.monotonic() - t0
        out["after_alone"] = sorted(str(p.relative_to(ck)) for p in ck.rglob("*"))
        done.write_text("")
    else:  # no collective meanwhile: rank 1 is elsewhere
        while not done.exists():
            time.sleep(0.1)
    return out


def test_a_rank_zero_only_removal_with_private_folders_removes_rank_zeros_files_and_a_lone_one_fails_bounded(tmp_path):
    """:func:`rank_zero_pruning_worker`: with ``shared=False`` a ``ModelCheckpoint`` subclass removing on rank 0 only
    outside its every-rank saves takes no collective (it hung or crashed gloo: "Connection closed by peer"): rank 0
    removes the checkpoint and its EMA folder (every rank's files of it, by their names), the last EMA stays, the plain
    EMA of the weights at step 4 bitwise. A removal that only rank 0 takes as every rank's fails there within the
    arrival limit (5 s here) with a ``CheckpointTimeoutError`` naming the checkpoint, the rank and the cause, and
    removes nothing."""
    got = run_ranks(
        "tests.test_integrations_lightning:rank_zero_pruning_worker",
        world_size=2,
        timeout=150,
        env={"FUNCTIONAL_EMA_TIMEOUT": "5"},
        root=str(tmp_path),
    )
    for out in got:
        assert out["pruned"] == ["epoch=0-step=4.ckpt", "epoch=0-step=4.ckpt.ema"], out
        assert out["bitwise"] is True, out
    alone = got[0]["alone"]
    assert alone is not None and alone.startswith("CheckpointTimeoutError: EMACallback(shared=False): rank 0"), alone
    assert "epoch=0-step=4.ckpt with it" in alone and "sync_dist=True" in alone and "Nothing was removed" in alone
    assert 4 < got[0]["alone_s"] < 60, got[0]
    ema_files = sorted(str(p.relative_to(tmp_path / "ckpt")) for p in (tmp_path / "ckpt").rglob("*"))
    assert got[0]["after_alone"] == ema_files and "epoch=0-step=4.ckpt" in ema_files, ema_files
    assert any(n.endswith("ema_manifest.json") for n in ema_files), ema_files
