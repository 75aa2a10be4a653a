"""TRL's ``SFTTrainer`` and ``DPOTrainer`` with ``functional_ema.integrations.transformers.EMACallback`` as written
(``callbacks=[ema]``), at 2 real ranks on CPU (gloo), gradient accumulation 2, TRL's own defaults otherwise
(``bf16=True``: DeepSpeed's bf16 engine with fp32 masters; autocast under DDP).

A tiny Llama (``tests._integration_models.tiny_llama_config``) and a tiny word-level tokenizer, built in the
ranks (no network). The EMA is checked against a reference EMA of the full fp32 weights (DeepSpeed's
``safe_get_full_fp32_param``, DDP's parameters) taken once per optimizer step by a second, test-only callback:
bitwise, for two EMAs (a float decay and a power schedule) started after step ``START``.

``SFTTrainer`` under DeepSpeed ZeRO-2 (one launch): the EMA bitwise; the EMA evaluation logged at each
evaluation and equal to the live evaluation of the same model holding the reference EMA; the callback's
``export_path`` file turned into a model folder by ``functional_ema.export.to_hf`` loads with
``AutoModelForCausalLM.from_pretrained`` (nothing missing or unexpected) holding the reference EMA, bitwise, and
the tokenizer beside it; a second run stopped after its step-4 checkpoint, resumed by a third Trainer with
``train(resume_from_checkpoint=True)``, ends with the uninterrupted run's EMA, bitwise (both in the same
processes, each Trainer with its own model and callback).

``DPOTrainer`` under DDP (one launch), the policy given as a model folder and ``precompute_ref_log_probs=True``
(no reference model kept): the EMA bitwise, and its evaluation logged (TRL's ``evaluate`` refuses a dataset
passed to it after step 0 in this mode; the callback passes the Trainer's own dataset on as ``None``).

``SFTTrainer(peft_config=LoraConfig(task_type="CAUSAL_LM"))`` under DDP (one launch): TRL wraps the model after the
callback was made; the EMA holds the LoRA tensors only, bitwise, and the export with ``like=`` an adapter folder
(``save_pretrained``'s, the Trainer's ``checkpoint-N``) loads with ``PeftModel.from_pretrained`` holding it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("trl")

from functional_ema._testing.multirank import run_ranks
from tests._integration_models import hf_reference_callback

START = 2
STEPS = 8
SAVE_EVERY = 4  # checkpoints and evaluations at steps 4 and 8
LAUNCH_TIMEOUT = 300
#: No network, no telemetry, no progress bars in the ranks' output.
ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_DATASETS_DISABLE_PROGRESS_BARS": "1",
    "TQDM_DISABLE": "1",
}
WORDS = 60  # + 4 special tokens: the tiny Llama's vocabulary of 64


def _decays() -> list:
    import functional_ema as fe

    return [0.9, fe.schedules.power(gamma=3.0)]


def _tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w59`` and four special tokens (ids 0-3), built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3, **{f"w{i}": i + 4 for i in range(WORDS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def _tiny(root: str) -> tuple[Any, Any, str]:
    """The tiny Llama (seed 0) and the tokenizer; rank 0 saves both into ``root/like`` (the export's ``like``)."""
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    from tests._integration_models import tiny_llama_config

    cfg = tiny_llama_config()
    cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = 0, 2, 3  # the tokenizer's
    torch.manual_seed(0)
    model, tok = LlamaForCausalLM(cfg), _tokenizer()
    like = os.path.join(root, "like")
    if dist.get_rank() == 0 and not os.path.isdir(like):
        model.save_pretrained(like)
        tok.save_pretrained(like)
    dist.barrier()
    return model, tok, like


def _words(g: torch.Generator, lo: int, hi: int) -> str:
    n = int(torch.randint(lo, hi, (1,), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(0, WORDS, (n,), generator=g))


def _sft_data(n: int, seed: int) -> Any:
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_dict({"text": [_words(g, 4, 12) for _ in range(n)]})


def _dpo_data(root: str, name: str, n: int, seed: int) -> Any:
    """Preference triples; chosen and rejected start with a space, so the prompt stays a token prefix. Saved by
    rank 0 and loaded from disk, as ``load_dataset`` gives them: TRL caches the precomputed reference log-probs
    beside the dataset's files, where every rank reads them (an in-memory dataset has them in each rank's own
    temporary folder, and the other ranks fail to find rank 0's)."""
    import torch.distributed as dist
    from datasets import Dataset, load_from_disk

    folder = os.path.join(root, f"data_{name}")
    if dist.get_rank() == 0:
        g = torch.Generator().manual_seed(seed)
        rows = [(_words(g, 2, 6), " " + _words(g, 2, 6), " " + _words(g, 2, 6)) for _ in range(n)]
        cols = {k: [r[i] for r in rows] for i, k in enumerate(("prompt", "chosen", "rejected"))}
        Dataset.from_dict(cols).save_to_disk(folder)
    dist.barrier()
    return load_from_disk(folder)


def _common(out: str, max_steps: int, deepspeed: bool) -> dict:
    """TrainingArguments fields both trainers share (TRL's defaults otherwise, bf16 included)."""
    ds_config = {
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto",
        "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
    }
    return {
        "output_dir": out,
        "max_steps": max_steps,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "per_device_eval_batch_size": 4,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "optim": "adamw_torch",
        "gradient_checkpointing": False,
        "max_length": 16,
        "save_strategy": "steps",
        "save_steps": SAVE_EVERY,
        "eval_strategy": "steps",
        "eval_steps": SAVE_EVERY,
        "logging_steps": SAVE_EVERY,
        "report_to": [],
        "disable_tqdm": True,
        "seed": 0,
        "data_seed": 0,
        "deepspeed": ds_config if deepspeed else None,
        "ddp_backend": "gloo",
        "dataloader_num_workers": 0,
        "use_cpu": True,
    }


def _sft(root: str, name: str, max_steps: int, callbacks: tuple | list = (), export: str | None = None) -> tuple:
    from trl import SFTConfig, SFTTrainer

    from functional_ema.integrations.transformers import EMACallback

    model, tok, _ = _tiny(root)
    ema = EMACallback(decay=_decays(), start_step=START, export_path=export)
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**_common(os.path.join(root, name), max_steps, deepspeed=True)),
        train_dataset=_sft_data(64, seed=1),
        eval_dataset=_sft_data(16, seed=2),
        processing_class=tok,
        callbacks=[ema, *callbacks],
    )
    return trainer, ema


