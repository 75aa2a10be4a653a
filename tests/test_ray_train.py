"""Ray Train (issue 37): the EMA kept through a killed worker, bitwise, with checkpoints in Ray's storage.

A real ``ray.train.torch.TorchTrainer`` of 2 CPU workers (gloo) on a local Ray started on loopback. Its train
function trains three models side by side in the same worker group (one launch, three engines): a DDP model,
an FSDP2 model and a DeepSpeed ZeRO-3 engine, each with its EMA. Every other step, every worker writes the
training state (DDP: rank 0's file; FSDP2: torch.distributed.checkpoint; DeepSpeed: ``save_checkpoint``) and
the EMAs (``fe.save(..., shared=False)``) into its own temporary folder and reports it with
``ray.train.report``; Ray merges the workers' folders into one ``checkpoint_*`` in ``storage_path``. Rank 1
SIGKILLs itself once, after a report; with ``FailureConfig(max_failures=1)`` Ray starts the worker group again
and hands it the last committed checkpoint through ``ray.train.get_checkpoint()``, from which the run resumes.

Checked, for a local ``storage_path`` and a bucket on a real S3 server (SeaweedFS on loopback):

* the run was killed and resumed from a checkpoint (each attempt's start step is recorded);
* each engine's final EMA equals, bitwise, that of the same loop run uninterrupted without Ray (``run_ranks``),
  whose EMA in turn equals a plain-torch EMA of the full fp32 weights at every step (the independent reference);
* the last checkpoint Ray committed (the workers' merged folders) consolidates to that EMA, bitwise; from the
  bucket, ``python -m functional_ema export s3://.../checkpoint_.../ema_ddp OUT --like BASE`` writes a folder
  that ``LlamaForCausalLM.from_pretrained`` loads as that EMA, bitwise;
* no connection of Ray's processes or the workers went to an address other than loopback (sampled during the
  run; the same watch sees Ray's default, the machine's routable address, when the flag below is 1);
* ``examples/ray_train_ema.py`` runs as a user runs it and leaves a complete checkpoint.

Ray runs only in the Ray tier (``make test-ray``: the ``ray`` extra); without ``ray`` installed this module is
skipped. Ray is kept on loopback (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` before the import, see
docs/notes/ray-train-facts.md), and its processes are stopped at the end of the module, by pid.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from functional_ema._testing.multirank import ROOT, extensions_dir, run_ranks

# Before `import ray`: no usage report, and Ray's servers and the process group stay on loopback.
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
ray = pytest.importorskip("ray", reason="the Ray tier (make test-ray) installs the ray extra")
pytest.importorskip("ray.train.torch")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:ray")  # Ray's own, at its import

DECAY = 0.9
STEPS = 6
REPORT_EVERY = 2
KILL_AT = 5  # rank 1 dies after step 4's report: Ray resumes from step 2's or step 4's checkpoint (facts 3.2)
KINDS = ("ddp", "fsdp2", "zero3")


def _record(cfg: dict[str, Any], **event: Any) -> None:
    """Append one event (this process's) to the run's ``events_<label>.jsonl``."""
    with open(Path(cfg["out"]) / f"events_{cfg['label']}.jsonl", "a") as f:
        f.write(json.dumps({"pid": os.getpid(), **event}) + "\n")


def _kill_once(cfg: dict[str, Any], step: int, rank: int) -> None:
    """Rank 1 SIGKILLs itself at step ``KILL_AT`` of a run with ``cfg["kill"]``, the first time only."""
    marker = Path(cfg["out"]) / f"killed_{cfg['label']}"
    if cfg.get("kill") and step == KILL_AT and rank == 1 and not marker.exists():
        marker.touch()
        os.kill(os.getpid(), signal.SIGKILL)


def _write_final(cfg: dict[str, Any], kind: str, full: dict[str, torch.Tensor], plain: dict[str, torch.Tensor]) -> None:
    """Rank 0's files: the run's final EMA of ``kind`` and, in the reference run, the plain-torch EMA."""
    import safetensors.torch

    out = Path(cfg["out"])
    safetensors.torch.save_file(full, out / f"{cfg['label']}_{kind}.safetensors")
    if cfg.get("reference"):
        safetensors.torch.save_file(plain, out / f"plain_{kind}.safetensors")


# ------------------------------------------------------------------------------------------ the models


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 12), torch.nn.ReLU(), torch.nn.Linear(12, 5))


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    from tests._integration_models import quiet_hf, tiny_llama_config

    quiet_hf()
    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config())


class _Trained:
    """One model under one engine: ``x`` is what ``fe.local_shards`` reads. DDP trains a tiny Llama (so the
    export has a ``--like`` folder to follow), FSDP2 an MLP, DeepSpeed ZeRO-3 the suite's ``OddNet``."""

    def __init__(self, kind: str) -> None:
        import torch.distributed as dist

        self.kind, self.rank = kind, dist.get_rank()
        if kind == "ddp":
            self.net = tiny_llama()
            self.x = torch.nn.parallel.DistributedDataParallel(self.net)
            self.opt = torch.optim.AdamW(self.x.parameters(), lr=1e-2)
        elif kind == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            self.net = _mlp()
            for layer in self.net:
                if isinstance(layer, torch.nn.Linear):
                    fully_shard(layer)
            self.x = fully_shard(self.net)
            self.opt = torch.optim.AdamW(self.net.parameters(), lr=1e-2)
        else:
            from functional_ema._testing.multirank import make_engine

            self.x = make_engine(3)

    def train(self, step: int) -> None:
        if self.kind == "zero3":
            from functional_ema._testing.multirank import train_step

            train_step(self.x, step)
            return
        g = torch.Generator().manual_seed(1000 * step + self.rank)
        if self.kind == "ddp":
            ids = torch.randint(0, 64, (2, 8), generator=g)
            self.x(input_ids=ids, labels=ids).loss.backward()
        else:
            x, y = torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)
            torch.nn.functional.mse_loss(self.x(x), y).backward()
        self.opt.step()
        self.opt.zero_grad()

    def full(self) -> dict[str, torch.Tensor]:
        """The full fp32 weights (collective for FSDP2 and ZeRO-3): the independent reference's input."""
        from functional_ema._testing.multirank import full_fp32_reference, full_tensor_of

        if self.kind == "zero3":
            return full_fp32_reference(self.x)
        return {n: full_tensor_of(p.detach()).clone() for n, p in self.net.named_parameters()}

    def save_training(self, folder: Path) -> None:
        """This rank's part of the training state, into its own folder (Ray merges the folders)."""
        if self.kind == "ddp":
            if self.rank == 0:  # the replicas hold the same state: one copy
                torch.save({"model": self.net.state_dict(), "opt": self.opt.state_dict()}, folder / "ddp_train.pt")
        elif self.kind == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model, opt = get_state_dict(self.net, self.opt)
            dcp.save({"model": model, "opt": opt}, checkpoint_id=str(folder / "fsdp2_train"))
        else:
            self.x.save_checkpoint(str(folder / "zero3_train"), tag="t")

    def load_training(self, folder: Path) -> None:
        if self.kind == "ddp":
            saved = torch.load(folder / "ddp_train.pt", weights_only=True)
            self.net.load_state_dict(saved["model"])
            self.opt.load_state_dict(saved["opt"])
        elif self.kind == "fsdp2":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

            model, opt = get_state_dict(self.net, self.opt)
            sd = {"model": model, "opt": opt}
            dcp.load(sd, checkpoint_id=str(folder / "fsdp2_train"))
            set_state_dict(self.net, self.opt, model_state_dict=sd["model"], optim_state_dict=sd["opt"])
        else:
            self.x.load_checkpoint(str(folder / "zero3_train"), tag="t")


