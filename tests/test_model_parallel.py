"""DeepSpeed tensor, pipeline, expert and sequence parallelism: every verb on each layout (issue 22).

Real 8-, 4- and 2-rank launches on CPU (gloo): DeepSpeed engines built with ``mpu=`` (a Megatron-style
tensor-parallel MLP, :class:`functional_ema._testing.multirank.TPMLP`), as a ``PipelineEngine`` (stages x data parallel,
a BatchNorm in the first stage), both at once (tensor 2 x pipeline 2 x data parallel 2), AutoTP training
of a Hugging Face Llama, ZeRO++ hpZ, DeepSpeed MoE (expert parallel 2 x expert-data parallel 2: expert
parameters named by their global expert index) and Ulysses sequence parallelism. On each layout:

* ``local_shards`` places the rank in its model-parallel part (tensor-parallel rank, pipeline stage);
  ``update`` sends 0 bytes;
* the EMA gathered over the data-parallel group is bitwise the EMA of DeepSpeed's own full fp32 weights
  of what the model-parallel rank holds (``safe_get_full_fp32_param``), averaged in plain torch;
* ``swapped``: the engine's forward (or ``eval_batch``) equals the same engine with the EMA weights put in
  by plain torch; training inside it is refused (``backward``, ``train_batch``);
* ``save`` (with buffers on the pipeline), ``AsyncSaver``, snapshots; killed and resumed in fresh
  processes, the EMA continues bitwise as the uninterrupted run's; loaded at another data-parallel size
  with the same model-parallel layout, it is the saved one;
* loaded by another model-parallel layout (no tensor parallelism, one stage), the saved parts are joined
  and re-cut; where the split is unknown that is refused;
* offline: the stages consolidate into one file, tensor-parallel slices join along the recorded split
  (Megatron's attributes, AutoTP's layout record: checked against DeepSpeed's own gather), or per
  ``tp_dims``, or one tensor-parallel rank's alone (the CLI writes one file per rank when the split is
  unknown).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

import functional_ema as fe
from functional_ema._testing.multirank import NUM_EXPERTS, MoENet, run_ranks

DECAYS = (fe.schedules.power(gamma=3.0), fe.schedules.power(gamma=6.0))  # power EMAs: snapshots need them
STEPS, SAVE_AT = 6, 4


# ------------------------------------------------------------------------------------------ helpers


def _reference(engine) -> dict[str, torch.Tensor]:
    from functional_ema._testing.multirank import full_fp32_reference

    return full_fp32_reference(engine)


class _Ref:
    """Plain-torch EMAs of full tensors, one ``lerp_`` per tensor, updated at every step."""

    def __init__(self, full: dict[str, torch.Tensor], step: int):
        self.emas = [{n: t.clone() for n, t in full.items()} for _ in DECAYS]
        self.step = step

    def feed(self, full: dict[str, torch.Tensor], step: int) -> None:
        from tests._integration_models import weight

        for k, d in enumerate(DECAYS):
            w = weight(d, self.step, step)
            for n, t in full.items():
                self.emas[k][n].lerp_(t, w)
        self.step = step


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[n].reshape(b[n].shape), b[n]) for n in a)


def _save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    save_file({n: t.contiguous() for n, t in tensors.items()}, str(path))


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path))


def _swap_check(engine, state, forward) -> dict:
    """The forward inside ``swapped`` against the same engine with the gathered EMA put into its module
    parameters by plain torch; and training inside refused."""
    full = fe.gather_full(state, engine)
    with torch.no_grad(), fe.swapped(engine, state):
        inside = forward()
        refused = None
        try:
            engine.backward(torch.zeros(()))
        except fe.SwappedTrainingError as e:
            refused = str(e)
        if hasattr(engine, "train_batch"):
            try:
                engine.train_batch(iter([]))
            except fe.SwappedTrainingError:
                pass
            else:
                refused = None
    params = dict(engine.module.named_parameters())
    live = {n: params[n].detach().clone() for n in full}
    with torch.no_grad():
        for n, t in full.items():
            params[n].copy_(t.to(params[n].dtype).view(params[n].shape))
        manual = forward()
        for n, t in live.items():
            params[n].copy_(t)
    return {"swapped_equal": torch.equal(inside, manual), "training_refused": refused is not None}


def _zero_bytes_update(state, engine, step) -> tuple:
    from functional_ema._testing.multirank import CollectiveSpy

    shards = fe.local_shards(engine)
    with CollectiveSpy() as spy:
        state = fe.update(state, shards, step, decay=list(DECAYS))
    return state, spy.total


# ------------------------------------------------------------------------------ ZeRO++ hpZ and MiCS


def hpz_worker(out: str) -> dict:
    """4 ranks: ZeRO-3 with ZeRO++ hpZ (zero_hpz_partition_size=2: a secondary copy of the 16-bit
    parameters per node, the fp32 masters still partitioned over all ranks) works like plain ZeRO-3;
    MiCS (mics_shard_size) is refused, naming the option (by DeepSpeed 0.19.8 itself, which removed it)."""
    import deepspeed

    from functional_ema._testing.multirank import OddNet, batch, ds_config, make_engine, train_step
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    report: dict = {}
    engine = make_engine(3, model=OddNet(extras=False), seed=4, zero_hpz_partition_size=2)
    state = fe.init_ema(fe.local_shards(engine), num_emas=2)
    ref = _Ref(_reference(engine), 0)
    sent = 0
    for step in (1, 2):
        train_step(engine, step)
        state, n = _zero_bytes_update(state, engine, step)
        sent += n
        ref.feed(_reference(engine), step)
    report["hpz_world"] = fe.shard_layout(engine).world_size
    report["hpz_collectives_in_update"] = sent
    full = fe.gather_full(state, engine)
    report["hpz_equal_ref"] = _equal(full, ref.emas[0])
    twin = OddNet(extras=False)
    twin.load_state_dict(full, strict=True)
    x, _ = batch(engine, 99)
    engine.eval()
    with torch.no_grad(), fe.swapped(engine, state):
        inside = engine(x)
    with torch.no_grad():
        report["hpz_swapped_equal"] = torch.equal(inside, twin(x))
    fe.save(state, engine, out / "hpz", "t")
    report["hpz_load_equal"] = _equal(fe.gather_full(fe.load(engine, out / "hpz", "t"), engine), full)
    cfg = ds_config(3, mics_shard_size=2)
    model = OddNet(extras=False)
    try:
        deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=cfg)
    except Exception as e:  # noqa: BLE001
        report["mics_refused"] = [type(e).__name__, str(e)[:300]]
    return report


def test_zero_plus_plus_hpz_and_mics(tmp_path):
    for r in run_ranks("tests.test_model_parallel:hpz_worker", world_size=4, timeout=600, out=str(tmp_path)):
        assert r["hpz_world"] == 4 and r["hpz_collectives_in_update"] == 0, r
        assert r["hpz_equal_ref"] and r["hpz_swapped_equal"] and r["hpz_load_equal"], r
        assert "mics_shard_size" in r["mics_refused"][1], r["mics_refused"]


# ----------------------------------------------------------------------------- tensor parallel (mpu=)


def _tp_engine(tp_size: int, seed: int, attributes: bool = True, stage: int = 2):
    from functional_ema._testing.multirank import MPU, TPMLP, make_engine

    mpu = MPU(tp_size)
    model = TPMLP(
        mpu.get_model_parallel_rank(), tp_size, mpu.get_model_parallel_group(), seed=seed, attributes=attributes
    )
    return make_engine(stage, model=model, mpu=mpu, seed=seed), mpu


def _tp_batch(mpu, step: int):
    g = torch.Generator().manual_seed(
        1234 + 1000 * step + mpu.get_data_parallel_rank()
    )  # the same on every tensor-parallel rank
    return torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g)


def _tp_train(engine, mpu, step: int) -> None:
    x, y = _tp_batch(mpu, step)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def tp_worker(out: str, phase: str, tp_size: int = 2) -> dict:
    import torch.distributed as dist

    from functional_ema import posthoc
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    rank = dist.get_rank()
    report: dict = {}
    if phase == "train":
        engine, mpu = _tp_engine(tp_size, seed=0)
        part = fe.shard_layout(engine).part
        report["part"] = list(part)
        report["tp_dims"] = fe.shard_layout(engine).tp_dims
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        ref = _Ref(_reference(engine), 0)
        bytes_sent = []
        for step in range(1, STEPS + 1):
            _tp_train(engine, mpu, step)
            state, sent = _zero_bytes_update(state, engine, step)
            bytes_sent.append(sent)
            ref.feed(_reference(engine), step)
            if step % 2 == 0:
                posthoc.save_snapshot(state, engine, out / "snaps", list(DECAYS))
            if step == SAVE_AT:
                fe.save(state, engine, out / "ck", decay=list(DECAYS))
                engine.save_checkpoint(str(out / "ck"))
                fe.AsyncSaver().save(state, engine, out / "ck_async", "t").wait()
                gathered = fe.gather_full(state, engine)
                report["gathered_at_save_equal_ref"] = _equal(gathered, ref.emas[0])
                if mpu.get_data_parallel_rank() == 0:
                    _save_tensors(out / f"gathered{SAVE_AT}_tp{part.tp}.safetensors", gathered)
        report["collectives_in_update"] = sum(bytes_sent)
        final = fe.gather_full(state, engine)
        report["final_equal_ref"] = _equal(final, ref.emas[0]) and _equal(
            fe.gather_full(state, engine, index=1), ref.emas[1]
        )
        if mpu.get_data_parallel_rank() == 0:
            _save_tensors(out / f"final_tp{part.tp}.safetensors", final)
        x, _ = _tp_batch(mpu, 99)
        engine.eval()
        report.update(_swap_check(engine, state, lambda: engine(x)))
        # the same model without Megatron's attributes: how its slices join is unknown
        plain, _ = _tp_engine(tp_size, seed=3, attributes=False)
        fe.save(fe.init_ema(fe.local_shards(plain)), plain, out / "noattr", "t")
        report["plain_tp_dims"] = fe.shard_layout(plain).tp_dims
        return report
    if phase == "resume":  # fresh processes, other initial weights: everything comes from the files
        engine, mpu = _tp_engine(tp_size, seed=9)
        engine.load_checkpoint(str(out / "ck"))
        state = fe.load(engine, out / "ck")
        report["loaded_step"] = int(state.step)
        for step in range(SAVE_AT + 1, STEPS + 1):
            _tp_train(engine, mpu, step)
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
        part = fe.shard_layout(engine).part
        report["continued_bitwise"] = _equal(
            fe.gather_full(state, engine), _load_tensors(out / f"final_tp{part.tp}.safetensors")
        )
        saved = _load_tensors(out / f"gathered{SAVE_AT}_tp{part.tp}.safetensors")
        report["async_equal"] = _equal(fe.gather_full(fe.load(engine, out / "ck_async", "t"), engine), saved)
        # post-hoc EMA of this rank's pieces, gathered, against the offline reconstruction joined (checked in the test)
        pieces = posthoc.posthoc_local(out / "snaps", fe.shard_layout(engine), gamma=3.0)
        local = fe.gather_full(fe.EmaState(torch.tensor(STEPS - 2), (pieces,)), engine)
        if mpu.get_data_parallel_rank() == 0:
            _save_tensors(out / f"posthoc_tp{part.tp}.safetensors", local)
        return report
    if phase == "relayout":  # no tensor parallelism now (ZeRO-2, data parallel 2): the saved slices joined
        from functional_ema._testing.multirank import TPMLP, make_engine

        engine = make_engine(2, model=TPMLP(0, 1, None, seed=9), seed=9)
        report["part"] = list(fe.shard_layout(engine).part)
        state = fe.load(engine, out / "ck")
        if rank == 0:
            _save_tensors(out / "relayout.safetensors", fe.gather_full(state, engine, dst=0))
        else:
            fe.gather_full(state, engine, dst=0)
        try:
            fe.load(engine, out / "noattr", "t")
        except fe.CheckpointError as e:
            report["unknown_split"] = [type(e).__name__, str(e)]
        return report
    if phase == "reshard":  # the same tensor-parallel layout, another data-parallel size
        engine, mpu = _tp_engine(tp_size, seed=9)
        state = fe.load(engine, out / "ck")
        part = fe.shard_layout(engine).part
        report["world"] = fe.shard_layout(engine).world_size
        report["resharded_equal"] = _equal(
            fe.gather_full(state, engine), _load_tensors(out / f"gathered{SAVE_AT}_tp{part.tp}.safetensors")
        )
        return report
    raise ValueError(phase)


def _join(parts: list[dict[str, torch.Tensor]], split: dict) -> dict[str, torch.Tensor]:
    """Tensor-parallel slices joined in plain torch (the test's own join, independent of the library's)."""
    return {n: parts[0][n] if d is None else torch.cat([p[n] for p in parts], dim=d) for n, d in split.items()}


def _launches(factory, folder: str, worker: str, phases, timeout: int = 600, **kwargs) -> tuple:
    """One multi-rank launch of ``worker`` (of this module) per ``(phase, world size)``, in order, all on one new
    folder: ``(folder, *each launch's reports)``, for a module fixture."""
    out = factory.mktemp(folder)
    target = f"tests.test_model_parallel:{worker}"
    return (
        out,
        *(run_ranks(target, world_size=w, timeout=timeout, out=str(out), phase=p, **kwargs) for p, w in phases),
    )


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    return _launches(
        tmp_path_factory, "tp", "tp_worker", (("train", 4), ("resume", 4), ("reshard", 2), ("relayout", 2))
    )


def test_tensor_parallel_mpu_every_verb(tp_runs):
    from functional_ema._testing.multirank import TPMLP

    out, train, resume, reshard, relayout = tp_runs
    for rank, r in enumerate(train):
        assert r["part"] == [rank % 2, 2, 0, 1], r["part"]
        assert r["tp_dims"] == TPMLP.SPLIT and r["plain_tp_dims"] is None
        assert r["collectives_in_update"] == 0
        assert r["gathered_at_save_equal_ref"] and r["final_equal_ref"], rank
        assert r["swapped_equal"] and r["training_refused"], rank
    for r in resume:
        assert r["loaded_step"] == SAVE_AT and r["continued_bitwise"] and r["async_equal"], r
    for r in reshard:
        assert r["world"] == 1 and r["resharded_equal"], r
    # another model-parallel layout (none): the slices joined along the recorded split, as consolidate joins them
    for r in relayout:
        assert r["part"] == [0, 1, 0, 1]
        name, msg = r["unknown_split"]
        assert name == "CheckpointMismatchError" and "how its slices join is unknown" in msg, msg
    assert _equal(_load_tensors(out / "relayout.safetensors"), fe.consolidate(out / "ck"))


def test_tensor_parallel_consolidation(tp_runs, tmp_path):
    from functional_ema import posthoc
    from functional_ema.__main__ import main
    from functional_ema._testing.multirank import TPMLP

    out = tp_runs[0]
    slices = [_load_tensors(out / f"gathered{SAVE_AT}_tp{t}.safetensors") for t in (0, 1)]
    want = _join(slices, TPMLP.SPLIT)
    assert _equal(fe.consolidate(out / "ck"), want)  # joined along Megatron's partition_dim
    assert _equal(fe.consolidate(out / "ck", tp_rank=1), slices[1])
    assert fe.checkpoint.saved_parts(out / "ck") == (2, 1, True)
    fe.consolidate_to_file(out / "ck", tmp_path / "ema.safetensors")
    assert _equal(_load_tensors(tmp_path / "ema.safetensors"), want)
    # tp_dims must agree with the recorded split: a replicated bias joined twice, a split weight kept whole, a
    # dim the parameter lacks, a name it lacks: refused naming the parameter and both dims (API, file, CLI)
    assert _equal(fe.consolidate(out / "ck", tp_dims={"fc1.weight": 0}), want)  # agreeing: the same result
    for bad, words in [
        ({"fc2.bias": 0}, ["'fc2.bias'", "=0 contradicts", "dimension None"]),
        ({"fc1.weight": None}, ["'fc1.weight'", "=None contradicts", "dimension 0"]),
        ({"fc1.weight": 1}, ["'fc1.weight'", "=1 contradicts", "dimension 0"]),
        ({"fc1.bias": 1}, ["tp_dims['fc1.bias']=1", "1 dimension(s)"]),
        ({"nope": 0}, ["tp_dims names 'nope'"]),
    ]:
        for verb in (
            lambda: fe.consolidate(out / "ck", tp_dims=bad),
            lambda: fe.consolidate_to_file(out / "ck", tmp_path / "x.safetensors", tp_dims=bad),
        ):
            with pytest.raises(fe.checkpoint.CheckpointMismatchError) as e:
                verb()
            assert all(w in str(e.value) for w in words), (bad, str(e.value))
    assert not (tmp_path / "x.safetensors").exists()
    cli = tmp_path / "cli.safetensors"
    assert main(["consolidate", str(out / "ck"), str(cli), "--tp-dim", "fc2.bias=0"]) == 1 and not cli.exists()
    with pytest.raises(TypeError, match="tp_dims must be a dict"):
        fe.consolidate(out / "ck", tp_dims=[("fc1.weight", 0)])
    # post-hoc EMA: offline (joined) equals the ranks' own reconstructions, gathered and joined
    local = _join([_load_tensors(out / f"posthoc_tp{t}.safetensors") for t in (0, 1)], TPMLP.SPLIT)
    assert _equal(posthoc.posthoc_offline(out / "snaps", gamma=3.0), local)
    # without the attributes the split is unknown: refused with the fix, joined with tp_dims, or one file per rank
    with pytest.raises(fe.CheckpointError, match=r"how its slices join is unknown.*tp_dims="):
        fe.consolidate(out / "noattr", "t")
    assert fe.checkpoint.saved_parts(out / "noattr", "t") == (2, 1, False)
    joined = fe.consolidate(out / "noattr", "t", tp_dims=TPMLP.SPLIT)
    assert sorted(joined) == sorted(TPMLP.SPLIT) and joined["fc1.weight"].shape == (12, 7)
    assert main(["consolidate", str(out / "noattr"), str(tmp_path / "plain.safetensors"), "--tag", "t"]) == 0
    per_rank = [_load_tensors(tmp_path / f"plain.tp{t}of2.safetensors") for t in (0, 1)]
    assert _equal(_join(per_rank, TPMLP.SPLIT), joined)


# ---------------------------------------------------------------------------------- pipeline stages


def _pipe_engine(stages: int, seed: int, tp: int = 1):
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from deepspeed.runtime.pipe.topology import PipelineParallelGrid, PipeModelDataParallelTopology
    from torch import nn

    from functional_ema._testing.multirank import ColumnParallelLinear, RowParallelLinear, ds_config, tp_full_weights

    world = torch.distributed.get_world_size()
    topo = PipeModelDataParallelTopology(num_pp=stages, num_mp=tp, num_dp=world // (stages * tp))
    torch.manual_seed(seed)
    if tp == 1:  # a BatchNorm in the first stage: module buffers per stage
        layers = [nn.Linear(7, 13), nn.BatchNorm1d(13), nn.Tanh(), nn.Linear(13, 5)]
    else:  # Megatron-style tensor-parallel layers, the column-parallel one in stage 0, the row-parallel one in stage 1
        grid = PipelineParallelGrid(topology=topo)
        t, group = grid.get_slice_parallel_rank(), grid.get_slice_parallel_group()
        w = tp_full_weights(seed)
        layers = [ColumnParallelLinear(w["w1"], w["b1"], t, tp), RowParallelLinear(w["w2"], w["b2"], t, tp, group)]
    module = PipelineModule(layers=layers, topology=topo, loss_fn=nn.MSELoss(), partition_method="uniform")
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=ds_config(1)
    )
    return engine


def _pipe_data(engine, step: int):
    g = torch.Generator().manual_seed(1234 + 1000 * step + engine.grid.get_data_parallel_rank())
    return iter([(torch.randn(4, 7, generator=g), torch.randn(4, 5, generator=g))])


def pipe_worker(out: str, phase: str, tp: int = 1) -> dict:
    from functional_ema import posthoc
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    report: dict = {}
    name = f"pp_tp{tp}"
    if phase == "train":
        engine = _pipe_engine(2, seed=0, tp=tp)
        layout = fe.shard_layout(engine)
        report["part"] = list(layout.part)
        report["names"] = sorted(layout.specs)
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        bufs = fe.buffers.init_buffers(engine, num_emas=2)
        ref = _Ref(_reference(engine), 0)
        sent = 0
        for step in range(1, STEPS + 1):
            engine.train_batch(_pipe_data(engine, step))
            state, n = _zero_bytes_update(state, engine, step)
            sent += n
            bufs = fe.buffers.update_buffers(bufs, engine, step, decay=list(DECAYS))
            ref.feed(_reference(engine), step)
            if step % 2 == 0:
                posthoc.save_snapshot(state, engine, out / f"{name}_snaps", list(DECAYS))
            if step == SAVE_AT:
                fe.save(state, engine, out / f"{name}_ck", decay=list(DECAYS), buffers=bufs)
                engine.save_checkpoint(str(out / f"{name}_ck"))
                fe.AsyncSaver().save(state, engine, out / f"{name}_async", "t", buffers=bufs).wait()
                gathered = fe.gather_full(state, engine)
                report["gathered_at_save_equal_ref"] = _equal(gathered, ref.emas[0])
                if engine.grid.get_data_parallel_rank() == 0:
                    _save_tensors(
                        out / f"{name}_g{SAVE_AT}_pp{layout.part.pp}_tp{layout.part.tp}.safetensors", gathered
                    )
        report["collectives_in_update"] = sent
        final = fe.gather_full(state, engine)
        report["final_equal_ref"] = _equal(final, ref.emas[0])
        if engine.grid.get_data_parallel_rank() == 0:
            _save_tensors(out / f"{name}_final_pp{layout.part.pp}_tp{layout.part.tp}.safetensors", final)
        engine.eval()
        report.update(_swap_check(engine, state, lambda: engine.eval_batch(_pipe_data(engine, 99))))
        return report
    if phase == "resume":
        engine = _pipe_engine(2, seed=9, tp=tp)
        engine.load_checkpoint(str(out / f"{name}_ck"))
        loaded = fe.checkpoint.load_checkpoint(engine, out / f"{name}_ck", buffers=True)
        state, bufs = loaded.state, loaded.buffers
        report["loaded_step"] = [int(state.step), int(bufs.step)]
        for step in range(SAVE_AT + 1, STEPS + 1):
            engine.train_batch(_pipe_data(engine, step))
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
        part = fe.shard_layout(engine).part
        report["continued_bitwise"] = _equal(
            fe.gather_full(state, engine), _load_tensors(out / f"{name}_final_pp{part.pp}_tp{part.tp}.safetensors")
        )
        saved = _load_tensors(out / f"{name}_g{SAVE_AT}_pp{part.pp}_tp{part.tp}.safetensors")
        report["async_equal"] = _equal(fe.gather_full(fe.load(engine, out / f"{name}_async", "t"), engine), saved)
        report["snapshot_equal"] = _equal(
            fe.gather_full(fe.load(engine, out / f"{name}_snaps", posthoc.snapshot_tag(SAVE_AT)), engine), saved
        )
        return report
    if phase == "relayout":  # one stage now (data parallel 2): the saved stages' parameters and buffers, by name
        engine = _pipe_engine(1, seed=9, tp=tp)
        loaded = fe.checkpoint.load_checkpoint(engine, out / f"{name}_ck", buffers=True)
        report["part"] = list(fe.shard_layout(engine).part)
        report["buffers"] = sorted(loaded.buffers.emas[0]) + sorted(loaded.buffers.copied)
        try:  # the PipelineModule instead of the engine: refused, naming the engine
            fe.local_shards(engine.module)
            report["module_refused"] = None
        except TypeError as e:
            report["module_refused"] = str(e)
        full = fe.gather_full(loaded.state, engine, dst=0)
        if torch.distributed.get_rank() == 0:
            _save_tensors(out / f"{name}_relayout.safetensors", full)
        return report
    if phase == "reshard":
        engine = _pipe_engine(2, seed=9, tp=tp)
        state = fe.load(engine, out / f"{name}_ck")
        part = fe.shard_layout(engine).part
        report["world"] = fe.shard_layout(engine).world_size
        report["resharded_equal"] = _equal(
            fe.gather_full(state, engine), _load_tensors(out / f"{name}_g{SAVE_AT}_pp{part.pp}_tp{part.tp}.safetensors")
        )
        if tp == 1:  # 2 stages at 2 ranks: tied layers and selections, in the launch already made
            report["tied"] = _pipe_tied(out)
            report["selected"] = _pipe_selected(out)
        return report
    raise ValueError(phase)


def _two_stage_engine(layers, **kwargs):
    """A 2-stage PipelineEngine (data parallel 1, 2 ranks) of ``layers``, ZeRO-1 fp32."""
    import deepspeed
    from deepspeed.pipe import PipelineModule
    from torch import nn

    from functional_ema._testing.multirank import ds_config

    torch.manual_seed(0)
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), **kwargs)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=ds_config(1)
    )
    return engine


