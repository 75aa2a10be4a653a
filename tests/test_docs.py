"""The README and the documentation site: short, every link resolves, every public name in the API
reference. (``mkdocs build --strict`` itself runs in ``.ci/run``: ``make docs``.)"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import functional_ema as fe

ROOT = Path(__file__).resolve().parents[1]
API_PAGE = ROOT / "docs" / "api.md"
#: The public submodules: each is documented whole (its ``__all__``) on the API page.
PUBLIC_MODULES = [
    "checkpoint",
    "export",
    "buffers",
    "dcp",
    "posthoc",
    "schedules",
    "integrations.lightning",
    "integrations.transformers",
    "integrations.accelerate",
    "integrations.diffusers",
]


def documented() -> list[str]:
    """The dotted paths of the ``::: functional_ema.x`` entries on the API page."""
    return re.findall(r"^::: functional_ema\.([\w.]+)\s*$", API_PAGE.read_text(), flags=re.M)


def test_api_reference_lists_every_public_name():
    entries = set(documented())
    assert [m for m in PUBLIC_MODULES if m not in entries] == [], "public modules missing from docs/api.md"
    modules = [importlib.import_module(f"functional_ema.{m}") for m in PUBLIC_MODULES]
    undocumented = []
    for name in fe.__all__:
        obj = getattr(fe, name)
        if name in entries or any(name in mod.__all__ and getattr(mod, name) is obj for mod in modules):
            continue
        undocumented.append(name)
    assert undocumented == [], f"in functional_ema.__all__ but not on docs/api.md: {undocumented}"
    # The opt-in flat storage helpers the README names.
    assert {"engines.fsdp2.flatten_local_shards", "engines.module.flatten_parameters"} <= entries


def _relative_links(path: Path) -> list[str]:
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text())
    return [link for link in links if not re.match(r"^[a-z]+://|^mailto:", link)]


@pytest.mark.parametrize("page", ["README.md"] + [f"docs/{p.name}" for p in sorted((ROOT / "docs").glob("*.md"))])
def test_relative_links_resolve(page):
    path = ROOT / page
    broken = [link for link in _relative_links(path) if not (path.parent / link).exists()]
    assert broken == [], f"{page} links to missing files: {broken}"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the docs pages hold the detail"


def test_every_docs_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert [p for p in pages if p not in nav] == []


# ------------------------------------------------------------------ the README's quickstarts, run

#: The README's quickstart per engine (its "### heading"), run as written at 2 real ranks, with
#: tiny stand-ins for what the snippet leaves to the reader (model, data, evaluate) and its save
#: interval shortened from 1000 steps to 3.
QUICKSTARTS = {"deepspeed": "### DeepSpeed", "fsdp2": "### torch FSDP2", "ddp": "### A plain or DDP model"}


def readme_block(heading: str) -> str:
    """The first ```python block after ``heading`` in the README."""
    text = (ROOT / "README.md").read_text()
    after = text[text.index(heading + "\n") :]
    return re.search(r"```python\n(.*?)```", after, re.S).group(1)


def readme_quickstarts_worker(root: str) -> dict:
    import os

    import torch
    import torch.nn as nn

    import functional_ema as fe

    torch.manual_seed(0)
    rank = torch.distributed.get_rank()
    batches = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * rank + i)) for i in range(6)]

    class LossNet(nn.Module):  # DeepSpeed's snippet: engine(batch) is the loss
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(4, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.out(torch.tanh(self.inp(x))).pow(2).mean()

    class Blocks(nn.Module):  # FSDP2's snippet: model.blocks, loss_fn(model(batch))
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 4)])

        def forward(self, x):
            return self.blocks[1](torch.tanh(self.blocks[0](x)))

    def evaluate(m):  # the mean output (the DeepSpeed model's output is its loss)
        return sum(float(m(b).float().mean()) for b in batches[:2])

    out = {}
    for kind, heading in QUICKSTARTS.items():
        os.makedirs(f"{root}/{kind}", exist_ok=True)
        os.chdir(f"{root}/{kind}")
        code = readme_block(heading).replace("% 1000 == 0", "% 3 == 0")
        model = LossNet() if kind == "deepspeed" else Blocks()
        scope = {
            "fe": fe,
            "torch": torch,
            "model": model,
            "net": model,
            "loader": batches,
            "evaluate": evaluate,
            "loss_fn": lambda y: y.pow(2).mean(),
            "step": 1,
            "optimizer": torch.optim.AdamW(model.parameters(), lr=1e-2),
            "ds_config": {
                "train_micro_batch_size_per_gpu": 2,
                "zero_optimization": {"stage": 3},
                "zero_allow_untested_optimizer": True,
                "steps_per_print": 10**9,
            },
        }
        exec(compile(code, f"README.md ({heading})", "exec"), scope)
        state = scope["state"]
        x = scope.get("engine", scope["model"])
        saved = fe.load(x, "ckpt")
        full = fe.gather_full(state, x)
        out[kind] = {
            "step": int(state.step),
            "loaded_step": int(saved.step),
            "names": sorted(full),
            "params": sorted(n for n, p in model.named_parameters() if p.requires_grad),
            "reloaded_equal": all(torch.equal(a, b) for a, b in zip(fe.gather_full(saved, x).values(), full.values())),
        }
    return out


def test_readme_quickstarts_run_as_written():
    """Each engine's README quickstart runs as written at 2 ranks (DeepSpeed ZeRO-3, FSDP2, DDP): the
    EMA advanced to the last step, covers every trainable parameter, and what it saved loads back bitwise."""
    import tempfile

    from functional_ema._testing.multirank import run_ranks

    with tempfile.TemporaryDirectory() as root:
        results = run_ranks("tests.test_docs:readme_quickstarts_worker", world_size=2, timeout=300, root=root)
    for r in results:
        ds, fsdp2, ddp = r["deepspeed"], r["fsdp2"], r["ddp"]
        assert ds["step"] == ds["loaded_step"] == 6 and ds["reloaded_equal"], ds
        assert ds["names"] == ds["params"] and len(ds["names"]) == 4, ds
        assert fsdp2["step"] == fsdp2["loaded_step"] == 6 and fsdp2["reloaded_equal"], fsdp2
        assert fsdp2["names"] == fsdp2["params"], fsdp2
        assert ddp["step"] == ddp["loaded_step"] == 1 and ddp["reloaded_equal"], ddp
        assert [n.removeprefix("module.") for n in ddp["names"]] == ddp["params"], ddp
