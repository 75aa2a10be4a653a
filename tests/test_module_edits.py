"""A plain (or DDP) module edited by the user between two calls of the per-step path.

Each row starts from ``state = init_ema(local_shards(model))`` (the reading is then kept on the model), applies one
edit users make to a model, and runs ``update(state, local_shards(model), 1, decay=0.5)``, ``swapped`` and
``gather_full``. The outcome is either the right EMA, checked against a reference made in plain torch from
``model.named_parameters()``, or an error naming the parameter (a state that lacks a newly trainable parameter, or
holds another shape): never an EMA silently averaging parameters the model no longer uses.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.nn.utils.prune
from torch import nn

import functional_ema as fe
from functional_ema._testing.multirank import run_ranks
from functional_ema.engines.module import flatten_parameters


class Net(nn.Module):
    """Two square layers (tie-able), one without bias (``c.bias`` registered as ``None``), a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 3, bias=False)
        self.frozen = nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.c(torch.tanh(self.b(torch.tanh(self.a(x))))))


def _sym(w: torch.Tensor) -> torch.Tensor:
    return w.triu() + w.triu(1).t()


class _Sym(nn.Module):
    def forward(self, w: torch.Tensor) -> torch.Tensor:
        return _sym(w)


def _compiled(m: nn.Module) -> nn.Module:
    return torch.compile(m, backend="eager")  # only the wrapper is built: nothing is compiled before a forward


def _compiled_once(m: Net) -> nn.Module:
    """The model compiled once, the same wrapper read before and after (kept in the model's ``__dict__``, where
    ``nn.Module.__setattr__`` would have registered it as a submodule)."""
    if "_wrapper" not in m.__dict__:
        m.__dict__["_wrapper"] = _compiled(m)
    return m.__dict__["_wrapper"]


def _tie(m: Net) -> None:
    m.b.weight = m.a.weight


def _untie(m: Net) -> None:
    m.b.weight = nn.Parameter(m.a.weight.detach().clone())


def _freeze_and_unfreeze(m: Net) -> None:
    m.a.weight.requires_grad_(False)
    fe.local_shards(m)  # read frozen: kept, as read once (see _base.is_read)
    m.a.weight.requires_grad_(True)


def _frozen_replaced_then_unfrozen(m: Net) -> None:
    m.frozen.weight = nn.Parameter(torch.zeros(3, 3), requires_grad=False)
    fe.local_shards(m)  # frozen: still left out
    m.frozen.weight.requires_grad_(True)


def _to_on_swap(dtype: torch.dtype) -> Callable[[Net], None]:
    def edit(m: Net) -> None:
        before = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(True)  # torch.utils.swap_tensors: same objects
        try:
            m.to(dtype)
        finally:
            torch.__future__.set_swap_module_params_on_conversion(before)

    return edit


def _to_on_overwrite(dtype: torch.dtype) -> Callable[[Net], None]:
    def edit(m: Net) -> None:
        before = torch.__future__.get_overwrite_module_params_on_conversion()
        torch.__future__.set_overwrite_module_params_on_conversion(True)  # new Parameters, set into _parameters
        try:  # directly: no registration hook runs, only the identity comparison of the registries sees them
            m.to(dtype)
        finally:
            torch.__future__.set_overwrite_module_params_on_conversion(before)

    return edit


def _to_empty(m: Net) -> None:
    m.to_empty(device="cpu")
    with torch.no_grad():
        for i, p in enumerate(m.parameters()):
            p.fill_(0.1 * i)


def _del_and_add(m: Net) -> None:
    old = m.a.weight
    del m.a.weight
    m.a.weight = nn.Parameter(old.detach() * 2)


def _prune(m: Net) -> None:
    nn.utils.prune.l1_unstructured(m.a, "weight", amount=0.5)


def _loaded(assign: bool) -> Callable[[Net], None]:
    def edit(m: Net) -> None:
        m.load_state_dict({k: v * 0.5 - 1 for k, v in m.state_dict().items()}, assign=assign)

    return edit


class Row(NamedTuple):
    edit: Callable[[Net], nn.Module | None]  # made after the first reading; returns what is read next (None: the model)
    error: str | None = None  # None: the right EMA; else what update's error says (it names the parameter)
    start: Callable[[Net], nn.Module] = lambda m: m  # what the state is made from


def _names(missing: str = "", new: str = "") -> str:
    """The pattern of update's error for names the shards and the state do not share (``missing``: in the state
    only, ``new``: in the shards only; each the start of the quoted list)."""
    parts = ([f"missing from shards: {missing}"] if missing else []) + ([f"not in state.emas[0]: {new}"] if new else [])
    return re.escape("shards do not match state.emas[0]; " + "; ".join(parts))


