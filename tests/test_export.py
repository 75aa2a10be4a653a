"""``functional_ema.export.to_hf`` and ``python -m functional_ema export``: the EMA as a Hugging Face folder.

A tiny Llama (``LlamaConfig``: hidden 32, 2 layers, vocab 64; no downloads) trained by the Hugging Face
``Trainer`` under DeepSpeed ZeRO-3 at 2 real ranks, the EMA callback passed in ``callbacks=``; its
step-4 checkpoint exported offline and loaded with ``AutoModelForCausalLM.from_pretrained``: logits
bitwise equal to the model holding the consolidated fp32 EMA (itself bitwise equal to a plain-torch EMA
of DeepSpeed's full fp32 weights); a bf16 export holds exactly the fp32 EMA cast to bf16; a sharded
export (several files + index) loads the same. A FSDP2 tensor-parallel checkpoint (DTensor TP) exports
the joined full EMA. LoRA (peft) under DDP, ZeRO-2 and ZeRO-3: the EMA holds the adapters only (element
count), bitwise equal to a plain-torch EMA of them; ``swapped`` evaluates with them; the export is PEFT's
layout and ``PeftModel.from_pretrained`` reproduces the reference logits. Hostile outputs and options are
refused naming the path or option.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from functional_ema._testing.multirank import run_ranks

DECAY = 0.9
STEPS = 4
LORA_TARGETS = ["q_proj", "v_proj"]


def _config():
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )


def _lora_config():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS, lora_dropout=0.0, init_lora_weights="gaussian")


def _tokens(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 64, (n, 8), generator=torch.Generator().manual_seed(seed))


class _LMData(torch.utils.data.Dataset):
    def __init__(self, n: int, seed: int):
        self.ids = _tokens(n, seed)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_worker(out: str, stage: int | None, lora: bool) -> dict:
    """Train the tiny Llama (LoRA-wrapped when ``lora``) with the HF Trainer, the EMA in ``callbacks=``."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import functional_ema as fe
    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA, deepspeed_full_fp32, equal, max_diff, quiet

    quiet()
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    if rank == 0:
        model.save_pretrained(os.path.join(out, "base"))
    if lora:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config())
        if rank == 0:
            model.save_pretrained(os.path.join(out, "adapter0"))
    dist.barrier()
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    ds_config = None
    if stage is not None:
        ds_config = {
            "train_micro_batch_size_per_gpu": "auto",
            "gradient_accumulation_steps": "auto",
            "train_batch_size": "auto",
            "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0} if stage == 3 else {})},
            "zero_allow_untested_optimizer": True,
            "steps_per_print": 10**9,
        }
    args = TrainingArguments(
        output_dir=os.path.join(out, "run"),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        save_strategy="steps",
        save_steps=STEPS,
        eval_strategy="no",
        logging_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        deepspeed=ds_config,
        ddp_backend="gloo",
        dataloader_num_workers=0,
        use_cpu=True,
    )
    ref = ReferenceEMA([DECAY])
    box: dict = {}

    class Reference(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            engine = box["t"].model_wrapped
            if type(engine).__name__ == "DeepSpeedEngine":
                full = deepspeed_full_fp32(engine)
            else:  # DDP: every rank holds the whole parameters
                full = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
            ref.feed(state.global_step, full)

    ema = EMACallback(decay=DECAY)
    trainer = Trainer(model=model, args=args, train_dataset=_LMData(32, seed=1), callbacks=[ema, Reference()])
    box["t"] = trainer
    trainer.train()
    wrapped = trainer.model_wrapped
    r: dict = {"engine": type(wrapped).__name__, "ema_step": int(ema.state.step)}
    if stage is not None:
        r["stage"] = wrapped.zero_optimization_stage()
    full = fe.gather_full(ema.state, wrapped)
    r["bitwise"] = equal(full, ref.emas[0])
    r["max_diff"] = max_diff(full, ref.emas[0])
    r["names"] = sorted(full)
    r["trainable"] = trainable
    r["local_ema_numel"] = sum(t.numel() for t in ema.state.emas[0].values())
    x = _tokens(3, seed=7)
    module = wrapped.module if hasattr(wrapped, "module") else wrapped
    with torch.no_grad():
        with ema.ema.swapped(wrapped):
            swapped_logits = module(input_ids=x).logits
        live_logits = module(input_ids=x).logits
    r["swap_restored"] = equal(fe.gather_full(ema.state, wrapped), full)
    if rank == 0:
        save_file({n: t.contiguous() for n, t in ref.emas[0].items()}, os.path.join(out, "ref.safetensors"))
        save_file(
            {"swapped": swapped_logits.contiguous(), "live": live_logits.contiguous()},
            os.path.join(out, "logits.safetensors"),
        )
    return r


def tp_worker(out: str) -> dict:
    """FSDP2 over DTensor tensor parallelism (2 x 2 ranks): an EMA saved, and a plain-torch EMA of the full weights."""
    import torch.distributed as dist
    from safetensors.torch import save_file

    import functional_ema as fe
    from functional_ema._testing.multirank import TP_DECAY, full_tensor_of, tp_batch, tp_mesh, tp_model

    mesh = tp_mesh((2, 2))
    model, opt = tp_model(0, mesh)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: full_tensor_of(p) for n, p in model.named_parameters()}
    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in ref.items()}, os.path.join(out, "tp_like", "model.safetensors"))
    for step in range(1, STEPS + 1):
        model(tp_batch(step, mesh)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=TP_DECAY)
        for n, p in model.named_parameters():
            ref[n].lerp_(full_tensor_of(p), 1 - TP_DECAY)
    fe.save(state, model, os.path.join(out, "tp_ckpt"), tag="tp")
    layout = fe.shard_layout(model)
    if dist.get_rank() == 0:
        save_file({n: t.contiguous() for n, t in ref.items()}, os.path.join(out, "tp_ref.safetensors"))
    return {"tp_size": layout.part.tp_size}


# ------------------------------------------------------------------------------------------- fixtures


def _launch(root: Path, name: str, stage: int | None, lora: bool) -> tuple[Path, list[dict]]:
    out = root / name
    out.mkdir()
    res = run_ranks("tests.test_export:trainer_worker", world_size=2, timeout=600, out=str(out), stage=stage, lora=lora)
    return out, res


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    return _launch(tmp_path_factory.mktemp("export"), "zero3", 3, False)


def _logits(model, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=x).logits


def _ema_model(base: Path, weights: dict[str, torch.Tensor], dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype)  # as from_pretrained builds it in that dtype
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model.eval()


# ---------------------------------------------------------------------------------------------- tests


