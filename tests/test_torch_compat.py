"""The FSDP2 adapter's torch check: the versions it knows read quietly, another torch with every
internal warns and stops wrapping FSDP2's private method, a torch without one is refused by name."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param

from functional_ema.engines import _torch_compat as compat


def test_version_parsing_and_the_known_range():
    assert compat.torch_minor("2.13.0+cpu") == (2, 13)
    assert compat.torch_minor("2.11.0a0+git1234") == (2, 11)
    assert compat.torch_minor("garbage") == (0, 0)
    assert [compat.is_known_torch(v) for v in ("2.10.1", "2.11.0", "2.13.0+cpu", "2.14.0", "3.0.0")] == [
        False,
        True,
        True,
        False,
        False,
    ]
    assert compat.is_known_torch(), f"the suite runs on torch {torch.__version__}, outside {compat.KNOWN_TORCH}"


def test_pyproject_torch_range_is_the_known_range():
    from pathlib import Path

    import tomllib

    deps = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    spec = next(d for d in deps["dependencies"] if d.startswith("torch"))
    (a, b), (c, d) = compat.KNOWN_TORCH
    assert spec == f"torch>={a}.{b},<{c}.{d + 1}"


def test_this_torch_has_every_internal_and_checks_quietly(recwarn):
    assert compat.missing_fsdp2_internals() == []
    compat.check_fsdp2_internals()
    assert not [w for w in recwarn if issubclass(w.category, RuntimeWarning)]


def test_an_untested_torch_with_every_internal_warns_naming_both_versions(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    with pytest.warns(RuntimeWarning, match=r"tested on torch 2\.11 to 2\.13, not 2\.99\.0"):
        compat.check_fsdp2_internals()


def test_an_untested_torch_without_an_internal_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.delattr(_fsdp_param.FSDPParam, "reset_sharded_param")
    with pytest.raises(NotImplementedError) as e:
        compat.check_fsdp2_internals()
    msg = str(e.value)
    assert "FSDPParam.reset_sharded_param" in msg and "torch 2.99.0" in msg and "2.11 to 2.13" in msg
    assert "torch>=2.11,<2.14" in msg


def test_an_untested_torch_is_read_without_wrapping_fsdp2s_private_method(monkeypatch):
    from functional_ema.engines import fsdp2

    monkeypatch.setattr(torch, "__version__", "2.99.0")
    monkeypatch.setattr(fsdp2, "_REPLACEMENTS", [None])
    original = _fsdp_param.FSDPParam.reset_sharded_param
    fsdp2._count_replacements()
    assert fsdp2._REPLACEMENTS == [None], "counting installed on an untested torch"
    assert _fsdp_param.FSDPParam.reset_sharded_param is original
