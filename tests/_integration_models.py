"""Small models, data and reference EMAs shared by the framework integration tests.

The reference EMA is independent of the library: full-shape tensors read through the engine's own
API (DeepSpeed's ``safe_get_full_fp32_param``, FSDP2's ``full_tensor()``, the plain parameters),
averaged with one ``lerp_`` per tensor, once per optimizer step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import functional_ema as fe


def quiet() -> None:
    """Keep rank output small (the harness reads it through pipes) and the logs readable."""
    for name in (
        "DeepSpeed",
        "deepspeed",
        "transformers",
        "accelerate",
        "lightning",
        "lightning.pytorch",
        "lightning.fabric",
        "pytorch_lightning",
        "torch.distributed",
    ):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.ERROR)
    except ImportError:  # pragma: no cover
        pass
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:  # pragma: no cover
        pass


class BNNet(nn.Module):
    """Uneven sizes and a BatchNorm (floating buffers and an integer one)."""

    def __init__(self, d_in: int = 7, hidden: int = 13, d_out: int = 5):
        super().__init__()
        self.inp = nn.Linear(d_in, hidden)
        self.norm = nn.BatchNorm1d(hidden)
        self.mid = nn.Linear(hidden, 11)
        self.out = nn.Linear(11, d_out)

    def forward(self, x, labels=None):
        y = self.out(torch.tanh(self.mid(torch.tanh(self.norm(self.inp(x))))))
        if labels is None:
            return {"logits": y}
        return {"loss": ((y.float() - labels.float()) ** 2).mean(), "logits": y}


class Backboned(nn.Module):
    """A backbone that a fine-tuning schedule freezes at first (``frozen``) and a head: progressive unfreezing.
    ``forward(x)`` gives the output; with ``labels``, ``{"loss"}`` (the Trainer's)."""

    def __init__(self, frozen: bool = True, d_in: int = 7, hidden: int = 9, d_out: int = 5):
        super().__init__()
        torch.manual_seed(0)
        self.backbone = nn.Linear(d_in, hidden)
        self.head = nn.Linear(hidden, d_out)
        self.backbone.requires_grad_(not frozen)

    def forward(self, x, labels=None):
        y = self.head(torch.tanh(self.backbone(x)))
        return y if labels is None else {"loss": ((y - labels) ** 2).mean()}


class RegressionData(torch.utils.data.Dataset):
    """Deterministic regression pairs ``{"x", "labels"}``."""

    def __init__(self, n: int = 64, seed: int = 0, d_in: int = 7, d_out: int = 5):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, d_in, generator=g)
        w = torch.randn(d_in, d_out, generator=g)
        self.y = torch.tanh(self.x @ w) + 0.1 * torch.randn(n, d_out, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "labels": self.y[i]}


def weight(decay, last: int, step: int) -> float:
    """``1 - d`` exactly as :func:`functional_ema.update` computes it."""
    if type(decay) is float:
        return 1.0 - decay ** (step - last)
    return 1.0 - fe.schedules.interval_decay(decay, last, step)


class ReferenceEMA:
    """Dense EMAs of full tensors: started at the first step >= ``start``, then updated at the
    multiples of ``every`` (the controller's rule), with ``decays``."""

    def __init__(self, decays, start: int = 0, every: int = 1):
        self.decays, self.start, self.every = list(decays), start, every
        self.emas: list[dict[str, torch.Tensor]] | None = None
        self.buffers: list[dict[str, torch.Tensor]] | None = None
        self.step: int | None = None

    def due(self, step: int) -> bool:
        if step < self.start:
            return False
        return self.emas is None or (step % self.every == 0 and step != self.step)

    def feed(self, step: int, full: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor] | None = None) -> None:
        if self.emas is None:
            self.emas = [{n: t.detach().float().clone() for n, t in full.items()} for _ in self.decays]
            if buffers is not None:
                self.buffers = [{n: t.detach().float().clone() for n, t in buffers.items()} for _ in self.decays]
        else:
            for k, d in enumerate(self.decays):
                w = weight(d, self.step, step)
                for n, t in full.items():
                    self.emas[k][n].lerp_(t.detach().float(), w)
                if buffers is not None:
                    for n, t in buffers.items():
                        self.buffers[k][n].lerp_(t.detach().float(), w)
        self.step = step


def float_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: b for n, b in module.named_buffers() if b.is_floating_point()}


