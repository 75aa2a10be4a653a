"""Choosing what is averaged: ``local_shards(x, include=..., exclude=...)`` and where the selection travels.

Single process (a plain module): the EMA of the selected names against a plain-torch EMA of those names
(``ref.lerp_(w, 1 - decay)``), the unselected parameters never read nor written (``swapped``, the
controller's ``copy_to_model``), the selection carried by ``init_ema``/``update``/``save``/``load`` and
refused, naming the names, by a load with another selection. Multi-rank (2 ranks, gloo, one launch per
engine): DeepSpeed ZeRO-3 and FSDP2 over a tiny Llama, the EMA of the selection bitwise equal to a plain-torch
EMA of the full fp32 weights, ``swapped`` with the unselected weights live, save/load bitwise, another
selection refused naming the names, and an export with ``--like`` that ``from_pretrained`` loads with the
selected weights the EMA and the others ``--like``'s (bitwise). DeepSpeed MoE (2 ranks, expert parallel 2,
ZeRO-2, one launch): the experts left out, and the experts alone, each bitwise a plain-torch EMA of DeepSpeed's
own full fp32 weights (``safe_get_full_fp32_param``), through ``gather_full``, ``swapped``, save/load and an
offline ``consolidate``, the checkpoint's expert record holding the selected experts only.
"""

from __future__ import annotations

import copy
import fnmatch
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import functional_ema as fe
from functional_ema._testing.multirank import run_ranks
from functional_ema.integrations._common import EMAController

DECAY = 0.75  # large steps: a missed or wrong update shows in every element
STEPS = 3


# ------------------------------------------------------------------------------------ one process


class EncDec(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6))
        self.dec = nn.Linear(6, 3)
        self.frozen = nn.Parameter(torch.randn(4), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(x)) + self.frozen.sum()


def _train(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    loss = model(torch.randn(8, 5, generator=g)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _live(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


SELECTED = ["enc.0.weight", "enc.2.weight"]  # include="enc.*", exclude="*.bias"


def test_plain_module_selection_is_a_plain_ema_of_those_names(tmp_path):
    torch.manual_seed(0)
    model = EncDec()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    shards = fe.local_shards(model, include="enc.*", exclude="*.bias")
    assert list(shards) == SELECTED and shards.selection is not None
    assert fe.local_shards(model, include="enc.*", exclude="*.bias") is shards  # cached: one object every step
    pred = lambda n: n.startswith("enc.") and n.endswith("weight")  # noqa: E731 - the same object every call
    by_pred = fe.local_shards(model, include=pred)
    assert list(by_pred) == SELECTED and fe.local_shards(model, include=pred) is by_pred

    class Rule:
        def keep(self, name: str) -> bool:
            return name in SELECTED

    rule = Rule()  # rule.keep is a new bound method at every access, equal to the last: the cache still hits
    assert fe.local_shards(model, include=rule.keep) is fe.local_shards(model, include=rule.keep)
    state = fe.init_ema(shards)
    ref = {n: p.detach().clone() for n, p in model.named_parameters() if n in SELECTED}
    for step in range(1, STEPS + 1):
        _train(model, opt, step)
        state = fe.update(state, fe.local_shards(model, include="enc.*", exclude="*.bias"), step, decay=DECAY)
        for n in SELECTED:
            ref[n].lerp_(dict(model.named_parameters())[n].detach(), 1 - DECAY)
    info = fe.update_info(state, fe.local_shards(model, include="enc.*", exclude="*.bias"))
    assert info.fused and info.reused
    assert list(state.ema) == SELECTED and state.ema.selection == shards.selection
    assert all(torch.equal(state.ema[n], ref[n]) for n in SELECTED)  # bitwise: the same lerp_ per element
    assert sorted(fe.gather_full(state, model)) == sorted(SELECTED)

    # swapped: the selected parameters compute with the EMA, every other one stays live; all back on exit
    live = _live(model)
    with fe.swapped(model, state) as stats, torch.no_grad():
        inside = _live(model)
    assert stats.swapped_params == len(SELECTED)
    for n, t in inside.items():
        assert torch.equal(t, ref[n] if n in SELECTED else live[n]), n
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())

    # save / load: the selection is recorded, the same selection loads bitwise, another is refused naming names
    fe.save(state, model, tmp_path / "ck", "t")
    manifest = json.loads((tmp_path / "ck" / "t" / "ema_manifest.json").read_text())
    assert manifest["selection"] == {"include": ["enc.*"], "exclude": ["*.bias"]}
    assert list(manifest["params"]) == SELECTED
    back = fe.load(model, tmp_path / "ck", "t", include="enc.*", exclude="*.bias")
    assert all(torch.equal(back.ema[n], state.ema[n]) for n in SELECTED)
    assert back.ema.selection == shards.selection
    assert fe.update_info(back, fe.local_shards(model, include="enc.*", exclude="*.bias")).fused
    into = fe.load(model, tmp_path / "ck", "t", out=fe.init_ema(shards))  # the selection of out=
    assert all(torch.equal(into.ema[n], state.ema[n]) for n in SELECTED)
    with pytest.raises(fe.CheckpointError) as e:
        fe.load(model, tmp_path / "ck", "t")  # every parameter: the biases and the decoder are not saved
    assert "include='enc.*', exclude='*.bias'" in str(e.value) and "'dec.weight'" in str(e.value)
    assert "selected by this load but not in the checkpoint" in str(e.value)
    with pytest.raises(fe.CheckpointError) as e:
        fe.load(model, tmp_path / "ck", "t", include="enc.0.*", exclude="*.bias")
    assert "saved but not selected by this load: 'enc.2.weight'" in str(e.value)
    sd = fe.dcp.EMAStateful(model, state).state_dict()  # torch.distributed.checkpoint: the selection's names
    assert sorted(sd["emas"]["0"]) == sorted(SELECTED)
    fresh = fe.init_ema(shards)
    fe.dcp.EMAStateful(model, fresh).load_state_dict(sd)
    assert all(torch.equal(fresh.ema[n], state.ema[n]) for n in SELECTED)
    saver = fe.AsyncSaver()  # the background save records the selection too
    saver.save(state, model, tmp_path / "ck", "async")
    saver.wait()
    saver.close()
    assert (
        json.loads((tmp_path / "ck" / "async" / "ema_manifest.json").read_text())["selection"] == manifest["selection"]
    )
    again = fe.load(model, tmp_path / "ck", "async", include="enc.*", exclude="*.bias")
    assert all(torch.equal(again.ema[n], state.ema[n]) for n in SELECTED)
    full = fe.save(fe.init_ema(fe.local_shards(model)), model, tmp_path / "ck", "all")
    with pytest.raises(fe.CheckpointError) as e:  # a full checkpoint loaded as a selection
        fe.load(model, full.parent, "all", include="enc.*", exclude="*.bias")
    assert "of every parameter" in str(e.value) and "'enc.0.bias'" in str(e.value)


def test_unselected_parameters_are_never_touched():
    """The selection's EMA holds no view of the others, and the controller's copy into the model leaves them
    with their trained values while the selected ones get the EMA (bitwise)."""
    torch.manual_seed(1)
    model = EncDec()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    ctrl = EMAController(DECAY, include=["enc.*"], exclude=lambda n: n.endswith("bias"))
    ref: dict[str, torch.Tensor] = {}
    for step in range(1, STEPS + 1):
        _train(model, opt, step)
        assert ctrl.on_step(model, step)
        for n, p in model.named_parameters():
            if n in SELECTED:
                ref[n] = p.detach().clone() if n not in ref else ref[n].lerp_(p.detach(), 1 - DECAY)
    assert ctrl.state is not None and list(ctrl.state.ema) == SELECTED
    others = {n: p.data_ptr() for n, p in model.named_parameters() if n not in SELECTED}
    views = {
        t.untyped_storage().data_ptr() for t in fe.local_shards(model, include=["enc.*"], exclude="*.bias").values()
    }
    assert not views & set(others.values())  # no view of an unselected parameter's memory
    trained = _live(model)
    ctrl.copy_to_model(model)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), ref[n] if n in SELECTED else trained[n]), n


