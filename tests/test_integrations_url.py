"""The integrations' checkpoints in a bucket (issue 37, item 3): ``EMAController.save`` / ``load`` and the Lightning
callback at an fsspec URL, against a real S3 server (SeaweedFS on loopback, ``functional_ema._testing.s3``), 2 ranks
(gloo), one launch each, every check batched into it. The credentials reach the ranks only as fsspec's configuration
(``FSSPEC_S3_KEY`` / ``_SECRET`` / ``_ENDPOINT_URL``), which Lightning's fsspec use and ours both read.

* The controller (a DDP model): a save before the EMA started writes only the checksummed ``integration.json``
  object; a load of it honours it (not started, the saved step) and refuses another framework step; the save
  after the start is bitwise the state when loaded back by a fresh controller (on every rank), removes the
  superseded record, and the async save (``async_save=True``) too once waited for; an empty prefix is refused as
  incomplete; ``shared=False`` with a URL is refused naming it; nothing is ever written to a local ``s3:`` folder.
* Lightning (DDP, ``ModelCheckpoint(dirpath="s3://...")``): the EMA of a 3-epoch fit is bitwise a plain-torch EMA
  of the full weights (and buffers) taken at each optimizer step; the top-1 rotation removes each older
  checkpoint's EMA objects under its ``.ema`` prefix, by their exact names, and nothing else (decoy objects sharing
  the prefix's name stay, and so do a user's objects inside the prefix, beside the tag and in it); a 2-epoch fit into
  another prefix, resumed from its ``s3://`` checkpoint for a third epoch, ends bitwise on the uninterrupted EMA.
* Without a server: a URL reaching the Accelerate or HF Trainer callbacks' folders is refused naming the argument.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from functional_ema._testing.multirank import raised, run_ranks

pytest.importorskip("s3fs")

BUCKET = "fe-integrations"
DECAYS = (0.8, 0.5)
START, EVERY = 2, 2


def _env(srv: Any) -> dict[str, str]:
    """fsspec's configuration for the server: what the ranks (ours and Lightning's fsspec use) read."""
    return {
        "FSSPEC_S3_KEY": srv.key,
        "FSSPEC_S3_SECRET": srv.secret,
        "FSSPEC_S3_ENDPOINT_URL": srv.endpoint,
        "AWS_DEFAULT_REGION": "us-east-1",
    }


def _listing(prefix: str) -> list[str]:
    import fsspec

    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    return sorted(p.removeprefix(prefix + "/") for p in fs.find(prefix))


def _same(a: Any, b: Any) -> bool:
    return int(a.step) == int(b.step) and all(
        sorted(x) == sorted(y) and all(torch.equal(x[n], y[n]) for n in x) for x, y in zip(a.emas, b.emas)
    )


# ------------------------------------------------------------------------------------------------ the controller


def controller_worker(root: str) -> dict:
    import torch.distributed as dist

    from functional_ema._testing.multirank import ddp_trained
    from functional_ema.integrations._common import EMAController

    os.chdir(root)  # a URL taken for a path would make ./s3: here
    rank = dist.get_rank()
    url = f"s3://{BUCKET}/ctl/ckpt"
    x, train, _ = ddp_trained(rank)
    out: dict[str, Any] = {}
    ema = EMAController(list(DECAYS), start_step=3)
    ema.on_step(x, 1)  # before start_step: nothing to save but the record
    out["unstarted_returned"] = ema.save(x, url, 1)
    dist.barrier()
    out["unstarted_listing"] = _listing(f"{BUCKET}/ctl/ckpt")
    fresh = EMAController(list(DECAYS), start_step=3)
    out["unstarted_load"] = [fresh.load(x, url, 1), fresh.state is None]
    out["unstarted_other_step"] = raised(lambda: EMAController(list(DECAYS), start_step=3).load(x, url, 2))
    for step in (2, 3, 4, 5):
        train(step)
        ema.on_step(x, step)
    out["returned"] = ema.save(x, url, 5)
    dist.barrier()
    out["listing"] = _listing(f"{BUCKET}/ctl/ckpt")
    fresh = EMAController(list(DECAYS), start_step=3)
    out["loaded_step"] = fresh.load(x, url, 5)
    out["bitwise"] = fresh.state is not None and ema.state is not None and _same(fresh.state, ema.state)
    # async: the same through AsyncSaver, committed at wait()
    train(6)
    ema.on_step(x, 6)
    background = EMAController(list(DECAYS), start_step=3, async_save=True)
    background.state = ema.state
    background.save(x, url + "-async", 6)
    background.wait()
    fresh = EMAController(list(DECAYS), start_step=3)
    out["async_loaded_step"] = fresh.load(x, url + "-async", 6)
    out["async_bitwise"] = fresh.state is not None and ema.state is not None and _same(fresh.state, ema.state)
    out["empty"] = raised(lambda: EMAController(list(DECAYS), start_step=3).load(x, f"s3://{BUCKET}/ctl/none", 6))
    out["private"] = raised(lambda: EMAController(list(DECAYS), shared=False).save(x, url, 6))
    out["local_s3_folder"] = Path(root, "s3:").exists()
    return out


def test_controller_save_load_by_url(tmp_path: Path) -> None:
    from functional_ema._testing.s3 import s3_server

    with s3_server(tmp_path / "srv") as srv:
        srv.make_bucket(BUCKET)
        res = run_ranks(
            "tests.test_integrations_url:controller_worker",
            world_size=2,
            timeout=600,
            env=_env(srv),
            root=str(tmp_path),
        )
    url = f"s3://{BUCKET}/ctl/ckpt"
    for r in res:
        assert r["unstarted_returned"] == f"{url}/ema"
        assert r["unstarted_listing"] == ["ema/integration.json"]  # the record alone: no EMA yet
        assert r["unstarted_load"] == [1, True]
        name, msg = r["unstarted_other_step"]
        assert name == "CheckpointMismatchError" and "saved at framework step 1" in msg and "step 2" in msg, msg
        assert r["returned"] == f"{url}/ema"
        # the local format's objects; the superseded record removed
        assert "ema/ema_manifest.json" in r["listing"] and "ema/integration.json" not in r["listing"], r["listing"]
        assert "ema_latest" in r["listing"] and not any(".ema_store." in n for n in r["listing"])
        assert r["loaded_step"] == 5 and r["bitwise"] is True
        assert r["async_loaded_step"] == 6 and r["async_bitwise"] is True
        name, msg = r["empty"]
        assert name == "IncompleteCheckpointError" and f"s3://{BUCKET}/ctl/none/ema" in msg, msg
        name, msg = r["private"]
        assert name == "ValueError" and "shared=False" in msg and url in msg, msg
        assert r["local_s3_folder"] is False


# --------------------------------------------------------------------------------------------------- Lightning


def _lit_module() -> Any:
    import lightning.pytorch as pl

    from tests._integration_models import BNNet, RegressionData

    class LitNet(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = BNNet()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch["x"], batch["labels"])["loss"]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(RegressionData(32, seed=1), batch_size=4, shuffle=False)

    return LitNet()


def _reference(ref: Any) -> Any:
    """A callback feeding ``ref`` (a plain-torch EMA) the full weights and buffers at each optimizer step."""
    import lightning.pytorch as pl

    from tests._integration_models import float_buffers

    class Reference(pl.Callback):
        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if ref.due(trainer.global_step):
                import functional_ema as fe

                weights = {n: p.detach().clone().float() for n, p in pl_module.named_parameters()}
                ref.feed(
                    trainer.global_step, weights, float_buffers(fe.engines.adapter_for(trainer.strategy.model).module())
                )

    return Reference()


def _fit(dirpath: str, epochs: int, top_k: int, extra: list, ckpt_path: str | None = None) -> Any:
    import lightning.pytorch as pl

    from functional_ema.integrations.lightning import EMACallback

    ema = EMACallback(decay=list(DECAYS), start_step=START, every_n_steps=EVERY, buffers="average")
    ckpt = pl.callbacks.ModelCheckpoint(dirpath=dirpath, every_n_epochs=1, save_top_k=top_k)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=pl.strategies.DDPStrategy(process_group_backend="gloo"),
        max_epochs=epochs,
        accumulate_grad_batches=2,
        callbacks=[ema, ckpt, *extra],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=os.getcwd(),
    )
    trainer.fit(_lit_module(), ckpt_path=ckpt_path)
    return trainer, ema


def lightning_worker(root: str) -> dict:
    import fsspec
    import torch.distributed as dist

    import functional_ema as fe
    from tests._integration_models import ReferenceEMA, equal, quiet

    quiet()
    os.chdir(root)  # a URL taken for a path would make ./s3: here
    rank = dist.get_rank()
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    decoys = [f"{BUCKET}/full/epoch=0-step=2.ckpt.emax/keep", f"{BUCKET}/full/keep.txt"]
    # a user's objects inside a rotated checkpoint's EMA prefix: not the callback's
    decoys += [
        f"{BUCKET}/full/epoch=0-step=2.ckpt.ema/notes.txt",
        f"{BUCKET}/full/epoch=0-step=2.ckpt.ema/ema/mine.json",
    ]
    if rank == 0:
        for d in decoys:
            fs.pipe_file(d, b"not the callback's")
    dist.barrier()
    out: dict[str, Any] = {}
    ref = ReferenceEMA(DECAYS, start=START, every=EVERY)
    trainer, ema = _fit(f"s3://{BUCKET}/full", 3, 1, [_reference(ref)])  # 2 optimizer steps an epoch
    target = trainer.strategy.model
    full = [fe.gather_full(ema.state, target, index=k) for k in range(2)]
    out["steps"] = [trainer.global_step, int(ema.state.step)]
    out["bitwise"] = [equal(full[k], ref.emas[k]) for k in range(2)]
    out["buffers_bitwise"] = [equal(ema.ema.buffer_state.emas[k], ref.buffers[k]) for k in range(2)]
    dist.barrier()
    out["listing"] = _listing(f"{BUCKET}/full")
    _fit(f"s3://{BUCKET}/part", 2, -1, [])
    dist.barrier()
    out["part_listing"] = _listing(f"{BUCKET}/part")
    trainer, ema = _fit(f"s3://{BUCKET}/part", 3, -1, [], ckpt_path=f"s3://{BUCKET}/part/epoch=1-step=4.ckpt")
    resumed = [fe.gather_full(ema.state, trainer.strategy.model, index=k) for k in range(2)]
    out["resumed_steps"] = [trainer.global_step, int(ema.state.step)]
    out["resumed_bitwise"] = [equal(resumed[k], full[k]) for k in range(2)]
    out["local_s3_folder"] = Path(root, "s3:").exists()
    return out


def test_lightning_checkpoints_in_a_bucket(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from functional_ema._testing.s3 import s3_server

    with s3_server(tmp_path / "srv") as srv:
        srv.make_bucket(BUCKET)
        res = run_ranks(
            "tests.test_integrations_url:lightning_worker", world_size=2, timeout=600, env=_env(srv), root=str(tmp_path)
        )
    last = "epoch=2-step=6.ckpt"
    for r in res:
        assert r["steps"] == [6, 6] and r["bitwise"] == [True, True] and r["buffers_bitwise"] == [True, True]
        listing = r["listing"]
        # the top-1 rotation removed the older checkpoints and their EMA objects; the decoys stay, and only they
        users = ["epoch=0-step=2.ckpt.ema/ema/mine.json", "epoch=0-step=2.ckpt.ema/notes.txt"]
        assert [n for n in listing if n.startswith("epoch=0-step=2.ckpt.ema/")] == users, listing
        assert {n.split("/")[0] for n in listing} == {
            last,
            f"{last}.ema",
            "epoch=0-step=2.ckpt.ema",
            "epoch=0-step=2.ckpt.emax",
            "keep.txt",
        }
        assert not [n for n in listing if n.startswith("epoch=1-step=4.ckpt")], listing
        assert f"{last}.ema/ema/ema_manifest.json" in listing and f"{last}.ema/ema_latest" in listing
        assert {f"epoch={e}-step={2 * e + 2}.ckpt.ema/ema/ema_manifest.json" for e in (0, 1)} <= set(r["part_listing"])
        assert r["resumed_steps"] == [6, 6] and r["resumed_bitwise"] == [True, True]
        assert r["local_s3_folder"] is False


# ------------------------------------------------------------------------------------- folders that stay local


def test_local_only_callbacks_refuse_a_url(tmp_path: Path) -> None:
    """Accelerate and the HF Trainer write their own checkpoints with local file I/O: a URL reaching the EMA's
    folder there is refused naming the argument (no EMA in a bucket beside a checkpoint in a local ``s3:``)."""
    from functional_ema.integrations._common import local_folder

    with pytest.raises(ValueError, match=r"accelerator.save_state\(output_dir\)='s3://b/x' is a URL.*Accelerate"):
        local_folder("s3://b/x", "accelerator.save_state(output_dir)", "Accelerate")
    assert local_folder(str(tmp_path), "output_dir", "Accelerate") == tmp_path
    pytest.importorskip("accelerate")
    import accelerate

    from functional_ema.integrations.accelerate import AcceleratorEMA

    model = torch.nn.Linear(3, 2)
    ema = AcceleratorEMA(accelerate.Accelerator(cpu=True), model, decay=0.5)
    with pytest.raises(ValueError, match=r"accelerator.load_state\(input_dir\)='s3://b/x' is a URL"):
        ema._on_load([model], "s3://b/x")
    with pytest.raises(ValueError, match=r"accelerator.save_state\(output_dir\)='s3://b/x' is a URL"):
        ema._on_save([model], [], "s3://b/x")
    assert not Path("s3:").exists()