def deepspeed_full_fp32(engine) -> dict[str, torch.Tensor]:
    """Full fp32 masters through DeepSpeed's API (a collective on ZeRO 1-3)."""
    from deepspeed.utils import safe_get_full_fp32_param

    out = {}
    for n, p in engine.module.named_parameters():
        if p.requires_grad:
            full = safe_get_full_fp32_param(p) if engine.zero_optimization_stage() else p.detach()
            out[n] = full.detach().clone().float().view(p.ds_shape if hasattr(p, "ds_shape") else p.shape)
    return out


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n].float().reshape(b[n].shape), b[n].float()) for n in a)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[n].float().reshape(b[n].shape) - b[n].float()).abs().max().item() for n in b) if b else 0.0


# --------------------------------------------------------------------------- the start rule (one trajectory, two accumulations)

#: Optimizer steps of each start-rule run, and the later start it also checks (besides start_step=0).
RULE_STEPS = 5
RULE_START = 3


def record_start(controller) -> dict:
    """Wrap ``controller.on_step`` (this instance only) to record the step it started at and how
    often it was called at step 0 (a micro-batch before the first optimizer step)."""
    seen = {"started_at": None, "calls_at_0": 0}
    on_step = controller.on_step

    def recording(x, step):
        moved = on_step(x, step)
        if int(step) == 0:
            seen["calls_at_0"] += 1
        if seen["started_at"] is None and controller.state is not None:
            seen["started_at"] = int(step)
        return moved

    controller.on_step = recording
    return seen


def start_rule_report(runs: dict) -> dict:
    """Compare one trajectory trained at gradient accumulation 1 and 2 (the same micro-batch twice).

    ``runs[ga]`` holds ``weights`` (the full weights at the end), and per start step ``k``:
    ``emas[k]`` (the integration's EMAs gathered full), ``refs[k]`` (a :class:`ReferenceEMA` started
    at the first optimizer step >= max(1, k)) and ``seen[k]`` (:func:`record_start`)."""
    one, two = runs[1], runs[2]
    starts = sorted(one["emas"])
    return {
        "weights_equal": equal(one["weights"], two["weights"]),  # validates the setup
        "weights_moved": not equal(one["weights"], one["start_weights"]),
        "refs_equal": {
            str(k): all(equal(a, b) for a, b in zip(one["refs"][k].emas, two["refs"][k].emas)) for k in starts
        },
        "emas_equal": {str(k): all(equal(a, b) for a, b in zip(one["emas"][k], two["emas"][k])) for k in starts},
        "emas_vs_ref": {
            f"ga{ga}/start{k}": all(equal(e, r) for e, r in zip(run["emas"][k], run["refs"][k].emas))
            for ga, run in runs.items()
            for k in starts
        },
        "max_diff_vs_ref": {
            f"ga{ga}/start{k}": max(max_diff(e, r) for e, r in zip(run["emas"][k], run["refs"][k].emas))
            for ga, run in runs.items()
            for k in starts
        },
        "started_at": {f"ga{ga}/start{k}": run["seen"][k]["started_at"] for ga, run in runs.items() for k in starts},
        "calls_at_0": {f"ga{ga}/start{k}": run["seen"][k]["calls_at_0"] for ga, run in runs.items() for k in starts},
        "ref_steps": {f"ga{ga}/start{k}": run["refs"][k].step for ga, run in runs.items() for k in starts},
    }


def check_start_rule(report: dict, calls_at_0: bool) -> None:
    """The assertions on :func:`start_rule_report` (in the parent). ``calls_at_0``: whether the
    framework calls the controller at step 0 under accumulation (the case the rule is about)."""
    starts = (0, RULE_START)
    assert report["weights_equal"] and report["weights_moved"], report
    assert report["refs_equal"] == {str(k): True for k in starts}, report
    assert report["emas_equal"] == {str(k): True for k in starts}, report
    assert all(report["emas_vs_ref"].values()), report["max_diff_vs_ref"]
    assert report["started_at"] == {f"ga{ga}/start{k}": max(1, k) for ga in (1, 2) for k in starts}, report
    assert set(report["ref_steps"].values()) == {RULE_STEPS}, report
    want_0 = {f"ga{ga}/start{k}": (1 if calls_at_0 and ga == 2 else 0) for ga in (1, 2) for k in starts}
    assert report["calls_at_0"] == want_0, report


# --------------------------------------------------------------------------- tiny Hugging Face families (the export's oracle)

