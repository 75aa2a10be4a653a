"""The README quickstart for a plain PyTorch model (or a DDP one): EMA, eval, save, load, export.

python examples/quickstart_module.py --out runs/quickstart_module
"""

import argparse

import torch
from torch import nn

import functional_ema as fe

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--out", default="runs/quickstart_module", help="checkpoint directory")
parser.add_argument("--steps", type=int, default=200)
args = parser.parse_args()

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 1))
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
w_true = torch.randn(16, 1)


def batch(n=64):
    x = torch.randn(n, 16)
    return x, x @ w_true + 0.3 * torch.randn(n, 1)


state = fe.init_ema(fe.local_shards(model))  # fp32 copy of the trainable parameters
schedule = fe.schedules.warmup(max_decay=0.999)
for step in range(1, args.steps + 1):
    x, y = batch()
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    state = fe.update(state, fe.local_shards(model), step, decay=schedule)

x_val, y_val = batch(4096)
with torch.no_grad():
    raw = nn.functional.mse_loss(model(x_val), y_val).item()
    with fe.swapped(model, state):  # the model computes with the EMA weights inside
        ema = nn.functional.mse_loss(model(x_val), y_val).item()
print(f"raw eval loss {raw:.4f}, EMA eval loss {ema:.4f}")

fe.save(state, model, args.out, decay=schedule)  # tag global_step<step>; ema_latest points at it
restored = fe.load(model, args.out)  # follows ema_latest
assert int(restored.step) == args.steps
full = fe.consolidate(args.out)  # offline: from the files alone
gathered = fe.gather_full(state, model)
print("consolidated == gathered:", all(torch.equal(full[n], gathered[n]) for n in gathered))