def test_zero3_trainer_callback_export_loads_with_from_pretrained(zero3):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import functional_ema as fe
    from functional_ema.__main__ import main
    from functional_ema.export import to_hf

    out, res = zero3
    for r in res:
        assert r["engine"] == "DeepSpeedEngine" and r["stage"] == 3 and r["ema_step"] == STEPS
        assert r["bitwise"], r["max_diff"]
    ckpt = out / "run" / f"checkpoint-{STEPS}"
    ref = load_file(out / "ref.safetensors")
    consolidated = fe.consolidate(ckpt, "ema")
    assert sorted(consolidated) == sorted(ref) and all(torch.equal(consolidated[n], ref[n]) for n in ref)
    x = _tokens(3, seed=7)
    want = _logits(_ema_model(out / "base", consolidated), x)

    # fp32, one file, through the API
    fp32 = to_hf(ckpt, out / "hf_fp32", out / "base", tag="ema")
    files = sorted(p.name for p in fp32.iterdir())
    assert files == ["config.json", "ema_export.json", "generation_config.json", "model.safetensors"], files
    got = AutoModelForCausalLM.from_pretrained(fp32)
    assert torch.equal(_logits(got, x), want)
    record = json.loads((fp32 / "ema_export.json").read_text())
    assert record["step"] == STEPS and record["ema_index"] == 0 and record["tag"] == "ema"
    assert record["schedule"] == {"kind": "constant", "decay": DECAY} and record["copied_from_like"] == []
    from safetensors import safe_open

    with safe_open(str(fp32 / "model.safetensors"), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == "pt" and json.loads(meta["functional_ema"])["step"] == STEPS

    # bf16 and sharded, through the CLI: several shards + index; weights exactly the fp32 EMA cast to bf16
    rc = main(
        [
            "export",
            str(ckpt),
            str(out / "hf_bf16"),
            "--like",
            str(out / "base"),
            "--tag",
            "ema",
            "--dtype",
            "bf16",
            "--max-shard-size",
            "8KB",
            "--no-progress",
        ]
    )
    assert rc == 0
    shards = sorted(p.name for p in (out / "hf_bf16").glob("model-*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", shards
    index = json.loads((out / "hf_bf16" / "model.safetensors.index.json").read_text())
    assert sorted(index["weight_map"]) == sorted(ref) and set(index["weight_map"].values()) == set(shards)
    written = {}
    for s in shards:
        written.update(load_file(out / "hf_bf16" / s))
    assert all(written[n].dtype == torch.bfloat16 and torch.equal(written[n], ref[n].bfloat16()) for n in ref)
    assert json.loads((out / "hf_bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    got16 = AutoModelForCausalLM.from_pretrained(out / "hf_bf16")
    assert got16.dtype == torch.bfloat16
    want16 = _logits(_ema_model(out / "base", {n: t.bfloat16() for n, t in ref.items()}, torch.bfloat16), x)
    assert torch.equal(_logits(got16, x), want16)

    # sharded fp32 through the API: loads the same as one file
    sharded = to_hf(ckpt, out / "hf_sharded", out / "base", tag="ema", max_shard_size=20_000)
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(sharded), x), want)

    # a consolidated file is a source too (what consolidate, consolidate --dcp and posthoc write)
    fe.consolidate_to_file(ckpt, out / "ema.safetensors", "ema", progress=False)
    from_file = to_hf(out / "ema.safetensors", out / "hf_from_file", out / "base")
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(from_file), x), want)


def test_export_refuses_hostile_outputs_and_options(zero3, capsys):
    from functional_ema.__main__ import main
    from functional_ema.checkpoint import OutputPathError
    from functional_ema.export import to_hf

    out, _ = zero3
    ckpt = out / "run" / f"checkpoint-{STEPS}"
    base = out / "base"
    for inside in (ckpt / "ema" / "hf", ckpt / "hf", ckpt, out / "run", base / "sub"):
        with pytest.raises(OutputPathError, match="refusing to write"):
            to_hf(ckpt, inside, base, tag="ema")
        assert not inside.exists() or inside in (ckpt, out / "run")
    before = sorted(p.name for p in (ckpt / "ema").iterdir())
    existing = out / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    with pytest.raises(OutputPathError, match="refusing to replace the existing, non-empty folder"):
        to_hf(ckpt, existing, base, tag="ema")
    assert (existing / "keep.txt").read_text() == "mine"
    with pytest.raises(OutputPathError, match="not a previous export of this tool"):  # never what it did not write
        to_hf(ckpt, existing, base, tag="ema", overwrite=True)
    assert sorted(p.name for p in existing.iterdir()) == ["keep.txt"]
    previous = to_hf(ckpt, out / "previous", base, tag="ema")
    first_inode = (previous / "model.safetensors").stat().st_ino
    replaced = to_hf(ckpt, previous, base, tag="ema", overwrite=True)  # a previous export: replaced as a whole
    assert (replaced / "model.safetensors").stat().st_ino != first_inode
    (replaced / "notes.md").write_text("mine")  # a file its export did not write: the folder is no longer replaced
    with pytest.raises(OutputPathError, match=r"files its export did not write \(notes\.md\)"):
        to_hf(ckpt, replaced, base, tag="ema", overwrite=True)
    assert (replaced / "notes.md").read_text() == "mine"
    assert sorted(p.name for p in (ckpt / "ema").iterdir()) == before
    for kwargs, option in (
        ({"dtype": "int8"}, "dtype"),
        ({"max_shard_size": "lots"}, "max_shard_size"),
        ({"max_shard_size": 0}, "max_shard_size"),
        ({"index": -1}, "index"),
        ({"missing": "zeros"}, "missing"),
    ):
        with pytest.raises(ValueError, match=option):
            to_hf(ckpt, out / "bad", base, tag="ema", **kwargs)
        assert not (out / "bad").exists()
    with pytest.raises(ValueError, match="EMA"):  # index out of range: the checkpoint names how many
        to_hf(ckpt, out / "bad", base, tag="ema", index=3)
    rc = main(["export", str(ckpt), str(out / "bad"), "--like", str(base), "--tag", "ema", "--dtype", "fp8"])
    assert rc == 2 and "--dtype" in capsys.readouterr().err
    rc = main(["export", str(ckpt), str(out / "bad"), "--like", str(base), "--tag", "ema", "--max-shard-size", "x"])
    assert rc == 2 and "--max-shard-size" in capsys.readouterr().err
    rc = main(["export", str(ckpt), str(existing), "--like", str(base), "--tag", "ema"])
    assert rc == 2 and "refusing to replace" in capsys.readouterr().err  # a usage error, before the source is read
    rc = main(["export", str(ckpt), str(out / "bad"), "--like", str(out / "nowhere"), "--tag", "ema"])
    assert rc == 1 and "--like" in capsys.readouterr().err
    assert not (out / "bad").exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_tensor_parallel_checkpoint_exports_the_joined_full_ema(tmp_path):
    from safetensors.torch import load_file

    import functional_ema as fe
    from functional_ema.export import to_hf

    (tmp_path / "tp_like").mkdir()
    (tmp_path / "tp_like" / "config.json").write_text(json.dumps({"model_type": "tpnet"}))
    res = run_ranks("tests.test_export:tp_worker", world_size=4, timeout=600, out=str(tmp_path))
    assert all(r["tp_size"] == 2 for r in res)
    ref = load_file(tmp_path / "tp_ref.safetensors")
    joined = fe.consolidate(tmp_path / "tp_ckpt", "tp")
    got_dir = to_hf(tmp_path / "tp_ckpt", tmp_path / "tp_hf", tmp_path / "tp_like", tag="tp", max_shard_size=200)
    index = json.loads((got_dir / "model.safetensors.index.json").read_text())
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(got_dir / f))
    assert sorted(got) == sorted(ref) == sorted(joined)
    for n in ref:
        assert torch.equal(got[n], joined[n]) and torch.allclose(got[n], ref[n], rtol=0, atol=1e-6), n


@pytest.mark.parametrize("stage", [None, 2, 3], ids=["ddp", "zero2", "zero3"])
def test_lora_adapters_ema_and_peft_export(tmp_path, stage):
    pytest.importorskip("peft")
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from functional_ema.export import to_hf

    out, res = _launch(tmp_path, "lora", stage, True)
    trainable = res[0]["trainable"]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    adapters = sum(trainable.values())
    for r in res:
        assert r["engine"] == ("DistributedDataParallel" if stage is None else "DeepSpeedEngine")
        assert r["ema_step"] == STEPS and r["bitwise"], r["max_diff"]
        assert r["names"] == sorted(trainable)  # the adapters only: no frozen base weight has an EMA
        assert r["swap_restored"]
    numels = [r["local_ema_numel"] for r in res]
    if stage is None:
        assert numels == [adapters, adapters]  # DDP: each rank holds the whole adapters
    else:
        assert sum(numels) == adapters  # ZeRO: the adapters split across the ranks, nothing else
    ref = load_file(out / "ref.safetensors")
    x = _tokens(3, seed=7)

    def reference():
        base = AutoModelForCausalLM.from_pretrained(out / "base")
        model = PeftModel.from_pretrained(base, out / "adapter0")
        missing, unexpected = model.load_state_dict(ref, strict=False)
        assert not unexpected and not [m for m in missing if "lora" in m]
        return model.eval()

    want = _logits(reference(), x)
    logits = load_file(out / "logits.safetensors")
    assert torch.equal(logits["swapped"], want)  # swapped: the adapters' EMA, evaluated by the engine
    assert not torch.equal(logits["live"], want)

    ckpt = out / "run" / f"checkpoint-{STEPS}"
    exported = to_hf(ckpt, out / "peft_ema", out / "adapter0", tag="ema")
    names = sorted(p.name for p in exported.iterdir())
    assert "adapter_model.safetensors" in names and "adapter_config.json" in names
    written = load_file(exported / "adapter_model.safetensors")
    assert sorted(written) == sorted(load_file(out / "adapter0" / "adapter_model.safetensors"))
    assert not [n for n in written if ".default." in n]
    assert json.loads((exported / "ema_export.json").read_text())["layout"] == "peft"
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(out / "base"), exported).eval()
    assert torch.equal(_logits(loaded, x), want)


