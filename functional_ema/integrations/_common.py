"""What every framework integration does, written once, with no framework imported.

:class:`EMAController` holds the configuration and this rank's state, and has one method per
moment of training: :meth:`~EMAController.on_step` after each optimizer step (a micro-batch inside
gradient accumulation passes the same step again: a no-op), :meth:`~EMAController.swapped` around
evaluation, :meth:`~EMAController.save` / :meth:`~EMAController.load` beside the framework's
checkpoint, :meth:`~EMAController.export` / :meth:`~EMAController.copy_to_model` at the end. The
callbacks only translate their framework's events and find the training object (a DeepSpeed
engine, an FSDP2 model, a DDP or plain module) that the verbs of :mod:`functional_ema` take.

Files written into a checkpoint folder ``save_dir`` under ``tag`` (default ``"ema"``)::

    save_dir/tag/ema_rank_*_of_*.safetensors    every rank's EMA pieces (functional_ema.save)
    save_dir/tag/buffers_rank_*_of_*.safetensors every rank's buffer EMAs (when buffers= is set)
    save_dir/tag/integration.json               rank 0: the framework's step, whether the EMA started
    save_dir/tag/ema_manifest.json              written last: the tag is complete
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import functional_ema as fe
from functional_ema import buffers as fb
from functional_ema.schedules import DecayLike

__all__ = ["EMAController", "INTEGRATION_FILE"]

INTEGRATION_FILE = "integration.json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _atomic_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f"{path.name}.part-{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class EMAController:
    """One or more EMAs of a model's weights, driven by a training loop's events.

    Args:
        decay: a float, a schedule (:mod:`functional_ema.schedules`) or a callable ``step -> decay``;
            or a sequence of them to track several EMAs at once (one state, read once per update).
        every_n_steps: update at optimizer steps that are multiples of N only; the decay is
            compounded over the skipped steps exactly (``update`` does that).
        start_step: the EMA starts (equal to the weights) after the first optimizer step ``>= start_step``
            that :meth:`on_step` sees. Optimizer steps are numbered from 1, so it starts at a step
            ``>= max(1, start_step)`` whatever the gradient accumulation: step 0 (no optimizer step
            yet, e.g. the first micro-batches of an accumulation) never starts it. Before it there is
            nothing to evaluate, save or export.
        buffers: ``None`` (parameters only), ``"average"`` (an EMA of every floating buffer, with
            the same decays) or ``"copy"`` (the live buffers copied at each update). Integer buffers
            are copied in both modes. See :mod:`functional_ema.buffers`.
        eval_index: which EMA the evaluation swaps in (``None``: evaluate with the live weights).
        posthoc_dir: write post-hoc snapshots (:func:`functional_ema.posthoc.save_snapshot`) into
            this folder every ``posthoc_every`` steps; the decays must be power schedules.
        posthoc_every: snapshot interval in optimizer steps.
        export_path: at the end of training, write the consolidated EMA ``eval_index`` (parameters,
            tied aliases and buffers) to this safetensors file (rank 0 writes it).
        copy_to_model: at the end of training, copy EMA ``eval_index`` into the model's weights.
        tag: the tag folder name inside each checkpoint folder.
        dtype: EMA dtype (fp32).
        async_save: write the EMA files in the background (:class:`functional_ema.AsyncSaver`):
            :meth:`save` returns after a memory copy of this rank's EMA, the write overlaps the
            training that follows, and a failure is raised at the next :meth:`save`, at
            :meth:`wait`, :meth:`load` or at the end of training. A process that exits waits for
            the write to finish.
    """

    def __init__(
        self,
        decay: DecayLike | Sequence[DecayLike] = 0.9999,
        *,
        every_n_steps: int = 1,
        start_step: int = 0,
        buffers: str | None = None,
        eval_index: int | None = 0,
        posthoc_dir: str | os.PathLike | None = None,
        posthoc_every: int | None = None,
        export_path: str | os.PathLike | None = None,
        copy_to_model: bool = False,
        tag: str = "ema",
        dtype: torch.dtype = torch.float32,
        async_save: bool = False,
    ):
        self.decays = list(decay) if isinstance(decay, (list, tuple)) else [decay]
        if not self.decays:
            raise ValueError("decay: give at least one decay")
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
            raise ValueError(f"start_step must be an int >= 0, got {start_step!r}")
        if buffers not in (None, "average", "copy"):
            raise ValueError(f'buffers must be None, "average" or "copy", got {buffers!r}')
        if eval_index is not None and not 0 <= eval_index < len(self.decays):
            raise ValueError(f"eval_index={eval_index} is not one of the {len(self.decays)} EMAs")
        if (posthoc_dir is None) != (posthoc_every is None):
            raise ValueError("posthoc_dir and posthoc_every go together: give both or neither")
        if posthoc_every is not None:
            if posthoc_every < 1:
                raise ValueError(f"posthoc_every must be >= 1, got {posthoc_every}")
            # Post-hoc synthesis needs power EMAs; refuse anything else now, not at the first snapshot
            # (a bare float would be read as a sigma_rel by posthoc.snapshot_gammas).
            bad = [d for d in self.decays if not isinstance(getattr(d, "gamma", None), (int, float))]
            if bad:
                raise TypeError(f"post-hoc snapshots need power EMAs (fe.schedules.power(sigma_rel=...)) for every decay; "
                                f"got {bad!r}")
        self.every_n_steps, self.start_step, self.buffers = every_n_steps, start_step, buffers
        self.eval_index, self.tag, self.dtype = eval_index, tag, dtype
        self.posthoc_dir = None if posthoc_dir is None else Path(posthoc_dir)
        self.posthoc_every = posthoc_every
        self.export_path = None if export_path is None else Path(export_path)
        self.copy_to_model_at_end = copy_to_model
        self.state: fe.EmaState | None = None
        self.buffer_state: fb.BufferState | None = None
        self._saver = fe.AsyncSaver() if async_save else None

    # ------------------------------------------------------------------------------------ helpers

    @property
    def decay(self):
        """The ``decay`` argument for :func:`functional_ema.update` (one, or one per EMA)."""
        return self.decays[0] if len(self.decays) == 1 else self.decays

    @property
    def num_emas(self) -> int:
        return len(self.decays)

    @property
    def started(self) -> bool:
        return self.state is not None

    # ---------------------------------------------------------------------------------- training

    def on_step(self, x: Any, step: int) -> bool:
        """After the optimizer step that made the training step ``step`` (optimizer steps count from
        1; ``0``: none yet). Returns whether the EMA moved. Calling it again with the same step (each
        micro-batch of an accumulation) is a no-op.

        The EMA starts equal to the weights at the first step ``>= max(1, start_step)`` seen: a call
        at step 0 (a micro-batch before the first optimizer step) never starts it, so the same
        trajectory gives the same EMA with or without gradient accumulation."""
        step = int(step)
        if step < max(1, self.start_step):
            return False
        if self.state is None:
            self.state = fe.init_ema(fe.local_shards(x), num_emas=self.num_emas, dtype=self.dtype, step=step)
            if self.buffers:
                self.buffer_state = fb.init_buffers(x, num_emas=self.num_emas, step=step)
            moved = True
        elif step % self.every_n_steps or step == int(self.state.step):
            return False
        else:
            self.state = fe.update(self.state, fe.local_shards(x), step, decay=self.decay)
            if self.buffers:
                self.buffer_state = fb.update_buffers(self.buffer_state, x, step, decay=self.decay, mode=self.buffers)
            moved = True
        if self.posthoc_every and step % self.posthoc_every == 0 and step >= 1:
            fe.posthoc.save_snapshot(self.state, x, self.posthoc_dir, self.decays)
        return moved

    @contextlib.contextmanager
    def swapped(self, x: Any, index: int | None = None) -> Iterator[bool]:
        """Evaluate with EMA ``index`` (default ``eval_index``), buffers too when they are carried.
        Yields whether EMA weights are in (``False`` before the EMA started, or ``eval_index=None``)."""
        index = self.eval_index if index is None else index
        if self.state is None or index is None:
            yield False
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(fe.swapped(x, self.state, index=index))
            if self.buffer_state is not None:
                stack.enter_context(fb.swapped_buffers(x, self.buffer_state, index=index))
            yield True

    # ------------------------------------------------------------------------------- checkpoints

    def save(self, x: Any, save_dir: str | os.PathLike, framework_step: int) -> Path:
        """Write every rank's pieces into ``save_dir/<tag>/``. Collective: call on every rank.

        Buffers and the small ``integration.json`` first, :func:`functional_ema.save` last (its
        manifest marks the tag complete). Before the EMA started only ``integration.json`` is written.
        """
        save_dir = Path(save_dir)
        tag_dir = save_dir / self.tag
        if _rank() == 0:
            tag_dir.mkdir(parents=True, exist_ok=True)
            _atomic_json(tag_dir / INTEGRATION_FILE, {
                "framework_step": int(framework_step), "started": self.state is not None,
                "ema_step": None if self.state is None else int(self.state.step), "num_emas": self.num_emas,
                "buffers": self.buffers if self.buffer_state is not None else None,
                "every_n_steps": self.every_n_steps, "start_step": self.start_step,
            })
        if self.state is None:
            _barrier()
            return tag_dir
        if self.buffer_state is not None:
            fb.save_buffers(self.buffer_state, x, save_dir, self.tag, mode=self.buffers)
        if self._saver is not None:
            self._saver.save(self.state, x, save_dir, self.tag, decay=self.decay)  # manifest last, in the background
            return tag_dir
        return fe.save(self.state, x, save_dir, self.tag, decay=self.decay)

    def wait(self) -> None:
        """Wait for the EMA writes in flight (``async_save=True``); raise a failure of one."""
        if self._saver is not None:
            self._saver.wait()

    def load(self, x: Any, load_dir: str | os.PathLike, framework_step: int | None = None) -> None:
        """Restore this rank's state from ``load_dir/<tag>/`` (any world size or engine: ``fe.load``
        reshards). Collective. ``framework_step`` (the step the framework resumed at) is checked: an
        EMA ahead of it belongs to another run."""
        self.wait()  # a write of this process in flight finishes first
        load_dir = Path(load_dir)
        info_path = load_dir / self.tag / INTEGRATION_FILE
        info = json.loads(info_path.read_text()) if info_path.is_file() else None
        if info is not None and not info.get("started", True):
            self.state = self.buffer_state = None
            return
        try:
            state = fe.load(x, load_dir, self.tag)
        except fe.CheckpointError as e:
            raise fe.CheckpointError(
                f"resuming from {load_dir}: no usable EMA in it under tag {self.tag!r} ({e}). Was the EMA callback "
                "attached when this checkpoint was written?"
            ) from e
        if state.num_emas != self.num_emas:
            raise ValueError(f"the EMA checkpoint in {load_dir / self.tag} tracks {state.num_emas} EMAs but this run's "
                             f"callback has {self.num_emas} decays")
        if framework_step is not None and int(state.step) > int(framework_step):
            raise ValueError(f"the EMA in {load_dir / self.tag} is at step {int(state.step)}, after the step the "
                             f"training resumed at ({framework_step}): it belongs to another checkpoint")
        self.state = state
        self.buffer_state = None
        if self.buffers:
            if fb.has_buffers(load_dir, self.tag):
                self.buffer_state = fb.load_buffers(x, load_dir, self.tag)
            else:  # saved without buffers: start them from the live ones at the EMA's step
                self.buffer_state = fb.init_buffers(x, num_emas=self.num_emas, step=int(state.step))

    # --------------------------------------------------------------------------------------- end

    def full_state_dict(self, x: Any, index: int | None = None, dst: int | None = 0, strip_prefix: str = "") -> dict[str, torch.Tensor]:
        """Full-shape EMA ``index`` (parameters, their tied aliases, buffers) on rank ``dst``
        (``None``: every rank; others get ``{}``), names as in the engine's module with
        ``strip_prefix`` removed (a framework's wrapper, e.g. Lightning's ``_forward_module.``). Collective."""
        index = self.eval_index if index is None else index
        index = 0 if index is None else index
        if self.state is None:
            raise RuntimeError(f"the EMA has not started (start_step={self.start_step}): nothing to export")
        full = fe.gather_full(self.state, x, index=index, dst=dst)
        if dst is not None and _rank() != dst:
            return {}
        module = fe.engines.adapter_for(x).module()
        first = {}
        for n, p in module.named_parameters(remove_duplicate=False):
            first.setdefault(id(p), n)
        for n, p in module.named_parameters(remove_duplicate=False):
            if n not in full and first[id(p)] in full:
                full[n] = full[first[id(p)]]  # a tied alias: the same tensor under each name
        if self.buffer_state is not None:
            full.update({n: t.detach().clone() for n, t in self.buffer_state.emas[index].items()})
            full.update({n: t.detach().clone() for n, t in self.buffer_state.copied.items()})
        if strip_prefix:
            full = {n.removeprefix(strip_prefix): t for n, t in full.items()}
        return full

    def export(self, x: Any, path: str | os.PathLike, index: int | None = None, strip_prefix: str = "") -> Path | None:
        """Write :meth:`full_state_dict` to one safetensors file from rank 0 (atomic). Collective."""
        from safetensors.torch import save as st_save

        full = self.full_state_dict(x, index=index, dst=0, strip_prefix=strip_prefix)
        path = Path(path)
        if _rank() == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
            # Tied aliases share storage; safetensors wants distinct tensors.
            tensors = {n: t.detach().contiguous().clone() for n, t in full.items()}
            meta = {"format": "functional_ema.export", "step": str(int(self.state.step)),
                    "ema_index": str(self.eval_index or 0)}
            tmp = path.with_name(f"{path.name}.part-{os.getpid()}")
            with open(tmp, "wb") as f:
                f.write(st_save(tensors, metadata=meta))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        _barrier()
        return path if _rank() == 0 else None

    def copy_to_model(self, x: Any, index: int | None = None) -> None:
        """Overwrite the model's trained weights with EMA ``index`` (end of training). Collective.

        The fp32 weights the optimizer holds (DeepSpeed's masters, FSDP2's local shards, the plain
        parameters) and the copies the forward uses (ZeRO-3 partitions, ZeRO-0/1/2 module
        parameters) all receive the EMA, so ``save_pretrained``/``save_checkpoint`` afterwards
        write the EMA weights. Buffers too when they are carried.
        """
        index = self.eval_index if index is None else index
        index = 0 if index is None else index
        if self.state is None:
            raise RuntimeError(f"the EMA has not started (start_step={self.start_step}): nothing to copy")
        adapter = fe.engines.adapter_for(x)
        reading = adapter.read()
        pieces = self.state.emas[index]
        full = None
        if adapter.name == "deepspeed" and reading.layout.stage != 3:
            full = fe.gather_full(self.state, x, index=index)  # collective: before any rank writes
        with torch.no_grad():
            for n, t in reading.shards.items():
                if t.numel():
                    t.copy_(pieces[n].reshape(t.shape))
            if adapter.name == "deepspeed":
                if reading.layout.stage == 3:
                    x.empty_partition_cache()
                    for n, p in reading.params.items():
                        numel = reading.layout.specs[n].numel
                        if numel:
                            p.ds_tensor.data.view(-1)[:numel].copy_(pieces[n].reshape(-1))
                else:
                    for n, p in reading.params.items():
                        p.data.copy_(full[n].to(p.dtype))
            if self.buffer_state is not None:
                live = fb.module_buffers(x)
                for n, t in {**self.buffer_state.emas[index], **self.buffer_state.copied}.items():
                    live[n].copy_(t)
        _barrier()

    def on_train_end(self, x: Any, strip_prefix: str = "") -> None:
        """Wait for the EMA writes in flight, then the configured final export and/or copy into the model."""
        self.wait()
        if self.state is None:
            return
        if self.export_path is not None:
            self.export(x, self.export_path, strip_prefix=strip_prefix)
        if self.copy_to_model_at_end:
            self.copy_to_model(x)