def _shape(name: str, got: tuple, had: tuple) -> str:
    return re.escape(f"shards['{name}'] has shape {got} but the EMA (emas[0]) has {had}")


def _none(_result: object) -> None:
    """An edit made for its effect on the model (what it returns is not the object to read next)."""


PLAIN = "'a.bias', 'a.weight', 'b.bias', 'b.weight', 'c.weight'"
# update's note for names the state lacks, with the way out for progressive unfreezing
_NEW_HINT = " " + re.escape(
    "(state.emas[0] holds the parameters read when it was made: a name it lacks was frozen then"
)


def _freeze(p: nn.Parameter) -> None:
    p.requires_grad_(False)


def _unfreeze(p: nn.Parameter) -> None:
    p.requires_grad_(True)


# Rows marked "fixed" were a silently stale reading before the change they came with (see engines/module.py).
EDITS: dict[str, Row] = {
    # --- trainable or not
    "requires_grad off then on": Row(_freeze_and_unfreeze),
    "freeze a read parameter": Row(lambda m: _freeze(m.a.weight)),  # still averaged
    "unfreeze a frozen parameter": Row(lambda m: _unfreeze(m.frozen.weight), _names(new="'frozen.weight'") + _NEW_HINT),
    "frozen replaced by a trainable one": Row(  # fixed
        lambda m: setattr(m.frozen, "weight", nn.Parameter(torch.zeros(3, 3))), _names(new="'frozen.weight'")
    ),
    "frozen replaced, then unfrozen": Row(_frozen_replaced_then_unfrozen, _names(new="'frozen.weight'")),  # fixed
    # --- registrations
    "tie b.weight to a.weight": Row(_tie, _names(missing="'b.weight'")),
    "tie a.weight to b.weight": Row(lambda m: setattr(m.a, "weight", m.b.weight), _names(missing="'b.weight'")),
    "untie b.weight": Row(_untie, _names(new="'b.weight'"), start=lambda m: _tie(m) or m),  # fixed
    "bias set where bias=False left None": Row(  # fixed
        lambda m: setattr(m.c, "bias", nn.Parameter(torch.zeros(3))), _names(new="'c.bias'")
    ),
    "parameter registered as None": Row(lambda m: m.a.register_parameter("extra", None)),
    "buffer registered": Row(lambda m: m.a.register_buffer("extra", torch.ones(2))),
    "del then re-added under its name": Row(_del_and_add),
    "prune (weight_orig + mask)": Row(_prune, _names("'a.weight'", "'a.weight_orig'")),
    "register_parametrization": Row(
        lambda m: _none(nn.utils.parametrize.register_parametrization(m.a, "weight", _Sym())),
        _names("'a.weight'", "'a.parametrizations.weight.original'"),
    ),
    "weight_norm": Row(
        lambda m: _none(nn.utils.parametrizations.weight_norm(m.b)),
        _names("'b.weight'", "'b.parametrizations.weight.original0', 'b.parametrizations.weight.original1'"),
    ),
    "weight_norm before init, no edit": Row(
        lambda m: None, start=lambda m: _none(nn.utils.parametrizations.weight_norm(m.b)) or m
    ),
    "register_parametrization before init, no edit": Row(
        lambda m: None, start=lambda m: _none(nn.utils.parametrize.register_parametrization(m.a, "weight", _Sym())) or m
    ),
    # --- torch.compile: the wrapper is read as the model it wraps (its names, no '_orig_mod.'; one reading), so a
    # state of either steps through the other (the names differed before, and update refused)
    "compiled after init": Row(_compiled),
    "compiled at init, plain after": Row(lambda m: m, start=_compiled),
    "compiled, the same wrapper read throughout": Row(_compiled_once, start=_compiled_once),  # a forward: traced
    # --- dtype and memory
    "half()": Row(lambda m: m.half()),
    "to(bfloat16)": Row(lambda m: m.to(torch.bfloat16)),
    "to(float64)": Row(lambda m: m.to(torch.float64)),
    "to(float64), swap_module_params_on_conversion": Row(_to_on_swap(torch.float64)),
    "to(bfloat16), swap_module_params_on_conversion": Row(_to_on_swap(torch.bfloat16)),
    "to(float64), overwrite_module_params_on_conversion": Row(_to_on_overwrite(torch.float64)),
    "share_memory()": Row(lambda m: m.share_memory()),
    "flatten_parameters": Row(lambda m: _none(flatten_parameters(m))),
    "load_state_dict": Row(_loaded(assign=False)),
    "load_state_dict(assign=True)": Row(_loaded(assign=True)),
    "to_empty": Row(_to_empty),
    # --- .data rebound
    ".data = new memory, same shape": Row(lambda m: setattr(m.a.weight, "data", torch.full((4, 4), 3.0))),
    ".data = other numel": Row(
        lambda m: setattr(m.a.weight, "data", torch.zeros(10)),
        _shape("a.weight", (10,), (4, 4)),
    ),
    ".data = .data.reshape (same memory)": Row(  # fixed
        lambda m: setattr(m.a.weight, "data", m.a.weight.data.reshape(2, 8)),
        _shape("a.weight", (2, 8), (4, 4)),
    ),
    ".data = .data[:2] (same memory)": Row(  # fixed
        lambda m: setattr(m.a.weight, "data", m.a.weight.data[:2]),
        _shape("a.weight", (2, 4), (4, 4)),
    ),
    ".data = .data.t() (same memory, 4x3)": Row(  # fixed
        lambda m: setattr(m.c.weight, "data", m.c.weight.data.t()),
        _shape("c.weight", (4, 3), (3, 4)),
    ),
    ".data = .data.t() (same memory, square)": Row(  # fixed: same pointer and shape, other strides
        lambda m: setattr(m.a.weight, "data", m.a.weight.data.t())
    ),
}


