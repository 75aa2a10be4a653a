"""How tests/data/ckpt_v1 was made: format-1 EMA checkpoint written by the pre-v2 code (git 1467c9b).

World size 2, ZeRO-2, fp32, OddNet, two EMAs (0.8 and power gamma=3), 3 steps; reference_full holds
fe.gather_full of each EMA at the save (keys "<k>/<name>"). Rerun only with that commit checked out:
    python -c "from functional_ema._testing.multirank import run_ranks; run_ranks('tests.data.make_ckpt_v1:worker', out='tests/data/ckpt_v1')"
"""

import shutil
from pathlib import Path


def worker(out):
    import torch.distributed as dist
    from safetensors.torch import save_file

    import functional_ema as fe
    from functional_ema._testing.multirank import advance, checkpoint_decays, make_engine

    engine = make_engine(2, "fp32")
    state = advance(engine, fe.init_ema(fe.local_shards(engine), num_emas=2), 3)
    tmp = Path(out) / "tmp"
    fe.save(state, engine, tmp, "global_step3", decay=checkpoint_decays())
    full = [fe.gather_full(state, engine, index=i) for i in range(2)]
    if dist.get_rank() == 0:
        dst = Path(out) / "global_step3"
        dst.mkdir(parents=True)
        for p in (tmp / "global_step3").iterdir():
            shutil.copy(p, dst / p.name)
        (Path(out) / "latest").write_text("global_step3")
        save_file(
            {f"{i}/{n}": t.contiguous() for i, e in enumerate(full) for n, t in e.items()},
            str(Path(out) / "reference_full.safetensors"),
        )
        shutil.rmtree(tmp)
    return 0
