"""``EMAController`` (functional_ema/integrations/_common.py), what every framework callback drives:
its arguments are checked at construction and at each call, before anything moves.

The issue this guards against: a bad ``decay`` (``1.5``, ``"0.9"``, ``None``, a dict) used to be accepted
by every integration and refused only at the first update after the start, possibly hours in; and
``save(framework_step=2.7 | -3 | True | 10**40)`` wrote a checkpoint that its own ``load`` refused.
In process, one rank, a plain module; the callbacks' construction too (they all build an ``EMAController``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import functional_ema as fe
from functional_ema.integrations import EMAController

BAD_CONSTRUCTION = [
    # (keyword arguments, error class, words of the message)
    ({"decay": 1.5}, ValueError, "decay must be in [0, 1], got 1.5"),
    ({"decay": "0.9"}, TypeError, "decay must be a float"),
    ({"decay": None}, TypeError, "decay must be a float"),
    ({"decay": {"a": 0.9}}, TypeError, "decay must be a float"),
    ({"decay": float("nan")}, ValueError, "decay must be in [0, 1]"),
    ({"decay": [0.9, 2.0]}, ValueError, "decay[1] must be in [0, 1], got 2.0"),
    ({"decay": []}, ValueError, "decay: give at least one decay"),
    ({"every_n_steps": 0}, ValueError, "every_n_steps must be >= 1"),
    ({"every_n_steps": 2.5}, TypeError, "every_n_steps must be an int"),
    ({"every_n_steps": True}, TypeError, "every_n_steps must be an int, got a bool"),
    ({"start_step": -1}, ValueError, "start_step=-1"),
    ({"start_step": "3"}, TypeError, "start_step must be an int"),
    ({"eval_index": 0.5}, TypeError, "eval_index must be an int"),
    ({"eval_index": 2}, ValueError, "eval_index=2 is not one of the 1 EMAs"),
    ({"posthoc_dir": "snaps", "posthoc_every": 0}, ValueError, "posthoc_every must be >= 1"),
    ({"posthoc_dir": 5, "posthoc_every": 2}, TypeError, "posthoc_dir must be a path"),
    ({"export_path": 3.0}, TypeError, "export_path must be a path"),
    ({"copy_to_model": "yes"}, TypeError, "copy_to_model must be True or False"),
    ({"async_save": 1}, TypeError, "async_save must be True or False"),
    ({"tag": 5.0}, TypeError, "tag must be a str"),
    ({"tag": "latest"}, fe.CheckpointError, "tag 'latest'"),
    ({"buffers": "mean"}, ValueError, "buffers must be None"),
    ({"dtype": "float32"}, TypeError, "dtype must be a torch.dtype"),
]


def _callbacks():
    """Every integration's constructor, as ``f(**kwargs)`` (the framework objects they need made here)."""
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.lightning import EMACallback as LightningEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    class Accelerator:  # the two hooks AcceleratorEMA registers (nothing is registered when it refuses)
        registered = 0

        def register_save_state_pre_hook(self, hook):
            Accelerator.registered += 1

        def register_load_state_pre_hook(self, hook):
            Accelerator.registered += 1

    model = torch.nn.Linear(3, 2)
    return {
        "EMAController": EMAController,
        "lightning": LightningEMA,
        "transformers": HFEMA,
        "accelerate": lambda **kw: AcceleratorEMA(Accelerator(), model, **kw),
    }, Accelerator


@pytest.mark.parametrize("kwargs, err, words", BAD_CONSTRUCTION, ids=[repr(c[0])[:40] for c in BAD_CONSTRUCTION])
def test_every_integration_refuses_bad_arguments_at_construction(kwargs, err, words):
    makers, accelerator = _callbacks()
    for name, make in makers.items():
        with pytest.raises(err) as e:
            make(**kwargs)
        assert words in str(e.value), (name, str(e.value))
    assert accelerator.registered == 0  # refused before any hook was registered