def test_diffusers_unet_export_loads_with_from_pretrained(tmp_path):
    """One process: a tiny ``UNet2DModel``'s EMA saved, exported (diffusers' file name), loaded by diffusers."""
    pytest.importorskip("diffusers")
    from diffusers import UNet2DModel

    import functional_ema as fe
    from functional_ema.export import to_hf

    torch.manual_seed(0)
    unet = UNet2DModel(
        sample_size=8,
        in_channels=1,
        out_channels=1,
        block_out_channels=(8, 16),
        norm_num_groups=4,
        down_block_types=("DownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "UpBlock2D"),
        layers_per_block=1,
    )
    unet.save_pretrained(tmp_path / "base")
    x = torch.randn(2, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    state, ref = _trained_ema(unet, STEPS, lambda step: unet(x, step).sample.pow(2).mean())
    fe.save(state, unet, tmp_path / "ckpt", tag="s4")
    out = to_hf(tmp_path / "ckpt", tmp_path / "unet_ema", tmp_path / "base", tag="s4")
    assert (out / "diffusion_pytorch_model.safetensors").is_file() and (out / "config.json").is_file()
    assert json.loads((out / "ema_export.json").read_text())["layout"] == "diffusers"
    loaded = UNet2DModel.from_pretrained(out)
    want = UNet2DModel.from_pretrained(tmp_path / "base")
    missing, unexpected = want.load_state_dict(ref, strict=False)
    assert not missing and not unexpected
    with torch.no_grad():
        assert torch.equal(loaded(x, 1).sample, want(x, 1).sample)


def test_hf_names_drop_wrappers_and_the_peft_adapter_name():
    from functional_ema.export import hf_name

    assert (
        hf_name("module._orig_mod.model.layers.0._checkpoint_wrapped_module.mlp.weight") == "model.layers.0.mlp.weight"
    )
    assert hf_name("_forward_module.model._fsdp_wrapped_module.lm_head.weight") == "model.lm_head.weight"
    assert hf_name("model.module.weight") == "model.module.weight"  # 'module' inside a name stays
    lora = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"
    assert hf_name(lora, "default") == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert (
        hf_name("base_model.model.x.lora_magnitude_vector.default", "default")
        == "base_model.model.x.lora_magnitude_vector"
    )


def test_tied_embeddings_frozen_weights_and_prefixed_names(tmp_path):
    """One process: a tied-embedding Llama with its embedding frozen, its EMA saved with a wrapper prefix."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    import functional_ema as fe
    from functional_ema.checkpoint import CheckpointMismatchError
    from functional_ema.export import to_hf

    cfg = _config()
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path / "base")
    assert "lm_head.weight" not in load_file(tmp_path / "base" / "model.safetensors")  # save_pretrained omits it
    model.model.embed_tokens.weight.requires_grad_(False)  # frozen: no EMA; the export copies it from --like
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    x = _tokens(4, seed=3)
    for step in range(1, STEPS + 1):
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        for n, p in model.named_parameters():
            if p.requires_grad:
                ref[n].lerp_(p.detach(), 1 - DECAY)
    fe.save(state, model, tmp_path / "ckpt", tag="s")
    assert "model.embed_tokens.weight" not in fe.consolidate(tmp_path / "ckpt", "s")
    with pytest.raises(CheckpointMismatchError, match=r"model\.embed_tokens\.weight.*missing=\"like\""):
        to_hf(tmp_path / "ckpt", tmp_path / "strict", tmp_path / "base", tag="s", missing="error")
    out = to_hf(tmp_path / "ckpt", tmp_path / "hf", tmp_path / "base", tag="s")
    record = json.loads((out / "ema_export.json").read_text())
    assert record["copied_from_like"] == ["model.embed_tokens.weight"]
    written = load_file(out / "model.safetensors")
    assert sorted(written) == sorted(load_file(tmp_path / "base" / "model.safetensors"))
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    want.load_state_dict(ref, strict=False)
    got = AutoModelForCausalLM.from_pretrained(out)
    assert got.lm_head.weight is got.model.embed_tokens.weight
    assert torch.equal(_logits(got, x), _logits(want.eval(), x))

    # A file holding the tied alias too (what the callbacks' export_path writes), under a wrapper and a
    # framework's prefix: the alias is left out, the prefixes dropped.
    full = {f"_forward_module.model.{n}": t for n, t in ref.items()}
    full["_forward_module.model.lm_head.weight"] = want.model.embed_tokens.weight.detach().clone()
    full["_forward_module.model.model.embed_tokens.weight"] = full["_forward_module.model.lm_head.weight"].clone()
    save_file(full, tmp_path / "ema.safetensors", metadata={"format": "functional_ema.export", "step": str(STEPS)})
    out2 = to_hf(tmp_path / "ema.safetensors", tmp_path / "hf2", tmp_path / "base")
    record2 = json.loads((out2 / "ema_export.json").read_text())
    assert record2["tied_left_out"] == ["_forward_module.model.lm_head.weight"] and record2["copied_from_like"] == []
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out2), x), _logits(want, x))
    ours = {"format": "functional_ema.export"}
    save_file({"encoder.weight": torch.zeros(2)}, tmp_path / "alien.safetensors", metadata=ours)
    with pytest.raises(CheckpointMismatchError, match=r"no place.*encoder\.weight"):
        to_hf(tmp_path / "alien.safetensors", tmp_path / "hf3", tmp_path / "base")
    save_file({}, tmp_path / "empty.safetensors", metadata=ours)  # no EMA tensor: never the base model shipped
    with pytest.raises(CheckpointMismatchError, match="holds no EMA tensor"):
        to_hf(tmp_path / "empty.safetensors", tmp_path / "hf3", tmp_path / "base")
    save_file(dict(ref), tmp_path / "foreign.safetensors")  # right names, but not a file this library wrote
    with pytest.raises(CheckpointMismatchError, match="not a file of full EMA weights written by functional_ema"):
        to_hf(tmp_path / "foreign.safetensors", tmp_path / "hf3", tmp_path / "base")
    assert not (tmp_path / "hf3").exists() and not (tmp_path / "strict").exists()


def _tiny_llama_checkpoint(root: Path) -> dict[str, torch.Tensor]:
    """One process: a tiny untied Llama saved as ``root/base``, its one-step EMA saved as ``root/ckpt`` (tag ``s``)."""
    from transformers import LlamaForCausalLM

    import functional_ema as fe

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    model.save_pretrained(root / "base")
    state = fe.init_ema(fe.local_shards(model))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    state = fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    fe.save(state, model, root / "ckpt", tag="s")
    return fe.consolidate(root / "ckpt", "s")


def test_a_killed_export_leaves_no_folder_a_later_export_keeps(tmp_path):
    """``kill -9`` mid-export: the hidden temporary folder is removed by the next export of the same out_dir;
    temporary folders of live writers, of other hosts and without the marker are left alone."""
    import signal
    import subprocess
    import sys

    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    script = (
        "import sys, time\n"
        "import functional_ema.export as e\n"
        "def stall(tmp, *a, **k):\n"
        "    (tmp / 'model.safetensors').write_bytes(b'0' * 4096)\n"
        "    print('writing', flush=True)\n"  # after the write: killed at once, the partial file is there
        "    time.sleep(120)\n"
        "e._write = stall\n"
        "e.to_hf(sys.argv[1], sys.argv[2], sys.argv[3], tag='s')\n"
    )
    out = tmp_path / "ema_hf"
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "ckpt"), str(out), str(tmp_path / "base")],
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"writing"
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".ema_hf.tmp-")]
    assert len(left) == 1 and (left[0] / "model.safetensors").is_file()
    foreign = [tmp_path / ".ema_hf.tmp-nomarker", tmp_path / ".ema_hf.tmp-otherhost", tmp_path / ".ema_hf.tmp-alive"]
    for d in foreign:
        d.mkdir()
    (foreign[1] / ".functional_ema_export_in_progress").write_text(json.dumps({"host": "elsewhere", "pid": 1}))
    # A live writer's folder: a sleeping child's pid (probing it must neither remove the folder nor signal the child).
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (foreign[2] / ".functional_ema_export_in_progress").write_text(
            json.dumps({"host": __import__("socket").gethostname(), "pid": sleeper.pid})
        )
        to_hf(tmp_path / "ckpt", out, tmp_path / "base", tag="s")
        assert sleeper.poll() is None
    finally:
        sleeper.kill()
        sleeper.wait(timeout=30)
    assert not left[0].exists() and all(d.is_dir() for d in foreign)
    assert (out / "model.safetensors").is_file() and not [p for p in out.iterdir() if "progress" in p.name]


def _selection_llama(root: Path, selection: dict, peft: bool = False):
    """One process: a tiny untied Llama (PEFT: its LoRA) saved as ``root/like``, an EMA of ``selection`` of it saved
    as ``root/ckpt`` (tag ``s``) and consolidated to ``root/ema.safetensors``. Returns (the EMA, --like's weights)."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    import functional_ema as fe

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    if peft:
        from peft import get_peft_model

        model = get_peft_model(model, _lora_config())
    model.save_pretrained(root / "like")
    state = fe.init_ema(fe.local_shards(model, **selection))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    state = fe.update(state, fe.local_shards(model, **selection), 1, decay=DECAY)
    fe.save(state, model, root / "ckpt", tag="s")
    fe.consolidate_to_file(root / "ckpt", root / "ema.safetensors", "s", progress=False)
    weights = {} if peft else load_file(root / "like" / "model.safetensors")
    return fe.gather_full(state, model), weights


def test_a_selection_ema_exports_from_its_checkpoint_or_file_and_refusals_name_it(tmp_path):
    """An EMA of ``exclude="*mlp*"``: exported from its checkpoint and from ``consolidate_to_file``'s file, it loads as
    the EMA with the MLPs of --like, and both records name the selection; ``missing="error"`` and a PEFT adapter
    refuse naming it (nothing is frozen)."""
    from transformers import AutoModelForCausalLM

    from functional_ema.checkpoint import CheckpointMismatchError
    from functional_ema.export import to_hf

    selection = {"include": None, "exclude": ["*mlp*"]}
    ema, like = _selection_llama(tmp_path, {"exclude": "*mlp*"})
    for source, opts in ((tmp_path / "ckpt", {"tag": "s"}), (tmp_path / "ema.safetensors", {})):
        out = to_hf(source, tmp_path / f"out_{source.name}", tmp_path / "like", progress=False, **opts)
        record = json.loads((out / "ema_export.json").read_text())
        assert record["selection"] == selection and len(record["copied_from_like"]) == 6
        loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
        bad = [n for n, t in loaded.state_dict().items() if not torch.equal(t, ema[n] if n in ema else like[n])]
        assert not bad, bad
    with pytest.raises(CheckpointMismatchError, match=r"left out by the checkpoint's selection \(include=None, exclu"):
        to_hf(tmp_path / "ckpt", tmp_path / "strict", tmp_path / "like", tag="s", missing="error", progress=False)
    pytest.importorskip("peft")
    _selection_llama(tmp_path / "peft", {"include": "*layers.0*"}, peft=True)
    with pytest.raises(CheckpointMismatchError, match=r"selection \(include=\['\*layers.0\*'\], exclude=None\) left"):
        to_hf(tmp_path / "peft" / "ckpt", tmp_path / "adapter", tmp_path / "peft" / "like", tag="s", progress=False)
    assert not (tmp_path / "strict").exists() and not (tmp_path / "adapter").exists()
    # The file's 'selection' metadata is another tool's input once it leaves us: forged, it is refused naming the
    # file and the field, before anything is written.
    from safetensors import safe_open
    from safetensors.torch import save_file

    from functional_ema.checkpoint import CorruptCheckpointError

    with safe_open(str(tmp_path / "ema.safetensors"), framework="pt") as f:
        meta = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - a safe_open handle has keys() but is not iterable
    for i, forged in enumerate(["not json", "[1, 2]", '{"include": 3}', '{"include": null, "exclude": [7]}']):
        save_file(tensors, str(tmp_path / f"forged{i}.safetensors"), metadata={**meta, "selection": forged})
        with pytest.raises(CorruptCheckpointError, match=rf"forged{i}\.safetensors: safetensors metadata 'selection'"):
            to_hf(tmp_path / f"forged{i}.safetensors", tmp_path / f"o{i}", tmp_path / "like", progress=False)
        assert not (tmp_path / f"o{i}").exists()


def _peft_llama_ema(root: Path, adapter: str, targets: list[str]) -> dict[str, torch.Tensor]:
    """One process: a tiny untied Llama saved as ``root/base``, its LoRA on ``targets`` as adapter ``adapter`` (its
    folder saved as ``root/like``) trained 3 AdamW steps; the EMA saved as ``root/ckpt`` (tag ``s``). Returns the
    plain-torch EMA (``lerp``) of the trained parameters, under the PEFT model's names (the oracle)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(_config()).save_pretrained(root / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0, init_lora_weights="gaussian")
    model = get_peft_model(LlamaForCausalLM.from_pretrained(root / "base"), lora, adapter_name=adapter)
    model.save_pretrained(root / "like")
    return _train_and_save(model, root / "ckpt")


def _train_and_save(model: torch.nn.Module, ckpt: Path) -> dict[str, torch.Tensor]:
    """3 AdamW steps of a causal LM with an EMA of its trainable parameters, saved under ``ckpt`` (tag ``s``);
    returns the plain-torch EMA (``lerp``) of the same parameters (the oracle)."""
    import functional_ema as fe

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: p.detach().clone() for n, p in params.items()}
    for step in range(1, 4):
        x = _tokens(2, seed=step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        for n, p in params.items():
            ref[n].lerp_(p.detach(), 1 - DECAY)
    fe.save(state, model, ckpt, tag="s")
    return ref


@pytest.mark.parametrize("adapter", ["mlp", "0"])
def test_an_adapter_named_like_a_module_path_component_exports_peft_names(tmp_path, adapter):
    """Adapter ``mlp`` on the MLP projections, adapter ``0`` on layer 0's: PEFT removes the adapter name only in
    its own place (``..lora_A.<adapter>.weight``), so ``model.layers.0.mlp`` stays in the saved names. The export
    writes PEFT's own names and ``PeftModel.from_pretrained`` loads exactly the plain-torch EMA."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import _remove_adapter_name_from_state_dict_key as peft_rule
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from functional_ema.export import hf_name, to_hf

    ref = _peft_llama_ema(tmp_path, adapter, ["gate_proj", "up_proj", "down_proj"])
    assert all(hf_name(n, adapter) == peft_rule(n, adapter) for n in ref)
    own = tmp_path / "like" / ("" if adapter == "default" else adapter) / "adapter_model.safetensors"
    out = to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s", adapter_name=adapter, progress=False)
    assert sorted(load_file(out / "adapter_model.safetensors")) == sorted(load_file(own))  # PEFT's names
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    got = dict(PeftModel.from_pretrained(base, out, adapter_name=adapter).named_parameters())
    bad = [n for n, want in ref.items() if n not in got or not torch.equal(got[n].detach(), want)]
    assert len(ref) == 12 and not bad, bad


def test_a_lora_of_the_embeddings_ships_the_frozen_base_layer_peft_saves(tmp_path):
    """A LoRA whose targets include ``embed_tokens``: PEFT saves the frozen ``embed_tokens.base_layer.weight``
    beside the adapter (``save_embedding_layers``). The EMA has no such tensor (frozen); the export copies it
    from --like, records it, and ``PeftModel.from_pretrained`` loads every trained tensor as the plain-torch EMA."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from functional_ema.export import to_hf

    ref = _peft_llama_ema(tmp_path, "default", ["q_proj", "embed_tokens"])
    frozen = "base_model.model.model.embed_tokens.base_layer.weight"
    like = load_file(tmp_path / "like" / "adapter_model.safetensors")
    out = to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s", progress=False)
    written = load_file(out / "adapter_model.safetensors")
    assert sorted(written) == sorted(like) and torch.equal(written[frozen], like[frozen])
    record = json.loads((out / "ema_export.json").read_text())
    assert record["copied_from_like"] == [frozen], record
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    got = dict(PeftModel.from_pretrained(base, out).named_parameters())
    bad = [n for n, want in ref.items() if n not in got or not torch.equal(got[n].detach(), want)]
    assert len(ref) == 6 and not bad, bad  # q_proj A, B in two layers; lora_embedding_A, B


def _task_model(task_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A tiny model of the class PEFT's ``task_type`` wraps (seed 0) and the inputs of one step."""
    import transformers

    if task_type == "SEQ_2_SEQ_LM":
        t5 = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2)
        torch.manual_seed(0)
        return transformers.T5ForConditionalGeneration(t5), {"decoder_input_ids": _tokens(2, seed=9)}
    cls = {
        "CAUSAL_LM": "LlamaForCausalLM",
        "SEQ_CLS": "LlamaForSequenceClassification",
        "TOKEN_CLS": "LlamaForTokenClassification",
        "QUESTION_ANS": "LlamaForQuestionAnswering",
        "FEATURE_EXTRACTION": "LlamaModel",
    }[task_type]
    config = _config()
    config.pad_token_id = 0  # the sequence classifier pools at the last token that is not padding
    torch.manual_seed(0)
    return getattr(transformers, cls)(config), {}


def _trained_ema(
    model: torch.nn.Module, steps: int, loss: Callable[[int], torch.Tensor]
) -> tuple[object, dict[str, torch.Tensor]]:
    """``steps`` AdamW steps of ``loss(step)`` with the EMA updated after each (``DECAY``), and the same EMA of the
    trained parameters computed in plain torch (the oracle): ``(state, {name: reference EMA})``."""
    import functional_ema as fe

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(params.values(), lr=1e-2)
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: p.detach().clone() for n, p in params.items()}
    for step in range(1, steps + 1):
        loss(step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=DECAY)
        for n, p in params.items():
            ref[n].lerp_(p.detach(), 1 - DECAY)
    return state, ref


@pytest.mark.parametrize(
    "task_type", ["CAUSAL_LM", "SEQ_CLS", "SEQ_2_SEQ_LM", "TOKEN_CLS", "QUESTION_ANS", "FEATURE_EXTRACTION"]
)
def test_a_peft_adapter_saved_with_a_task_type_exports_and_loads_as_the_ema(tmp_path, task_type):
    """``LoraConfig(task_type=...)`` (what TRL's ``peft_config`` runs save): PEFT wraps the model in its task
    class (``PeftModelForCausalLM`` reads the base model's generation hook; the classifiers' heads join
    ``modules_to_save``). The export of the EMA with that adapter folder as --like keeps its adapter_config.json
    (the task type), and ``PeftModel.from_pretrained`` over the real base model builds the same task class
    holding every trained tensor (LoRA and head copies) as the plain-torch EMA, bitwise."""
    from peft import LoraConfig, PeftModel, get_peft_model

    import functional_ema as fe
    from functional_ema.export import to_hf

    model, extra = _task_model(task_type)
    model.save_pretrained(tmp_path / "base")
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q", "v"] if extra else LORA_TARGETS, task_type=task_type)
    model = get_peft_model(model, lora, adapter_name="default")
    model.save_pretrained(tmp_path / "like")

    def loss(step: int) -> torch.Tensor:
        out = model(input_ids=_tokens(2, seed=step), **extra)
        return next(v for v in out.values() if isinstance(v, torch.Tensor)).float().square().mean()

    state, ref = _trained_ema(model, 3, loss)
    fe.save(state, model, tmp_path / "ckpt", tag="s")
    out_dir = to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s", progress=False)
    written, like = (json.loads((d / "adapter_config.json").read_text()) for d in (out_dir, tmp_path / "like"))
    assert written == like and written["task_type"] == task_type
    base, _ = _task_model(task_type)
    loaded = PeftModel.from_pretrained(type(base).from_pretrained(tmp_path / "base"), out_dir)
    assert type(loaded) is type(model) and loaded.peft_config["default"].task_type == task_type
    got = dict(loaded.named_parameters())
    bad = [n for n, want in ref.items() if n not in got or not torch.equal(got[n].detach(), want)]
    heads = [n for n in ref if "modules_to_save" in n]
    assert not bad and len(ref) >= 8 and bool(heads) == (task_type in ("SEQ_CLS", "TOKEN_CLS", "QUESTION_ANS")), bad


def test_mixed_dtype_weights_under_a_config_stating_no_dtype_load_as_float32(tmp_path):
    """A bf16 ``--like`` whose config.json states no dtype (hand-written, other tools), an fp32 EMA of all but the
    frozen embedding (copied in bf16 from --like): the weights written are mixed, so the export states float32 in
    config.json; ``from_pretrained`` (``dtype="auto"``) would otherwise take the file's first tensor's bf16 and
    truncate the EMA. Every loaded tensor is the plain-torch EMA, the frozen one --like's bf16 value, exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from functional_ema.export import to_hf

    cfg = _config()
    cfg.tie_word_embeddings = True  # the frozen bf16 embedding is then the file's first floating tensor
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "like")
    config = json.loads((tmp_path / "like" / "config.json").read_text())
    config.pop("dtype", None), config.pop("torch_dtype", None)
    (tmp_path / "like" / "config.json").write_text(json.dumps(config))
    model = model.float()
    model.model.embed_tokens.weight.requires_grad_(False)
    ref = _train_and_save(model, tmp_path / "ckpt")
    out = to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s", progress=False)
    written = load_file(out / "model.safetensors")
    assert {t.dtype for t in written.values()} == {torch.float32, torch.bfloat16}
    frozen = load_file(tmp_path / "like" / "model.safetensors")["model.embed_tokens.weight"]
    loaded = AutoModelForCausalLM.from_pretrained(out)
    want = {**ref, "model.embed_tokens.weight": frozen.float(), "lm_head.weight": frozen.float()}
    bad = [n for n, t in loaded.state_dict().items() if t.dtype != torch.float32 or not torch.equal(t, want[n])]
    assert sorted(loaded.state_dict()) == sorted(want) and not bad, bad
    assert json.loads((out / "config.json").read_text())["dtype"] == "float32"


_KILL_IN_COMMIT = (
    "import os, signal, sys, pathlib\n"
    "import functional_ema._export.outdir as od\n"
    "at, rename, unlink, calls = sys.argv[4], os.rename, pathlib.Path.unlink, []\n"
    "def die(): os.kill(os.getpid(), signal.SIGKILL)\n"
    "def renamed(a, b):\n"
    "    calls.append(b)\n"
    "    if (at, len(calls)) in (('park', 1), ('commit', 2)): die()\n"
    "    return rename(a, b)\n"
    "def unlinked(self, *a, **k):\n"
    "    if at == 'unmark' and self.parent == pathlib.Path(sys.argv[2]): die()\n"
    "    return unlink(self, *a, **k)\n"
    "od.os.rename, pathlib.Path.unlink = renamed, unlinked\n"
    "from functional_ema.export import to_hf\n"
    "to_hf(sys.argv[1], sys.argv[2], sys.argv[3], tag='s', overwrite=True, progress=False)\n"
)


@pytest.mark.parametrize("at", ["park", "commit", "unmark"])
def test_a_kill_inside_the_commit_loses_nothing_and_a_rerun_recovers(tmp_path, at):
    """``kill -9`` while an ``overwrite`` export commits: before the previous export is parked (``park``), between
    the two renames (``commit``: out_dir is missing, the previous export parked in ``.ema_hf.old-*``), after the new
    folder is in place but still marked (``unmark``). Every folder left carries the library's marker; a rerun
    without ``overwrite`` puts the previous export back (bitwise) or keeps the committed one, removes the leftovers,
    and refuses the non-empty out_dir; with ``overwrite`` it loads exactly the plain-torch EMA."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import OutputPathError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    base = load_file(tmp_path / "base" / "model.safetensors")
    ref = {n: t.lerp(t + 0.01, 1 - DECAY) for n, t in base.items()}  # one update after init, in plain torch
    out = to_hf(tmp_path / "ckpt", tmp_path / "ema_hf", tmp_path / "base", tag="s", progress=False)
    previous = hashes(out)
    argv = [sys.executable, "-c", _KILL_IN_COMMIT, str(tmp_path / "ckpt"), str(out), str(tmp_path / "base"), at]
    assert subprocess.run(argv, timeout=300).returncode == -9
    left = sorted(p for p in tmp_path.iterdir() if p.name.startswith(".ema_hf."))
    assert left and all((p / ".functional_ema_export_in_progress").is_file() for p in left), left
    parked = [p / "prev" for p in left if (p / "prev").is_dir()]
    if at == "commit":
        assert not out.exists() and len(parked) == 1
        assert hashes(parked[0]) == {k.replace(str(out), str(parked[0])): v for k, v in previous.items()}
    else:  # unmark: the previous export still parked, about to be removed
        assert out.is_dir() and len(parked) == (at == "unmark")
    with pytest.raises(OutputPathError, match="refusing to replace the existing, non-empty folder"):
        to_hf(tmp_path / "ckpt", out, tmp_path / "base", tag="s", progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ema_hf.")]
    if at != "unmark":
        assert hashes(out) == previous  # the previous export, back or never moved
    assert sorted(p.name for p in out.iterdir()) == json.loads((out / "ema_export.json").read_text())["written"]
    to_hf(tmp_path / "ckpt", out, tmp_path / "base", tag="s", overwrite=True, progress=False)
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    bad = [n for n, t in loaded.state_dict().items() if not torch.equal(t, ref[n])]
    assert sorted(loaded.state_dict()) == sorted(ref) and not bad, bad
    assert sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "ema_hf"]


def _one_step_ema(base: Path) -> dict[str, torch.Tensor]:
    """The plain-torch EMA of :func:`_tiny_llama_checkpoint` (one update after init, every weight +0.01)."""
    from safetensors.torch import load_file

    return {n: t.lerp(t + 0.01, 1 - DECAY) for n, t in load_file(base / "model.safetensors").items()}


def _loads_as(out: Path, ref: dict[str, torch.Tensor]) -> None:
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    bad = [n for n, t in loaded.state_dict().items() if not torch.equal(t, ref[n])]
    assert sorted(loaded.state_dict()) == sorted(ref) and not bad, bad


@pytest.mark.parametrize("name", ["e" * 255, "ä" * 127, "[x]*" + "e" * 240], ids=["255", "utf8-254-bytes", "glob"])
def test_an_out_dir_named_up_to_the_name_limit_exports_and_overwrites(tmp_path, name):
    """An out_dir name of up to 255 bytes: the hidden ``.<name>.tmp-``/``.old-`` folders beside it are bounded (the
    name shortened, with a hash of it), so the export and an ``overwrite`` re-export succeed, load as exactly the
    plain-torch EMA and leave nothing beside out_dir; glob characters in the name are matched literally."""
    from functional_ema.export import to_hf

    assert len(name.encode()) >= 244  # beyond what .<name>.tmp-<8 hex> fits in 255 bytes
    _tiny_llama_checkpoint(tmp_path)
    ref = _one_step_ema(tmp_path / "base")
    for overwrite in (False, True):
        out = to_hf(tmp_path / "ckpt", tmp_path / name, tmp_path / "base", tag="s", overwrite=overwrite, progress=False)
        _loads_as(out, ref)
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["base", "ckpt", name])