def _train_selected(engine, selections: dict[str, dict], width: int) -> tuple[dict, dict]:
    """Train ``engine`` 3 steps, one EMA per selection (``{key: local_shards kwargs}``): ``(states, oracles)``, the
    oracle of each the plain-torch EMA of DeepSpeed's full fp32 weights of every stage, of the names it selects."""
    from functional_ema._selection import make_selection

    def batch(step):
        g = torch.Generator().manual_seed(1234 + 1000 * step)
        return iter([(torch.randn(4, 7, generator=g), torch.randn(4, width, generator=g))])

    states = {k: fe.init_ema(fe.local_shards(engine, **kw), num_emas=2) for k, kw in selections.items()}
    ref = _Ref(_reference(engine), 0)
    for step in range(1, 4):
        engine.train_batch(batch(step))
        states = {
            k: fe.update(s, fe.local_shards(engine, **selections[k]), step, decay=list(DECAYS))
            for k, s in states.items()
        }
        ref.feed(_reference(engine), step)
    every: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, ref.emas[0])
    whole = {n: t for r in reversed(every) for n, t in r.items()}  # a name of both stages: stage 0's
    oracles: dict = {"differ": sorted({n for r in every for n in r if not torch.equal(r[n], whole[n])})}
    for k, kw in selections.items():
        sel = make_selection(kw.get("include"), kw.get("exclude"))
        oracles[k] = {n: t for n, t in whole.items() if sel is None or sel.picks(n)}
    return states, oracles


