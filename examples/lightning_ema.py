"""PyTorch Lightning (DDP on 2 CPU ranks) with two power EMAs, post-hoc snapshots, EMA validation,
resumable checkpoints and a final export; then a post-hoc EMA of another length, evaluated in place.

    torchrun --nproc_per_node 2 examples/lightning_ema.py --out runs/lightning_ema
"""

import argparse

import lightning.pytorch as pl
import torch
from torch import nn

import functional_ema as fe
from functional_ema.integrations.lightning import EMACallback

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/lightning_ema")
parser.add_argument("--epochs", type=int, default=4)
args = parser.parse_args()


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch, _):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(x), y), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3)


def data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) + 0.3 * torch.randn(n, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


powers = [fe.schedules.power(sigma_rel=0.05), fe.schedules.power(sigma_rel=0.10)]
ema = EMACallback(
    decay=powers,  # two EMAs in one state
    buffers="average",  # BatchNorm statistics averaged too
    posthoc_dir=f"{args.out}/snapshots",
    posthoc_every=2,  # snapshots for post-hoc EMA
    export_path=f"{args.out}/ema.safetensors",  # consolidated EMA 0 at the end
)
trainer = pl.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_epochs=args.epochs,
    accumulate_grad_batches=2,
    callbacks=[ema, pl.callbacks.ModelCheckpoint(dirpath=f"{args.out}/ckpt", save_top_k=-1)],
    logger=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
model = Net()
trainer.fit(model, data(512, 0), data(256, 2))  # validation runs with EMA 0 swapped in
# resume later: trainer.fit(model, ..., ckpt_path=f"{args.out}/ckpt/epoch=1-step=16.ckpt")

# After training: the EMA of sigma_rel 0.08, synthesised from the snapshots, this rank's pieces only,
# fed into fe.swapped like any state.
pieces = fe.posthoc.posthoc_local(f"{args.out}/snapshots", fe.shard_layout(model), sigma_rel=0.08)
posthoc_state = fe.EmaState(torch.tensor(trainer.global_step), (pieces,))
x, y = next(iter(data(256, 3)))
model.eval()
with torch.no_grad():
    live = nn.functional.mse_loss(model.net(x), y).item()
    with fe.swapped(model, posthoc_state):
        post = nn.functional.mse_loss(model.net(x), y).item()
if trainer.is_global_zero:
    print(f"step {trainer.global_step}: live {live:.4f}, post-hoc sigma_rel=0.08 {post:.4f}")