def test_diffusers_drop_in_averages_the_selection_only():
    """``EMAModel(..., include=, exclude=)``: the selected positions are diffusers' EMA (its decay rule, one lerp_
    per step), the others are live values everywhere (``state_dict``, ``copy_to`` after ``store``)."""
    from functional_ema.integrations.diffusers import EMAModel

    torch.manual_seed(2)
    model = EncDec()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    ema = EMAModel(model.parameters(), decay=0.9, include="enc.*", exclude="*.bias")
    names = [n for n, _ in model.named_parameters()]
    ref = {n: p.detach().clone() for n, p in model.named_parameters() if n in SELECTED}
    for step in range(1, STEPS + 2):
        _train(model, opt, step)
        ema.step(model.parameters())
        d = ema.get_decay(step)
        for n, p in model.named_parameters():
            if n in SELECTED:
                ref[n].lerp_(p.detach(), 1 - d)
    assert ema.state is not None and list(ema.state.ema) == SELECTED
    live = _live(model)
    shadow = dict(zip(names, ema.state_dict()["shadow_params"]))
    for n in names:
        assert torch.equal(shadow[n], ref[n] if n in SELECTED else live[n]), n
    ema.store(model.parameters())
    ema.copy_to(model.parameters())
    inside = _live(model)
    ema.restore(model.parameters())
    for n in names:
        assert torch.equal(inside[n], ref[n] if n in SELECTED else live[n]), n
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    with pytest.raises(ValueError, match=r"include pattern 'unet\.\*' matches none"):
        EMAModel(model.parameters(), include="unet.*").step(model.parameters())