def _refusal(fn) -> str | None:
    """The message of the ``MismatchError`` ``fn`` raises, ``None`` when it returns."""
    try:
        fn()
    except fe.MismatchError as e:
        return f"{type(e).__name__}: {e}"
    return None


def _joined_and_consolidated(engine, state, oracle: dict, where: Path) -> dict:
    """``gather_full(join_parts=True)`` (to every rank, and to rank 1 only) and ``save`` + ``consolidate`` of
    ``state``: each refusal's message (``None``: it gave a result) and whether each result is ``oracle``."""
    rank = torch.distributed.get_rank()
    got: dict = {}

    def join(dst):
        got[dst] = fe.gather_full(state, engine, join_parts=True, dst=dst)

    report = {"join": _refusal(lambda: join(None)), "join_dst": _refusal(lambda: join(1))}
    report["join_equal"] = None in got and _equal(got[None], oracle)
    report["join_dst_equal"] = 1 in got and _equal(got[1], oracle if rank == 1 else {})
    fe.save(state, engine, where, "t")
    torch.distributed.barrier()
    if rank == 0:
        report["consolidate"] = _refusal(lambda: got.update(c=fe.consolidate(where, "t")))
        report["consolidate_equal"] = "c" in got and _equal(got["c"], oracle)
    return report


