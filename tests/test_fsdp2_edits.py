"""FSDP2 models edited between calls: ``update``, ``gather_full`` and ``swapped`` give the right EMA or a clear error.

A reading of an FSDP2 model is cached on it and re-validated each call (``engines/fsdp2.py``'s ``_Token``); a change
it misses leaves the EMA silently averaging dead weights. Each scenario here builds a fresh model (2 gloo CPU ranks,
``fully_shard`` on a block, and on the root or not), takes one EMA step, edits the model, takes a "training" step (the
same constant added to every trainable parameter on every rank) and an EMA step, and checks against an independent
reference: the full parameters (``p.full_tensor()``) averaged in plain torch with decay 0.5. The EMA must equal it
(``gather_full``, and the weights inside ``swapped``, with the live ones back after), or ``update`` must raise an
error naming the parameter. Every scenario runs in one launch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

from functional_ema._testing.multirank import full_tensor_of, raised, run_ranks

D, H = 5, 7  # odd row counts: FSDP2 pads the second rank's shards, and a one-rank mistake shows
DECAY = 0.5
TOL = 0.0  # bitwise: the reference lerps as update does
WRAPS = (False, True)  # fully_shard on the root too, or on the block only (the root's own parameters plain)


class Net(nn.Module):
    """A ``fully_shard``-ed block, the root's own parameters (a LayerNorm and a gate) and a frozen one."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
        self.norm = nn.LayerNorm(D)
        self.gate = nn.Parameter(torch.ones(3, D))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.block(x)) * self.gate[0] + self.frozen.sum()


# ------------------------------------------------------------------------------------ rank helpers


def _mesh() -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (torch.distributed.get_world_size(),))


def _build(wrap_root: bool) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    fully_shard(model.block, mesh=_mesh())
    if wrap_root:
        fully_shard(model, mesh=_mesh())
    return model


