"""Speed and memory of ``functional_ema.export.to_hf`` against ``consolidate_to_file`` (one file), same checkpoint.

Usage::

    python benchmarks/bench_export.py [--hidden 768] [--layers 12] [--vocab 32000] [--shard 100MB] [--dir DIR]

One process: a Llama built from a ``LlamaConfig`` (no download; the defaults give about 134M parameters)
is saved with ``save_pretrained`` (the ``--like`` folder) and its EMA with ``fe.save``. Then each
operation runs in a fresh child process, so its peak resident memory is its own: ``consolidate_to_file``
(one fp32 file), ``to_hf`` fp32 in one shard (with and without ``verify``: the source's checksums, the
read-back of what was written), fp32 in ``--shard``-sized shards, and bf16. Every ``to_hf`` also builds the
loader's meta-device view of the config (``_export.loader``). Printed: the
time, GB/s (bytes written / time; checksums of every byte read verified), the child's peak anonymous
RSS (sampled every 5 ms; file pages the readers map are the page cache's, not counted) above its value
before the operation, and beside it the largest tensor and one shard's size (the bounds the
export promises: about one tensor, never a shard or the model). Warm page cache (files just written).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _rss_anon() -> int:
    """This process's anonymous resident memory (bytes): what it allocated, not the file pages it maps."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _PeakSampler:
    """Samples RssAnon every 5 ms on a thread (the kernel keeps no peak of it): the peak, within a sample."""

    def start(self) -> None:
        import threading

        self.peak = _rss_anon()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, _rss_anon())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_anon())


def _child(op: str, root: Path, shard: str) -> dict:
    """One operation, timed, with this process's peak RSS above its RSS before it."""
    import functional_ema as fe
    from functional_ema.export import to_hf

    before = _rss_anon()
    sampler = _PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    if op == "consolidate_to_file":
        out = fe.consolidate_to_file(root / "ckpt", root / "one.safetensors", "ema", progress=False)
        written = out.stat().st_size
    else:
        kwargs = {
            "fp32": {},
            "fp32_unverified": {"verify": False},
            "fp32_sharded": {"max_shard_size": shard},
            "bf16": {"dtype": "bf16"},
        }[op]
        out = to_hf(root / "ckpt", root / op, root / "like", tag="ema", progress=False, **kwargs)
        written = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    seconds = time.perf_counter() - t0
    sampler.stop()
    peak = sampler.peak
    files = len(list(out.glob("*.safetensors"))) if out.is_dir() else 1
    return {"op": op, "seconds": seconds, "bytes": written, "peak_above": max(0, peak - before), "files": files}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--shard", default="100MB", help="max_shard_size of the sharded export")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, removed)")
    p.add_argument("--child", nargs=2, metavar=("OP", "ROOT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.child[0], Path(a.child[1]), a.shard)))
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    import functional_ema as fe
    from functional_ema.export import parse_size

    root = Path(a.dir or tempfile.mkdtemp(prefix="bench_export_"))
    root.mkdir(parents=True, exist_ok=True)
    try:
        cfg = LlamaConfig(
            hidden_size=a.hidden,
            intermediate_size=a.hidden * 8 // 3,
            num_hidden_layers=a.layers,
            num_attention_heads=max(1, a.hidden // 64),
            num_key_value_heads=max(1, a.hidden // 64),
            vocab_size=a.vocab,
            tie_word_embeddings=False,
        )
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg)
        numel = sum(q.numel() for q in model.parameters())
        largest = max(q.numel() for q in model.parameters()) * 4
        model.save_pretrained(root / "like")
        state = fe.init_ema(fe.local_shards(model))
        fe.save(state, model, root / "ckpt", tag="ema")
        del model, state
        print(
            f"Llama hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}: {numel / 1e6:.0f}M parameters, "
            f"{numel * 4 / 1e9:.2f} GB fp32; largest tensor {largest / 2**20:.0f} MiB; shard limit {a.shard} "
            f"({parse_size(a.shard) / 2**20:.0f} MiB)"
        )
        print(f"{'operation':<22}{'files':>6}{'seconds':>9}{'GB/s':>7}{'peak anon RSS above start':>27}")
        for op in ("consolidate_to_file", "fp32", "fp32_unverified", "fp32_sharded", "bf16"):
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
            res = subprocess.run(
                [sys.executable, __file__, "--shard", a.shard, "--child", op, str(root)],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            r = json.loads(res.stdout.strip().splitlines()[-1])
            name = {
                "fp32": "to_hf fp32",
                "fp32_unverified": "to_hf fp32 no-verify",
                "fp32_sharded": "to_hf fp32 sharded",
                "bf16": "to_hf bf16",
            }.get(op, op)
            print(
                f"{name:<22}{r['files']:>6}{r['seconds']:>9.2f}{r['bytes'] / r['seconds'] / 1e9:>7.2f}"
                f"{r['peak_above'] / 2**20:>22.0f} MiB"
            )
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