def _pipe_tied(out: Path) -> dict:
    """A ``TiedLayerSpec`` layer on both stages: with only its weight tied (DeepSpeed's default), and its bias too."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    from torch import nn

    report: dict = {}
    for attrs in (["weight"], ["weight", "bias"]):

        def tied(attrs=attrs):
            return TiedLayerSpec("emb", nn.Linear, 7, 7, tied_weight_attr=attrs)

        layers = [tied(), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 7, 7), LayerSpec(nn.Tanh), tied()]
        engine = _two_stage_engine(layers, partition_method="uniform")
        kws = {"all": {}, "no_bias": {"exclude": "tied_modules.emb.bias"}} if attrs == ["weight"] else {"all": {}}
        states, oracles = _train_selected(engine, kws, 7)
        key = "+".join(attrs)
        report[f"{key}:names"] = sorted(fe.local_shards(engine))
        report[f"{key}:differ"] = oracles["differ"]  # the oracle's names whose stages' values differ
        for k, state in states.items():
            got = _joined_and_consolidated(engine, state, oracles[k], out / f"tied_{key}_{k}")
            report.update({f"{key}:{k}:{what}": v for what, v in got.items()})
    return report


def _pipe_selected(out: Path) -> dict:
    """Selections of a 2-stage pipeline (stage 0 holds layers 0 and 2, stage 1 layer 4) that leave the last stage
    nothing, or name each stage's parameters in patterns the other stage's names do not match."""
    from torch import nn

    from functional_ema._checkpoint.format import MANIFEST_NAME
    from functional_ema._selection import selection_record

    engine = _two_stage_engine([nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 40), nn.Tanh(), nn.Linear(40, 5)])
    kws = {"exclude_last": {"exclude": "4.*"}, "include_first": {"include": "0.*"}, "both": {"include": ["0.*", "4.*"]}}
    states, oracles = _train_selected(engine, kws, 5)
    report: dict = {}
    for k, state in states.items():
        got = _joined_and_consolidated(engine, state, oracles[k], out / f"sel_{k}")
        report.update({f"{k}:{what}": v for what, v in got.items()})
        report[f"{k}:names"] = sorted(fe.local_shards(engine, **kws[k]))
        records: list = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(records, selection_record(state.emas[0]))
        manifest = json.loads((out / f"sel_{k}" / "t" / MANIFEST_NAME).read_text())
        report[f"{k}:records"] = [*records, manifest.get("selection")]
        report[f"{k}:swapped"] = _swap_selected(engine, state, oracles[k])
        loaded = fe.load(engine, out / f"sel_{k}", "t", **kws[k])
        report[f"{k}:loaded_equal"] = _equal(fe.gather_full(loaded, engine, join_parts=True), oracles[k])
    return report


def _swap_selected(engine, state, oracle: dict) -> bool:
    """Inside ``swapped``, the selected parameters hold the EMA and the others their live values; after it, every
    parameter its live value again."""
    live = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    with torch.no_grad(), fe.swapped(engine, state):
        inside = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    return _equal(after, live) and _equal(inside, {n: oracle.get(n, t) for n, t in live.items()})


@pytest.fixture(scope="module")
def pipe_runs(tmp_path_factory):
    return _launches(
        tmp_path_factory, "pipe", "pipe_worker", (("train", 4), ("resume", 4), ("reshard", 2), ("relayout", 2))
    )


def test_pipeline_stages_every_verb(pipe_runs):
    out, train, resume, reshard, relayout = pipe_runs
    for rank, r in enumerate(train):
        assert r["part"] == [0, 1, rank // 2, 2], r["part"]
        assert r["names"] == (["0.bias", "0.weight", "1.bias", "1.weight"] if rank < 2 else ["3.bias", "3.weight"]), r[
            "names"
        ]
        assert r["collectives_in_update"] == 0
        assert r["gathered_at_save_equal_ref"] and r["final_equal_ref"], rank
        assert r["swapped_equal"] and r["training_refused"], rank
    for r in resume:
        assert (
            r["loaded_step"] == [SAVE_AT, SAVE_AT]
            and r["continued_bitwise"]
            and r["async_equal"]
            and r["snapshot_equal"]
        ), r
    for r in reshard:
        assert r["world"] == 1 and r["resharded_equal"], r
    # both stages consolidate into one file: every parameter of the model, and stage 0's BatchNorm buffers
    stages = [_load_tensors(out / f"pp_tp1_g{SAVE_AT}_pp{p}_tp0.safetensors") for p in (0, 1)]
    assert _equal(fe.consolidate(out / "pp_tp1_ck"), {**stages[0], **stages[1]})
    sd = fe.buffers.consolidate(out / "pp_tp1_ck")
    assert sorted(sd) == [
        "0.bias",
        "0.weight",
        "1.bias",
        "1.num_batches_tracked",
        "1.running_mean",
        "1.running_var",
        "1.weight",
        "3.bias",
        "3.weight",
    ]
    # loaded by a one-stage pipeline (another layout): every stage's parameters and buffers, by name
    for r in relayout:
        assert r["part"] == [0, 1, 0, 1] and r["buffers"] == [
            "1.running_mean",
            "1.running_var",
            "1.num_batches_tracked",
        ], r
        msg = r["module_refused"]
        assert msg and "DeepSpeed PipelineModule" in msg and "the object deepspeed.initialize returned" in msg, msg
    assert _equal(_load_tensors(out / "pp_tp1_relayout.safetensors"), {**stages[0], **stages[1]})


def test_pipeline_tied_layer(pipe_runs):
    """A name held by two stages is joined (online and offline) only where the copies are equal: a TiedLayerSpec's
    tied weight; its untied bias is refused in both paths, on every rank, naming it and the fix."""
    reshard = pipe_runs[3]
    both = ["tied_modules.emb.bias", "tied_modules.emb.weight"]
    for rank, r in enumerate(reshard):
        t = r["tied"]
        assert t["weight:names"] == t["weight+bias:names"] == (["2.bias", "2.weight", *both] if rank == 0 else both)
        assert t["weight:differ"] == ["tied_modules.emb.bias"] and t["weight+bias:differ"] == [], t
        refusals = [t["weight:all:join"], t["weight:all:join_dst"]] + (
            [t["weight:all:consolidate"]] if rank == 0 else []
        )
        for msg in refusals:
            assert msg and "MismatchError" in msg and "'tied_modules.emb.bias'" in msg and "stages [0, 1]" in msg, msg
            assert "tied_weight_attr=['weight', 'bias']" in msg and "exclude=['tied_modules.emb.bias']" in msg, msg
            assert "'tied_modules.emb.weight'" not in msg, msg
        for k in ("weight:no_bias", "weight+bias:all"):
            assert t[f"{k}:join"] is None and t[f"{k}:join_dst"] is None, t
            assert t[f"{k}:join_equal"] and t[f"{k}:join_dst_equal"], (k, t)
            if rank == 0:
                assert t[f"{k}:consolidate"] is None and t[f"{k}:consolidate_equal"], (k, t)


def test_pipeline_untied_copies_checked_when_read(pipe_runs, monkeypatch):
    """The untied bias's copies are compared when it is read, not when the checkpoint is opened: opening it (what
    listing snapshots and loads into another layout do) reads no tensor, and a load that does not read the bias
    works; consolidate and a load of the bias still refuse it, naming it."""
    from torch import nn

    from functional_ema._checkpoint.reader import CheckpointReader, open_joined

    where = pipe_runs[0] / "tied_weight_all"  # the EMA of every parameter, the default TiedLayerSpec (bias untied)
    read: list[str] = []
    fill = CheckpointReader.fill

    def counting(self, dst, k, name, start, numel, verify):
        read.append(name)
        return fill(self, dst, k, name, start, numel, verify)

    monkeypatch.setattr(CheckpointReader, "fill", counting)
    with open_joined(where, "t") as joined:
        assert joined.shapes["tied_modules.emb.bias"] == (7,) and int(joined.step) == 3
    assert read == []

    def model(bias: bool) -> nn.Module:
        m = nn.Module()
        m.tied_modules = nn.ModuleDict({"emb": nn.Linear(7, 7, bias=bias)})
        m.add_module("2", nn.Linear(7, 7))
        return m

    # a model without the bias (another layout: every stage joined): refused before any tensor is read, since the
    # bias's EMA would be left behind (the untied copies are not what refuses it)
    msg = _refusal(lambda: fe.load(model(False), where, "t"))
    assert msg and "no rank of this job loads: 'tied_modules.emb.bias'" in msg and read == [], (msg, read)
    for refused in (lambda: fe.load(model(True), where, "t"), lambda: fe.consolidate(where, "t")):
        msg = _refusal(refused)
        assert msg and "'tied_modules.emb.bias'" in msg and "stages [0, 1]" in msg, msg


def test_pipeline_selection_spans_stages(pipe_runs):
    """One selection for the whole pipeline: a pattern for another stage's parameters is no typo on this stage, and
    a stage it leaves nothing averages nothing; every verb gives exactly the selected parameters' oracle EMA."""
    reshard = pipe_runs[3]
    names = {
        "exclude_last": [["0.bias", "0.weight", "2.bias", "2.weight"], []],
        "include_first": [["0.bias", "0.weight"], []],
        "both": [["0.bias", "0.weight"], ["4.bias", "4.weight"]],
    }
    for rank, r in enumerate(reshard):
        s = r["selected"]
        for k, per_stage in names.items():
            assert s[f"{k}:names"] == per_stage[rank], (k, s)
            assert s[f"{k}:join"] is None and s[f"{k}:join_dst"] is None, (k, s)
            assert s[f"{k}:join_equal"] and s[f"{k}:join_dst_equal"] and s[f"{k}:loaded_equal"], (k, s)
            assert s[f"{k}:swapped"], k  # the selected hold the EMA inside, the others stay live; all restored
            records = s[f"{k}:records"]  # each stage's state, then the manifest
            assert records[0] is not None and all(x == records[0] for x in records), (k, records)
            if rank == 0:
                assert s[f"{k}:consolidate"] is None and s[f"{k}:consolidate_equal"], (k, s)


# ------------------------------------------------- bf16 pipeline at ZeRO-0 (BF16_Optimizer), repartitioned stages


