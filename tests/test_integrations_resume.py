"""The resume recipe of ``examples/resume_other_world.py``, run as written: a DeepSpeed ZeRO-3 run
and its EMA saved at 2 ranks resume at 1 rank, on ZeRO-3 (universal checkpoint: weights, optimizer
and step) and on ZeRO-2 (fp32 weights, fresh optimizer, the step from the EMA checkpoint). After the
load the EMA equals the offline consolidation of the saved one and the engine's step is the saved
step; two more steps then match a reference EMA of DeepSpeed's full fp32 weights, bitwise.
"""

from __future__ import annotations

import runpy
import sys

import pytest

from functional_ema._testing.multirank import ROOT, run_ranks

EXAMPLE = str(ROOT / "examples" / "resume_other_world.py")


def resume_worker(argv: list[str], check: bool) -> dict:
    import functional_ema as fe
    from tests._integration_models import ReferenceEMA, deepspeed_full_fp32, equal, quiet

    quiet()
    sys.argv = [EXAMPLE, *argv]
    g = runpy.run_path(EXAMPLE, run_name="__main__")
    if not check:
        return {}
    engine, state, out = g["engine"], g["state"], g["args"].out
    report = {"world": g["world"], "stage": engine.zero_optimization_stage(), "global_steps": engine.global_steps}
    saved = fe.consolidate(out, g["TAG"])
    report["loaded_equals_saved"] = equal(fe.gather_full(state, engine), saved)
    # the engine's weights are the saved fp32 weights
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    report["weights_equal_saved"] = equal(
        deepspeed_full_fp32(engine), get_fp32_state_dict_from_zero_checkpoint(out, g["TAG"])
    )
    ref = ReferenceEMA([0.9])
    ref.emas, ref.step = [{n: t.clone() for n, t in saved.items()}], int(state.step)
    for step in range(engine.global_steps + 1, engine.global_steps + 3):
        g["train_step"](engine, step)
        state = fe.update(state, fe.local_shards(engine), engine.global_steps, decay=0.9)
        ref.feed(engine.global_steps, deepspeed_full_fp32(engine))
    report["continued_bitwise"] = equal(fe.gather_full(state, engine), ref.emas[0])
    report["ema_step"] = int(state.step)
    return report


@pytest.mark.parametrize("new_stage", [3, 2])
def test_resume_other_world_size_and_stage(tmp_path, new_stage):
    out = str(tmp_path)
    run_ranks(
        "tests.test_integrations_resume:resume_worker",
        world_size=2,
        timeout=600,
        argv=["train", "--out", out, "--stage", "3"],
        check=False,
    )
    (r,) = run_ranks(
        "tests.test_integrations_resume:resume_worker",
        world_size=1,
        timeout=600,
        argv=["resume", "--out", out, "--stage", str(new_stage), "--more", "0"],
        check=True,
    )
    assert r["world"] == 1 and r["stage"] == new_stage and r["global_steps"] == 4
    assert r["loaded_equals_saved"] and r["weights_equal_saved"]
    assert r["continued_bitwise"] and r["ema_step"] == 6
