"""How tests/data/format/*.json were made: real manifests and rank-file layouts of every checkpoint layout.

tests/test_format.py checks the manifest and layout validators of ``functional_ema._checkpoint.format``
against these, mutated one field at a time; they come from real multi-rank saves rather than hand-written
JSON, so that the clean cases are exactly what the library writes. The builders are the Files table's
(tests/test_hostile_files.py): ``deepspeed_builder`` (2 ranks: plain module with buffers, ZeRO-3, MoE with
expert parallelism and buffers, pipeline with buffers, tensor parallel through ``mpu=``) and ``fsdp_builder``
(4 ranks: FSDP2, HSDP, FSDP2 x DTensor tensor parallel), each saving twice into tag ``t`` (generation 1);
and ``single``: one save (generation 0) of a plain module with a BatchNorm in this process, no process group.

Each ``<layout>.json`` holds ``manifest`` (the tag's ``ema_manifest.json``) and ``metadata``: for every rank
file the manifest lists, its safetensors header's ``layout``, ``schedules`` and ``extra`` strings; ``single.json``
also ``tensors``: where each tensor's bytes lie in its rank file (``[start, end]``, from the header).
Rerun (minutes) after a change of the on-disk format:
    python tests/data/format/make_format.py [BUILD_DIR]
(BUILD_DIR, default a temporary folder, keeps the built checkpoints: a second run only extracts.)
"""

from __future__ import annotations

import json
import struct
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAYOUTS = {
    "deepspeed": (2, ("plain", "zero3", "moe", "pp", "ds_tp")),
    "fsdp": (4, ("fsdp2", "hsdp", "tp")),
}
KEPT_METADATA = ("layout", "schedules", "extra")


def header(path: Path) -> dict:
    """The JSON header of a safetensors file (after its 8-byte little-endian length)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def extract(tag_dir: Path, offsets: bool = False) -> dict:
    manifest = json.loads((tag_dir / "ema_manifest.json").read_text())
    parts = manifest.get("parts") or [manifest]
    out: dict = {"manifest": manifest, "metadata": {}}
    for p in parts:
        for e in p["files"]:
            head = header(tag_dir / e["file"])
            out["metadata"][e["file"]] = {
                k: head["__metadata__"][k] for k in KEPT_METADATA if k in head["__metadata__"]
            }
            if offsets:
                out.setdefault("tensors", {})[e["file"]] = {
                    k: v["data_offsets"] for k, v in head.items() if k != "__metadata__"
                }
    return out


def save_single(root: Path) -> Path:
    """``fe.save`` in this process: a plain module with a BatchNorm, two EMAs and its buffers, tag ``t``."""
    import torch

    import functional_ema as fe

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    state = fe.init_ema(fe.local_shards(model), num_emas=2)
    buffers = fe.buffers.init_buffers(model, num_emas=2)
    fe.save(state, model, root, "t", decay=(0.9, 0.99), buffers=buffers)
    return root / "t"


def main(build: Path) -> None:
    sys.path.insert(0, str(HERE.parents[2]))  # the repository root: the builders live in tests/
    from functional_ema._testing.multirank import run_ranks

    for builder, (world, layouts) in LAYOUTS.items():
        root = build / builder
        if not all((root / name / "ck" / "t" / "ema_manifest.json").is_file() for name in layouts):
            run_ranks(f"tests.test_hostile_files:{builder}_builder", world_size=world, timeout=900, root=str(root))
        for name in layouts:
            out = HERE / f"{name}.json"
            out.write_text(json.dumps(extract(root / name / "ck" / "t"), indent=1, sort_keys=True) + "\n")
            print(f"{out.relative_to(HERE.parents[2])}: {out.stat().st_size} bytes")
    single = build / "single" / "t"
    if not (single / "ema_manifest.json").is_file():
        save_single(build / "single")
    out = HERE / "single.json"
    out.write_text(json.dumps(extract(single, offsets=True), indent=1, sort_keys=True) + "\n")
    print(f"{out.relative_to(HERE.parents[2])}: {out.stat().st_size} bytes")


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(Path(sys.argv[1]))
    else:
        with tempfile.TemporaryDirectory(prefix="fe_format_") as tmp:
            main(Path(tmp))
