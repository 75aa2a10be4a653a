"""Resume a DeepSpeed run and its EMA at another world size or ZeRO stage (CPU, gloo).

    torchrun --nproc_per_node 2 examples/resume_other_world.py train  --out runs/rw --stage 3
    torchrun --nproc_per_node 1 examples/resume_other_world.py resume --out runs/rw --stage 3   # universal checkpoint
    torchrun --nproc_per_node 1 examples/resume_other_world.py resume --out runs/rw --stage 2   # weights only

DeepSpeed's own ``load_checkpoint`` refuses a new world size. Two ways around it, with the EMA the
same in both (``fe.load`` reshards it to any world size and stage):

* same ZeRO stage: convert the checkpoint to a *universal* one (``ds_to_universal``) and load it
  with ``"checkpoint": {"load_universal": true}``: weights, optimizer state and step come back;
* another ZeRO stage (DeepSpeed 0.19's universal loader expects the module-state file of the
  saving stage): load the fp32 weights with DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint``
  before ``deepspeed.initialize``, start the optimizer afresh (what ``load_optimizer_states=False``
  means) and take the step from the EMA checkpoint: ``engine.global_steps = int(state.step)``.
"""

import argparse

import deepspeed
import torch
import torch.distributed as dist
from torch import nn

import functional_ema as fe

parser = argparse.ArgumentParser()
parser.add_argument("phase", choices=["train", "resume"])
parser.add_argument("--out", default="runs/resume_other_world")
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--steps", type=int, default=4, help="steps before the checkpoint")
parser.add_argument("--more", type=int, default=2, help="steps after the resume")
args, _ = parser.parse_known_args()  # the deepspeed launcher appends --local_rank

deepspeed.init_distributed(dist_backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
TAG = f"global_step{args.steps}"


def config(stage: int, universal: bool = False) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    return cfg


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 33), nn.GELU(), nn.Linear(33, 1))


def train_step(engine, step: int) -> None:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(4, 16, generator=g)
    loss = nn.functional.mse_loss(engine(x), x[:, :1])
    engine.backward(loss)
    engine.step()


if args.phase == "train":
    model = make_model()
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config(args.stage)
    )
    state = fe.init_ema(fe.local_shards(engine))
    for step in range(1, args.steps + 1):
        train_step(engine, step)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.9)
    fe.save(state, engine, args.out)  # EMA first ...
    engine.save_checkpoint(args.out)  # ... then DeepSpeed (writes `latest`)
    if rank == 0:  # a universal copy, for a resume at another world size
        from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

        ds_to_universal(
            argparse.Namespace(
                input_folder=f"{args.out}/{TAG}",
                output_folder=f"{args.out}/{TAG}_universal",
                num_extract_workers=1,
                num_merge_workers=1,
                keep_temp_folder=False,
                strict=True,
                inject_missing_state=True,
            )
        )
    dist.barrier()
else:
    saved_stage = fe.checkpoint.read_manifest(args.out, TAG)["zero_stage"]
    model = make_model()
    if args.stage == saved_stage:  # universal checkpoint: weights, optimizer state and step
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2),
            config=config(args.stage, universal=True),
        )
        engine.load_checkpoint(args.out, tag=f"{TAG}_universal")
        state = fe.load(engine, args.out, TAG)  # the EMA, resharded for this world size
    else:  # another stage: fp32 weights, a fresh optimizer, the step from the EMA checkpoint
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(args.out, TAG))
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=config(args.stage)
        )
        state = fe.load(engine, args.out, TAG)
        engine.global_steps = int(state.step)
    assert engine.global_steps == int(state.step) == args.steps
    for step in range(args.steps + 1, args.steps + 1 + args.more):  # training and the EMA go on
        train_step(engine, step)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.9)
    if rank == 0:
        print(
            f"resumed at world size {world}, ZeRO-{args.stage} (saved at ZeRO-{saved_stage}); EMA at step {int(state.step)}"
        )