#: Each family's kind: a transformers model folder, a diffusers one, or a PEFT adapter folder.
HF_FAMILIES = {
    "llama_untied": "model",
    "llama_tied": "model",
    "gpt2": "model",
    "llava": "model",
    "unet": "diffusers",
    "lora": "peft",
    "dora": "peft",
    "lora_mts": "peft",
    "two_adapters": "peft",
    "other_adapter": "peft",
}
FAMILY_DECAYS = (0.9, 0.7)
FAMILY_STEPS = 3
FAMILY_TAG = "ema"
#: Parameters each family freezes (no EMA: the export copies them from ``--like``); PEFT freezes the base itself.
FAMILY_FROZEN = {
    "llama_untied": ("model.layers.0.input_layernorm.weight",),
    "gpt2": ("transformer.wpe.weight",),
    "llava": ("model.vision_tower.post_layernorm.weight", "model.vision_tower.post_layernorm.bias"),
}


def quiet_hf() -> None:
    """No progress bars or advice from transformers, diffusers and the hub (the tables print their own)."""
    import os

    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    quiet()
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        import diffusers

        diffusers.utils.logging.set_verbosity_error()
        diffusers.utils.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover
        pass


def cpu_training_args(out: Path | str, **overrides: Any) -> Any:
    """``transformers.TrainingArguments`` for a short, quiet, deterministic CPU run of the tests' tiny models (batch 8,
    constant lr 1e-2, AdamW, no saving, logging, reporting or worker processes); ``overrides`` win."""
    from transformers import TrainingArguments

    base: dict[str, Any] = {
        "per_device_train_batch_size": 8,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "optim": "adamw_torch",
        "save_strategy": "no",
        "logging_strategy": "no",
        "report_to": [],
        "disable_tqdm": True,
        "use_cpu": True,
        "dataloader_num_workers": 0,
    }
    return TrainingArguments(output_dir=str(out), **{**base, **overrides})


def tiny_llama_config(tie: bool = False, width: int = 1):
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=32 * width,
        intermediate_size=64 * width,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=64,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
    )


def _tiny_module(family: str, width: int) -> nn.Module:
    """The family's (base) module, initialised from the current seed; ``width=2``: twice as wide."""
    if family == "unet":
        from diffusers import UNet2DModel

        return UNet2DModel(
            sample_size=8,
            in_channels=1,
            out_channels=1,
            block_out_channels=(8 * width, 16 * width),
            norm_num_groups=4,
            down_block_types=("DownBlock2D", "DownBlock2D"),
            up_block_types=("UpBlock2D", "UpBlock2D"),
            layers_per_block=1,
        )
    if family == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        cfg = GPT2Config(n_embd=32 * width, n_layer=2, n_head=4, vocab_size=64, n_positions=32)
        cfg.bos_token_id = cfg.eos_token_id = 0  # inside the tiny vocabulary
        return GPT2LMHeadModel(cfg)
    if family == "llava":
        from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration

        vision = CLIPVisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            image_size=16,
            patch_size=8,
        )
        cfg = LlavaConfig(
            vision_config=vision,
            text_config=tiny_llama_config(width=width),
            image_token_index=63,
            vocab_size=64,
            vision_feature_layer=-1,
        )
        return LlavaForConditionalGeneration(cfg)
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(tiny_llama_config(tie=family == "llama_tied", width=width))


def _peft_config(family: str, width: int, r: int = 4):
    from peft import LoraConfig

    extra = {"use_dora": True} if family == "dora" else {"modules_to_save": ["lm_head"]} if family == "lora_mts" else {}
    return LoraConfig(
        r=r * width,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        init_lora_weights="gaussian",
        **extra,
    )


def make_family(family: str, root: Path, seed: int = 0, width: int = 1) -> tuple[nn.Module, Path, Path | None]:
    """The family's module and its ``--like`` folder, written by ``save_pretrained`` into ``root/like`` (PEFT: the
    base model into ``root/base``, the adapter folder into ``root/like``; ``two_adapters``, ``other_adapter``: a
    second adapter ``other``, which PEFT saves into ``root/like/other``, trained with the first or alone).
    Returns (module, like, base)."""
    torch.manual_seed(seed)
    if HF_FAMILIES[family] != "peft":
        module = _tiny_module(family, width)
        module.save_pretrained(root / "like")
        return module, root / "like", None
    module = _tiny_module("llama_untied", 1)
    from peft import get_peft_model

    module.save_pretrained(root / "base")
    model = get_peft_model(module, _peft_config(family, width))
    if family == "two_adapters":
        model.add_adapter("other", _peft_config(family, width, r=2))  # its own config: not the first one's
        model.base_model.set_adapter(["default", "other"])  # both active: both train
    elif family == "other_adapter":  # a second adapter trained alone: the EMA holds only "other"
        model.add_adapter("other", _peft_config(family, width, r=2))
        model.set_adapter("other")
    model.save_pretrained(root / "like")
    return model, root / "like", root / "base"