def test_an_out_dir_that_is_a_mount_point_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    """An empty mount point as out_dir (``docker run -v host:/out``): the export is renamed into place, which a mount
    point does not allow, so it is refused up front naming out_dir and a subfolder; that subfolder exports. A real
    tmpfs where this runs as root and may mount, else ``os.path.ismount`` reporting it."""
    import subprocess

    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import OutputPathError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(out)]).returncode == 0
    try:
        if not mounted:
            real = os.path.ismount
            monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == out or real(p))
        before = hashes(tmp_path)
        with pytest.raises(OutputPathError, match=rf"out_dir: {out} .*is a mount point.*e\.g\. {out / 'ema_hf'}"):
            to_hf(tmp_path / "ckpt", out, tmp_path / "base", tag="s", progress=False)
        assert hashes(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "out"]
        sub = to_hf(tmp_path / "ckpt", out / "ema_hf", tmp_path / "base", tag="s", progress=False)
        _loads_as(sub, _one_step_ema(tmp_path / "base"))
        assert [p.name for p in out.iterdir()] == ["ema_hf"]
    finally:
        if mounted:
            subprocess.run(["umount", str(out)], check=True)


def test_a_checkpoint_folder_as_like_ships_no_checkpoint_only_files(tmp_path):
    """--like a Trainer checkpoint folder (the model's files beside DeepSpeed's ``latest`` and ``zero_to_fp32.py``,
    this library's ``ema_latest``, ``trainer_state.json``, Accelerate's ``random_states_0.pkl``): those belong to the
    checkpoint, not the model, so they are listed in ``ignored_in_like`` and not shipped; the export loads as exactly
    the plain-torch EMA."""
    import shutil

    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    like = tmp_path / "checkpoint-1"
    shutil.copytree(tmp_path / "base", like)
    only = ["ema_latest", "latest", "random_states_0.pkl", "trainer_state.json", "zero_to_fp32.py"]
    for name in only:
        (like / name).write_text("checkpoint's own")
    (like / "tokenizer_config.json").write_text("{}")  # a model file: shipped
    out = to_hf(tmp_path / "ckpt", tmp_path / "out", like, tag="s", progress=False)
    _loads_as(out, _one_step_ema(tmp_path / "base"))
    record = json.loads((out / "ema_export.json").read_text())
    assert record["ignored_in_like"] == only and (out / "tokenizer_config.json").is_file()
    assert not [n for n in only if (out / n).exists()] and sorted(p.name for p in out.iterdir()) == record["written"]