def test_hf_trainer_callback_with_a_selection(tmp_path):
    """``EMACallback(include=, exclude=)`` in a one-process Trainer: the EMA holds the selection only (equal to a
    plain EMA of the weights after each step), the Trainer's EMA evaluation computes with the selected weights
    averaged and the others live (a copy loaded so, evaluated here), and the export file holds the selection."""
    from safetensors import safe_open
    from transformers import Trainer, TrainerCallback

    from functional_ema.integrations.transformers import EMACallback
    from tests._integration_models import BNNet, RegressionData, cpu_training_args, quiet

    quiet()
    picked = ["inp.weight", "mid.weight"]
    ref: dict[str, torch.Tensor] = {}

    class Reference(TrainerCallback):  # after the EMA callback's own on_step_end: the weights of that step
        def on_step_end(self, args, state, control, model=None, **kw):
            for n, p in model.named_parameters():
                if n in picked:
                    ref[n] = p.detach().clone() if n not in ref else ref[n].lerp_(p.detach(), 0.5)

    ema = EMACallback(decay=0.5, include=["inp.*", "mid.*"], exclude="*.bias", export_path=tmp_path / "ema.safetensors")
    args = cpu_training_args(tmp_path / "out", max_steps=4)
    torch.manual_seed(0)
    data = RegressionData(32, seed=2)
    trainer = Trainer(model=BNNet(), args=args, train_dataset=RegressionData(64, seed=1), callbacks=[ema, Reference()])
    trainer.train()
    state = ema.ema.state
    assert state is not None and list(state.ema) == picked
    assert all(torch.equal(state.ema[n], ref[n]) for n in picked)
    got = trainer.evaluate(data)["eval_ema_loss"]
    net = copy.deepcopy(trainer.model)
    net.load_state_dict({n: ref[n] for n in picked}, strict=False)  # the others: the live weights
    net.eval()
    with torch.no_grad():
        want = net(x=data.x, labels=data.y)["loss"].item()
    assert got == pytest.approx(want, rel=1e-6, abs=0)
    with safe_open(str(tmp_path / "ema.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(picked)
        assert json.loads(f.metadata()["selection"]) == {"include": ["inp.*", "mid.*"], "exclude": ["*.bias"]}


def test_controller_refuses_a_selection_of_no_name_at_the_first_update():
    model = EncDec()
    ctrl = EMAController(DECAY, include="encoder.*")  # the types are checked here; the names with the model
    with pytest.raises(
        ValueError, match=r"include pattern 'encoder\.\*' matches none of the 7 parameter names of the model"
    ):
        ctrl.on_step(model, 1)
    assert ctrl.state is None
    with pytest.raises(TypeError, match="exclude must be"):
        EMAController(DECAY, exclude=3)


def test_a_wrapper_prefix_in_a_pattern_is_named():
    """Names are read from the wrapped module: a pattern with DDP's ``module.`` or torch.compile's ``_orig_mod.``
    prefix (what the wrapper's ``named_parameters()`` lists) matches nothing. The refusal pointed at
    ``model.named_parameters()``, which lists the prefixed names; it now names the pattern to write and the inner
    module's names. A pattern without the prefix keeps the general hint."""
    model = EncDec()
    compiled = torch.compile(model)  # wrapped only: nothing is compiled before a forward
    assert next(n for n, _ in compiled.named_parameters()).startswith("_orig_mod.")
    for x, kwargs, inner in (
        (compiled, {"include": "_orig_mod.enc.*"}, "enc.*"),
        (model, {"exclude": "module.dec.*"}, "dec.*"),  # as DDP(model).named_parameters() spells it
    ):
        with pytest.raises(ValueError) as e:
            fe.local_shards(x, **kwargs)
        msg = str(e.value)
        assert f"write {inner!r}" in msg and "model.module.named_parameters()" in msg, msg
        assert "[n for n, _ in model.named_parameters()]" not in msg, msg
    with pytest.raises(ValueError, match=r"Check the names with \[n for n, _ in model\.named_parameters\(\)\]$"):
        fe.local_shards(model, include="encoder.*")


def test_the_wrapper_prefix_hint_only_where_the_rest_names_a_parameter():
    """A model with a submodule of its own called ``module``: its names start with ``module.``, so a typo there
    (``"module.weigth"``) is no wrapper prefix. The hint said "write 'weigth'" (and "write ''" for ``"module."``);
    it is given now only where the pattern without the prefix matches a parameter name."""

    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.head = nn.Linear(2, 2)

    model = Holder()
    for pattern in ("module.weigth", "module.", "_orig_mod.module.weigth"):
        with pytest.raises(ValueError) as e:
            fe.local_shards(model, exclude=pattern)
        msg = str(e.value)
        assert "wrapped module's" not in msg and "write " not in msg, msg
        assert msg.endswith("Check the names with [n for n, _ in model.named_parameters()]"), msg
    with pytest.raises(ValueError, match=r"write 'head\.weight'"):  # the rest names a parameter: the hint
        fe.local_shards(model, exclude="module.head.weight")


def test_patterns_that_name_frozen_parameters_or_tied_aliases(tmp_path):
    """A pattern is checked against every parameter name of the model, not only those read. One that names a
    parameter frozen later (``exclude="enc.*"``, the encoder frozen at step 2) was refused as a typo by the resume
    ("matches none of the parameters read"), so a run that followed docs/core.md ("freezing a parameter later ... the
    run goes on") could not be resumed; now the resume is accepted and equals the uninterrupted run (and the
    plain-torch EMA of the selected names). One that names only a tied alias selects nothing and is refused, naming
    the name the tensor is read under."""
    torch.manual_seed(0)
    model = EncDec()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.3)
    ctrl, ref = EMAController(DECAY, exclude="enc.*"), None
    for step in range(1, 6):
        if step == 2:
            model.enc.requires_grad_(False)  # frozen later: its EMA would go on at its constant value, were it in
        if step == 4:  # resume here, into a model frozen as it was at the save
            ctrl.save(model, tmp_path / "ck", 3)
            fresh = EncDec()
            fresh.enc.requires_grad_(False)
            fresh.load_state_dict(model.state_dict())
            resumed = EMAController(DECAY, exclude="enc.*")
            resumed.load(fresh, tmp_path / "ck", framework_step=3)
            fresh_opt = torch.optim.SGD([p for n, p in fresh.named_parameters() if n != "frozen"], lr=0.3)
            fresh_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        _train(model, opt, step)
        ctrl.on_step(model, step)
        live = _live(model)
        ref = (
            {"dec.weight": live["dec.weight"], "dec.bias": live["dec.bias"]}
            if ref is None
            else {n: r.lerp(live[n], 1 - DECAY) for n, r in ref.items()}
        )
        if step >= 4:
            _train(fresh, fresh_opt, step)
            resumed.on_step(fresh, step)
    assert sorted(ctrl.state.ema) == sorted(ref) == sorted(resumed.state.ema)
    assert all(torch.equal(ctrl.state.ema[n], t) and torch.equal(resumed.state.ema[n], t) for n, t in ref.items())

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.out = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
            self.out.weight = self.emb.weight
            self.head = nn.Linear(3, 2)

    tied = Tied()
    for kw in ({"exclude": "out.weight"}, {"include": ["head.*", "out.*"]}):
        with pytest.raises(
            ValueError,
            match=r"pattern 'out\.(weight|\*)' matches only tied aliases \('out\.weight' "
            r"of 'emb\.weight'\).*Name it by that name",
        ):
            fe.local_shards(tied, **kw)
    assert list(fe.local_shards(tied, exclude="emb.weight")) == ["head.weight", "head.bias"]  # its first name
    # a pattern that names a frozen parameter selects it once it trains: no typo
    tied = Tied()
    tied.head.requires_grad_(False)  # before the first read: not read
    assert list(fe.local_shards(tied, include=["emb.*", "head.*"])) == ["emb.weight"]
    with pytest.raises(ValueError, match=r"'nope\.\*' matches none of the 4 parameter names of the model"):
        fe.local_shards(tied, include="nope.*")


def test_a_pattern_naming_a_tied_alias_next_to_other_names_is_not_overruled_silently():
    """``include="head.*"`` with ``head.weight`` tied to ``emb.weight`` selected only ``head.bias``: the tied weight
    is read once, as ``emb.weight``, so the pattern's hit on ``head.weight`` was dropped and the head's weight stayed
    live under swapped and export; ``exclude="head.*"`` kept it averaged. Both are refused now, naming the alias and
    its first name; naming the first name decides for both (``exclude="emb.*"``: a tied head is left out too)."""

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.mid, self.head = nn.Embedding(5, 3), nn.Linear(3, 3), nn.Linear(3, 5)
            self.head.weight = self.emb.weight

    tied = Tied()
    alias = r"'head\.weight', a tied alias of 'emb\.weight'.*Name the parameter by 'emb\.weight'"
    for kw in ({"include": "head.*"}, {"include": lambda n: n.startswith("head.")}):
        with pytest.raises(ValueError, match=rf"include .* selects {alias}"):
            fe.local_shards(tied, **kw)
    with pytest.raises(ValueError, match=rf"exclude .* leaves out {alias}"):
        fe.local_shards(tied, exclude="head.*")
    assert list(fe.local_shards(tied, exclude="emb.*")) == ["mid.weight", "mid.bias", "head.bias"]
    assert list(fe.local_shards(tied, include=["head.*", "emb.*"])) == ["emb.weight", "head.bias"]
    assert list(fe.local_shards(tied, exclude=["head.*", "emb.*"])) == ["mid.weight", "mid.bias"]
    # an include spelled out does not overrule an exclude of the first name (exclude wins, and decides for both)
    for include in ("*", "*.weight", ["head.*", "mid.*"]):
        assert "emb.weight" not in fe.local_shards(tied, include=include, exclude="emb.*"), include


def test_brackets_that_spell_a_parameter_name_are_refused_with_the_escape():
    """``[...]`` is a set of characters in a shell-style pattern: ``include="a[0].weight"`` for a ``ModuleDict`` entry
    named ``"a[0]"`` selected ``a0.weight`` instead, without a word. A pattern whose brackets, read literally, spell
    names it does not match is refused, naming both and the escaped form; the escaped form selects the name."""
    model = nn.ModuleDict({"a[0]": nn.Linear(2, 2), "a0": nn.Linear(2, 2), "b": nn.Linear(2, 2)})
    with pytest.raises(ValueError, match=r"matches 'a0\.weight', not 'a\[0\]\.weight'.*'a\[\[\]0\]\.weight'"):
        fe.local_shards(model, include="a[0].weight")
    with pytest.raises(ValueError, match=r"exclude pattern 'a\[0\]\.\*'.*'a\[\[\]0\]\.\*'"):
        fe.local_shards(model, exclude="a[0].*")
    assert list(fe.local_shards(model, include="a[[]0].weight")) == ["a[0].weight"]
    assert list(fe.local_shards(model, include="a[01].*")) == ["a0.weight", "a0.bias"]  # a set, as documented
    with pytest.raises(ValueError, match=r"matches none.*write a literal '\[' as '\[\[\]'"):
        fe.local_shards(model, include="b[x].weight")


def test_another_selection_is_named_as_the_cause(tmp_path):
    """A state, checkpoint or ``out=`` of one selection used with another: each refusal names both selections; none
    blames freezing or unfreezing (they did, though nothing here is frozen), and the controller's resume hint about
    unfreezing is not added."""
    model = EncDec()
    model.frozen.requires_grad_(True)  # nothing frozen
    state = fe.init_ema(fe.local_shards(model, include="dec.*"))
    with pytest.raises(fe.TreeMismatchError) as e:
        fe.update(state, fe.local_shards(model), 1, decay=DECAY)
    assert (
        "the state was made from the selection include='dec.*', exclude=None, and these shards are of every "
        "parameter (no include/exclude)"
        in str(e.value)
        and "frozen then" not in str(e.value)
    ), str(e.value)
    c = EMAController(DECAY, include="dec.*")
    c.on_step(model, 1)
    c.save(model, tmp_path / "c", 1)
    with pytest.raises(fe.CheckpointError) as e:
        EMAController(DECAY).load(model, tmp_path / "c", framework_step=1)
    assert "was saved with the selection include='dec.*'" in str(e.value)
    assert "resume with them frozen" not in str(e.value), str(e.value)
    fe.save(c.state, model, tmp_path / "f", "t")
    with pytest.raises(fe.CheckpointError) as e:
        fe.load(model, tmp_path / "f", "t", out=fe.init_ema(fe.local_shards(model)), include="dec.*")
    assert (
        "which this reading does not hold (the state was made from every parameter (no include/exclude), and "
        "these shards are of the selection include='dec.*'"
        in str(e.value)
        and "(frozen here" not in str(e.value)
    )


def test_a_load_that_re_cuts_parts_needs_the_saved_selection():
    """A load into another model-parallel layout (another pipeline partitioning or stage count) takes this rank's
    names from the joined saved parts, so its names always match: the selection records are compared instead. The
    same selection loads; a narrower one, or none where the save had one, is refused naming both (it would drop EMAs
    silently: manually checked end to end on a 2-stage DeepSpeed pipeline saved with exclude='*.bias', re-partitioned).
    """
    from functional_ema._selection import check_recut_selection, make_selection

    saved = {"include": None, "exclude": ["*.bias"]}
    check_recut_selection("tag 't'", saved, make_selection(None, "*.bias"))
    check_recut_selection("tag 't'", None, None)
    check_recut_selection("tag 't'", {"include": None, "exclude": ["b*", "a*"]}, make_selection(None, ["a*", "b*"]))
    for selection, shown in (
        (make_selection(None, ["*.bias", "0.*"]), "include=None, exclude=['*.bias', '0.*']"),
        (None, "every parameter (no include/exclude)"),
    ):
        with pytest.raises(fe.CheckpointError) as e:
            check_recut_selection("tag 't'", saved, selection)
        assert str(e.value).startswith(
            f"tag 't' was saved with the selection include=None, exclude='*.bias', and this load selects {shown}; a "
            "load into another model-parallel layout (the saved parts joined and re-cut) needs the selection"
        ), str(e.value)
    with pytest.raises(fe.CheckpointError, match="saved with the selection of every parameter"):
        check_recut_selection("tag 't'", None, make_selection("dec.*", None))


def test_selection_record_is_validated(tmp_path):
    model = EncDec()
    fe.save(fe.init_ema(fe.local_shards(model, include="dec.*")), model, tmp_path, "t")
    path = tmp_path / "t" / "ema_manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["selection"] == {"include": ["dec.*"], "exclude": None}
    path.write_text(json.dumps(dict(manifest, selection={"include": [3], "exclude": None})))
    with pytest.raises(fe.CheckpointError, match="selection"):
        fe.checkpoint.read_manifest(tmp_path, "t")


# ------------------------------------------------------------------------------------- multi-rank

INCLUDE = ["model.layers.*", "lm_head.weight"]
EXCLUDE = "*.mlp.*"  # wins over include: the MLPs of the layers are left out


def _selected(names: list[str]) -> list[str]:
    inc = [n for n in names if any(fnmatch.fnmatchcase(n, p) for p in INCLUDE)]
    return [n for n in inc if not fnmatch.fnmatchcase(n, EXCLUDE)]


def _tokens(step: int, rank: int) -> torch.Tensor:
    return torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


def selection_worker(engine: str, root: str) -> dict:
    """One engine at 2 ranks: train, EMA a selection, check it against a full-weight reference, swap, save,
    load, refuse another selection; rank 0 writes the reference EMA and the ``--like`` folder for the parent."""
    import torch.distributed as dist
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from tests._integration_models import quiet_hf, tiny_llama_config

    quiet_hf()
    rank = dist.get_rank()
    out = Path(root)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    if rank == 0:
        model.save_pretrained(out / "like")  # the --like folder: the initial weights
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    x, step_fn, full_fp32, forward_weights = _engine(engine, model)
    sel = _selected(names)
    shards = fe.local_shards(x, include=INCLUDE, exclude=EXCLUDE)
    res: dict = {
        "names_ok": list(shards) == sel,
        "same_object": fe.local_shards(x, include=INCLUDE, exclude=EXCLUDE) is shards,
    }
    state = fe.init_ema(shards)
    ref = {n: t.clone() for n, t in full_fp32().items() if n in sel}
    for step in range(1, STEPS + 1):
        step_fn(step)
        state = fe.update(state, fe.local_shards(x, include=INCLUDE, exclude=EXCLUDE), step, decay=DECAY)
        full = full_fp32()
        for n in sel:
            ref[n].lerp_(full[n], 1 - DECAY)
    info = fe.update_info(state, fe.local_shards(x, include=INCLUDE, exclude=EXCLUDE))
    res["fused_reused"] = info.fused and info.reused
    gathered = fe.gather_full(state, x)
    res["ema_bitwise"] = sorted(gathered) == sorted(sel) and all(torch.equal(gathered[n], ref[n]) for n in sel)

    live = forward_weights(names)
    with fe.swapped(x, state), torch.no_grad():
        inside = forward_weights(names)
    after = forward_weights(names)
    res["swap_selected_ema"] = all(torch.equal(inside[n].float(), ref[n].to(inside[n].dtype).float()) for n in sel)
    res["swap_others_live"] = all(torch.equal(inside[n], live[n]) for n in names if n not in sel)
    res["swap_restored"] = all(torch.equal(after[n], live[n]) for n in names)

    fe.save(state, x, out / "ck", "sel")
    back = fe.load(x, out / "ck", "sel", include=INCLUDE, exclude=EXCLUDE)
    res["load_bitwise"] = all(torch.equal(back.ema[n], state.ema[n]) for n in sel)
    res["load_fused"] = fe.update_info(back, fe.local_shards(x, include=INCLUDE, exclude=EXCLUDE)).fused
    res["refusals"] = []
    for kw in ({}, {"include": INCLUDE}):  # every parameter; the MLPs not excluded
        try:
            fe.load(x, out / "ck", "sel", **kw)
            res["refusals"].append(None)
        except fe.CheckpointError as e:
            res["refusals"].append(str(e))
    if engine == "fsdp2":  # in the same launch: a pipeline stage per rank (its adapter wraps the module's)
        res["pipeline_stage"] = _pipeline_stage_check(rank)
    if rank == 0:
        save_file({n: t.contiguous() for n, t in ref.items()}, str(out / "ref.safetensors"))
    dist.barrier()
    return res


def _pipeline_stage_check(rank: int) -> bool:
    """A ``torch.distributed.pipelining`` stage (stage ``rank`` of 2, a plain module): the selection's EMA swaps
    in and copies into the stage's module for the selected parameters only."""
    from torch.distributed.pipelining import PipelineStage

    torch.manual_seed(rank)
    mod = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 4))
    stage = PipelineStage(mod, rank, 2, torch.device("cpu"))
    sel = {"exclude": "*.bias"}
    state = fe.init_ema(fe.local_shards(stage, **sel))
    before = _live(mod)
    with torch.no_grad():
        for p in mod.parameters():
            p.add_(1.0)
    state = fe.update(state, fe.local_shards(stage, **sel), 1, decay=DECAY)
    want = {n: before[n].lerp(p.detach(), 1 - DECAY) for n, p in mod.named_parameters() if "weight" in n}
    live = _live(mod)
    with fe.swapped(stage, state), torch.no_grad():
        inside = _live(mod)
    ctrl = EMAController(DECAY)
    ctrl.state = state
    ctrl.copy_to_model(stage)
    return (
        list(state.ema) == ["0.weight", "2.weight"]
        and all(torch.equal(inside[n], want[n] if n in want else live[n]) for n in live)
        and all(torch.equal(p.detach(), want[n] if n in want else live[n]) for n, p in mod.named_parameters())
    )