def _vs_ref(trainer: Any, ema: Any, ref: Any) -> dict:
    """The EMAs gathered full against the reference: bitwise, and how far apart."""
    import functional_ema as fe
    from tests._integration_models import equal, max_diff

    full = [fe.gather_full(ema.state, trainer.model_wrapped, index=k) for k in range(2)]
    return {
        "full": full,
        "bitwise": [equal(full[k], ref.emas[k]) for k in range(2)],
        "max_diff": [max_diff(full[k], ref.emas[k]) for k in range(2)],
    }


def _ema_eval_check(trainer: Any, ema_weights: dict[str, torch.Tensor]) -> dict:
    """The live evaluation of the model holding ``ema_weights`` (written into the module's parameters in
    place, as the forward reads them), against the EMA loss the callback logged at the last step."""
    logged = [h["eval_ema_loss"] for h in trainer.state.log_history if "eval_ema_loss" in h]
    live = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    module = trainer.model_wrapped.module
    with torch.no_grad():
        for n, p in module.named_parameters():
            p.copy_(ema_weights[n])
    return {"logged_last": logged[-1], "live_last": live[-1], "reference": trainer.evaluate()["eval_loss"]}


def _export_check(out: str, like: str, ref_ema: dict[str, torch.Tensor]) -> dict:
    """Rank 0: the callback's export file as a model folder (``to_hf``), loaded by transformers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import functional_ema as fe

    folder = fe.export.to_hf(os.path.join(out, "ema.safetensors"), os.path.join(out, "ema_hf"), like=like)
    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    sd = model.state_dict()
    return {
        "load_problems": {k: sorted(v) for k, v in info.items() if k != "error_msgs" and v}
        | {"errors": info["error_msgs"]},
        "class": type(model).__name__,
        "names_equal": sorted(sd) == sorted(ref_ema),
        "bitwise": all(sd[n].dtype == torch.float32 and torch.equal(sd[n], ref_ema[n]) for n in ref_ema),
        "tokenizer_ids": AutoTokenizer.from_pretrained(folder)("w1 w7 w59")["input_ids"],
    }


def _sft_phase(out: str) -> dict:
    import torch.distributed as dist
    from transformers import TrainerCallback

    from tests._integration_models import ReferenceEMA, deepspeed_full_fp32, equal

    report: dict = {}
    # 1. Uninterrupted, with the reference and the export.
    ref, box = ReferenceEMA(_decays(), start=START), {}
    trainer, ema = _sft(
        out,
        "full",
        STEPS,
        [hf_reference_callback(box, ref, buffers=False)],
        export=os.path.join(out, "ema.safetensors"),
    )
    box["t"] = trainer
    trainer.train()
    engine = trainer.model_wrapped
    report["engine"] = [type(engine).__name__, engine.zero_optimization_stage(), engine.bfloat16_enabled()]
    report["global_steps"], report["ema_step"] = engine.global_steps, int(ema.state.step)
    got = _vs_ref(trainer, ema, ref)
    report["bitwise"], report["max_diff"], final = got["bitwise"], got["max_diff"], got["full"]
    report["ema_differs_from_live"] = not equal(final[0], deepspeed_full_fp32(engine))
    logs = trainer.state.log_history
    report["eval_ema_steps"] = [h["step"] for h in logs if "eval_ema_loss" in h]
    report["eval_steps"] = [h["step"] for h in logs if "eval_loss" in h]
    report["ckpt4_ema"] = sorted(p.name for p in Path(out, "full", "checkpoint-4", "ema").iterdir())
    if dist.get_rank() == 0:
        report["export"] = _export_check(out, os.path.join(out, "like"), ref.emas[0])
    report["ema_eval"] = _ema_eval_check(trainer, ref.emas[0])  # changes the model: last use of this Trainer

    # 2. Stopped after the step-4 checkpoint (the Trainer saves at step 4, then stops).
    class Stop(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == SAVE_EVERY:
                control.should_training_stop = True

    stopped, stopped_ema = _sft(out, "run", STEPS, [Stop()])
    stopped.train()
    report["stopped_at"] = [stopped.state.global_step, int(stopped_ema.state.step)]
    report["checkpoints"] = sorted(p.name for p in Path(out, "run").iterdir() if p.name.startswith("checkpoint-"))

    # 3. Resumed by a new Trainer (its own model and callback) from the last checkpoint of output_dir.
    resumed, resumed_ema = _sft(out, "run", STEPS)
    resumed.train(resume_from_checkpoint=True)
    import functional_ema as fe

    again = [fe.gather_full(resumed_ema.state, resumed.model_wrapped, index=k) for k in range(2)]
    report["resumed_ema_step"] = int(resumed_ema.state.step)
    report["resumed_bitwise"] = [equal(again[k], final[k]) for k in range(2)]
    report["resumed_eval_ema_steps"] = [h["step"] for h in resumed.state.log_history if "eval_ema_loss" in h]
    return report


def _dpo_phase(out: str) -> dict:
    from trl import DPOConfig, DPOTrainer

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA, equal

    _, tok, like = _tiny(out)
    ref, box = ReferenceEMA(_decays(), start=START), {}
    ema = EMACallback(decay=_decays(), start_step=START)
    fields = _common(os.path.join(out, "dpo"), STEPS, deepspeed=False) | {"save_strategy": "no"}
    trainer = DPOTrainer(
        model=like,  # a folder, as TRL's examples name a hub model
        args=DPOConfig(**fields, precompute_ref_log_probs=True),
        train_dataset=_dpo_data(out, "train", 64, seed=3),
        eval_dataset=_dpo_data(out, "eval", 16, seed=4),
        processing_class=tok,
        callbacks=[ema, hf_reference_callback(box, ref, buffers=False)],
    )
    box["t"] = trainer
    trainer.train()
    wrapped = trainer.model_wrapped
    got = _vs_ref(trainer, ema, ref)
    live = {n: p.detach() for n, p in wrapped.module.named_parameters()}
    logs = trainer.state.log_history
    return {
        "engine": [type(wrapped).__name__, trainer.ref_model is None, trainer.args.bf16],
        "ema_step": int(ema.state.step),
        "bitwise": got["bitwise"],
        "max_diff": got["max_diff"],
        "ema_differs_from_live": not equal(got["full"][0], live),
        "eval_ema_steps": [h["step"] for h in logs if "eval_ema_loss" in h],
        "eval_steps": [h["step"] for h in logs if "eval_loss" in h],
        "ema_eval": _ema_eval_check(trainer, ref.emas[0]),
    }


def _sft_peft_phase(out: str) -> dict:
    """``SFTTrainer(peft_config=LoraConfig(task_type="CAUSAL_LM"))`` under DDP: TRL wraps the model in PEFT after the
    callback was made; the EMA is the adapter's, bitwise, and exports (``like=`` an adapter folder the Trainer or
    ``save_pretrained`` wrote) into an adapter ``PeftModel.from_pretrained`` loads holding it."""
    import torch.distributed as dist
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import ReferenceEMA

    model, tok, like = _tiny(out)
    ref, box = ReferenceEMA(_decays(), start=START), {}
    ema = EMACallback(decay=_decays(), start_step=START, export_path=os.path.join(out, "ema.safetensors"))
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = SFTTrainer(
        model=model,
        args=SFTConfig(**_common(os.path.join(out, "peft"), STEPS, deepspeed=False)),
        train_dataset=_sft_data(64, seed=1),
        eval_dataset=_sft_data(16, seed=2),
        processing_class=tok,
        peft_config=lora,
        callbacks=[ema, hf_reference_callback(box, ref, buffers=False)],
    )
    box["t"] = trainer
    trainer.train()
    assert ref.emas is not None
    trained = sorted(n for n, p in trainer.model_wrapped.module.named_parameters() if p.requires_grad)
    ref_emas = [{n: e[n] for n in trained} for e in ref.emas]  # frozen base weights: no EMA
    ref.emas = ref_emas
    got = _vs_ref(trainer, ema, ref)
    report: dict = {"names": sorted(got["full"][0]) == trained, "lora_only": all("lora_" in n for n in trained)}
    report |= {"count": len(trained), "bitwise": got["bitwise"], "max_diff": got["max_diff"]}
    report["eval_ema_steps"] = [h["step"] for h in trainer.state.log_history if "eval_ema_loss" in h]
    if dist.get_rank() == 0:
        trainer.model.save_pretrained(os.path.join(out, "adapter0"))
        report["export"] = {
            src: _adapter_export_check(out, like, os.path.join(out, src), ref_emas[0])
            for src in ("adapter0", os.path.join("peft", f"checkpoint-{STEPS}"))
        }
    dist.barrier()
    return report


def _adapter_export_check(out: str, base: str, like: str, ref_ema: dict[str, torch.Tensor]) -> dict:
    """Rank 0: the callback's export file as an adapter folder (``to_hf`` with ``like`` a PEFT folder), loaded by
    ``PeftModel.from_pretrained`` over the base model."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import functional_ema as fe

    dest = os.path.join(out, "ema_adapter_" + os.path.basename(like))
    folder = fe.export.to_hf(os.path.join(out, "ema.safetensors"), dest, like=like)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), folder)
    sd = {n: p.detach() for n, p in model.named_parameters() if "lora_" in n}
    with open(os.path.join(folder, "adapter_config.json")) as f:
        task_type = json.load(f)["task_type"]
    return {
        "class": type(model).__name__,
        "task_type": task_type,
        "names_equal": sorted(sd) == sorted(ref_ema),
        "bitwise": all(torch.equal(sd[n], ref_ema[n]) for n in ref_ema if n in sd),
    }