def test_like_subfolders_are_listed_not_copied_and_said_on_stderr(tmp_path, capsys):
    """Review: ``--like``'s subfolders (``tokenizer/``, ``scheduler/``, a Trainer checkpoint's ``global_step4/``) were
    neither copied nor recorded: dropped silently. The export copies the folder's own files only (docs/shipping.md:
    config, generation config, tokenizer files); each subfolder is now listed in ``ignored_in_like`` with a trailing
    ``/`` and named in one stderr line. None is followed, copied or changed (a symlink out of the folder included), and
    the export still loads as exactly the plain-torch EMA."""
    import shutil

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    _tiny_llama_checkpoint(tmp_path)
    like = tmp_path / "like"
    shutil.copytree(tmp_path / "base", like)
    (like / "tokenizer").mkdir()
    (like / "tokenizer" / "tokenizer.json").write_text("{}")
    (like / "scheduler").mkdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "secret.txt").write_text("not the model's")
    (like / "linked").symlink_to(elsewhere, target_is_directory=True)
    before = hashes(tmp_path)
    out = tmp_path / "out"
    capsys.readouterr()  # save_pretrained's progress bar
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--like", str(like), "--tag", "s", "--no-progress"]) == 0
    assert capsys.readouterr().err == (
        "note: --like's subfolders linked/, scheduler/, tokenizer/ were not copied (the export copies the folder's own "
        "files); listed in ema_export.json (ignored_in_like)\n"
    )
    _loads_as(out, _one_step_ema(tmp_path / "base"))
    record = json.loads((out / "ema_export.json").read_text())
    assert record["ignored_in_like"] == ["linked/", "scheduler/", "tokenizer/"]
    assert all(p.is_file() for p in out.iterdir()) and sorted(p.name for p in out.iterdir()) == record["written"]
    assert {k: v for k, v in hashes(tmp_path).items() if not k.startswith(str(out))} == before


def test_export_takes_a_leading_tilde_as_the_home_folder(tmp_path, monkeypatch, capsys):
    """Review: a quoted ``'~/hf'`` OUT_DIR (or one from a config file) made ``./~/hf`` in the current folder. SOURCE,
    OUT_DIR and ``--like`` are expanded where they enter (``os.path.expanduser``): the export lands in the home
    folder and loads as exactly the plain-torch EMA; the current folder stays empty. ``file://~/hf`` names the host
    ``~``: refused, exit 2, nothing written."""
    from functional_ema.__main__ import main

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    _tiny_llama_checkpoint(home)
    assert main(["export", "~/ckpt", "~/hf", "--like", "~/base", "--tag", "s", "--no-progress"]) == 0
    _loads_as(home / "hf", _one_step_ema(home / "base"))
    assert list(work.iterdir()) == []
    capsys.readouterr()
    from tests.test_exit import file_urls_of_a_host_named_tilde_are_refused

    file_urls_of_a_host_named_tilde_are_refused(
        capsys,
        (["export", "~/ckpt", "file://~/hf2", "--like", "~/base", "--tag", "s"], "out_dir (OUT_DIR)"),
        (["export", "~/ckpt", "~/hf2", "--like", "file://~/base", "--tag", "s"], "like (--like)"),
    )
    assert list(work.iterdir()) == [] and sorted(p.name for p in home.iterdir()) == ["base", "ckpt", "hf"]