# ------------------------------------------------------------------------------------------ the loop


def train_loop(
    cfg: dict[str, Any], resume_from: Callable[[], Any] | None, report: Callable[[int, Path], None] | None
) -> None:
    """The training every run shares. ``resume_from``: a context manager yielding the checkpoint folder to
    resume from (Ray's ``get_checkpoint().as_directory()``), or None; ``report(step, folder)``: hand a
    checkpoint folder on (Ray's report), or None. Rank 0 writes each engine's final EMA (and, with
    ``cfg["reference"]``, a plain-torch EMA of the full weights) into ``cfg["out"]``."""
    import tempfile

    import torch.distributed as dist

    import functional_ema as fe

    rank = dist.get_rank()
    models = {kind: _Trained(kind) for kind in KINDS}
    states = {kind: fe.init_ema(fe.local_shards(m.x)) for kind, m in models.items()}
    start = 0
    if resume_from is not None:
        with resume_from() as folder:
            for kind, m in models.items():
                m.load_training(Path(folder))
                states[kind] = fe.load(m.x, Path(folder) / f"ema_{kind}")
            start = int(states["ddp"].step)
    _record(cfg, rank=rank, start=start)
    refs = {kind: {n: t.clone() for n, t in m.full().items()} for kind, m in models.items()} if start == 0 else {}
    for step in range(start + 1, STEPS + 1):
        for kind, m in models.items():
            m.train(step)
            states[kind] = fe.update(states[kind], fe.local_shards(m.x), step, decay=DECAY)
            if cfg.get("reference"):
                for n, t in m.full().items():
                    refs[kind][n].lerp_(t, 1 - DECAY)
        _kill_once(cfg, step, rank)
        if report is not None and step % REPORT_EVERY == 0:
            folder = Path(tempfile.mkdtemp(prefix=f"fe_ray_r{rank}_"))
            for kind, m in models.items():
                m.save_training(folder)
                fe.save(states[kind], m.x, folder / f"ema_{kind}", f"step{step}", decay=DECAY, shared=False)
            report(step, folder)
    for kind, m in models.items():
        full = fe.gather_full(states[kind], m.x)
        if rank == 0:
            _write_final(cfg, kind, full, refs.get(kind, {}))


