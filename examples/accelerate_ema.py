"""Accelerate + DeepSpeed ZeRO-3 on CPU, gradient accumulation 2, with an EMA that follows
``accelerator.save_state`` / ``load_state``.

    torchrun --nproc_per_node 2 examples/accelerate_ema.py --out runs/acc            # train, save at step 4
    torchrun --nproc_per_node 2 examples/accelerate_ema.py --out runs/acc --resume   # continue from runs/acc/ckpt
"""

import argparse

import torch
from accelerate import Accelerator, DeepSpeedPlugin, PartialState
from torch import nn

import functional_ema as fe
from functional_ema.integrations.accelerate import AcceleratorEMA

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/accelerate_ema")
parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
parser.add_argument("--save-at", type=int, default=4)
parser.add_argument("--stop-at", type=int, default=None, help="stop right after this step (as if killed)")
parser.add_argument("--resume", action="store_true")
parser.add_argument("--async-save", action="store_true", help="write the EMA files in the background")
args = parser.parse_args()

GA = 2
DS_CONFIG = {  # runs on CPU: ZeRO-3, the client optimizer below, no fused ops to build
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": GA,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 10**9,
}
# On CPU: set up the CPU ranks (gloo) first; Accelerator(cpu=True) would turn DeepSpeed off. On GPUs
# drop this line.
PartialState(cpu=True)
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=DS_CONFIG), gradient_accumulation_steps=GA)
assert accelerator.distributed_type == "DEEPSPEED", accelerator.distributed_type

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
model, optimizer = accelerator.prepare(model, optimizer)
ema = AcceleratorEMA(
    accelerator, model, decay=[0.9, fe.schedules.power(sigma_rel=0.1)], buffers="average", async_save=args.async_save
)
ckpt = f"{args.out}/ckpt"
if args.resume:
    accelerator.load_state(ckpt)  # DeepSpeed's engine, then the EMA (any world size: it reshards)

w_true = torch.randn(16, 1, generator=torch.Generator().manual_seed(1))


def batch(i: int, n: int = 4):
    g = torch.Generator().manual_seed(1000 * i + accelerator.process_index)
    x = torch.randn(n, 16, generator=g)
    return x, x @ w_true + 0.3 * torch.randn(n, 1, generator=g)


micro = ema.optimizer_step * GA  # a resumed run continues with the next micro-batch
while ema.optimizer_step < args.steps:
    x, y = batch(micro)
    micro += 1
    with accelerator.accumulate(model):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    if ema.step() and ema.optimizer_step == args.save_at:  # True when the optimizer stepped
        accelerator.save_state(ckpt)
    if args.stop_at is not None and ema.optimizer_step == args.stop_at:
        raise SystemExit(0)

x_val, y_val = batch(10**6, 256)
model.eval()
with torch.no_grad():
    raw = nn.functional.mse_loss(model(x_val), y_val).item()
    with ema.swapped():  # EMA 0's weights and BatchNorm statistics
        ema_loss = nn.functional.mse_loss(model(x_val), y_val).item()
accelerator.print(f"step {ema.optimizer_step}: raw eval loss {raw:.4f}, EMA eval loss {ema_loss:.4f}")
ema.wait()  # with --async-save: the step-4 EMA files are complete (exiting would wait for them too)
ema.export(f"{args.out}/ema.safetensors")  # consolidated EMA 0 + buffers, loads with strict=True