def family_loss(family: str, model: nn.Module, step: int) -> torch.Tensor:
    """A deterministic batch's loss (every parameter gets a gradient, but the frozen ones)."""
    g = torch.Generator().manual_seed(100 + step)
    if family == "unet":
        return model(torch.randn(2, 1, 8, 8, generator=g), step).sample.pow(2).mean()
    if family == "llava":
        ids = torch.randint(0, 62, (2, 12), generator=g)
        ids[:, 1:5] = 63  # four image tokens: a 16x16 image in 8x8 patches
        return model(input_ids=ids, pixel_values=torch.randn(2, 3, 16, 16, generator=g), labels=ids).loss
    ids = torch.randint(0, 64, (4, 8), generator=g)
    return model(input_ids=ids, labels=ids).loss


def family_aliases(module: nn.Module) -> dict[str, str]:
    """Tied names -> the name ``named_parameters`` (hence the EMA) holds the tensor under."""
    first: dict[int, str] = {}
    out = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out[n] = first[id(p)]
        else:
            first[id(p)] = n
    return out


@dataclass
class FamilyRun:
    """A family trained in one process: its folders, its checkpoint and its plain-torch reference EMAs."""

    family: str
    kind: str  # "model", "diffusers" or "peft"
    like: Path
    base: Path | None  # PEFT: the base model's folder
    adapter: str  # PEFT: the adapter to export
    ckpt: Path  # fe.save's checkpoint (tag FAMILY_TAG, one EMA per FAMILY_DECAYS)
    emas: list[dict[str, torch.Tensor]]  # the reference EMAs, the module's parameter names
    initial: dict[str, torch.Tensor]  # the module's state_dict when ``like`` was saved
    aliases: dict[str, str]
    model: nn.Module
    state: fe.EmaState
    snaps: Path | None = None  # power-EMA snapshots (``snapshots=True``)


def train_family(family: str, root: Path, snapshots: bool = False) -> FamilyRun:
    """Build the family (:func:`make_family`), train ``FAMILY_STEPS`` steps with two EMAs (and, with
    ``snapshots``, two power EMAs snapshotted each step), ``fe.save`` them; the reference EMAs by ``lerp``."""
    from functional_ema import posthoc, schedules

    model, like, base = make_family(family, root)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for n, p in model.named_parameters():
        if n in FAMILY_FROZEN.get(family, ()):
            p.requires_grad_(False)
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    opt = torch.optim.AdamW(list(trainable.values()), lr=1e-2)
    state = fe.init_ema(fe.local_shards(model), num_emas=len(FAMILY_DECAYS))
    ref = ReferenceEMA(FAMILY_DECAYS)
    ref.feed(0, trainable)
    tracked = [schedules.power(sigma_rel=s) for s in (0.05, 0.10)]
    snap = fe.init_ema(fe.local_shards(model), num_emas=2) if snapshots else None
    for step in range(1, FAMILY_STEPS + 1):
        family_loss(family, model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state = fe.update(state, fe.local_shards(model), step, decay=FAMILY_DECAYS)
        ref.feed(step, trainable)
        if snap is not None:
            snap = fe.update(snap, fe.local_shards(model), step, decay=tracked)
            posthoc.save_snapshot(snap, model, root / "snaps", tracked)
    fe.save(state, model, root / "ckpt", FAMILY_TAG, decay=FAMILY_DECAYS)
    assert ref.emas is not None
    return FamilyRun(
        family,
        HF_FAMILIES[family],
        like,
        base,
        "other" if family in ("two_adapters", "other_adapter") else "default",
        root / "ckpt",
        ref.emas,
        initial,
        family_aliases(model),
        model,
        state,
        root / "snaps" if snapshots else None,
    )


def load_family(kind: str, family: str, out: Path, base: Path | None, adapter: str) -> tuple[nn.Module, list[str]]:
    """``out`` loaded by the real loader of the family (transformers, diffusers, PEFT over ``base``) and what the
    loader reported: keys it left initialised (missing), ignored (unexpected) or could not fit (mismatched)."""
    if kind == "peft":
        from peft import PeftModel, get_peft_model_state_dict
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out, adapter_name=adapter)
        with safe_open(str(out / "adapter_model.safetensors"), framework="pt") as f:
            written = set(f.keys())
        expected = set(get_peft_model_state_dict(model, adapter_name=adapter))
        problems = [f"ignored by PEFT: {sorted(written - expected)[:4]}"] if written - expected else []
        if expected - written:
            problems.append(f"not in the adapter file: {sorted(expected - written)[:4]}")
        return model, problems
    if kind == "diffusers":
        import diffusers

        model, info = diffusers.UNet2DModel.from_pretrained(out, output_loading_info=True)
    elif family == "llava":
        from transformers import LlavaForConditionalGeneration

        model, info = LlavaForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    else:
        from transformers import AutoModelForCausalLM

        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    problems = [
        f"{k}: {sorted(info[k])[:4]}" for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info[k]
    ]
    return model, problems + [str(m)[:200] for m in info.get("error_msgs", [])]