def trl_worker(out: str, phase: str) -> dict:
    from tests._integration_models import quiet_hf

    quiet_hf()
    return {"sft": _sft_phase, "dpo": _dpo_phase, "sft_peft": _sft_peft_phase}[phase](out)


def _close(got: float, want: float) -> bool:
    """The same forward pass over the same weights, up to float rounding in the gathered mean."""
    return got == pytest.approx(want, rel=1e-6, abs=0)


def _launch(tmp_path: Path, phase: str) -> list[dict]:
    """One 2-rank launch of ``trl_worker`` for ``phase``; rank 0's report printed."""
    res = run_ranks(
        "tests.test_integrations_trl:trl_worker",
        world_size=2,
        timeout=LAUNCH_TIMEOUT,
        env=ENV,
        out=str(tmp_path),
        phase=phase,
    )
    print(json.dumps(res[0]))
    return res


def test_sft_trainer_zero2_ema_resume_export(tmp_path: Path) -> None:
    res = _launch(tmp_path, "sft")
    for r in res:
        assert r["engine"] == ["DeepSpeedEngine", 2, True]
        assert r["global_steps"] == STEPS and r["ema_step"] == STEPS
        assert r["bitwise"] == [True, True], r["max_diff"]
        assert r["ema_differs_from_live"]
        assert r["eval_ema_steps"] == [4, 8] and r["eval_steps"] == [4, 8]
        assert _close(r["ema_eval"]["logged_last"], r["ema_eval"]["reference"]), r["ema_eval"]
        assert not _close(r["ema_eval"]["live_last"], r["ema_eval"]["reference"]), r["ema_eval"]
        assert "ema_manifest.json" in r["ckpt4_ema"]
        assert r["stopped_at"] == [SAVE_EVERY, SAVE_EVERY] and r["checkpoints"] == ["checkpoint-4"]
        assert r["resumed_ema_step"] == STEPS
        assert r["resumed_bitwise"] == [True, True]
        assert r["resumed_eval_ema_steps"] == [4, 8]  # step 4 from the restored log history, step 8 new
    export = res[0]["export"]
    assert export["load_problems"] == {"errors": []}, export
    assert export["class"] == "LlamaForCausalLM" and export["names_equal"] and export["bitwise"]
    assert export["tokenizer_ids"] == [5, 11, 63]