def test_cli_out_dir_refusals_that_need_nothing_read_are_usage_errors(tmp_path, monkeypatch, capsys):
    """Review: export's OUT_DIR inside the checkpoint (or --like, or a tag folder's root), the current folder or under
    a file was exit 1, refused after the source was opened, where consolidate and posthoc refuse OUT as usage errors
    (exit 2); and an OUT_DIR under a file was said to be "not writable by this user" once the writable pre-check came
    first. Each is now a usage error found before anything is read (the missing source ``none`` proves it), naming
    OUT_DIR and why, exit 2, nothing written or changed; the API (``to_hf``) names the file too. Outside, the export
    loads as exactly the plain-torch EMA."""
    from functional_ema.__main__ import main
    from functional_ema._checkpoint.errors import OutputPathError
    from functional_ema._testing.files import hashes
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    ckpt, base, tag, afile = tmp_path / "ckpt", tmp_path / "base", tmp_path / "ckpt" / "s", tmp_path / "afile"
    afile.write_text("hi")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.md").write_text("mine")
    before = hashes(tmp_path)
    under = f"error: out_dir: afile/sub/hf is under {afile}, which is a file, not a folder\n"
    capsys.readouterr()
    for argv, want in (
        (["ckpt", "afile/sub/hf", "--tag", "s"], under),
        (["none", "afile/sub/hf"], under),
        (["ckpt", "ckpt/hf", "--tag", "s"], f"inside {ckpt}, which this export reads. Write it elsewhere, e.g. "),
        (["none", "base/hf"], f"inside {base}, which this export reads. Write it elsewhere, e.g. "),
        (["ckpt/s", "ckpt/x"], f"inside {ckpt}, which this export reads. Write it elsewhere, e.g. "),
        (["ckpt/s", "ckpt/s/x"], f"inside {tag}, which this export reads. Write it elsewhere, e.g. "),
        (["ckpt", "..", "--tag", "s"], "the current folder, one of its parents, the home folder or '/'"),
        # what is there, not only where: a file, a folder of someone else's files (exit 1, after reading, before)
        (["none", "afile"], "out_dir: afile exists and is not a folder; choose another name\n"),
        (["none", "full"], "out_dir: refusing to replace the existing, non-empty folder full: pass overwrite=True "),
        (
            ["none", "full", "--overwrite"],
            "out_dir: refusing to replace full: it is not a previous export of this tool",
        ),
    ):
        assert main(["export", argv[0], argv[1], "--like", "base", *argv[2:]]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("error: out_dir: ") and want in err and err.count("\n") == 1, (argv, err)
        assert hashes(tmp_path) == before, argv
    with pytest.raises(OutputPathError) as e:
        to_hf(ckpt, afile / "sub" / "hf", base, tag="s", progress=False)
    assert str(e.value) == f"out_dir: {afile / 'sub' / 'hf'} is under {afile}, which is a file, not a folder"
    assert hashes(tmp_path) == before
    assert main(["export", "ckpt", "hf", "--like", "base", "--tag", "s", "--no-progress"]) == 0
    _loads_as(tmp_path / "hf", _one_step_ema(base))


def test_like_broken_links_and_special_files_are_listed_and_hidden_folders_not_said(tmp_path, capsys):
    """Review: a broken symlink or a FIFO in ``--like`` was neither copied nor listed (dropped silently), and the stderr
    note named ``.cache/`` (which ``huggingface-cli download --local-dir`` creates) as if the model had lost a part.
    Both are now listed in ``ignored_in_like`` (never followed or opened: the FIFO would block a reader); ``.cache/``
    is listed there but not said. The export loads as exactly the plain-torch EMA and nothing in --like changes."""
    import shutil

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    _tiny_llama_checkpoint(tmp_path)
    like = tmp_path / "like"
    shutil.copytree(tmp_path / "base", like)
    (like / ".cache" / "huggingface").mkdir(parents=True)
    (like / "dangling").symlink_to(tmp_path / "gone")
    os.mkfifo(like / "pipe")
    before = hashes(tmp_path)  # a FIFO is not read (hashes skips it)
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["export", str(tmp_path / "ckpt"), str(out), "--like", str(like), "--tag", "s", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
    _loads_as(out, _one_step_ema(tmp_path / "base"))
    record = json.loads((out / "ema_export.json").read_text())
    assert record["ignored_in_like"] == [".cache/", "dangling", "pipe"]
    assert sorted(p.name for p in out.iterdir()) == record["written"] and all(p.is_file() for p in out.iterdir())
    after = {k: v for k, v in hashes(tmp_path).items() if not k.startswith(str(out))}
    assert after == before and (like / "pipe").is_fifo() and (like / "dangling").is_symlink()


def test_cli_out_dir_refusals_suggest_a_place_that_is_not_refused_too(tmp_path, monkeypatch, capsys):
    """Review: an OUT_DIR refused for being near what the export reads suggested ``a.parent.parent / name``: one
    folder too high for a folder read (``export ckpt ckpt/e7`` suggested beside ``tmp_path``'s parent), the refused
    path itself for a file read (``export cons/c.safetensors cons``). The suggestion is now beside the folder read
    (the file's folder), else beside the root of a tag folder given, and left out where that would be refused too;
    exit 2, nothing written."""
    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    _tiny_llama_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cons").mkdir()
    (tmp_path / "cons" / "c.safetensors").write_bytes(b"a source that exists: it is refused before it is read")
    before = hashes(tmp_path)
    capsys.readouterr()
    ckpt = tmp_path / "ckpt"
    for argv, want in (
        (["ckpt", "ckpt/e7", "--tag", "s"], f"ckpt/e7 (-> {ckpt / 'e7'}): it is inside {ckpt}, which this export "
         f"reads. Write it elsewhere, e.g. {tmp_path / 'e7'}"),
        (["ckpt/s", "ckpt/s/x"], f"ckpt/s/x (-> {ckpt / 's' / 'x'}): it is inside {ckpt / 's'}, which this export "
         f"reads. Write it elsewhere, e.g. {tmp_path / 'x'}"),
        (["cons/c.safetensors", "cons"], f"cons (-> {tmp_path / 'cons'}): it is equal to or above "
         f"{tmp_path / 'cons' / 'c.safetensors'}, which this export reads. Write it elsewhere"),
    ):  # fmt: skip
        assert main(["export", argv[0], argv[1], "--like", "base", *argv[2:]]) == 2, argv
        assert capsys.readouterr().err == f"error: out_dir: refusing to write {want}\n", argv
        assert hashes(tmp_path) == before, argv


_CTRL_C_IN_COMMIT = (
    "import os, sys\n"
    "from pathlib import Path\n"
    "rename = os.rename\n"
    "def interrupted(src, dst, *a, **k):\n"
    "    if Path(src).name.startswith('.ema_hf.tmp-') and Path(dst) == Path(sys.argv[2]):  # the new one into place\n"
    "        raise KeyboardInterrupt\n"
    "    return rename(src, dst, *a, **k)\n"
    "os.rename = interrupted\n"
    "from functional_ema.__main__ import main\n"
    "sys.exit(main(['export', sys.argv[1], sys.argv[2], '--like', sys.argv[3], '--tag', 's', '--overwrite', "
    "'--no-progress']))\n"
)


def test_cli_ctrl_c_between_the_commit_renames_says_where_the_previous_export_is(tmp_path):
    """Review: Ctrl-C during ``export --overwrite`` between ``commit_dir``'s two renames (the previous export moved
    into ``.ema_hf.old-<id>/prev``, the new one not yet in place) said OUT_DIR "is not written (no partial file
    left)", as if nothing had been there. The message (exit 130) now names where the previous export is parked and
    that the next export puts it back, which it does, bitwise, once the interrupted process is gone."""
    import subprocess
    import sys

    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import OutputPathError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    out = to_hf(tmp_path / "ckpt", tmp_path / "ema_hf", tmp_path / "base", tag="s", progress=False)
    previous = hashes(out)
    argv = [sys.executable, "-c", _CTRL_C_IN_COMMIT, str(tmp_path / "ckpt"), str(out), str(tmp_path / "base")]
    run = subprocess.run(argv, timeout=300, capture_output=True, text=True)
    assert run.returncode == 130, run.stderr
    (parked,) = [p / "prev" for p in tmp_path.iterdir() if p.name.startswith(".ema_hf.old-")]
    assert not out.exists() and hashes(parked) == {k.replace(str(out), str(parked)): v for k, v in previous.items()}
    assert run.stderr.splitlines()[-1] == (
        f"error: export interrupted: {out} is not in place: the previous export is parked in {parked}, and the next "
        "export to it puts it back"
    )
    with pytest.raises(OutputPathError, match="refusing to replace the existing, non-empty folder"):
        to_hf(tmp_path / "ckpt", out, tmp_path / "base", tag="s", progress=False)
    assert hashes(out) == previous and sorted(p.name for p in tmp_path.iterdir()) == ["base", "ckpt", "ema_hf"]


def test_sigterm_mid_export_removes_its_temporary_folder(tmp_path):
    """Review: SIGTERM (``timeout``, Slurm, Kubernetes) ended ``export`` at once, leaving its marked temporary folder
    beside OUT_DIR until the next export of it; Ctrl-C removed it. SIGTERM now takes Ctrl-C's path: the folder is
    removed at once, one line says OUT_DIR is not written, then the process is killed by SIGTERM (status 143 in a
    shell; the next run's recovery of a killed export's folder stays: test_export_stages.py)."""
    from tests.test_exit import sigterm_leaves_no_temporary_file

    _tiny_llama_checkpoint(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    argv = ["export", str(tmp_path / "ckpt"), str(work / "hf"), "--like", str(tmp_path / "base"), "--tag", "s"]
    sigterm_leaves_no_temporary_file(tmp_path, [("export", [*argv, "--no-progress"], work / "hf")])


def test_export_of_a_tag_folder_given_as_the_root_says_it_is_one(tmp_path, capsys):
    """Review: ``export ckpt/s OUT_DIR --tag s`` said "no tag 's' in ckpt/s. Tags here with a complete EMA: []". It
    now says the folder given is itself the tag folder of that tag (drop --tag, or give its root): exit 1, one line,
    nothing written; without --tag it exports, loading as exactly the plain-torch EMA."""
    from functional_ema.__main__ import main

    _tiny_llama_checkpoint(tmp_path)
    tag, out = tmp_path / "ckpt" / "s", tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(tag), str(out), "--like", str(tmp_path / "base"), "--tag", "s", "--no-progress"]) == 1
    assert capsys.readouterr().err == (
        f"error: no tag 's' in {tag}: the folder given is itself the tag folder of that tag, not a checkpoint "
        f"directory holding tag folders; drop tag=... (--tag) to read it, or give its root {tag.parent} with --tag s (tag='s')\n"
    )
    assert not out.exists() and not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert main(["export", str(tag), str(out), "--like", str(tmp_path / "base"), "--no-progress"]) == 0
    _loads_as(out, _one_step_ema(tmp_path / "base"))


def test_cli_a_bad_option_leaves_a_dead_exports_folders_to_the_export_that_runs(tmp_path, monkeypatch, capsys):
    """Review: the command line's early check of OUT_DIR (``check_out_dir``) also recovered a killed export's marked
    folders (removed its temporary folder, rolled a parked previous export back), and ran before the options were
    checked: ``--dtype fp8`` was exit 2, a usage error, yet changed the disk. Every option is now checked first: each
    bad one is exit 2 with its one line, the dead writer's folder untouched; the export that runs then recovers it and
    writes the EMA bitwise."""
    import json
    import socket
    import subprocess
    import sys

    from safetensors.torch import load_file

    from functional_ema.__main__ import main
    from functional_ema._testing.files import hashes

    ema = _tiny_llama_checkpoint(tmp_path)
    monkeypatch.chdir(tmp_path)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    tmp = tmp_path / ".hf.tmp-deadbeef"
    tmp.mkdir()
    (tmp / ".functional_ema_export_in_progress").write_text(
        json.dumps({"host": socket.gethostname(), "pid": int(dead.stdout)})
    )
    (tmp / "model.safetensors").write_text("half written")
    before = hashes(tmp_path)
    capsys.readouterr()
    argv = ["export", "ckpt", "hf", "--like", "base", "--tag", "s", "--no-progress"]
    for bad, flag in (
        (["--dtype", "fp8"], "dtype (--dtype)"),
        (["--max-shard-size", "lots"], "max_shard_size"),
        (["--index", "-1"], "index (--index)"),
        (["--adapter-name", "a.b"], "adapter_name (--adapter-name)"),
    ):
        assert main([*argv, *bad]) == 2, bad
        err = capsys.readouterr().err
        assert err.startswith(f"error: {flag}") and err.count("\n") == 1, (bad, err)
        assert hashes(tmp_path) == before, bad
    assert main(argv) == 0, capsys.readouterr().err
    assert not tmp.exists()
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(ema) and all(torch.equal(got[n], ema[n]) for n in ema)


# ------------------------------------------------------------- --like folders as the Hub has them (probe AQ)


class _Blocked(Exception):
    pass


def _export_bounded(*args, seconds: int = 20, **kwargs):
    """``to_hf`` that fails the test, instead of hanging it, when a read blocks (a FIFO opened for reading)."""
    import signal

    from functional_ema.export import to_hf

    def alarm(signum, frame):
        raise _Blocked(f"the export still ran after {seconds} s: it blocked reading a file of --like")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        return to_hf(*args, progress=False, **kwargs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _as_fifo(path: Path) -> Path:
    path.unlink()
    os.mkfifo(path)
    return path


def _link_to_fifo(path: Path) -> Path:
    pipe = path.parent.parent / f"{path.name}.pipe"
    os.mkfifo(pipe)
    path.unlink()
    path.symlink_to(pipe)
    return path


def _link_to_device(path: Path) -> Path:
    path.unlink()
    path.symlink_to("/dev/zero")
    return path


_SPECIAL = {
    "weights a FIFO": ("model.safetensors", _as_fifo),
    "weights a link to a FIFO": ("model.safetensors", _link_to_fifo),
    "weights a link to a device": ("model.safetensors", _link_to_device),
    "config a FIFO": ("config.json", _as_fifo),
    "index a FIFO": ("model.safetensors.index.json", _as_fifo),
    "shard a FIFO": ("model-00002-of-00002.safetensors", _as_fifo),
    "adapter weights a FIFO": ("adapter_model.safetensors", _as_fifo),
    "adapter weights a link to a FIFO": ("adapter_model.safetensors", _link_to_fifo),
    "adapter config a FIFO": ("adapter_config.json", _as_fifo),
}


@pytest.mark.parametrize("case", list(_SPECIAL))
def test_a_fifo_or_device_as_a_file_of_like_is_refused_naming_it_never_opened(tmp_path, case):
    """Probe AQ F1: ``model.safetensors`` (or a PEFT ``adapter_model.safetensors``) in ``--like`` that is a FIFO, or a
    link to one, made the export block for ever reading its header (only ``exists()`` was checked); the index and
    shards were refused already. Every file the export reads from ``--like`` that is a FIFO or a device is now
    refused naming it ("is not a regular file"), at once; ``--like`` unchanged, no folder written."""
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError
    from tests._integration_models import shard_weights

    name, make = _SPECIAL[case]
    if name.startswith("adapter"):
        _peft_llama_ema(tmp_path, "default", ["q_proj"])
    else:
        _tiny_llama_checkpoint(tmp_path)
        (tmp_path / "like").mkdir()
        for f in (tmp_path / "base").iterdir():
            (tmp_path / "like" / f.name).write_bytes(f.read_bytes())
        if "index" in case or "shard" in case:
            shard_weights(tmp_path / "like")
    special = make(tmp_path / "like" / name)
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError) as e:
        _export_bounded(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s")
    assert str(special) in str(e.value) and "not a regular file" in str(e.value), str(e.value)
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_files_of_like_are_read_and_copied_only_when_regular_at_the_open(tmp_path):
    """Probe AQ F1: the JSON files and the copied files of ``--like`` are refused naming them when they are a FIFO or
    a link to a device at the check, rather than blocking (a FIFO) or copied without end (``/dev/zero``). (A file
    swapped after the check: the next test.)"""
    import time

    from functional_ema._export.foreign import copy_regular_file, read_json_object
    from functional_ema.checkpoint import ForeignFileError

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)
    (tmp_path / "zero.json").symlink_to("/dev/zero")
    t0 = time.monotonic()
    for src in (fifo, tmp_path / "zero.json"):
        with pytest.raises(ForeignFileError, match=f"like \\(--like\\): {src}.* is not a regular file"):
            copy_regular_file(src, tmp_path / "copy", "like (--like)")
        with pytest.raises(ForeignFileError, match=f"like \\(--like\\): {src}.* is not a regular file"):
            read_json_object(src, "like (--like)")
    assert time.monotonic() - t0 < 5 and not (tmp_path / "copy").exists()
    (tmp_path / "ok.json").write_text('{"a": 1}')
    copy_regular_file(tmp_path / "ok.json", tmp_path / "copy", "like (--like)")
    assert (tmp_path / "copy").read_text() == '{"a": 1}' and read_json_object(tmp_path / "copy", "x") == {"a": 1}


@pytest.mark.parametrize("reader", ["json", "weights header", "weights", "copy"])
def test_a_like_file_swapped_for_a_fifo_after_its_check_is_refused_at_the_open(tmp_path, monkeypatch, reader):
    """Review C item 1: ``read_json_object`` (``is_file`` then ``read_bytes``) and ``read_weights_header``
    (``special_kind`` then a path open) opened the file with a blocking open after their check, so one swapped for a
    FIFO between the check and the open blocked for ever. Here the check is the real one, on a regular file, and the
    file is swapped for a FIFO right after it (what another process could do): every reader of a ``--like`` file
    refuses it naming it, within seconds, on the descriptor it reads from; nothing copied. Bounded by SIGALRM."""
    import signal
    import time

    import functional_ema._export.foreign as foreign
    from functional_ema.checkpoint import ForeignFileError

    path = tmp_path / ("config.json" if reader == "json" else "model.safetensors")
    if reader == "json":
        path.write_text('{"a": 1}')
    else:
        from safetensors.torch import save_file

        save_file({"w": torch.ones(3)}, path)
    real = foreign.special_kind

    def check_then_swap(p: Path) -> str | None:
        kind = real(p)  # the real check sees the regular file; then the file is swapped for a FIFO
        if p == path and kind is None:
            path.unlink()
            os.mkfifo(path)
        return kind

    monkeypatch.setattr(foreign, "special_kind", check_then_swap)

    def weights() -> None:
        with foreign.open_weights(path, "like (--like)") as f:
            f.read_range("w", 0, 3)

    run = {
        "json": lambda: foreign.read_json_object(path, "like (--like)"),
        "weights header": lambda: foreign.read_weights_header(path, "like (--like)"),
        "weights": weights,
        "copy": lambda: foreign.copy_regular_file(path, tmp_path / "copy", "like (--like)"),
    }[reader]

    def hung(*_: object) -> None:
        raise TimeoutError(f"{reader}: blocked in the open of the FIFO")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(5)
    t0 = time.monotonic()
    try:
        with pytest.raises(ForeignFileError, match=f"like \\(--like\\): {path} is not a regular file \\(a FIFO"):
            run()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - t0 < 5 and not (tmp_path / "copy").exists()


@pytest.mark.parametrize(
    "quant",
    [
        {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
        {"quant_method": "gptq", "bits": 4, "group_size": 128},
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        "not an object",
    ],
    ids=["bnb4", "gptq", "fp8", "malformed"],
)
def test_a_like_config_with_a_quantization_config_is_refused_naming_it(tmp_path, quant):
    """Probe AQ F2: a ``config.json`` with ``quantization_config`` (a quantized Hub base) over full-precision weights
    was exported with the field copied: ``from_pretrained(out)`` then failed (bitsandbytes/optimum missing) or would
    quantize the EMA on load, which is not the EMA. Refused, naming the field and its ``quant_method`` and the fix;
    ``--like`` unchanged, nothing written. The same folder without the field exports and loads as the EMA."""
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError) as e:
        to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "base", tag="s", progress=False)
    msg = str(e.value)
    method = quant["quant_method"] if isinstance(quant, dict) else None
    assert str(tmp_path / "base" / "config.json") in msg and "'quantization_config'" in msg, msg
    assert f"quant_method {method!r}" in msg and "no quantization_config" in msg, msg
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()
    (tmp_path / "base" / "config.json").write_text(json.dumps(config))
    out = to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "base", tag="s", progress=False)
    _loads_as(out, _one_step_ema(tmp_path / "base"))