def _bf16_pipe_engine(seed: int, partition_method: str):
    """A bf16 2-stage PipelineEngine at ZeRO-0 (2 ranks, data parallel 1): DeepSpeed gives a bf16 pipeline
    ``BF16_Optimizer`` even at ZeRO-0, its fp32 masters flat partitions (a plain engine gets another wrapper).
    ``partition_method`` "uniform" cuts the layers [0, 3) [3, 6), "parameters" [0, 1) [1, 6)."""
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch import nn

    from functional_ema._testing.multirank import ds_config

    torch.manual_seed(seed)
    layers = [LayerSpec(nn.Linear, 7, 200), LayerSpec(nn.Linear, 200, 5), LayerSpec(nn.Linear, 5, 5)]
    layers += [LayerSpec(nn.Linear, 5, 5), LayerSpec(nn.Tanh), LayerSpec(nn.Tanh)]
    module = PipelineModule(layers=layers, num_stages=2, loss_fn=nn.MSELoss(), partition_method=partition_method)
    engine, *_ = deepspeed.initialize(
        model=module, optimizer=torch.optim.AdamW(module.parameters(), lr=1e-2), config=ds_config(0, "bf16")
    )
    return engine


def _bf16_pipe_data(step: int):
    g = torch.Generator().manual_seed(1234 + 1000 * step)
    return iter([(torch.randn(4, 7, generator=g).bfloat16(), torch.randn(4, 5, generator=g).bfloat16())])


def _bf16_fp32_masters(engine) -> dict[str, torch.Tensor]:
    """The oracle: DeepSpeed's own full fp32 master of each trained parameter (through ``_hp_mapping``)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        n: safe_get_full_fp32_param(p).detach().clone().float()
        for n, p in engine.module.named_parameters()
        if p.requires_grad
    }


def pipe_bf16_worker(out: str, phase: str) -> dict:
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    report: dict = {}
    pp = torch.distributed.get_rank()  # data parallel 1: the rank is the stage
    if phase == "train":
        engine = _bf16_pipe_engine(0, "uniform")
        opt = engine.optimizer
        report["optimizer"] = [type(opt).__name__, engine.zero_optimization_stage()]
        shards = fe.local_shards(engine)
        report["names"] = sorted(shards)
        report["trained"] = sorted(n for n, p in engine.module.named_parameters() if p.requires_grad)
        flats = {t.untyped_storage().data_ptr() for t in opt.fp32_groups_flat_partition}
        report["views_of_masters"] = all(t.untyped_storage().data_ptr() in flats for t in shards.values())
        report["stage"] = fe.shard_layout(engine).stage
        state = fe.init_ema(shards, num_emas=2)
        ref = _Ref(_bf16_fp32_masters(engine), 0)
        for step in range(1, STEPS + 1):
            engine.train_batch(_bf16_pipe_data(step))
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
            ref.feed(_bf16_fp32_masters(engine), step)
            if step == SAVE_AT:
                fe.save(state, engine, out / "bf16_ck", decay=list(DECAYS))
                gathered = fe.gather_full(state, engine)
                report["gathered_at_save_equal_ref"] = _equal(gathered, ref.emas[0])
                _save_tensors(out / f"bf16_g{SAVE_AT}_pp{pp}.safetensors", gathered)
        final = fe.gather_full(state, engine)
        report["final_equal_ref"] = _equal(final, ref.emas[0]) and _equal(
            fe.gather_full(state, engine, index=1), ref.emas[1]
        )
        _save_tensors(out / f"bf16_final_pp{pp}.safetensors", final)
        engine.eval()
        report.update(_swap_check(engine, state, lambda: engine.eval_batch(_bf16_pipe_data(99))))
        return report
    if phase == "resume":  # fresh processes: resumed, and loaded by stages partitioned otherwise
        # DeepSpeed 0.19.8 cannot reload this engine's own checkpoint (BF16_Optimizer.load_state_dict indexes the
        # stage-0 optimizer dict by data-parallel rank: KeyError 0), so the training is replayed (deterministic)
        engine = _bf16_pipe_engine(0, "uniform")
        for step in range(1, SAVE_AT + 1):
            engine.train_batch(_bf16_pipe_data(step))
        state = fe.load(engine, out / "bf16_ck")
        report["loaded_step"] = int(state.step)
        for step in range(SAVE_AT + 1, STEPS + 1):
            engine.train_batch(_bf16_pipe_data(step))
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
        report["continued_bitwise"] = _equal(
            fe.gather_full(state, engine), _load_tensors(out / f"bf16_final_pp{pp}.safetensors")
        )
        # the same 2 stages, the layers split otherwise: each stage's EMA by name from the joined saved stages
        other = _bf16_pipe_engine(9, "parameters")
        report["other_names"] = sorted(fe.local_shards(other))
        got: dict = {}
        report["repartitioned_refused"] = _refusal(
            lambda: got.update(
                fe.gather_full(fe.load(other, out / "bf16_ck", f"global_step{SAVE_AT}"), other, join_parts=True)
            )
        )
        saved = [_load_tensors(out / f"bf16_g{SAVE_AT}_pp{p}.safetensors") for p in (0, 1)]
        report["repartitioned_names"] = sorted(got)
        report["repartitioned_equal"] = _equal(got, {**saved[0], **saved[1]})
        return report
    raise ValueError(phase)


@pytest.fixture(scope="module")
def pipe_bf16_runs(tmp_path_factory):
    return _launches(tmp_path_factory, "pipe_bf16", "pipe_bf16_worker", (("train", 2), ("resume", 2)))


def test_pipeline_bf16_zero0_every_verb(pipe_bf16_runs):
    """A bf16 PipelineEngine at ZeRO-0 (DeepSpeed's BF16_Optimizer): every stage's trained parameters are read
    (they read as none before: empty EMAs and saves, exit 0), as views of the optimizer's fp32 partitions; the EMA
    is bitwise the plain-torch EMA of DeepSpeed's fp32 masters; swap; save, resumed in fresh processes continues
    bitwise; the stages consolidate into the full EMA."""
    out, train, resume = pipe_bf16_runs
    stages = (["0.bias", "0.weight", "1.bias", "1.weight", "2.bias", "2.weight"], ["3.bias", "3.weight"])
    for pp, r in enumerate(train):
        assert r["optimizer"] == ["BF16_Optimizer", 0] and r["stage"] == 0, r
        assert r["names"] == r["trained"] == stages[pp] and r["views_of_masters"], r
        assert r["gathered_at_save_equal_ref"] and r["final_equal_ref"], r
        assert r["swapped_equal"] and r["training_refused"], r
    for r in resume:
        assert r["loaded_step"] == SAVE_AT and r["continued_bitwise"], r
    saved = [_load_tensors(out / f"bf16_g{SAVE_AT}_pp{pp}.safetensors") for pp in (0, 1)]
    assert sorted(saved[0]) == stages[0] and sorted(saved[1]) == stages[1]
    assert _equal(fe.consolidate(out / "bf16_ck", f"global_step{SAVE_AT}"), {**saved[0], **saved[1]})


def test_pipeline_repartitioned_load(pipe_bf16_runs):
    """Saved by 2 stages partitioned "uniform", loaded by 2 stages partitioned "parameters" (the same stage indices,
    other layers): joined and re-cut by name, exactly the saved EMA (it was refused as "does not match this model")."""
    resume = pipe_bf16_runs[2]
    names = (["0.bias", "0.weight"], ["1.bias", "1.weight", "2.bias", "2.weight", "3.bias", "3.weight"])
    for pp, r in enumerate(resume):
        assert r["other_names"] == names[pp], r
        assert r["repartitioned_refused"] is None, r["repartitioned_refused"]
        assert r["repartitioned_names"] == sorted(names[0] + names[1]) and r["repartitioned_equal"], r


# ------------------------------------------------------------------ tensor x pipeline x data parallel


@pytest.fixture(scope="module")
def tp_pp_runs(tmp_path_factory):
    """Tensor 2 x pipeline 2 x data parallel 2 (8 ranks), resumed at 8 and resharded to data parallel 1 (4 ranks)."""
    phases = (("train", 8), ("resume", 8), ("reshard", 4))
    return _launches(tmp_path_factory, "tppp", "pipe_worker", phases, timeout=900, tp=2)


def test_tensor_times_pipeline_parallel(tp_pp_runs):
    out, train, resume, reshard = tp_pp_runs
    for rank, r in enumerate(
        train
    ):  # DeepSpeed's topology: rank = stage * 4 + data-parallel rank * 2 + tensor-parallel rank
        assert r["part"] == [rank % 2, 2, rank // 4, 2], r["part"]
        assert r["collectives_in_update"] == 0
        assert (
            r["gathered_at_save_equal_ref"] and r["final_equal_ref"] and r["swapped_equal"] and r["training_refused"]
        ), rank
    for r in resume:
        assert r["continued_bitwise"] and r["async_equal"] and r["snapshot_equal"], r
    for r in reshard:
        assert r["world"] == 1 and r["resharded_equal"], r
    # every stage, each tensor-parallel parameter joined along its recorded split
    g = {(p, t): _load_tensors(out / f"pp_tp2_g{SAVE_AT}_pp{p}_tp{t}.safetensors") for p in (0, 1) for t in (0, 1)}
    want = {
        **_join([g[0, 0], g[0, 1]], {"0.weight": 0, "0.bias": 0}),
        **_join([g[1, 0], g[1, 1]], {"1.weight": 1, "1.bias": None}),
    }
    assert _equal(fe.consolidate(out / "pp_tp2_ck"), want)
    assert fe.checkpoint.saved_parts(out / "pp_tp2_ck") == (2, 2, True)


# ------------------------------------------------------------------------- DeepSpeed AutoTP (training)


AUTOTP_DECAYS = (0.0, 0.9)  # EMA 0 is the weights themselves: checked against DeepSpeed's own gather of the slices


def _autotp_engine(seed: int):
    import deepspeed
    from transformers import LlamaConfig, LlamaForCausalLM

    from functional_ema._testing.multirank import ds_config

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = LlamaForCausalLM(config)
    cfg = ds_config(1)
    cfg["tensor_parallel"] = {"autotp_size": 2}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=cfg)
    return engine


def _autotp_ids(step: int) -> torch.Tensor:
    return torch.randint(
        0, 64, (2, 8), generator=torch.Generator().manual_seed(100 + step)
    )  # the same on both TP ranks


def _autotp_train(engine, step: int) -> None:
    ids = _autotp_ids(step)
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()


def _deepspeed_gathered_weights(engine) -> dict[str, torch.Tensor]:
    """The full weights through DeepSpeed's own AutoTP gather (GatherReplacedLayerParams), layer by layer."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    out = {}
    for prefix, module in engine.module.named_modules():
        own = [(n, p) for n, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        params = [getattr(module, "weight", None), getattr(module, "bias", None)]
        with GatherReplacedLayerParams([p for p in params if p is not None], module, enabled=True):
            for n, p in own:
                out[f"{prefix}.{n}" if prefix else n] = p.detach().clone().float()
    return out


def autotp_worker(out: str, phase: str) -> dict:
    import torch.distributed as dist

    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    rank = dist.get_rank()
    report: dict = {}
    if phase == "train":
        engine = _autotp_engine(0)
        layout = fe.shard_layout(engine)
        report["part"], report["tp_dims"] = list(layout.part), layout.tp_dims
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        ref = {n: t.clone() for n, t in _reference(engine).items()}
        sent = 0
        for step in range(1, 5):
            _autotp_train(engine, step)
            shards = fe.local_shards(engine)
            from functional_ema._testing.multirank import CollectiveSpy

            with CollectiveSpy() as spy:
                state = fe.update(state, shards, step, decay=list(AUTOTP_DECAYS))
            sent += spy.total
            for n, t in _reference(engine).items():
                ref[n].lerp_(t, 1 - 0.9)
            if step == 3:
                fe.save(state, engine, out / "ck", decay=list(AUTOTP_DECAYS))
                engine.save_checkpoint(str(out / "ck"))
                engine.eval()
                weights = _deepspeed_gathered_weights(engine)  # a collective over the tensor-parallel ranks
                engine.train()
                if rank == 0:
                    _save_tensors(out / "deepspeed_gathered3.safetensors", weights)
        report["collectives_in_update"] = sent
        report["equal_ref"] = _equal(fe.gather_full(state, engine, index=1), ref)
        _save_tensors(out / f"final_tp{layout.part.tp}.safetensors", fe.gather_full(state, engine, index=1))
        engine.eval()
        ids = _autotp_ids(99)
        report.update(
            _swap_check(engine, fe.EmaState(state.step, (state.emas[1],)), lambda: engine(input_ids=ids).logits)
        )
        return report
    if phase == "resume":
        engine = _autotp_engine(9)
        engine.load_checkpoint(str(out / "ck"))
        state = fe.load(engine, out / "ck")
        _autotp_train(engine, 4)
        state = fe.update(state, fe.local_shards(engine), 4, decay=list(AUTOTP_DECAYS))
        part = fe.shard_layout(engine).part
        report["continued_bitwise"] = _equal(
            fe.gather_full(state, engine, index=1), _load_tensors(out / f"final_tp{part.tp}.safetensors")
        )
        return report
    raise ValueError(phase)


def test_autotp_training_every_verb(tmp_path):
    pytest.importorskip("transformers")
    train = run_ranks(
        "tests.test_model_parallel:autotp_worker", world_size=2, timeout=600, out=str(tmp_path), phase="train"
    )
    resume = run_ranks(
        "tests.test_model_parallel:autotp_worker", world_size=2, timeout=600, out=str(tmp_path), phase="resume"
    )
    for rank, r in enumerate(train):
        assert r["part"] == [rank, 2, 0, 1], r["part"]
        dims = r["tp_dims"]
        assert (
            dims["model.layers.0.self_attn.q_proj.weight"] == 0 and dims["model.layers.0.self_attn.o_proj.weight"] == 1
        )
        assert dims["model.layers.0.mlp.down_proj.weight"] == 1 and dims["model.norm.weight"] is None, dims
        assert r["collectives_in_update"] == 0 and r["equal_ref"], r
        assert r["swapped_equal"] and r["training_refused"], r
    for r in resume:
        assert r["continued_bitwise"], r
    # EMA 0 (decay 0) is the weights at the save: joined along AutoTP's recorded splits, it equals DeepSpeed's own gather
    joined = fe.consolidate(tmp_path / "ck", index=0)
    gathered = _load_tensors(tmp_path / "deepspeed_gathered3.safetensors")
    assert _equal(joined, {n: gathered[n] for n in joined})
    assert joined["model.layers.0.self_attn.q_proj.weight"].shape == (32, 32)
    assert joined["model.layers.0.mlp.down_proj.weight"].shape == (32, 64)


# ---------------------------------------------------------------------- expert parallel (DeepSpeed MoE)


_EXPERTS = "moe.deepspeed_moe.experts.deepspeed_experts."


def _moe_engine(ep_size: int, seed: int, stage: int = 2, dtype: str = "fp32"):
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    from functional_ema._testing.multirank import ds_config

    model = MoENet(ep_size, seed, buffers=dtype == "fp32")
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(groups, lr=1e-2), config=ds_config(stage, dtype)
    )
    return engine


def _moe_batch(step: int):
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1234 + 1000 * step + dist.get_rank())
    return torch.randn(16, 7, generator=g), torch.randn(16, 5, generator=g)