def test_dpo_trainer_ddp_ema_precomputed_reference(tmp_path: Path) -> None:
    res = _launch(tmp_path, "dpo")
    for r in res:
        assert r["engine"] == ["DistributedDataParallel", True, True]
        assert r["ema_step"] == STEPS
        assert r["bitwise"] == [True, True], r["max_diff"]
        assert r["ema_differs_from_live"]
        assert r["eval_ema_steps"] == [4, 8] and r["eval_steps"] == [4, 8]
        assert _close(r["ema_eval"]["logged_last"], r["ema_eval"]["reference"]), r["ema_eval"]
        assert not _close(r["ema_eval"]["live_last"], r["ema_eval"]["reference"]), r["ema_eval"]


def test_sft_trainer_with_peft_config_ddp_ema_of_the_adapter_exports(tmp_path: Path) -> None:
    res = _launch(tmp_path, "sft_peft")
    for r in res:
        assert r["names"] and r["lora_only"] and r["count"] == 2 * 2 * 2, r  # 2 layers x (q, v) x (A, B)
        assert r["bitwise"] == [True, True], r["max_diff"]
        assert r["eval_ema_steps"] == [4, 8]
    for src, export in res[0]["export"].items():
        assert export["class"] == "PeftModelForCausalLM" and export["task_type"] == "CAUSAL_LM", (src, export)
        assert export["names_equal"] and export["bitwise"], (src, export)
