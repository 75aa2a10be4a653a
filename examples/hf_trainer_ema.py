"""Hugging Face Trainer + DeepSpeed ZeRO-3 on CPU (2 ranks), gradient accumulation 2, with an EMA:
EMA evaluation logged as eval_ema_*, the EMA saved in every checkpoint folder, exported at the end.

    torchrun --nproc_per_node 2 examples/hf_trainer_ema.py --out runs/hf_ema
    torchrun --nproc_per_node 2 examples/hf_trainer_ema.py --out runs/hf_ema --resume   # from the last checkpoint
"""

import argparse

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from functional_ema.integrations.transformers import EMACallback

parser = argparse.ArgumentParser()
parser.add_argument("--out", default="runs/hf_ema")
parser.add_argument("--resume", action="store_true")
args, _ = parser.parse_known_args()

DS_CONFIG = {  # a DeepSpeed config that runs on CPU: ZeRO-3, the Trainer's AdamW, "auto" from the arguments
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "zero_optimization": {"stage": 3},
    "zero_allow_untested_optimizer": True,
}


class Regressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 1))

    def forward(self, x, labels=None):
        y = self.net(x)
        return {"loss": nn.functional.mse_loss(y, labels), "logits": y}


class Data(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 16, generator=g)
        self.y = self.x @ torch.randn(16, 1, generator=torch.Generator().manual_seed(1)) + 0.3 * torch.randn(
            n, 1, generator=g
        )

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


training_args = TrainingArguments(
    output_dir=args.out,
    max_steps=16,
    per_device_train_batch_size=8,
    gradient_accumulation_steps=2,
    learning_rate=3e-3,
    eval_strategy="steps",
    eval_steps=8,
    save_steps=8,
    logging_steps=8,
    deepspeed=DS_CONFIG,
    use_cpu=True,
    ddp_backend="gloo",
    report_to=[],
    disable_tqdm=True,
)
torch.manual_seed(0)
ema = EMACallback(decay=0.99, buffers="average", export_path=f"{args.out}/ema.safetensors")
trainer = Trainer(
    model=Regressor(), args=training_args, train_dataset=Data(512, 0), eval_dataset=Data(128, 2), callbacks=[ema]
)
trainer.train(resume_from_checkpoint=True if args.resume else None)
metrics = next(h for h in reversed(trainer.state.log_history) if "eval_ema_loss" in h)
metrics.update(next(h for h in reversed(trainer.state.log_history) if "eval_loss" in h))
if trainer.is_world_process_zero():
    print({k: round(v, 4) for k, v in metrics.items() if k in ("eval_loss", "eval_ema_loss")})