def oracle_problems(
    loaded: nn.Module,
    ema: dict[str, torch.Tensor],
    initial: dict[str, torch.Tensor],
    aliases: dict[str, str],
    dtype: torch.dtype | None,
    peft: bool,
) -> list[str]:
    """Where ``loaded``'s state differs from what it must hold, bitwise: the EMA cast to ``dtype`` (floats) where the
    EMA has the tensor (a tied name: its pair's EMA), else the ``--like`` value (cast alike; a PEFT base weight,
    which the base folder supplies, as saved)."""
    problems = []
    for k, got in loaded.state_dict().items():
        name = aliases.get(k, k)
        adapter_part = ".lora_" in k or "modules_to_save." in k
        if name in ema:
            want = ema[name]
        elif k in initial:
            want = initial[k]
        else:
            problems.append(f"{k}: no EMA and no --like value for it")
            continue
        dtype_k = dtype if (name in ema or not peft or adapter_part) else None  # a PEFT base: its own folder's
        if dtype_k is not None and want.is_floating_point():
            want = want.to(dtype_k)
        if got.shape != want.shape:
            problems.append(f"{k}: shape {tuple(got.shape)}, want {tuple(want.shape)}")
        elif want.is_floating_point() != got.is_floating_point() or not torch.equal(got.double(), want.double()):
            diff = (got.double() - want.double()).abs().max().item() if got.is_floating_point() else "int"
            problems.append(f"{k}: differs ({got.dtype} vs {want.dtype}, max {diff})")
    return problems


def shard_weights(folder: Path) -> None:
    """The folder's one weight file split into two shards with an index, as ``save_pretrained`` shards a larger
    model (``model-00001-of-00002.safetensors``, ``model.safetensors.index.json``; diffusers' stem alike)."""
    import json

    from safetensors.torch import load, save_file

    (path,) = folder.glob("*.safetensors")
    stem, tensors = path.name.removesuffix(".safetensors"), load(path.read_bytes())  # not a memory map: replaced
    names = list(tensors)
    halves = {
        f"{stem}-00001-of-00002.safetensors": names[: len(names) // 2],
        f"{stem}-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, group in halves.items():
        save_file({n: tensors[n] for n in group}, folder / fname, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": {n: f for f, g in halves.items() for n in g}}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2))
    path.unlink()


def hf_reference_callback(trainer_box: dict, ref: Any, buffers: bool = True) -> Any:
    """A ``transformers.TrainerCallback`` that feeds ``ref`` (``ref.due(step)``, ``ref.feed(step, full[, buffers])``)
    the full fp32 weights at each optimizer step: DeepSpeed's masters, or a DDP model's whole parameters; with
    ``buffers``, its floating buffers too. ``trainer_box["t"]`` is the Trainer, set once it exists."""
    from transformers import TrainerCallback

    class Reference(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if ref.due(state.global_step):
                engine = trainer_box["t"].model_wrapped
                if type(engine).__name__ == "DeepSpeedEngine":
                    full = deepspeed_full_fp32(engine)
                else:  # DDP: every rank holds the whole parameters
                    full = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
                extra = (float_buffers(engine.module),) if buffers else ()
                ref.feed(state.global_step, full, *extra)

    return Reference()