def _engine(engine: str, model: nn.Module):
    """(the object the verbs take, a training step, the full fp32 weights, the forward's full weights)."""
    import torch.distributed as dist

    rank = dist.get_rank()

    def loss_of(m, step: int) -> torch.Tensor:
        ids = _tokens(step, rank)
        return m(input_ids=ids, labels=ids).loss

    if engine == "zero3":
        import deepspeed

        from functional_ema._testing.multirank import ds_config
        from functional_ema._testing.multirank import forward_weights as ds_forward
        from tests._integration_models import deepspeed_full_fp32

        opt = torch.optim.AdamW(model.parameters(), lr=3e-2)
        eng, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config(3, micro_batch=2))

        def ds_step(step: int) -> None:
            eng.backward(loss_of(eng, step))
            eng.step()

        return eng, ds_step, lambda: deepspeed_full_fp32(eng), lambda names: ds_forward(eng, names)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-2)

    def fsdp_step(step: int) -> None:
        loss_of(model, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def full() -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}

    return model, fsdp_step, full, lambda names: {n: t for n, t in full().items() if n in names}


@pytest.mark.parametrize("engine", ["zero3", "fsdp2"])
def test_selection_multirank(engine, tmp_path):
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    results = run_ranks(
        "tests.test_selection:selection_worker", world_size=2, timeout=600, engine=engine, root=str(tmp_path)
    )
    for rank, r in enumerate(results):
        checks = {k: v for k, v in r.items() if k != "refusals"}
        assert all(checks.values()), (rank, checks)
        every, no_exclude = r["refusals"]
        assert every is not None and "exclude='*.mlp.*'" in every and "'model.embed_tokens.weight'" in every, every
        assert no_exclude is not None and "'model.layers.0.mlp.gate_proj.weight'" in no_exclude, no_exclude

    # The export: the selected weights are the EMA, the others --like's (the initial weights), bitwise.
    out = fe.export.to_hf(tmp_path / "ck", tmp_path / "hf", like=tmp_path / "like", tag="sel")
    ref = load_file(str(tmp_path / "ref.safetensors"))
    like = LlamaForCausalLM.from_pretrained(tmp_path / "like").state_dict()
    got = LlamaForCausalLM.from_pretrained(out).state_dict()
    assert sorted(ref) == sorted(_selected(list(like)))
    for n, t in got.items():
        assert torch.equal(t, ref[n] if n in ref else like[n]), n
    record = json.loads((out / "ema_export.json").read_text())
    assert record["selection"] == {"include": INCLUDE, "exclude": [EXCLUDE]}
    assert sorted(record["copied_from_like"]) == sorted(n for n in like if n not in ref)