def _tied_like_with_saved_alias(root: Path, family: str, stale: bool) -> tuple[dict[str, torch.Tensor], str, str]:
    """A tied model (``tie_word_embeddings`` true) saved as ``root/base``, trained 3 steps with an EMA (``root/ckpt``),
    and ``root/like``: ``base`` with the tied ``lm_head.weight`` saved beside the embedding, as older Hub folders
    have it (equal to it, or ``stale``: another value). (the plain-torch EMA, the alias, the tensor it is tied to)"""
    from safetensors.torch import load_file, save_file
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64))
        holder = "transformer.wte.weight"
    else:
        cfg = _config()
        cfg.tie_word_embeddings = True
        model = LlamaForCausalLM(cfg)
        holder = "model.embed_tokens.weight"
    assert model.lm_head.weight is model.get_input_embeddings().weight
    model.save_pretrained(root / "base")
    (root / "like").mkdir()
    for f in (root / "base").iterdir():
        (root / "like" / f.name).write_bytes(f.read_bytes())
    weights = load_file(root / "base" / "model.safetensors")
    assert "lm_head.weight" not in weights  # save_pretrained leaves the alias out
    weights["lm_head.weight"] = weights[holder] + (1 if stale else 0)
    save_file(weights, root / "like" / "model.safetensors", metadata={"format": "pt"})
    return _train_and_save(model, root / "ckpt"), "lm_head.weight", holder


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_tied_alias_saved_in_like_exports_as_save_pretrained_would(tmp_path, family):
    """Probe AQ F3: a tied ``lm_head.weight`` saved in --like's weights, equal to the embedding, under a config that
    ties them (older Hub folders; transformers loads them tied) was refused with a hint about base-model prefixes,
    while the export without a loader view accepted the same layout. It is now left out, as save_pretrained leaves it:
    ``from_pretrained(out)`` ties it to the embedding's EMA, and every tensor of the loaded model is the plain-torch
    EMA; the record lists it (``aliases_in_like_left_out``); --like unchanged."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from functional_ema._testing.files import hashes

    ref, alias, holder = _tied_like_with_saved_alias(tmp_path, family, stale=False)
    before = hashes(tmp_path / "like")
    out = _export_bounded(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s")
    assert hashes(tmp_path / "like") == before
    assert alias not in load_file(out / "model.safetensors")
    record = json.loads((out / "ema_export.json").read_text())
    assert record["aliases_in_like_left_out"] == {alias: holder}, record
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    got = dict(loaded.named_parameters(remove_duplicate=False))
    assert got[alias] is got[holder]
    bad = [n for n, want in ref.items() if not torch.equal(got[n].detach(), want)]
    assert sorted(ref) == sorted(dict(loaded.named_parameters())) and not bad, bad


def test_a_stale_tied_alias_saved_in_like_is_refused_naming_the_tie(tmp_path):
    """Probe AQ F3: --like's saved ``lm_head.weight`` differs from the embedding it is tied to. transformers loads such
    a folder untied (its warning says so), so whether the model trained tied cannot be told: refused, naming the two
    tensors, the file and ``tie_word_embeddings``; --like unchanged, nothing written."""
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError

    _, alias, holder = _tied_like_with_saved_alias(tmp_path, "llama", stale=True)
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError) as e:
        _export_bounded(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s")
    msg = str(e.value)
    assert all(s in msg for s in (repr(alias), repr(holder), "tie_word_embeddings", "untied")), msg
    assert str(tmp_path / "like" / "model.safetensors") in msg and "prefix" not in msg, msg
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_diffusers_pipeline_root_as_like_is_refused_naming_its_model_subfolders(tmp_path):
    """Probe AQ F4: a diffusers pipeline's root (``model_index.json``, ``unet/``, ``vae/``, ...) as --like was refused
    with "holds no config.json ... no adapter_config.json" alone. The refusal now names the subfolders that hold a
    config.json and suggests one (``--like <root>/unet``); nothing written."""
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    root = tmp_path / "pipeline"
    (root / "scheduler").mkdir(parents=True)
    (root / "model_index.json").write_text(json.dumps({"_class_name": "DDPMPipeline", "unet": ["diffusers", "x"]}))
    (root / "scheduler" / "scheduler_config.json").write_text("{}")
    for sub in ("unet", "vae"):
        (root / sub).mkdir()
        (root / sub / "config.json").write_text(json.dumps({"_class_name": "UNet2DModel"}))
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError) as e:
        to_hf(tmp_path / "ckpt", tmp_path / "out", root, tag="s", progress=False)
    msg = str(e.value)
    assert "holds no config.json" in msg and "model_index.json" in msg, msg
    assert "unet/, vae/" in msg and f"--like {root / 'unet'}" in msg and "scheduler/" not in msg, msg
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_tied_alias_saved_in_another_float_dtype_with_the_same_values_is_left_out(tmp_path):
    """Review C item 2: --like's saved ``lm_head.weight`` in bf16 beside an fp32 embedding holding bf16-exact values:
    transformers casts both to the model's dtype, finds them equal and ties them, so the model trained tied. It was
    refused as stale on the dtype alone; it is now compared as float64 (both exact there), left out, and the export
    loads as the plain-torch EMA. An fp32 embedding that the bf16 copy rounds is still refused."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from functional_ema.checkpoint import ForeignFileError

    torch.manual_seed(0)
    cfg = _config()
    cfg.tie_word_embeddings = True
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight.bfloat16().float())
    model.save_pretrained(tmp_path / "like")
    weights = load_file(tmp_path / "like" / "model.safetensors")
    embed = weights["model.embed_tokens.weight"]
    save_file({**weights, "lm_head.weight": embed.bfloat16()}, tmp_path / "like" / "model.safetensors")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "like")
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight  # transformers ties them
    ref = _train_and_save(model, tmp_path / "ckpt")
    out = _export_bounded(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s")
    record = json.loads((out / "ema_export.json").read_text())
    assert record["aliases_in_like_left_out"] == {"lm_head.weight": "model.embed_tokens.weight"}, record
    loaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert loaded.lm_head.weight is loaded.model.embed_tokens.weight
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(ref) and not [n for n in ref if not torch.equal(got[n].detach(), ref[n])]
    rounded = embed.clone()
    rounded[0, 0] = 1 + 2**-12  # an fp32 value bf16 rounds: not the alias's value
    save_file(
        {**weights, "model.embed_tokens.weight": rounded, "lm_head.weight": rounded.bfloat16()},
        tmp_path / "like" / "model.safetensors",
    )
    with pytest.raises(ForeignFileError, match=r"'lm_head\.weight' with other values"):
        _export_bounded(tmp_path / "ckpt", tmp_path / "out2", tmp_path / "like", tag="s")


def test_a_stale_encoder_embedding_alias_of_t5_is_refused_without_the_flag_advice(tmp_path):
    """Review C item 3: the stale-alias refusal advised setting ``tie_word_embeddings`` false for every alias, but a
    T5 ``encoder.embed_tokens.weight`` is tied to ``shared.weight`` by the class whatever the flag (T5's config forces
    it true): following the advice changed nothing. The refusal now names the flag only for aliases it unties (the
    Llama ``lm_head``: the stale test above), and here says the class ties them itself, with the re-save advice."""
    from safetensors.torch import load_file, save_file
    from transformers import T5Config, T5ForConditionalGeneration

    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError

    torch.manual_seed(0)
    config = T5Config(
        vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=1, num_heads=2, decoder_start_token_id=0, pad_token_id=0
    )
    model = T5ForConditionalGeneration(config)
    model.save_pretrained(tmp_path / "like")
    weights = load_file(tmp_path / "like" / "model.safetensors")
    weights["encoder.embed_tokens.weight"] = weights["shared.weight"] + 1
    save_file(weights, tmp_path / "like" / "model.safetensors", metadata={"format": "pt"})
    _train_and_save(model, tmp_path / "ckpt")
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError) as e:
        _export_bounded(tmp_path / "ckpt", tmp_path / "out", tmp_path / "like", tag="s")
    msg = str(e.value)
    assert "'encoder.embed_tokens.weight'" in msg and "'shared.weight'" in msg and "save_pretrained" in msg, msg
    assert "tie_word_embeddings" not in msg and "by the class itself" in msg, msg
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()