def _moe_train(engine, step: int) -> None:
    x, y = _moe_batch(step)
    out, aux = engine(x.to(engine.module.inp.weight.dtype))
    engine.backward(((out.float() - y) ** 2).mean() + aux.float())
    engine.step()


def _global_name(name: str, ep: int, local: int) -> str:
    """The test's own renaming (independent of the library's): local expert i of expert-parallel rank ep is
    global expert ep * local + i, as DeepSpeed's own MoE checkpoint names it."""
    if not name.startswith(_EXPERTS):
        return name
    i, rest = name[len(_EXPERTS) :].split(".", 1)
    return f"{_EXPERTS}{ep * local + int(i)}.{rest}"


def _moe_reference(engine) -> dict[str, torch.Tensor]:
    """DeepSpeed's full fp32 master (``safe_get_full_fp32_param``: a collective over each parameter's partition
    group) of every non-expert parameter and of this rank's experts, keyed by GLOBAL expert index; the
    expert-parallel rank from DeepSpeed's own groups."""
    from deepspeed.utils import groups, safe_get_full_fp32_param

    ep_size = engine.module.moe.ep_size
    ep = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    out = {}
    for n, p in engine.module.named_parameters():
        out[_global_name(n, ep, NUM_EXPERTS // ep_size)] = safe_get_full_fp32_param(p).detach().clone().float()
    return out


def _moe_swap_check(engine, state) -> dict:
    """``swapped``: the forward equals the same engine with the gathered EMA copied into its module parameters by
    plain torch (local expert names mapped to global ones by the test); training inside is refused."""
    from deepspeed.utils import groups

    ep_size = engine.module.moe.ep_size
    ep = groups._get_expert_parallel_rank(f"ep_size_{ep_size}")
    full = fe.gather_full(state, engine)
    x, _ = _moe_batch(99)
    engine.eval()
    with torch.no_grad(), fe.swapped(engine, state):
        inside = engine(x)[0]
        try:
            engine.backward(torch.zeros(()))
            refused = False
        except fe.SwappedTrainingError:
            refused = True
    params = dict(engine.module.named_parameters())
    live = {n: p.detach().clone() for n, p in params.items()}
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(full[_global_name(n, ep, NUM_EXPERTS // ep_size)])
        manual = engine(x)[0]
        plain = {n: p.detach().clone() for n, p in params.items()}
        for n, p in params.items():
            p.copy_(live[n])
    engine.train()
    return {
        "swapped_equal": torch.equal(inside, manual),
        "training_refused": refused,
        "swap_changed_weights": any(not torch.equal(plain[n], live[n]) for n in params),
    }


def moe_worker(out: str, phase: str) -> dict:
    import torch.distributed as dist

    from functional_ema import posthoc
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    rank = dist.get_rank()
    report: dict = {}
    if phase == "train":  # 4 ranks, expert parallel 2, ZeRO-2
        engine = _moe_engine(2, seed=0)
        layout = fe.shard_layout(engine)
        report["world"], report["experts"] = layout.world_size, list(layout.experts[:2])
        report["names"] = list(layout.specs)
        report["held"] = sorted(n for n, s in layout.specs.items() if s.numel)
        shards = fe.local_shards(engine)
        opt = engine.optimizer  # zero-copy: every piece is a view of DeepSpeed's fp32 partitions
        flats = {t.untyped_storage().data_ptr() for t in opt.single_partition_of_fp32_groups}
        report["views_of_masters"] = all(shards[n].untyped_storage().data_ptr() in flats for n in report["held"])
        state = fe.init_ema(shards, num_emas=2)
        bufs = fe.buffers.init_buffers(engine, num_emas=2)
        ref = _Ref(_moe_reference(engine), 0)
        sent = 0
        for step in range(1, STEPS + 1):
            _moe_train(engine, step)
            state, n = _zero_bytes_update(state, engine, step)
            sent += n
            bufs = fe.buffers.update_buffers(bufs, engine, step, decay=list(DECAYS))
            ref.feed(_moe_reference(engine), step)
            if step % 2 == 0:
                posthoc.save_snapshot(state, engine, out / "snaps", list(DECAYS))
            if step == SAVE_AT:
                fe.save(state, engine, out / "ck", decay=list(DECAYS), buffers=bufs)
                engine.save_checkpoint(str(out / "ck"))
                fe.AsyncSaver().save(state, engine, out / "ck_async", "t").wait()
                gathered = fe.gather_full(state, engine)
                report["gathered_at_save_equal_ref"] = all(torch.equal(gathered[n], t) for n, t in ref.emas[0].items())
                _save_tensors(out / f"bufs{rank}.safetensors", bufs.emas[0])
                if rank == 0:
                    _save_tensors(out / f"gathered{SAVE_AT}.safetensors", gathered)
        report["collectives_in_update"] = sent
        final = fe.gather_full(state, engine)
        report["ref_names"] = sorted(ref.emas[0])
        report["final_equal_ref"] = all(torch.equal(final[n], t) for n, t in ref.emas[0].items()) and all(
            torch.equal(fe.gather_full(state, engine, index=1)[n], t) for n, t in ref.emas[1].items()
        )
        experts = [final[f"{_EXPERTS}{g}.weight"] for g in range(NUM_EXPERTS)]
        report["experts_distinct"] = all(not torch.equal(a, b) for i, a in enumerate(experts) for b in experts[i + 1 :])
        if rank == 0:
            _save_tensors(out / "final.safetensors", final)
        report.update(_moe_swap_check(engine, state))
        # the integrations' copy_to_model: the EMA into DeepSpeed's fp32 masters and the module's parameters
        from deepspeed.utils import groups

        from functional_ema.integrations import EMAController

        ctl = EMAController(list(DECAYS))
        ctl.state = state
        ctl.copy_to_model(engine)
        ep = groups._get_expert_parallel_rank("ep_size_2")
        masters = _moe_reference(engine)
        report["copied_to_model"] = all(torch.equal(masters[n], final[n]) for n in masters) and all(
            torch.equal(p, final[_global_name(n, ep, NUM_EXPERTS // 2)]) for n, p in engine.module.named_parameters()
        )
        return report
    if phase == "resume":  # fresh processes, other initial weights: everything comes from the files
        engine = _moe_engine(2, seed=9)
        engine.load_checkpoint(str(out / "ck"))
        loaded = fe.checkpoint.load_checkpoint(engine, out / "ck", buffers=True)
        state = loaded.state
        report["loaded_step"] = int(state.step)
        saved_bufs = _load_tensors(out / f"bufs{rank}.safetensors")
        report["buffers_equal"] = _equal(dict(loaded.buffers.emas[0]), saved_bufs)
        for step in range(SAVE_AT + 1, STEPS + 1):
            _moe_train(engine, step)
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
        report["continued_bitwise"] = _equal(fe.gather_full(state, engine), _load_tensors(out / "final.safetensors"))
        saved = _load_tensors(out / f"gathered{SAVE_AT}.safetensors")
        report["async_equal"] = _equal(fe.gather_full(fe.load(engine, out / "ck_async", "t"), engine), saved)
        report["snapshot_equal"] = _equal(
            fe.gather_full(fe.load(engine, out / "snaps", posthoc.snapshot_tag(SAVE_AT)), engine), saved
        )
        pieces = posthoc.posthoc_local(out / "snaps", fe.shard_layout(engine), gamma=3.0)
        local = fe.gather_full(fe.EmaState(torch.tensor(STEPS - 2), (pieces,)), engine)
        if rank == 0:
            _save_tensors(out / "posthoc.safetensors", local)
        return report
    if phase == "reshard":  # 2 ranks, the same expert-parallel size 2, ZeRO-1: each expert whole on one rank
        engine = _moe_engine(2, seed=9, stage=1)
        layout = fe.shard_layout(engine)
        report["world"], report["experts"] = layout.world_size, list(layout.experts[:2])
        state = fe.load(engine, out / "ck")
        full = fe.gather_full(state, engine)
        report["resharded_equal"] = _equal(full, _load_tensors(out / f"gathered{SAVE_AT}.safetensors"))
        # and it goes on at 2 ranks: one more step, against the loaded EMA lerped in plain torch
        ref = _Ref({}, SAVE_AT)
        ref.emas = [fe.gather_full(state, engine, index=k) for k in range(2)]
        _moe_train(engine, SAVE_AT + 1)
        state, sent = _zero_bytes_update(state, engine, SAVE_AT + 1)
        mine = _moe_reference(engine)
        ref.feed({n: mine.get(n, ref.emas[0][n]) for n in ref.emas[0]}, SAVE_AT + 1)
        after = fe.gather_full(state, engine)
        report["collectives_in_update"] = sent
        report["continued_equal_ref"] = all(torch.equal(after[n], ref.emas[0][n]) for n in mine)
        return report
    if phase == "ep_changed":  # 2 ranks, expert-parallel size 1 (every rank holds all 4 experts): refused
        engine = _moe_engine(1, seed=9)
        report["experts"] = list(fe.shard_layout(engine).experts[:2])
        try:
            fe.load(engine, out / "ck")
        except fe.CheckpointError as e:
            report["refused"] = [type(e).__name__, str(e)]
        # bf16 ZeRO-2, expert parallel 2: the fp32 masters of 16-bit training, against DeepSpeed's
        engine = _moe_engine(2, seed=5, dtype="bf16")
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        ref = _Ref(_moe_reference(engine), 0)
        for step in (1, 2):
            _moe_train(engine, step)
            state, _ = _zero_bytes_update(state, engine, step)
            ref.feed(_moe_reference(engine), step)
        full = fe.gather_full(state, engine)
        report["bf16_equal_ref"] = all(torch.equal(full[n], t) for n, t in ref.emas[0].items())
        report["bf16_param_dtype"] = str(engine.module.inp.weight.dtype)
        # ZeRO-0 keeps replicated expert copies, which are not placed: refused, naming the stage
        engine = _moe_engine(2, seed=5, stage=0)
        try:
            fe.local_shards(engine)
        except NotImplementedError as e:
            report["stage0_refused"] = str(e)
        return report
    raise ValueError(phase)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    return _launches(
        tmp_path_factory, "moe", "moe_worker", (("train", 4), ("resume", 4), ("reshard", 2), ("ep_changed", 2))
    )


def test_expert_parallel_every_verb(moe_runs):
    """DeepSpeed MoE, 4 ranks, expert parallel 2 x expert-data parallel 2, ZeRO-2: expert parameters are named by
    their global expert index; every verb is checked against DeepSpeed's own full fp32 weights of each expert,
    taken on the ranks that own it; resumed in fresh processes, resharded to 2 ranks (ZeRO-1), and a changed
    expert-parallel size refused."""
    _out, train, resume, reshard, changed = moe_runs
    experts = [f"{_EXPERTS}{g}.{w}" for g in range(NUM_EXPERTS) for w in ("weight", "bias")]
    covered: set[str] = set()
    for rank, r in enumerate(train):
        assert r["world"] == 4 and r["experts"] == [rank % 2, 2], r["experts"]
        assert set(experts) <= set(r["names"]) and r["names"] == train[0]["names"], r[
            "names"
        ]  # every expert, same order
        mine = [n for n in experts if int(n[len(_EXPERTS) :].split(".")[0]) // 2 == rank % 2]
        assert set(n for n in r["held"] if n in experts) <= set(mine), (rank, r["held"])  # only its own experts
        assert r["views_of_masters"] and r["collectives_in_update"] == 0, r
        assert r["gathered_at_save_equal_ref"] and r["final_equal_ref"] and r["experts_distinct"], rank
        assert r["swapped_equal"] and r["training_refused"] and r["swap_changed_weights"] and r["copied_to_model"], r
        covered |= set(r["ref_names"])
    assert covered == set(train[0]["names"])  # the reference covers every parameter and expert, from its owners
    for r in resume:
        assert r["loaded_step"] == SAVE_AT and r["buffers_equal"], r
        assert r["continued_bitwise"] and r["async_equal"] and r["snapshot_equal"], r
    for rank, r in enumerate(reshard):
        assert r["world"] == 2 and r["experts"] == [rank, 2] and r["resharded_equal"], r
        assert r["collectives_in_update"] == 0 and r["continued_equal_ref"], r
    for r in changed:
        assert r["experts"] == [0, 1]
        name, msg = r["refused"]
        assert name == "CheckpointMismatchError" and "expert-parallel size (ep_size) 2" in msg and "size 1" in msg, msg
        assert r["bf16_equal_ref"] and r["bf16_param_dtype"] == "torch.bfloat16", r
        assert "MoE with ZeRO stage 0" in r["stage0_refused"], r


def test_expert_parallel_consolidation(moe_runs, tmp_path):
    """Offline, from the files alone: every expert once, under its global index, with the values gathered in
    training; post-hoc EMA offline equals the ranks' own; a manifest claiming another expert-parallel rank for a
    file, or giving an expert to another rank, is refused naming the field."""
    import json
    import shutil

    from functional_ema import posthoc

    out = moe_runs[0]
    saved = _load_tensors(out / f"gathered{SAVE_AT}.safetensors")
    full = fe.consolidate(out / "ck")
    assert _equal(full, saved)
    assert sorted(n for n in full if n.startswith(_EXPERTS)) == sorted(
        f"{_EXPERTS}{g}.{w}" for g in range(NUM_EXPERTS) for w in ("weight", "bias")
    )
    assert _equal(fe.consolidate(out / "ck_async", "t"), saved)
    assert _equal(posthoc.posthoc_offline(out / "snaps", gamma=3.0), _load_tensors(out / "posthoc.safetensors"))
    manifest = fe.checkpoint.read_manifest(out / "ck")
    assert manifest["experts"]["ep_size"] == 2 and [f["ep"] for f in manifest["files"]] == [0, 1, 0, 1]
    tag = manifest["tag"]
    for i, (edit, field) in enumerate(
        (
            (lambda m: m["files"][1].update(ep=0), "field 'files[1].ep' says expert-parallel rank 0"),
            (lambda m: m["experts"]["owners"].update({f"{_EXPERTS}0.weight": 1}), "field 'experts'"),
            (lambda m: m["files"][0].update(ep=2), "field 'files[0].ep' must be"),
        )
    ):
        bad = tmp_path / f"bad{i}"
        shutil.copytree(out / "ck", bad)
        mpath = bad / tag / "ema_manifest.json"
        m = json.loads(mpath.read_text())
        edit(m)
        mpath.write_text(json.dumps(m))
        with pytest.raises(fe.CheckpointError, match=re.escape(field)):
            fe.consolidate(bad, tag)
    # a forger who rewrites rank 1's header AND the manifest to say expert-parallel rank 0 (checksums updated to
    # match): rank 1 then holds pieces of experts 2 and 3, which expert-parallel rank 1 owns: refused, naming one
    bad = tmp_path / "forged"
    shutil.copytree(out / "ck", bad)
    _forge_layout(bad / tag, 1, lambda lay: lay["experts"].update(ep=0))
    m = json.loads((bad / tag / "ema_manifest.json").read_text())
    m["files"][1]["ep"] = 0
    (bad / tag / "ema_manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        fe.CheckpointError,
        match=r"ema_rank_00001_of_00004.*holds elements of expert parameter "
        r"'moe\.deepspeed_moe\.experts\.deepspeed_experts\.[23]\..*expert-parallel rank 1",
    ):
        fe.consolidate(bad, tag)


def _forge_layout(tag_dir: Path, rank: int, edit) -> None:
    """Rewrite the layout in rank ``rank``'s file header (of 4) and the manifest's size and header checksum to
    match, as a deliberate forger would: only validation, not a checksum, can catch it."""
    import json
    import struct

    from functional_ema import _io

    f = tag_dir / f"ema_rank_{rank:05d}_of_00004.safetensors"
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    lay = json.loads(header["__metadata__"]["layout"])
    edit(lay)
    header["__metadata__"]["layout"] = json.dumps(lay)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    new = struct.pack("<Q", len(text)) + text
    f.write_bytes(new + raw[8 + n :])
    mpath = tag_dir / "ema_manifest.json"
    m = json.loads(mpath.read_text())
    e = next(e for e in m["files"] if e["rank"] == rank)
    e["bytes"] = len(new) + len(raw) - 8 - n
    e["header_checksum"] = _io.format_checksum(_io.CHECKSUM, _io.CHECKSUMS[_io.CHECKSUM](new))
    mpath.write_text(json.dumps(m))


# ------------------------------------------------------------------- Ulysses sequence parallelism


class UlyssesMPU:
    """Ulysses groups for ``deepspeed.initialize(mpu=...)``: sequence-parallel groups of ``sp`` consecutive ranks,
    data-parallel groups across them, and the sequence-data-parallel group (every rank) ZeRO partitions over.
    (With ``mesh_param=(dp, sp)`` instead, DeepSpeed 0.19.8 partitions over the data-parallel group only and, on
    this CPU/gloo setup, the sequence-parallel ranks' fp32 weights drift apart within two steps.)"""

    def __init__(self, sp: int):
        import torch.distributed as dist

        from functional_ema._testing.multirank import block_and_strided_groups

        world, rank = dist.get_world_size(), dist.get_rank()
        self.sp = sp
        self._sp, self._dp = block_and_strided_groups(sp)
        for r in range(world):
            g = dist.new_group([r])
            if r == rank:
                self._mp = g
        self._sdp = dist.new_group(list(range(world)))

    def _rank(self, g):
        import torch.distributed as dist

        return dist.get_rank(g)

    def _size(self, g):
        import torch.distributed as dist

        return dist.get_world_size(g)

    def get_sequence_parallel_world_size(self):
        return self.sp

    def get_sequence_parallel_rank(self):
        return self._rank(self._sp)

    def get_sequence_parallel_group(self):
        return self._sp

    def get_sequence_data_parallel_world_size(self):
        return self._size(self._sdp)

    def get_sequence_data_parallel_rank(self):
        return self._rank(self._sdp)

    def get_sequence_data_parallel_group(self):
        return self._sdp

    def get_data_parallel_world_size(self):
        return self._size(self._dp)

    def get_data_parallel_rank(self):
        return self._rank(self._dp)

    def get_data_parallel_group(self):
        return self._dp

    def get_model_parallel_world_size(self):
        return 1

    def get_model_parallel_rank(self):
        return 0

    def get_model_parallel_group(self):
        return self._mp


class UlyssesAttention(torch.nn.Module):
    """One attention block over a sequence split across the sequence-parallel group: DeepSpeed's
    ``DistributedAttention`` (all-to-all: heads scattered, sequence gathered) around a plain softmax attention."""

    def __init__(self, spg, seed: int, hidden: int = 8, heads: int = 2):
        from deepspeed.sequence.layer import DistributedAttention

        super().__init__()
        torch.manual_seed(seed)
        self.heads, self.d = heads, hidden // heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

        def local(q, k, v, *_a, **_k):  # [sequence, batch, heads, head dim]
            s = torch.einsum("sbhd,tbhd->bhst", q, k) / self.d**0.5
            return torch.einsum("bhst,tbhd->sbhd", s.softmax(-1), v)

        self.attn = DistributedAttention(local, spg)

    def forward(self, x):  # [local sequence, batch, hidden]
        s, b, _ = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, self.d).unbind(2)
        return self.proj(self.attn(q.contiguous(), k.contiguous(), v.contiguous(), 1).reshape(s, b, -1))


def _ulysses_engine(seed: int):
    import deepspeed

    from functional_ema._testing.multirank import ds_config

    mpu = UlyssesMPU(2)
    model = UlyssesAttention(mpu.get_sequence_parallel_group(), seed)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), config=ds_config(2), mpu=mpu
    )
    return engine, mpu


def _ulysses_batch(mpu, step: int):
    """This sequence-parallel rank's half of its data-parallel rank's sequence (and target)."""
    g = torch.Generator().manual_seed(1234 + 1000 * step + mpu.get_data_parallel_rank())
    x, y = torch.randn(8, 2, 8, generator=g), torch.randn(8, 2, 8, generator=g)
    sp = mpu.get_sequence_parallel_rank()
    return x.chunk(2)[sp], y.chunk(2)[sp]


def _ulysses_train(engine, mpu, step: int) -> None:
    x, y = _ulysses_batch(mpu, step)
    engine.backward(((engine(x) - y) ** 2).mean())
    engine.step()


def ulysses_worker(out: str, phase: str) -> dict:
    from tests._integration_models import quiet

    quiet()
    out = Path(out)
    report: dict = {}
    if phase == "train":
        engine, mpu = _ulysses_engine(0)
        layout = fe.shard_layout(engine)
        report["sp"] = engine.sequence_parallel_size
        report["world"], report["part"] = layout.world_size, list(layout.part)
        report["held"] = sum(s.numel for s in layout.specs.values())
        state = fe.init_ema(fe.local_shards(engine), num_emas=2)
        ref = _Ref(_reference(engine), 0)
        sent = 0
        for step in range(1, STEPS + 1):
            _ulysses_train(engine, mpu, step)
            state, n = _zero_bytes_update(state, engine, step)
            sent += n
            ref.feed(_reference(engine), step)
            if step == SAVE_AT:
                fe.save(state, engine, out / "ck", decay=list(DECAYS))
                engine.save_checkpoint(str(out / "ck"))
        report["collectives_in_update"] = sent
        final = fe.gather_full(state, engine)
        report["final_equal_ref"] = _equal(final, ref.emas[0]) and _equal(
            fe.gather_full(state, engine, index=1), ref.emas[1]
        )
        if torch.distributed.get_rank() == 0:
            _save_tensors(out / "final.safetensors", final)
        x, _ = _ulysses_batch(mpu, 99)
        engine.eval()
        report.update(_swap_check(engine, state, lambda: engine(x)))
        return report
    if phase == "resume":
        engine, mpu = _ulysses_engine(9)
        engine.load_checkpoint(str(out / "ck"))
        state = fe.load(engine, out / "ck")
        report["loaded_step"] = int(state.step)
        for step in range(SAVE_AT + 1, STEPS + 1):
            _ulysses_train(engine, mpu, step)
            state = fe.update(state, fe.local_shards(engine), step, decay=list(DECAYS))
        report["continued_bitwise"] = _equal(fe.gather_full(state, engine), _load_tensors(out / "final.safetensors"))
        return report
    raise ValueError(phase)


def test_ulysses_sequence_parallel(tmp_path):
    """DeepSpeed Ulysses (DistributedAttention, sequence parallel 2 x data parallel 2, ZeRO-2, groups from an mpu):
    ZeRO partitions over the sequence-data-parallel group (all 4 ranks), which local_shards reads; the EMA is
    DeepSpeed's full fp32 weights EMA'd in plain torch, bitwise; swapped; saved, resumed in fresh processes, bitwise."""
    train = run_ranks(
        "tests.test_model_parallel:ulysses_worker", world_size=4, timeout=600, out=str(tmp_path), phase="train"
    )
    resume = run_ranks(
        "tests.test_model_parallel:ulysses_worker", world_size=4, timeout=600, out=str(tmp_path), phase="resume"
    )
    for r in train:
        assert r["sp"] == 2 and r["world"] == 4 and r["part"] == [0, 1, 0, 1], r
        assert r["collectives_in_update"] == 0 and r["final_equal_ref"], r
        assert r["swapped_equal"] and r["training_refused"], r
    assert sum(r["held"] for r in train) == sum(
        t.numel() for t in _load_tensors(tmp_path / "final.safetensors").values()
    )
    for r in resume:
        assert r["loaded_step"] == SAVE_AT and r["continued_bitwise"], r