# ------------------------------------------------------------------ DeepSpeed MoE (expert parallelism)

#: The two selections of the MoE case: the experts left out, and the experts alone.
MOE_SELECTIONS: dict[str, dict[str, str]] = {
    "no_experts": {"exclude": "*experts*"},
    "experts": {"include": "*experts*"},
}


def _moe_picked(selection: str, name: str) -> bool:
    """The test's own reading of :data:`MOE_SELECTIONS` (independent of the library's)."""
    expert = fnmatch.fnmatchcase(name, "*experts*")
    return expert if selection == "experts" else not expert


def moe_selection_worker(root: str) -> dict:
    """2 ranks, DeepSpeed MoE with expert parallel 2 on ZeRO-2 (each expert whole on its owner, the other
    parameters cut over both ranks): both selections averaged side by side over the same training, each checked
    against DeepSpeed's own full fp32 weights (global expert names, the test's renaming), swapped, saved,
    loaded; each rank writes its reference EMAs for the parent's offline ``consolidate``."""
    import torch.distributed as dist
    from deepspeed.utils import groups
    from safetensors.torch import save_file

    from tests._integration_models import quiet
    from tests.test_model_parallel import NUM_EXPERTS, _global_name, _moe_engine, _moe_reference, _moe_train

    quiet()
    rank, out = dist.get_rank(), Path(root)
    engine = _moe_engine(2, seed=3)
    ep = groups._get_expert_parallel_rank("ep_size_2")
    glob = {n: _global_name(n, ep, NUM_EXPERTS // 2) for n, _ in engine.module.named_parameters()}
    states = {k: fe.init_ema(fe.local_shards(engine, **sel)) for k, sel in MOE_SELECTIONS.items()}
    full = _moe_reference(engine)  # this rank's experts and every other parameter, by global name
    refs = {k: {n: t.clone() for n, t in full.items() if _moe_picked(k, n)} for k in MOE_SELECTIONS}
    for step in range(1, STEPS + 1):
        _moe_train(engine, step)
        for k, sel in MOE_SELECTIONS.items():
            states[k] = fe.update(states[k], fe.local_shards(engine, **sel), step, decay=DECAY)
        full = _moe_reference(engine)
        for ref in refs.values():
            for n, t in ref.items():
                t.lerp_(full[n], 1 - DECAY)
    res: dict = {"ep": ep, "names": sorted(full)}
    for k, sel in MOE_SELECTIONS.items():
        res[k] = _moe_selection_checks(engine, k, sel, states[k], refs[k], glob, out)
        save_file({n: t.contiguous() for n, t in refs[k].items()}, str(out / f"{k}_ref{rank}.safetensors"))
    for k in MOE_SELECTIONS:  # last: it changes the weights. The EMA into the masters and module, the others kept
        live = _moe_reference(engine)
        ctrl = EMAController(DECAY)
        ctrl.state = states[k]
        ctrl.copy_to_model(engine)
        masters = _moe_reference(engine)
        module = {glob[n]: p.detach() for n, p in engine.module.named_parameters()}
        res[f"{k}_copied"] = all(
            torch.equal(masters[n], refs[k][n] if _moe_picked(k, n) else live[n]) and torch.equal(module[n], masters[n])
            for n in live
        )
    # expert-parallel size 1 (every rank holds all 4 experts): the EMA without experts loads as saved (its pieces
    # do not depend on how experts are placed); the experts' is refused, naming the expert-parallel sizes
    other = _moe_engine(1, seed=5)
    back = fe.gather_full(fe.load(other, out / "no_experts", "t", **MOE_SELECTIONS["no_experts"]), other)
    res["ep1_no_experts"] = sorted(back) == sorted(refs["no_experts"]) and all(
        torch.equal(back[n], t) for n, t in refs["no_experts"].items()
    )
    try:
        fe.load(other, out / "experts", "t", **MOE_SELECTIONS["experts"])
        res["ep1_experts_refused"] = None
    except fe.CheckpointError as e:
        res["ep1_experts_refused"] = str(e)
    dist.barrier()
    return res


def _moe_selection_checks(engine, key: str, sel: dict, state, ref: dict, glob: dict, out: Path) -> dict:
    """One selection's verbs on the MoE engine, each against ``ref`` (this rank's plain-torch EMAs by global
    name: the other parameters, and the experts this rank owns) and the live weights."""
    shards = fe.local_shards(engine, **sel)
    res: dict = {"shards": list(shards), "fused": fe.update_info(state, shards).fused}
    gathered = fe.gather_full(state, engine)
    res["gathered"] = sorted(gathered)
    res["gather_bitwise"] = all(torch.equal(gathered[n], t) for n, t in ref.items())
    live = {glob[n]: p.detach().clone() for n, p in engine.module.named_parameters()}
    with fe.swapped(engine, state), torch.no_grad():
        inside = {glob[n]: p.detach().clone() for n, p in engine.module.named_parameters()}
    after = {glob[n]: p.detach().clone() for n, p in engine.module.named_parameters()}
    res["swap_selected_ema"] = all(torch.equal(inside[n], ref[n]) for n in ref)
    res["swap_others_live"] = all(torch.equal(inside[n], live[n]) for n in live if not _moe_picked(key, n))
    res["swap_restored"] = all(torch.equal(after[n], live[n]) for n in live)
    res["ema_not_live"] = all(not torch.equal(ref[n], live[n]) for n in ref)  # so the swap checks tell them apart
    fe.save(state, engine, out / key, "t")
    fresh = fe.init_ema(shards)  # the current weights, overwritten by the load
    for kind, back in (
        ("load", fe.load(engine, out / key, "t", **sel)),
        ("load_out", fe.load(engine, out / key, "t", out=fresh)),
    ):
        res[kind] = list(back.ema) == list(state.ema) and all(torch.equal(back.ema[n], state.ema[n]) for n in state.ema)
    other = next(s for k, s in MOE_SELECTIONS.items() if k != key)
    try:
        fe.load(engine, out / key, "t", **other)
        res["other_refused"] = None
    except fe.CheckpointError as e:
        res["other_refused"] = [type(e).__name__, str(e)]
    return res


def test_selection_deepspeed_moe(tmp_path):
    """DeepSpeed MoE with a selection: the experts left out, or the experts alone. Every verb bitwise against a
    plain-torch EMA of DeepSpeed's full fp32 weights (each expert checked on the rank that owns it, the union
    covering every selected name); the manifest's expert record lists the selected experts only; offline
    ``consolidate`` of each checkpoint is the selected EMA."""
    from safetensors.torch import load_file

    from tests.test_model_parallel import _EXPERTS, NUM_EXPERTS

    results = run_ranks("tests.test_selection:moe_selection_worker", world_size=2, timeout=600, root=str(tmp_path))
    experts = sorted(f"{_EXPERTS}{g}.{w}" for g in range(NUM_EXPERTS) for w in ("weight", "bias"))
    every = sorted(set(results[0]["names"]) | set(results[1]["names"]))
    assert set(experts) <= set(every) and sorted(r["ep"] for r in results) == [0, 1]
    for r in results:
        assert r["ep1_no_experts"] and r["no_experts_copied"] and r["experts_copied"], r
        refused = r["ep1_experts_refused"]
        assert refused is not None and "expert-parallel size (ep_size) 2" in refused and "size 1" in refused, refused
    for key, sel in MOE_SELECTIONS.items():
        want = [n for n in every if _moe_picked(key, n)]
        assert want and (want == experts) == (key == "experts"), want
        for rank, r in enumerate(results):
            got = r[key]
            assert sorted(got["shards"]) == want and got["gathered"] == want, (key, rank, got)
            checks = {c: v for c, v in got.items() if c not in ("shards", "gathered", "other_refused")}
            assert all(checks.values()), (key, rank, checks)
            # refused before a byte is read, by the names that differ (checked before the expert record)
            assert got["other_refused"] is not None and got["other_refused"][0] == "CheckpointMismatchError", got
            assert "was saved with the selection" in got["other_refused"][1], got["other_refused"]
            assert "the names differ" in got["other_refused"][1], got["other_refused"]
        ref = {
            **load_file(str(tmp_path / f"{key}_ref0.safetensors")),
            **load_file(str(tmp_path / f"{key}_ref1.safetensors")),
        }
        assert sorted(ref) == want  # the owners' references cover every selected name
        full = fe.consolidate(tmp_path / key, "t")
        assert sorted(full) == want and all(torch.equal(full[n], ref[n]) for n in want), key
        manifest = fe.checkpoint.read_manifest(tmp_path / key, "t")
        assert manifest["selection"] == {w: [sel[w]] if w in sel else None for w in ("include", "exclude")}
        owners = (manifest.get("experts") or {}).get("owners", {})
        assert sorted(owners) == (experts if key == "experts" else []), owners
        assert ("experts" in manifest) == (key == "experts")  # no expert selected: no expert parallelism
        if key == "experts":  # expert g of 4 belongs to expert-parallel rank g // 2
            assert all(o == int(n[len(_EXPERTS) :].split(".")[0]) // 2 for n, o in owners.items()), owners