def test_a_like_weight_file_truncated_while_the_tie_check_reads_it_is_refused_naming_it(tmp_path, monkeypatch):
    """Review C nit: ``_Like.equal`` read the tensors through ``safe_open``, opened by path after the header was
    checked, whose ``SafetensorError`` (the file truncated by another process in between) escaped as a foreign
    exception. The header is checked on the real file, which is then truncated, as a concurrent writer could: the
    check now reads through the descriptor it validated, and the short read is refused naming the file."""
    from functional_ema import _io
    from functional_ema._export.like import read_like
    from functional_ema.checkpoint import ForeignFileError
    from functional_ema.export import _Like

    _tied_like_with_saved_alias(tmp_path, "llama", stale=False)
    like = read_like(tmp_path / "like", "default")
    file = tmp_path / "like" / "model.safetensors"
    real = _io.SafetensorsFile.__init__

    opened = []

    def checked_then_truncated(self: _io.SafetensorsFile, *args: object, **kwargs: object) -> None:
        real(self, *args, **kwargs)  # type: ignore[arg-type]
        opened.append(self)
        if len(opened) == 2:  # both tensors' files checked (here one file): then truncated
            os.truncate(file, self.header_size + 8)

    monkeypatch.setattr(_io.SafetensorsFile, "__init__", checked_then_truncated)
    with pytest.raises(ForeignFileError, match=f"like \\(--like\\): {file}.*truncated"):
        _Like(like).equal("lm_head.weight", "model.embed_tokens.weight")


@pytest.mark.parametrize("where", ["llm_config", "thinker_config.text_config", "vision_config"])
def test_a_quantization_config_nested_anywhere_in_the_like_config_is_refused(tmp_path, where):
    """Review C nit: ``quantization_config`` was looked for at the top and in three fixed sub-configs, but
    transformers reads it from the decoder's text config wherever a composite config nests it (InternVL's
    ``llm_config``, Qwen-Omni's ``thinker_config.text_config``). Every nested object is looked at; one in a
    vision sub-config only is refused too (it declares quantized weights the export does not write)."""
    from functional_ema._testing.files import hashes
    from functional_ema.checkpoint import ForeignFileError
    from functional_ema.export import to_hf

    _tiny_llama_checkpoint(tmp_path)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    nested: dict = {"quantization_config": {"quant_method": "awq", "bits": 4}}
    for key in reversed(where.split(".")):
        nested = {key: nested}
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, **nested}))
    before = hashes(tmp_path)
    with pytest.raises(ForeignFileError, match=f"field '{where}.quantization_config' \\(quant_method 'awq'\\)"):
        to_hf(tmp_path / "ckpt", tmp_path / "out", tmp_path / "base", tag="s", progress=False)
    assert hashes(tmp_path) == before and not (tmp_path / "out").exists()