def reference_worker(out: str) -> None:
    """The uninterrupted run, without Ray: what a resumed run must equal."""
    train_loop({"out": out, "label": "reference", "reference": True}, None, None)


def ray_train_func(cfg: dict[str, Any]) -> None:
    """The function every Ray worker runs (Ray initialised the gloo process group)."""
    import shutil

    import ray.train

    checkpoint = ray.train.get_checkpoint()

    def report(step: int, folder: Path) -> None:
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(str(folder)))
        shutil.rmtree(folder)  # Ray's default (SYNC) upload leaves the reported folder to the caller

    train_loop(cfg, checkpoint.as_directory if checkpoint is not None else None, report)


# ------------------------------------------------------------------------------------------ the HF Trainer


def hf_loop(cfg: dict[str, Any], ray_mode: bool) -> None:
    """The HF Trainer (DeepSpeed ZeRO-3) with ``EMACallback(shared=False)``: each worker's own ``output_dir``
    with ``save_on_each_node=True``, as on nodes that share no folder. Under Ray, ``RayTrainReportCallback``
    (after ours: the EMA is in the folder it reports) and a resume from ``get_checkpoint()``. Rank 0 writes the
    final EMA (and, with ``cfg["reference"]``, a plain-torch EMA of DeepSpeed's full fp32 weights)."""
    import torch.distributed as dist
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import functional_ema as fe
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import BNNet, ReferenceEMA, RegressionData, hf_reference_callback, quiet_hf

    quiet_hf()
    rank, out, label = dist.get_rank(), Path(cfg["out"]), cfg["label"]

    class KillOnce(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _kill_once(cfg, state.global_step, rank)

    args = TrainingArguments(
        output_dir=str(out / f"{label}_worker{rank}"),  # this worker's own folder
        save_on_each_node=True,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="steps",
        save_steps=REPORT_EVERY,
        logging_steps=REPORT_EVERY,
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        deepspeed={
            "train_micro_batch_size_per_gpu": "auto",
            "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto",
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        },
        ddp_backend="gloo",
        dataloader_num_workers=0,
        use_cpu=True,
    )
    torch.manual_seed(0)
    ema = EMACallback(decay=DECAY, shared=False)
    ref, box = ReferenceEMA([DECAY]), {}
    callbacks: list[Any] = [ema, KillOnce()]
    if cfg.get("reference"):
        callbacks.append(hf_reference_callback(box, ref, buffers=False))
    if ray_mode:
        from ray.train.huggingface.transformers import RayTrainReportCallback

        callbacks.append(RayTrainReportCallback())
    trainer = Trainer(model=BNNet(), args=args, train_dataset=RegressionData(96, seed=1), callbacks=callbacks)
    box["t"] = trainer
    checkpoint = None
    if ray_mode:
        import ray.train

        checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:  # RayTrainReportCallback reports <folder>/checkpoint
            resume = Path(folder) / "checkpoint"
            _record(cfg, rank=rank, start=json.loads((resume / "trainer_state.json").read_text())["global_step"])
            trainer.train(resume_from_checkpoint=str(resume))
    else:
        _record(cfg, rank=rank, start=0)
        trainer.train()
    full = fe.gather_full(ema.state, trainer.model_wrapped)
    if rank == 0:
        _write_final(cfg, "hf", full, ref.emas[0] if ref.emas else {})


def hf_reference_worker(out: str) -> None:
    hf_loop({"out": out, "label": "reference", "reference": True}, ray_mode=False)


def hf_ray_train_func(cfg: dict[str, Any]) -> None:
    hf_loop(cfg, ray_mode=True)


# ------------------------------------------------------------------------------------------ Lightning


def lightning_loop(cfg: dict[str, Any], ray_mode: bool) -> None:
    """Lightning (DDP) with ``EMACallback(shared=False)``, one optimizer step per epoch. Under Ray:
    ``RayDDPStrategy``, ``RayLightningEnvironment`` and Ray's ``RayTrainReportCallback``, which saves a checkpoint
    into each worker's own folder at every epoch's end and reports it; a resume from ``get_checkpoint()``."""
    import lightning.pytorch as pl
    import torch.distributed as dist

    import functional_ema as fe
    from functional_ema.integrations.lightning import EMACallback
    from tests._integration_models import BNNet, ReferenceEMA, RegressionData, quiet

    quiet()
    rank = dist.get_rank()
    ref = ReferenceEMA([DECAY])

    class Lit(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = BNNet()

        def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
            return self.net(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> torch.utils.data.DataLoader:  # 2 ranks x 4: one step per epoch
            return torch.utils.data.DataLoader(RegressionData(8, seed=1), batch_size=4, shuffle=False)

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            _record(cfg, rank=rank, start=trainer.global_step)

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            step = trainer.global_step
            if cfg.get("reference") and ref.due(step):
                ref.feed(step, {n: p.detach().clone() for n, p in trainer.lightning_module.named_parameters()})
            _kill_once(cfg, step, rank)

    ema = EMACallback(decay=DECAY, shared=False)
    callbacks: list[Any] = [ema, Watch()]
    if ray_mode:
        from ray.train.lightning import RayDDPStrategy, RayLightningEnvironment, RayTrainReportCallback

        strategy: Any = RayDDPStrategy(process_group_backend="gloo")
        plugins, devices = [RayLightningEnvironment()], "auto"
        callbacks.append(RayTrainReportCallback())
    else:
        strategy, plugins, devices = pl.strategies.DDPStrategy(process_group_backend="gloo"), [], 2
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        plugins=plugins,
        max_epochs=STEPS,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    checkpoint = None
    if ray_mode:
        import ray.train
        from ray.train.lightning import prepare_trainer

        trainer = prepare_trainer(trainer)
        checkpoint = ray.train.get_checkpoint()
        report = ray.train.report

        def recording_report(*args: Any, checkpoint: Any = None, **kwargs: Any) -> None:  # what each worker hands on
            if checkpoint is not None:
                files = sorted(
                    str(f.relative_to(checkpoint.path)) for f in Path(checkpoint.path).rglob("*") if f.is_file()
                )
                _record(cfg, rank=rank, reported=files)
            report(*args, checkpoint=checkpoint, **kwargs)

        ray.train.report = recording_report  # Ray's RayTrainReportCallback calls ray.train.report at each epoch
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            trainer.fit(Lit(), ckpt_path=os.path.join(folder, "checkpoint.ckpt"))
    else:
        trainer.fit(Lit())
    full = fe.gather_full(ema.state, trainer.strategy.model)
    if rank == 0:
        _write_final(cfg, "lightning", full, ref.emas[0] if ref.emas else {})


def lightning_reference_worker(out: str) -> None:
    lightning_loop({"out": out, "label": "reference", "reference": True}, ray_mode=False)


def lightning_ray_train_func(cfg: dict[str, Any]) -> None:
    lightning_loop(cfg, ray_mode=True)


# ------------------------------------------------------------------------------------------ Ray on loopback


@contextlib.contextmanager
def _ray_temp() -> Iterator[dict[str, str]]:
    """A temp folder of this test's own for everything Ray and its workers write there (Ray's session folders,
    its lock files, Ray Train's ``lightning_checkpoints-*``), removed at the end: nothing is left in the system's
    temp folder. Yields the environment that points there (short: Ray's socket paths must fit 107 bytes)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="fe_ray_")
    try:
        yield {"RAY_TMPDIR": folder, "TMPDIR": folder}
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[None]:
    """A local Ray on loopback, 2 CPUs, no dashboard; its processes stopped at the end, by pid, and its temp
    folder removed (:func:`_ray_temp`)."""
    with _ray_temp() as temp:
        yield from _local_ray(temp)


def _local_ray(temp: dict[str, str]) -> Iterator[None]:
    env = {
        **temp,  # the workers' temp folder (their tempfile, Ray Train's Lightning checkpoints)
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TORCH_EXTENSIONS_DIR": extensions_dir(),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
        # Ray's controller takes the workers' reports (and sees a dead worker) at this interval, 2 s by default:
        # consecutive reports wait for it (docs/notes/ray-train-facts.md, 3.4).
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
        # A worker group starts in 10-25 s here (facts 3.5), against Ray's 60 s limit: a busy CI machine may need more.
        "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "300",
    }
    driver_keys = ("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "RAY_TMPDIR")
    saved = {key: os.environ.get(key) for key in driver_keys}
    os.environ.update({key: env[key] for key in driver_keys})  # the controller reads them from the driver too
    ray.init(
        _node_ip_address="127.0.0.1",
        _temp_dir=os.path.join(temp["RAY_TMPDIR"], "ray"),
        include_dashboard=False,
        num_cpus=2,
        object_store_memory=100 * 2**20,
        runtime_env={"env_vars": env},
        log_to_driver=False,
    )
    pids = _ray_pids()
    try:
        yield
    finally:
        ray.shutdown()
        _kill_left(pids)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _ray_pids() -> list[int]:
    node = ray._private.worker._global_node  # the processes this driver's ray.init started
    return [info.process.pid for infos in node.all_processes.values() for info in infos if info.process is not None]


def _kill_left(pids: list[int]) -> None:
    deadline = time.monotonic() + 10
    for pid in pids:
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


class _Watch:
    """TCP connections of this process's descendants (Ray's servers and workers), sampled every 0.5 s."""

    def __init__(self) -> None:
        self.outside: set[str] = set()  # connections whose peer is not a loopback address
        self.loopback = 0  # samples of connections with a loopback peer (the watch saw Ray talking)


@contextlib.contextmanager
def _loopback_only() -> Iterator[_Watch]:
    import ipaddress
    import threading

    import psutil

    watch, stop = _Watch(), threading.Event()

    def loopback(ip: str) -> bool:
        addr = ipaddress.ip_address(ip)
        mapped = getattr(addr, "ipv4_mapped", None)
        return (mapped or addr).is_loopback

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            for proc in [me, *me.children(recursive=True)]:
                try:
                    conns, name = proc.net_connections(kind="tcp"), proc.name()
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                for c in conns:
                    if not c.raddr:
                        continue  # a listening socket (torch's TCPStore listens on every address; facts 4.3)
                    if loopback(c.raddr.ip):
                        watch.loopback += 1
                    else:
                        watch.outside.add(f"{name}: {c.laddr.ip}:{c.laddr.port} -> {c.raddr.ip}:{c.raddr.port}")
            stop.wait(0.5)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield watch
    finally:
        stop.set()
        thread.join()


def _fit(
    cfg: dict[str, Any], storage_path: str, storage_filesystem: Any = None, func: Callable[..., None] | None = None
) -> Any:
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        func or ray_train_func,
        train_loop_config=cfg,
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            storage_path=storage_path,
            storage_filesystem=storage_filesystem,
            name=cfg["label"],
            failure_config=FailureConfig(max_failures=1),
        ),
    )
    return trainer.fit()


# ------------------------------------------------------------------------------------------ the tests


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference")
    run_ranks("tests.test_ray_train:reference_worker", world_size=2, timeout=600, out=str(out))
    run_ranks("tests.test_ray_train:hf_reference_worker", world_size=2, timeout=600, out=str(out))
    run_ranks("tests.test_ray_train:lightning_reference_worker", world_size=2, timeout=600, out=str(out))
    return out


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    import safetensors.torch

    return safetensors.torch.load_file(path)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n], b[n]) for n in a)


def test_reference_run_is_the_plain_torch_ema(reference: Path) -> None:
    for kind in (*KINDS, "hf", "lightning"):
        got, plain = (
            _tensors(reference / f"reference_{kind}.safetensors"),
            _tensors(reference / f"plain_{kind}.safetensors"),
        )
        assert _equal(got, plain), kind


def _check_killed_run(
    out: Path, label: str, reference: Path, kinds: tuple[str, ...] = KINDS, resumable: tuple[int, ...] = (2, 4)
) -> list[int]:
    """The run was killed once and resumed from a checkpoint (one of the steps ``resumable``: Ray may commit the
    last report before the kill or not; facts 3.2); each final EMA equals the reference's, bitwise."""
    assert (out / f"killed_{label}").exists()
    events = [json.loads(line) for line in (out / f"events_{label}.jsonl").read_text().splitlines()]
    starts = [e["start"] for e in events if "start" in e]
    assert starts[:2] == [0, 0] and len(starts) == 4 and starts[2] == starts[3] and starts[2] in resumable, starts
    for kind in kinds:
        got = _tensors(out / f"{label}_{kind}.safetensors")
        assert _equal(got, _tensors(reference / f"reference_{kind}.safetensors")), (label, kind)
    return starts


def test_killed_worker_resumes_bitwise_bucket_storage_and_exports(
    local_ray, reference: Path, tmp_path: Path, monkeypatch
) -> None:
    """``storage_path`` a bucket on the local S3 server (pyarrow's ``S3FileSystem``): the killed and resumed run's
    EMAs equal the uninterrupted ones; the last checkpoint, read from the bucket, consolidates to them; exported
    from the bucket by URL with the command line, it loads as the EMA with ``from_pretrained``."""
    import fsspec
    import pyarrow.fs
    from transformers import LlamaForCausalLM

    import functional_ema as fe
    from functional_ema._testing.s3 import s3_server

    out = tmp_path / "out"
    out.mkdir()
    with s3_server(tmp_path / "s3") as s3:
        s3.make_bucket("fe-ray")
        host = s3.endpoint.removeprefix("http://")
        bucket = pyarrow.fs.S3FileSystem(
            access_key=s3.key, secret_key=s3.secret, endpoint_override=host, scheme="http", region="us-east-1"
        )
        with _loopback_only() as watch:
            result = _fit({"out": str(out), "label": "bucket", "kill": True}, "fe-ray/runs", bucket)
        assert result.error is None, result.error
        assert not watch.outside and watch.loopback > 0, (watch.outside, watch.loopback)  # Ray stayed on loopback
        _check_killed_run(out, "bucket", reference)
        # the last committed checkpoint (step 6), read from the bucket: the workers' merged folders, one
        # ordinary EMA checkpoint per engine
        monkeypatch.setitem(
            fsspec.config.conf,
            "s3",
            {
                "key": s3.key,
                "secret": s3.secret,
                "endpoint_url": s3.endpoint,
                "client_kwargs": {"region_name": "us-east-1"},
            },
        )
        for kind in KINDS:
            got = fe.consolidate(f"s3://{result.checkpoint.path}/ema_{kind}")
            assert _equal(got, _tensors(reference / f"reference_{kind}.safetensors")), kind
        url = f"s3://{result.checkpoint.path}/ema_ddp"
        assert url.startswith("s3://fe-ray/runs/bucket/checkpoint_"), url
        like = tmp_path / "like"
        tiny_llama().save_pretrained(like)
        env = {
            **os.environ,
            "FSSPEC_S3_KEY": s3.key,
            "FSSPEC_S3_SECRET": s3.secret,
            "FSSPEC_S3_ENDPOINT_URL": s3.endpoint,
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        cli = subprocess.run(
            [sys.executable, "-m", "functional_ema", "export", url, str(tmp_path / "hf"), "--like", str(like)],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert cli.returncode == 0, cli.stderr[-3000:]
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "hf").state_dict()
    want = _tensors(reference / "reference_ddp.safetensors")
    assert sorted(want) == sorted(n for n in loaded if n in want) and all(
        torch.equal(loaded[n], want[n]) for n in want
    ), [n for n in want if not torch.equal(loaded[n], want[n])]


def test_hf_trainer_under_ray_resumes_bitwise(local_ray, reference: Path, tmp_path: Path) -> None:
    """The HF Trainer (DeepSpeed ZeRO-3) in Ray's workers, ``EMACallback(shared=False)`` before
    ``RayTrainReportCallback``, a worker killed after a report: the resumed EMA equals the uninterrupted one."""
    import functional_ema as fe

    out = tmp_path / "out"
    out.mkdir()
    result = _fit({"out": str(out), "label": "hf", "kill": True}, str(tmp_path / "storage"), func=hf_ray_train_func)
    assert result.error is None, result.error
    _check_killed_run(out, "hf", reference, kinds=("hf",))
    ema = Path(result.checkpoint.path) / "checkpoint" / "ema"  # the merged workers' folders: one checkpoint
    assert _equal(fe.consolidate(ema), _tensors(reference / "reference_hf.safetensors"))


def test_lightning_under_ray_resumes_bitwise(local_ray, reference: Path, tmp_path: Path) -> None:
    """Lightning in Ray's workers (``RayDDPStrategy``, Ray's ``RayTrainReportCallback`` saving into each worker's
    own folder at every epoch's end), ``EMACallback(shared=False)``, a worker killed after a report: the resumed
    EMA equals the uninterrupted one, and the last checkpoint's EMA (beside ``checkpoint.ckpt``) consolidates to it."""
    import functional_ema as fe

    out = tmp_path / "out"
    out.mkdir()
    result = _fit(
        {"out": str(out), "label": "lightning", "kill": True}, str(tmp_path / "storage"), func=lightning_ray_train_func
    )
    assert result.error is None, result.error
    _check_killed_run(out, "lightning", reference, kinds=("lightning",), resumable=(3, 4))
    # every worker's reported folder holds the EMA beside its checkpoint (each rank's own path, not rank 0's)
    reports = [json.loads(line) for line in (out / "events_lightning.jsonl").read_text().splitlines()]
    reports = [e for e in reports if "reported" in e]
    assert {e["rank"] for e in reports} == {0, 1} and len(reports) >= 2 * STEPS, reports
    for e in reports:
        manifests = [
            f for f in e["reported"] if f.startswith("checkpoint.ckpt.ema/ema/") and f.endswith("/ema_manifest.json")
        ]
        assert len(manifests) == 1, e
    ema = Path(result.checkpoint.path) / "checkpoint.ckpt.ema" / "ema"
    assert _equal(fe.consolidate(ema), _tensors(reference / "reference_lightning.safetensors"))


def test_example_runs_and_its_checkpoint_consolidates(tmp_path: Path) -> None:
    """examples/ray_train_ema.py as a user runs it (its own Ray, ``--local``): exit 0, and Ray's last checkpoint
    is a complete EMA checkpoint of the last step. Its processes (Ray's included) die with its process group."""
    import functional_ema as fe

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(TORCH_EXTENSIONS_DIR=extensions_dir(), OMP_NUM_THREADS="1")
    argv = [sys.executable, str(ROOT / "examples" / "ray_train_ema.py"), "--local", "--steps", "2", "--every", "2"]
    with _ray_temp() as temp:
        proc = subprocess.Popen(
            [*argv, "--storage", str(tmp_path / "storage")],
            env={**env, **temp},
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=600)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        assert any((Path(temp["RAY_TMPDIR"]) / "ray").glob("session_*"))  # Ray's session folder: here, not /tmp
    text = output.decode(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    line = next((x for x in text.splitlines() if x.startswith("EMA of step 2 in ")), None)
    assert line is not None, text[-4000:]
    folder = Path(line.removeprefix("EMA of step 2 in ").split(":")[0])
    assert folder.is_relative_to(tmp_path / "storage") and folder.name == "ema", folder
    full = fe.consolidate(folder)
    manifest = fe.checkpoint.read_manifest(folder)
    assert sorted(full) == ["0.bias", "0.weight", "2.bias", "2.weight"] and manifest["step"] == 2, manifest