def test_other_integration_arguments_refused_at_construction():
    from functional_ema.integrations.accelerate import AcceleratorEMA
    from functional_ema.integrations.transformers import EMACallback as HFEMA

    with pytest.raises(TypeError, match="metric_prefix must be a str"):
        HFEMA(0.9, metric_prefix=None)
    with pytest.raises(TypeError, match=r"accelerator must be an accelerate.Accelerator"):
        AcceleratorEMA(object(), torch.nn.Linear(3, 2))
    with pytest.raises(TypeError, match="model: functional_ema cannot read"):
        AcceleratorEMA(_callbacks()[1](), "model")
    with pytest.raises(TypeError, match=r"trainer must be a transformers.Trainer"):
        HFEMA(0.9).attach(object())


def _files(root):
    return sorted((str(p.relative_to(root)), p.read_bytes()) for p in root.rglob("*") if p.is_file())


@pytest.mark.parametrize(
    "framework_step, err, words",
    [
        (2.7, TypeError, "framework_step must be an int, got float 2.7"),
        (-3, ValueError, "framework_step=-3 is outside [0, 2**63 - 1]"),
        (True, TypeError, "framework_step must be an int, got a bool (True)"),
        (10**40, ValueError, f"framework_step={10**40} is outside"),
        ("abc", TypeError, "framework_step must be an int, got str 'abc'"),
        (None, TypeError, "framework_step must be an int, got NoneType None"),
        (math.nan, TypeError, "framework_step must be an int, got float nan"),
        (math.inf, TypeError, "framework_step must be an int, got float inf"),
        (torch.tensor(2.0), TypeError, "framework_step must be an int, got a tensor of dtype torch.float32"),
        (4, ValueError, "framework_step=4: the rules (start_step=0, every_n_steps=1) put the EMA at step 4"),
        (0, ValueError, "framework_step=0: the rules (start_step=0, every_n_steps=1) put the EMA not started"),
    ],
)
def test_save_refuses_a_framework_step_its_load_would_refuse(tmp_path, framework_step, err, words):
    """Refused naming ``framework_step`` and the value, before anything is written (the folder's files and
    the EMA compared before and after); an earlier save in the folder stays and loads."""
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    c.on_step(model, 1)
    with torch.no_grad():
        model.weight.add_(1.0)
    c.on_step(model, 3)
    c.save(model, tmp_path, 3)
    before, ema = _files(tmp_path), [t.clone() for t in c.state.ema.values()]
    with pytest.raises(err) as e:
        c.save(model, tmp_path, framework_step)
    assert words in str(e.value), str(e.value)
    assert _files(tmp_path) == before
    assert all(torch.equal(a, b) for a, b in zip(c.state.ema.values(), ema))
    assert EMAController(0.9).load(model, tmp_path, framework_step=3) == 3


@pytest.mark.parametrize("framework_step", [3, np.int64(3), torch.tensor(3), torch.tensor([3])])
def test_save_accepts_integer_scalars(tmp_path, framework_step):
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    c.on_step(model, 3)
    c.save(model, tmp_path, framework_step)
    assert EMAController(0.9).load(model, tmp_path, framework_step=3) == 3


def test_calls_check_their_arguments():
    model = torch.nn.Linear(3, 2)
    c = EMAController(0.9)
    with pytest.raises(TypeError, match="step must be an int, got str"):
        c.on_step(model, "5")  # int("5") used to be taken as step 5
    with pytest.raises(TypeError, match="step must be an int, got float"):
        c.on_step(model, 2.7)
    assert c.state is None
    c.on_step(model, 1)
    with pytest.raises(TypeError, match="index must be an int"), c.swapped(model, index=0.5):
        pass
    with pytest.raises(ValueError, match="index=3 is not one of the 1 EMA"):
        c.full_state_dict(model, index=3)
    with pytest.raises(TypeError, match="strip_prefix must be a str"):
        c.full_state_dict(model, strip_prefix=None)
    with pytest.raises(ValueError, match="dst=9 is not a rank of the group"):
        c.full_state_dict(model, dst=9)
    with pytest.raises(TypeError, match="framework_step must be an int"):
        c.load(model, "nowhere", framework_step=2.5)