def _trained(model: nn.Module) -> dict[str, torch.Tensor]:
    """The reference's view of the model: every parameter by ``named_parameters()`` name (tied ones once)."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _inner(target: nn.Module) -> nn.Module:
    return getattr(target, "_orig_mod", target)


def _edited(row: Row) -> tuple[fe.EmaState, dict[str, torch.Tensor], nn.Module]:
    """The state made before the edit, the trainable weights it was made from (the reference's EMA then), and the
    object to read after the edit; training moved every trainable weight by one since."""
    torch.manual_seed(0)
    model = Net()
    start = row.start(model)
    first = {n: p.detach().clone() for n, p in _inner(start).named_parameters() if p.requires_grad}
    state = fe.init_ema(fe.local_shards(start))
    assert fe.local_shards(start) is fe.local_shards(start)  # the reading is kept until the edit
    edited = row.edit(model)
    target = model if edited is None else edited
    with torch.no_grad():  # training moved the weights: the EMA of decay 0.5 is half-way
        for p in target.parameters():
            if p.requires_grad:
                p.add_(1.0)
    return state, first, target


@pytest.mark.filterwarnings("ignore::functional_ema.LowPrecisionWeightsWarning")  # the half/bfloat16 rows
@pytest.mark.parametrize("row", EDITS.values(), ids=EDITS.keys())
def test_module_edited_after_the_first_reading(row: Row) -> None:
    state, first, target = _edited(row)
    now = _trained(_inner(target))  # a compiled model's names are those of the model it wraps
    trainable = {n for n, p in _inner(target).named_parameters() if p.requires_grad}
    if row.error is not None:
        with pytest.raises(fe.TreeMismatchError, match=row.error):
            fe.update(state, fe.local_shards(target), 1, decay=0.5)
        return

    fe.update(state, fe.local_shards(target), 1, decay=0.5)
    # every trainable parameter is averaged, and nothing else but the ones read frozen later (kept, see is_read)
    assert trainable <= set(state.ema) <= set(now), (sorted(trainable), sorted(state.ema))
    for n, e in state.ema.items():
        expect = first[n].lerp(now[n].to(first[n].dtype), 0.5)
        assert e.shape == now[n].shape, n
        assert torch.equal(e, expect), n  # bitwise, also for 16-bit and float64 parameters (lerped in fp32)

    # swapped: the forward computes with the EMA (in the parameters' dtype); the trained values come back bitwise
    x = torch.randn(5, 4).to(next(target.parameters()).dtype)
    # in the parameter's dtype and strides (a transposed weight takes another matmul path, rounding otherwise)
    ema_weights = {n: torch.empty_like(now[n]).copy_(e) for n, e in state.ema.items()}
    expect_out = torch.func.functional_call(_inner(target), {**now, **ema_weights}, (x,))
    with torch.no_grad(), fe.swapped(target, state):
        inside = _trained(_inner(target))
        out = target(x)
    assert all(torch.equal(inside[n], ema_weights.get(n, now[n])) for n in now)
    torch.testing.assert_close(out, expect_out, rtol=0, atol=0)
    assert all(torch.equal(p, now[n]) for n, p in _inner(target).named_parameters())

    full = fe.gather_full(state, target)
    assert sorted(full) == sorted(state.ema)  # in the model's order now (a parameter re-added comes last)
    assert all(torch.equal(full[n], state.ema[n]) and full[n].shape == now[n].shape for n in full)


REFUSED = [pytest.param(row, id=name) for name, row in EDITS.items() if row.error is not None]


@pytest.mark.parametrize("row", REFUSED)
def test_swapped_and_gather_full_refuse_the_state_update_refuses(row: Row) -> None:
    state, _, target = _edited(row)
    assert row.error is not None
    name = re.findall(r"'([\w.]+)'", row.error.replace("\\", ""))[0]  # the first parameter update's error names
    with pytest.raises(fe.StateMismatchError, match=re.escape(name)), fe.swapped(target, state):
        pass
    with pytest.raises(fe.StateMismatchError, match=re.escape(name)):
        fe.gather_full(state, target)


def test_plain_module_check_reads_every_registration_by_identity() -> None:
    # A parameter replaced by a tensor that compares equal must still be seen: registrations are compared by
    # identity, never by a tensor's `==` (elementwise; a one-element tensor of equal value would pass).
    model = nn.Linear(1, 1, bias=False)
    state = fe.init_ema(fe.local_shards(model))
    frozen = nn.Linear(1, 1, bias=False).requires_grad_(False)
    model.frozen = frozen  # a frozen submodule, then its parameter replaced by an equal trainable one
    fe.local_shards(model)
    frozen.weight = nn.Parameter(frozen.weight.detach().clone())
    with pytest.raises(fe.TreeMismatchError, match=_names(new="'frozen.weight'")):
        fe.update(state, fe.local_shards(model), 1, decay=0.5)


# ------------------------------------------------------------------------------------------------ DDP


def _ddp_case(rank: int) -> dict:
    """One process of the DDP check: the state made from the plain module, then used through its DDP wrapper, and
    a state made from the wrapper used through the plain module."""
    torch.manual_seed(0)  # the same model on every rank
    model = Net()
    state = fe.init_ema(fe.local_shards(model))
    first = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ddp = nn.parallel.DistributedDataParallel(model)
    report: dict = {"names": [list(fe.local_shards(model)), list(fe.local_shards(ddp))]}
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)
    now = _trained(model)
    fe.update(state, fe.local_shards(ddp), 1, decay=0.5)
    report["update"] = all(torch.equal(e, first[n].lerp(now[n], 0.5)) for n, e in state.ema.items())
    x = torch.randn(5, 4)
    expect_out = torch.func.functional_call(model, {**now, **dict(state.ema)}, (x,))
    with torch.no_grad(), fe.swapped(ddp, state):
        report["swapped"] = torch.equal(ddp(x), expect_out)
    report["restored"] = all(torch.equal(p, now[n]) for n, p in model.named_parameters())
    full = fe.gather_full(state, ddp)
    report["gather_full"] = sorted(full) == sorted(state.ema) and all(torch.equal(full[n], state.ema[n]) for n in full)
    report["layout"] = [fe.shard_layout(ddp).world_size, fe.shard_layout(model).world_size]
    # The other way: a state of the wrapper, stepped through the plain module (a rank's own whole weights).
    wrapped = fe.init_ema(fe.local_shards(ddp))
    with torch.no_grad():
        model.a.weight.add_(2.0)
    fe.update(wrapped, fe.local_shards(model), 1, decay=0.0)
    report["ddp_state_via_module"] = torch.equal(wrapped.ema["a.weight"], model.a.weight.detach())
    return report


def ddp_worker() -> dict:
    import torch.distributed as dist

    return _ddp_case(dist.get_rank())


def test_ddp_wrapper_reads_the_names_of_the_module_it_wraps() -> None:
    reports = run_ranks("tests.test_module_edits:ddp_worker", world_size=2, timeout=120, env={"FE_DIST_INIT": "torch"})
    for rep in reports:
        names = ["a.weight", "a.bias", "b.weight", "b.bias", "c.weight"]
        assert rep["names"] == [names, names]
        assert rep["update"] and rep["swapped"] and rep["restored"] and rep["gather_full"], rep
        # ddp.module at 2 ranks is a one-process model on each rank (its verbs local), the wrapper a replica
        assert rep["layout"] == [2, 1]
        assert rep["ddp_state_via_module"]