def _fsdp(m: nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule

    return [mod for mod in m.modules() if isinstance(mod, FSDPModule)]


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p._local_tensor if isinstance(p, DTensor) else p


def _train(model: nn.Module, k: float) -> None:
    """A training step's stand-in (called with every parameter sharded): the same constant on every rank, one per
    parameter, added to what the optimizer would update (FSDP2's local shard, or the whole plain tensor)."""
    with torch.no_grad():
        for i, (_n, p) in enumerate(model.named_parameters()):
            if p.requires_grad:
                _local(p).add_(k * (1 + 0.1 * i))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's full value (``full_tensor()``, a collective), in its own dtype."""
    return {n: full_tensor_of(p) for n, p in model.named_parameters()}


def _compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The names ``got`` has and the largest difference from ``ref`` (the ``_orig_mod.`` of torch.compile kept in
    the names, dropped to compare)."""
    bare = {n.removeprefix("_orig_mod."): t for n, t in got.items()}
    worst = [float((bare[n].double() - ref[n]).abs().max()) if bare[n].shape == ref[n].shape else 1e9 for n in ref]
    return {"names": sorted(got), "max": max(worst) if set(bare) >= set(ref) else None}


def _scenario(
    wrap_root: bool,
    edit: Callable[[nn.Module], Any],
    target: Callable[[nn.Module], Any] = lambda m: m,
    train_first: bool = False,
) -> dict[str, Any]:
    """One EMA step, ``edit``, one training and EMA step; then the EMA against the plain-torch reference.

    ``train_first``: train before the edit (one that leaves parameters gathered, so training after it would
    write FSDP2's gathered copies rather than the shards). ``target``: what the verbs are given (the model)."""
    import functional_ema as fe

    model = _build(wrap_root)
    state = fe.init_ema(fe.local_shards(target(model)))
    ref = {n: t for n, t in _full(model).items() if n != "frozen"}  # frozen from the start: not read
    _train(model, 1.0)
    state = fe.update(state, fe.local_shards(target(model)), 1, decay=DECAY)
    live = _full(model)
    ref = {n: r.lerp(live[n].to(r.dtype), 1 - DECAY) for n, r in ref.items()}
    if train_first:
        _train(model, 2.0)
    edit(model)
    if not train_first:
        _train(model, 2.0)
    live = _full(model)
    box: dict[str, Any] = {}
    error = raised(lambda: box.update(state=fe.update(state, fe.local_shards(target(model)), 2, decay=DECAY)))
    if error:  # gather_full and swapped (collectives) must refuse the stale state too, on every rank together

        def swap() -> None:
            with fe.swapped(target(model), state):
                pass

        return {
            "error": error,
            "gather_error": raised(lambda: fe.gather_full(state, target(model))),
            "swap_error": raised(swap),
        }
    ref = {n: ref[n].lerp(live[n].to(ref[n].dtype), 1 - DECAY) for n in ref if n in live}
    out: dict[str, Any] = {"error": None}

    def check() -> None:
        out["gather"] = _compare(fe.gather_full(box["state"], target(model)), ref)
        with fe.swapped(target(model), box["state"]):
            inside = _full(model)
        out["swapped"] = _compare({n: t for n, t in inside.items() if n in ref}, ref)
        out["restored"] = _compare(_full(model), live)

    out["late_error"] = raised(check)  # gather_full or swapped raising after update took the edit
    return out


def _inside_forward(wrap_root: bool, first_read_inside: bool) -> dict[str, Any]:
    """``local_shards`` and ``update`` from a forward pre-hook on the root's own LayerNorm, where FSDP2 has the
    parameters gathered (the first reading made there too, or before)."""
    import functional_ema as fe

    model = _build(wrap_root)
    box: dict[str, Any] = {}
    if not first_read_inside:
        box["state"] = fe.init_ema(fe.local_shards(model))
    ref = {n: t for n, t in _full(model).items() if n != "frozen"}

    def hook(_mod: nn.Module, _args: Any) -> None:
        shards = fe.local_shards(model)
        if "state" not in box:
            box["state"] = fe.init_ema(shards)
        else:
            box["state"] = fe.update(box["state"], shards, int(box["state"].step) + 1, decay=DECAY)

    handle = model.norm.register_forward_pre_hook(hook)
    for step in (1, 2):
        _train(model, float(step))
        live = _full(model)
        with torch.no_grad():
            model(torch.ones(2, D))
        for m in _fsdp(model):  # the root's parameters stay gathered after a forward: the next training step
            m.reshard()  # updates the shards (a backward would reshard)
        first = step == 1 and first_read_inside
        ref = {n: live[n] if first else ref[n].lerp(live[n].to(ref[n].dtype), 1 - DECAY) for n in ref}
    handle.remove()
    out = {"error": None, "late_error": None, "gather": _compare(fe.gather_full(box["state"], model), ref)}
    with fe.swapped(model, box["state"]):
        out["swapped"] = _compare({n: t for n, t in _full(model).items() if n in ref}, ref)
    out["restored"] = _compare(_full(model), live)
    return out


# ----------------------------------------------------------------------------------------- the edits


def _rename(m: nn.Module, old: str, new: str) -> None:
    setattr(m, new, getattr(m, old))
    delattr(m, old)


def _new_fsdp_block(m: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(1)
    m.block = fully_shard(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D)), mesh=_mesh())


def _with_future(flag: str, m: nn.Module) -> None:
    """``model.to(torch.float64)`` under one of torch's ``__future__`` conversion flags, reset after."""
    setter = getattr(torch.__future__, f"set_{flag}_module_params_on_conversion")
    setter(True)
    try:
        m.to(torch.float64)
    finally:
        setter(False)


def _assign(m: nn.Module) -> None:
    m.load_state_dict({k: v.detach() + 0.5 for k, v in m.state_dict().items()}, assign=True)


def _partial(m: nn.Module) -> None:
    sd = m.state_dict()
    m.load_state_dict({n: sd[n].detach() * 2 for n in ("norm.weight", "block.0.weight")}, strict=False)


def _dcp(m: nn.Module, how: str) -> None:
    """``torch.distributed.checkpoint.state_dict.set_model_state_dict``: full tensors (from every rank, or rank
    0's broadcast), the sharded state dict, or a partial one."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict

    if how in ("full", "broadcast"):
        sd: dict[str, Any] = {k: (v + 0.25).float() for k, v in _full(m).items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=how == "broadcast")
    else:
        sd = {k: v.detach() * 1.5 for k, v in get_model_state_dict(m).items()}
        if how == "partial":
            sd = {"norm.weight": sd["norm.weight"]}
        options = StateDictOptions(strict=how != "partial")
    set_model_state_dict(m, sd, options=options)


def _data_assign(m: nn.Module) -> None:
    with torch.no_grad():
        m.block[0].weight.data = m.block[0].weight.data * 0 + 3
        m.gate.data = m.gate.data * 0 + 3


def _flatten(m: nn.Module) -> None:
    from functional_ema.engines.fsdp2 import flatten_local_shards

    flatten_local_shards(m)


def _forward(m: nn.Module) -> None:
    """A forward leaves the root's parameters gathered: the next calls read, swap and gather in that state."""
    with torch.no_grad():
        m(torch.ones(2, D))


def _unshard(m: nn.Module) -> None:
    for mod in _fsdp(m):
        mod.unshard()


def _toggle_grad(m: nn.Module) -> None:
    """A parameter read is frozen (it keeps its place), then everything is made trainable again."""
    m.norm.weight.requires_grad_(False)
    m.requires_grad_(True)


#: edits after which the EMA must be right (values compared): loads, re-types, moves, freezes, gathered states,
#: and the structure edits the reading must notice (replaced, renamed or new submodules that FSDP2 shards)
RIGHT: dict[str, Callable[[nn.Module], Any]] = {
    "load_state_dict(assign=True)": _assign,
    "load_state_dict(strict=False) partial": _partial,
    "set_model_state_dict full": lambda m: _dcp(m, "full"),
    "set_model_state_dict broadcast_from_rank0": lambda m: _dcp(m, "broadcast"),
    "set_model_state_dict sharded": lambda m: _dcp(m, "sharded"),
    "set_model_state_dict strict=False partial": lambda m: _dcp(m, "partial"),
    "to(float64)": lambda m: m.to(torch.float64),
    "to(float64) then float()": lambda m: m.to(torch.float64).float(),
    "to(cpu)": lambda m: m.to("cpu"),
    "swap_module_params_on_conversion to(float64)": lambda m: _with_future("swap", m),
    "overwrite_module_params_on_conversion to(float64)": lambda m: _with_future("overwrite", m),
    "p.data = ...": _data_assign,
    "flatten_local_shards": _flatten,
    "freeze a read parameter": lambda m: m.norm.weight.requires_grad_(False),
    "freeze then requires_grad_(True) on one read": lambda m: m.norm.weight.requires_grad_(False).requires_grad_(True),
    "new fully_shard-ed block under the old name": _new_fsdp_block,
}
#: edits that leave FSDP2's parameters gathered: the training step comes before them
GATHERED = {"forward (root left unsharded)": _forward, "unshard()": _unshard}
#: edits in the root's own part that stays plain when only the block is fully_shard-ed (values compared there)
PLAIN_ROOT = {
    "root submodule replaced": lambda m: setattr(m, "norm", nn.LayerNorm(D)),
    "root parameter replaced": lambda m: setattr(m, "gate", nn.Parameter(torch.zeros(3, D))),
}
#: edits that must be refused, naming a parameter they add, move or replace
REFUSED: dict[str, Callable[[nn.Module], Any]] = {
    **PLAIN_ROOT,
    "parameter added to the root": lambda m: setattr(m, "extra", nn.Parameter(torch.ones(2))),
    "root submodule deleted": lambda m: delattr(m, "norm"),
    "Linear deleted from the fully_shard-ed block": lambda m: m.block.__delitem__(2),
    "module added outside every fully_shard": lambda m: setattr(m, "head", nn.Linear(D, 2)),
    "parameter added inside the fully_shard-ed block": lambda m: setattr(
        m.block[0], "extra", nn.Parameter(torch.ones(2))
    ),
    "Linear replaced inside the fully_shard-ed block": lambda m: m.block.__setitem__(2, nn.Linear(H, D)),
    "parameter set over a managed one in the block": lambda m: setattr(
        m.block[0], "weight", nn.Parameter(torch.zeros(H, D))
    ),
    "block renamed": lambda m: _rename(m, "block", "trunk"),
    "root submodule renamed": lambda m: _rename(m, "norm", "norm2"),
    "frozen parameter unfrozen": lambda m: m.frozen.requires_grad_(True),
    "requires_grad_(False) then (True) on the model": _toggle_grad,
}


def _compiled(m: nn.Module) -> nn.Module:
    """``torch.compile(m, backend="eager")``, made once per model (nothing is compiled until it is called)."""
    wrapper = m.__dict__.get("_test_compiled")
    if wrapper is None:
        wrapper = m.__dict__["_test_compiled"] = torch.compile(m, backend="eager")
    return wrapper


def _sharded_compiled(m: nn.Module) -> nn.Module:
    """``fully_shard(torch.compile(m))``: FSDP2 applied to the compile wrapper (made once per model)."""
    from torch.distributed.fsdp import fully_shard

    wrapper = m.__dict__.get("_test_sharded_compiled")
    if wrapper is None:
        wrapper = m.__dict__["_test_sharded_compiled"] = fully_shard(torch.compile(m, backend="eager"), mesh=_mesh())
    return wrapper


def _fully_shard_root(m: nn.Module) -> None:
    from torch.distributed.fsdp import fully_shard

    fully_shard(m, mesh=_mesh())


def _reshape_gate(m: nn.Module) -> None:
    m.gate.data = m.gate.data[:2]  # the same data pointer, another shape


def _shard(m: nn.Module, how: str) -> None:
    from torch.distributed.fsdp import fully_shard

    if how == "tensor parallel":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        parallelize_module(m.block, _mesh(), {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return
    fully_shard(m.block, mesh=_mesh())
    if how == "fully_shard, block and root":
        fully_shard(m, mesh=_mesh())


def _sharded_after_a_plain_read(how: str) -> dict[str, Any]:
    """A model read (and its EMA made) as a plain module, then sharded (``how``). Every ``local_shards`` until one
    succeeds (each raised torch's "invalid python storage": the plain-module reading kept on the model), then the
    old state refused by ``update``, then a state made anew stepped once against the full weights averaged in plain
    torch."""
    import functional_ema as fe

    torch.manual_seed(0)
    model = Net()
    old = fe.init_ema(fe.local_shards(model))
    _shard(model, how)
    out: dict[str, Any] = {"reads": []}
    for _ in range(3):
        error = raised(lambda: out.update(shards=fe.local_shards(model)))
        out["reads"].append(error)
        if error is None:
            break
    out["old state"] = raised(lambda: fe.update(old, out["shards"], 1, decay=DECAY))
    state = fe.init_ema(fe.local_shards(model))
    ref = {n: t for n, t in _full(model).items() if n != "frozen"}
    _train(model, 1.0)
    state = fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    live = _full(model)
    ref = {n: r.lerp(live[n].to(r.dtype), 1 - DECAY) for n, r in ref.items()}
    out["gather"] = _compare(fe.gather_full(state, model), ref)
    del out["shards"]
    return out


SHARDED_AFTER = ("fully_shard, block and root", "fully_shard, block only", "tensor parallel")


def edits_worker() -> dict[str, dict[str, Any]]:
    """``{"<edit>/<root wrapped>": outcome}`` for every edit, both ways of wrapping."""
    out: dict[str, dict[str, Any]] = {}
    for wrap in WRAPS:
        for name, edit in {**RIGHT, **REFUSED}.items():
            out[f"{name}/{wrap}"] = _scenario(wrap, edit)
        for name, edit in GATHERED.items():
            out[f"{name}/{wrap}"] = _scenario(wrap, edit, train_first=True)
        for first_inside in (False, True):
            out[f"inside a forward, first read {'inside' if first_inside else 'before'}/{wrap}"] = _inside_forward(
                wrap, first_inside
            )
        out[f"torch.compile wrapper/{wrap}"] = _scenario(wrap, lambda m: None, target=_compiled)
        mixed = _scenario(  # the state made from the model, then the wrapper passed (after the edit, a flag)
            wrap,
            lambda m: m.__dict__.update(_test_wrapped=True),
            target=lambda m: _compiled(m) if m.__dict__.get("_test_wrapped") else m,
        )
        out[f"state of the model, then its torch.compile wrapper/{wrap}"] = mixed
    out["fully_shard on the root after the first read/False"] = _scenario(False, _fully_shard_root)
    out["fully_shard of the torch.compile wrapper/False"] = _scenario(False, lambda m: None, target=_sharded_compiled)
    # the root's own parameter (plain: only the block is fully_shard-ed) re-shaped over the same memory
    out["root parameter re-shaped over its memory/False"] = _scenario(False, _reshape_gate)
    for how in SHARDED_AFTER:
        out[f"plain read, then {how}"] = _sharded_after_a_plain_read(how)
    return out


# --------------------------------------------------------------------------------------------- tests


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, dict[str, Any]]]:
    return run_ranks("tests.test_fsdp2_edits:edits_worker", world_size=2, timeout=300)


def _right(outcome: dict[str, Any], where: Any) -> None:
    assert outcome["error"] is None and outcome["late_error"] is None, (where, outcome)
    for check in ("gather", "swapped", "restored"):
        got = outcome[check]
        assert got["max"] is not None and got["max"] <= TOL, (where, check, got)


def _refused(outcome: dict[str, Any], where: str, kind: str, *needles: str) -> str:
    error = outcome["error"]
    assert error is not None and error[0] == kind, (where, outcome)
    for needle in needles:
        assert needle in error[1], (where, needle, error[1])
    # gather_full and swapped, given the state update refused, refuse it too (every rank, no collective left hanging)
    for later in (outcome["gather_error"], outcome["swap_error"]):
        assert later is not None and later[0] in ("StateMismatchError", "RuntimeError"), (where, later)
    return error[1]


def test_loads_retypes_freezes_and_gathered_states_keep_the_reference_ema(outcomes):
    for rank, per_rank in enumerate(outcomes):
        for wrap in WRAPS:
            for name in (*RIGHT, *GATHERED):
                _right(per_rank[f"{name}/{wrap}"], (rank, name, wrap))
            for where in ("before", "inside"):
                _right(per_rank[f"inside a forward, first read {where}/{wrap}"], (rank, where, wrap))


_UNSHARDED = (
    "parameter '{}' was sharded by fully_shard when the model was last read and is now a plain tensor: its module "
    "was replaced after fully_shard, and FSDP2 neither shards the new one nor reduces its gradients over the ranks. "
    "Call fully_shard on the new module before training it (or replace the module before fully_shard)"
)


def test_submodule_replaced_or_renamed_after_the_first_read_is_read_again(outcomes):
    """The reading stayed current after these edits (no local tensor of FSDP2's changed), and the EMA silently
    went on averaging the replaced module's weights, or kept the old names; now each is read again."""
    for rank, per_rank in enumerate(outcomes):
        # a new fully_shard-ed block under the old name: the new block's shards are averaged
        _right(per_rank["new fully_shard-ed block under the old name/False"], rank)
        for wrap in WRAPS:
            for name in ("parameter added to the root", "parameter added inside the fully_shard-ed block"):
                extra = "'extra'" if "root" in name else "'block.0.extra'"
                _refused(per_rank[f"{name}/{wrap}"], (rank, name), "TreeMismatchError", "not in state.emas[0]", extra)
            # a submodule removed registers nothing; its parent's submodule count shows it (it was not seen: the EMA
            # kept averaging the removed weights, under names the model no longer has)
            out = per_rank[f"root submodule deleted/{wrap}"]
            _refused(out, rank, "TreeMismatchError", "missing from shards: 'norm.bias', 'norm.weight'")
            out = per_rank[f"Linear deleted from the fully_shard-ed block/{wrap}"]
            _refused(out, rank, "TreeMismatchError", "missing from shards: 'block.2.bias', 'block.2.weight'")
            out = per_rank[f"module added outside every fully_shard/{wrap}"]
            _refused(out, rank, "TreeMismatchError", "not in state.emas[0]", "'head.bias', 'head.weight'")
            for old, new in (("block.0.weight", "trunk.0.weight"), ("norm.weight", "norm2.weight")):
                name = "block renamed" if old.startswith("block") else "root submodule renamed"
                _refused(per_rank[f"{name}/{wrap}"], (rank, name), "TreeMismatchError", f"'{old}'", f"'{new}'")
            # a plain Linear set inside the fully_shard-ed block is not FSDP2's (not sharded, not reduced): refused,
            # with that cause (it was refused as a shape mismatch, as if the state came from another world size)
            out = per_rank[f"Linear replaced inside the fully_shard-ed block/{wrap}"]
            _refused(out, rank, "RuntimeError", _UNSHARDED.format("block.2.weight"))
        # the root's own part: plain parameters when only the block is sharded (the new values averaged), FSDP2's
        # when the root is wrapped too (a new LayerNorm there is not FSDP2's: refused, as above)
        _right(per_rank["root submodule replaced/False"], rank)
        _right(per_rank["root parameter replaced/False"], rank)
        _refused(per_rank["root submodule replaced/True"], rank, "RuntimeError", _UNSHARDED.format("norm.weight"))


def test_a_tensor_set_over_an_fsdp2_parameter_is_refused_naming_it(outcomes):
    """FSDP2 puts its own parameter back at the next forward: neither the new tensor nor FSDP2's is what the user
    meant to average, so the reading refuses it instead of averaging FSDP2's old weights."""
    for rank, per_rank in enumerate(outcomes):
        cases = [("parameter set over a managed one in the block", wrap, "'block.0.weight'") for wrap in WRAPS]
        cases.append(("root parameter replaced", True, "'gate'"))
        for name, wrap, param in cases:
            message = _refused(per_rank[f"{name}/{wrap}"], (rank, name, wrap), "RuntimeError", f"parameter {param}")
            assert "after fully_shard" in message and "puts its own sharded parameter back" in message, message


def test_unfreezing_or_sharding_after_the_first_read_is_refused_naming_the_parameter(outcomes):
    for rank, per_rank in enumerate(outcomes):
        for wrap in WRAPS:
            for name in ("frozen parameter unfrozen", "requires_grad_(False) then (True) on the model"):
                _refused(
                    per_rank[f"{name}/{wrap}"], (rank, name), "TreeMismatchError", "not in state.emas[0]: 'frozen'"
                )
        out = per_rank["fully_shard on the root after the first read/False"]
        _refused(out, rank, "TreeMismatchError", "shards['gate'] has shape", "but the EMA (emas[0]) has (3, 5)")


def test_a_plain_parameter_re_shaped_over_its_memory_is_read_again(outcomes):
    """A parameter outside every fully_shard-ed module, re-shaped over the same memory: the reading compared its data
    pointer only, stayed current, and the EMA went on averaging the old extent; now read again, and the state (of
    the old shape) refused, naming it."""
    for rank, per_rank in enumerate(outcomes):
        out = per_rank["root parameter re-shaped over its memory/False"]
        _refused(
            out, rank, "TreeMismatchError", f"shards['gate'] has shape (2, {D}) but the EMA (emas[0]) has (3, {D})"
        )


def test_a_torch_compile_wrapper_is_read_like_the_model(outcomes):
    """``torch.compile(model)`` of a ``fully_shard``-ed root was refused as "a submodule inside a module that torch
    FSDP manages" (the wrapper forwards the flag FSDP2 sets on the modules it manages). It is read as the model it
    compiles, with that model's names (no ``_orig_mod.``), so a state of the bare model steps through the wrapper
    too (it was refused, the names differing)."""
    for rank, per_rank in enumerate(outcomes):
        for wrap in WRAPS:
            for case in ("torch.compile wrapper", "state of the model, then its torch.compile wrapper"):
                out = per_rank[f"{case}/{wrap}"]
                _right(out, (rank, case, wrap))
                assert not any("_orig_mod" in n for n in out["gather"]["names"]), (rank, case, wrap, out)


def test_fully_shard_of_a_torch_compile_wrapper_is_read_as_the_fsdp2_root(outcomes):
    """``fully_shard(torch.compile(model))`` was refused as "a submodule inside a module that FSDP manages": the
    wrapper, itself the FSDP2 root, was taken off. It is read as the root it is, with its names (``_orig_mod.``,
    as its own state_dict), and the EMA, gather_full and swapped equal the plain-torch reference."""
    for rank, per_rank in enumerate(outcomes):
        out = per_rank["fully_shard of the torch.compile wrapper/False"]
        _right(out, (rank, "fully_shard(torch.compile(model))"))
        assert all(n.startswith("_orig_mod.") for n in out["gather"]["names"]), (rank, out)


def test_a_model_sharded_after_a_plain_read_is_read_as_sharded(outcomes):
    """A model first read as a plain module and sharded since: ``local_shards`` crashed inside torch ("invalid python
    storage") reading the DTensors as plain tensors, on every call. Now the model is read as FSDP2 at the first call
    (``fully_shard`` on the root swaps its class; where the class stays, the stale plain reading hands over to the
    FSDP2 adapter), the state made before is refused naming the cause, and a state made anew equals the reference."""
    for rank, per_rank in enumerate(outcomes):
        for how in SHARDED_AFTER:
            out = per_rank[f"plain read, then {how}"]
            assert out["reads"] == [None], (rank, how, out["reads"])
            kind, message = out["old state"]
            assert kind == "TreeMismatchError" and "before the model was sharded (fully_shard" in message, out
            assert out["gather"]["max"] == 0.0, (rank, how, out["gather"])
