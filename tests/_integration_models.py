"""Small models, data and reference EMAs shared by the framework integration tests.

The reference EMA is independent of the library: full-shape tensors read through the engine's own
API (DeepSpeed's ``safe_get_full_fp32_param``, FSDP2's ``full_tensor()``, the plain parameters),
averaged with one ``lerp_`` per tensor, once per optimizer step.
"""

from __future__ import annotations

import logging

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
