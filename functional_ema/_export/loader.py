"""What the real loader expects of a folder: names, shapes and tied groups from a meta-device model.

The model class named by ``--like``'s config (``architectures[0]`` in ``transformers``, ``_class_name`` in
``diffusers``; never remote code) is built on the ``meta`` device from that config (no memory, no weights),
and ``save_pretrained``'s own steps are applied to its state dict (transformers: drop
``_keys_to_ignore_on_save``, drop tied aliases, revert the weight renamings). That gives:

* ``saved``: every name and shape ``save_pretrained`` writes, so ``from_pretrained`` loads them all;
* ``rename``: a module parameter name -> the name it is saved under (``model.language_model.x`` ->
  ``language_model.model.x`` for Llava in transformers 5);
* ``aliases``: a tied name that is not saved -> the saved name it shares its tensor with;
* ``untied``: a saved name the class ties to another when ``tie_word_embeddings`` is true, where the config
  sets it false (the export refuses an EMA that lacks it but holds its pair: trained tied, or frozen, it cannot tell);
* ``converted``: a module parameter that ``save_pretrained`` converts into several tensors (transformers 5
  fuses MoE experts in the module and saves them one per expert): the export refuses such an EMA tensor.

Without the library, an unknown class, or remote code (``auto_map``), there is no view: the export then
follows ``--like``'s weight files alone and records why the check was not run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from .._checkpoint.errors import ForeignFileError

__all__ = ["LoaderView", "loader_view", "untied_by_flag", "MAX_LAYERS"]

#: A layer count above this in a config is refused before any model is built (a forged ``num_hidden_layers``
#: of 2**40 would otherwise build layers for hours, even on the meta device).
MAX_LAYERS = 4096


class LoaderView(NamedTuple):
    cls: str  # the class built, e.g. "transformers.LlamaForCausalLM"
    saved: dict[str, tuple[int, ...]]  # saved name -> shape
    rename: dict[str, str]  # module name -> saved name, where they differ
    aliases: dict[str, str]  # saved-form name of a tied alias -> the saved name holding the tensor
    converted: dict[str, list[str]]  # module name -> the saved names its tensor is converted into (fused MoE experts)
    #: saved name -> the saved name the class ties it to when ``tie_word_embeddings`` is true, where the config sets
    #: it false (both saved: an EMA of a model trained tied lacks the first, which is the second's EMA)
    untied: Mapping[str, str] = MappingProxyType({})


def loader_view(kind: str, config: dict[str, Any], config_file: Path) -> tuple[LoaderView | None, str]:
    """(the view, "") or (None, why no view was built). ``kind``: ``transformers`` or ``diffusers``.

    Raises:
        ForeignFileError: the config names a known class that cannot be built from it (the message names
            ``config_file`` and the class's own error), or an implausible layer count.
    """
    if kind == "transformers":
        arch = config.get("architectures")
        name, lib = (arch[0] if arch else None), "transformers"
    elif kind == "diffusers":
        name, lib = config.get("_class_name"), "diffusers"
    else:
        return None, "a PEFT adapter: the base model is not given"
    if "auto_map" in config:
        return None, "the config names remote code (auto_map), which the export never runs"
    if not isinstance(name, str) or not name.isidentifier():
        return None, f"the config names no {lib} model class"
    if importlib.util.find_spec(lib) is None:
        return None, f"{lib} is not installed"
    _check_layers(config, config_file)
    with _quiet():
        module = importlib.import_module(lib)
        cls = getattr(module, name, None)
        base = getattr(module, "PreTrainedModel" if lib == "transformers" else "ModelMixin", None)
        if not (isinstance(cls, type) and base is not None and issubclass(cls, base)):
            return None, f"{lib} has no model class {name!r}"
        try:
            view = _transformers_view(cls, config_file) if lib == "transformers" else _diffusers_view(cls, config)
        except Exception as e:  # noqa: BLE001 - any failure of a third-party class on a foreign config is refused
            raise ForeignFileError(
                f"like (--like): {config_file}: {lib}.{name} cannot be built from this config "
                f"({type(e).__name__}: {str(e)[:300]})"
            ) from None
    return view, ""


def untied_by_flag(kind: str, config: dict[str, Any], config_file: Path, names: list[str]) -> set[str]:
    """Those of the tied aliases ``names`` that ``tie_word_embeddings`` controls: the ones the class no longer ties
    once the config states it false (at its top and in each sub-config stating it), by the loader's own reading of
    such a copy in a temporary folder. Not those a class ties itself whatever the flag (T5's: its config forces the
    flag true). Empty where no view is built, or no temporary folder can be made (the refusal then gives no flag
    advice rather than failing)."""

    def off(d: dict[str, Any], depth: int = 0) -> dict[str, Any]:
        return {
            k: False if k == "tie_word_embeddings" else off(v, depth + 1) if isinstance(v, dict) and depth < 4 else v
            for k, v in d.items()
        }

    edited = {**off(config), "tie_word_embeddings": False}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / config_file.name
            file.write_text(json.dumps(edited))
            view, _ = loader_view(kind, edited, file)
    except (ForeignFileError, OSError):  # only the advice of a refusal depends on it
        return set()
    return set() if view is None else {n for n in names if n not in view.aliases}


def _check_layers(config: Any, config_file: Path, depth: int = 0) -> None:
    if depth > 4 or not isinstance(config, dict):
        return
    for key, value in config.items():
        if isinstance(value, dict):
            _check_layers(value, config_file, depth + 1)
        elif (
            isinstance(key, str)
            and ("layers" in key or key in ("n_layer", "n_layers"))
            and isinstance(value, int)
            and not isinstance(value, bool)
            and value > MAX_LAYERS
        ):
            raise ForeignFileError(
                f"like (--like): {config_file}: field {key!r} is {value}, more than {MAX_LAYERS} layers: not a "
                "model this export builds"
            )


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Third-party warnings and logs about the foreign config are not the export's output."""
    loggers = [logging.getLogger(n) for n in ("transformers", "diffusers")]
    levels = [lg.level for lg in loggers]
    try:
        for lg in loggers:
            lg.setLevel(logging.ERROR)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _transformers_view(cls: Any, config_file: Path) -> LoaderView:
    from transformers import AutoConfig
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # The loader's own reading of config.json (model_type -> config class, sub-configs, checks), local only. It
    # reopens the file by path, after read_json_object read it through a descriptor checked regular: a swap for
    # a FIFO in that narrow window would block here (transformers opens it blocking); none is guarded against.
    cfg = AutoConfig.from_pretrained(str(config_file.parent), local_files_only=True, trust_remote_code=False)
    with torch.device("meta"):
        model = cls(cfg)
    state = model.state_dict()
    for key in model._keys_to_ignore_on_save or ():
        state.pop(key, None)
    kept = remove_tied_weights_from_state_dict(dict(state), model)
    saved = {n: tuple(t.shape) for n, t in revert_weight_conversion(model, dict(kept)).items()}
    rename, converted = {}, {}
    for n in state:
        out = list(revert_weight_conversion(model, {n: state[n]}))
        if len(out) != 1:
            converted[n] = out
        elif out[0] != n:
            rename[n] = out[0]
    groups: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(n)
    aliases = {}
    for names in groups.values():
        held = [rename.get(n, n) for n in names if rename.get(n, n) in saved]
        for n in names:
            if held and rename.get(n, n) not in saved:
                aliases[rename.get(n, n)] = held[0]
    untied = _flag_ties(model, rename, saved)
    return LoaderView(f"transformers.{cls.__name__}", saved, rename, aliases, converted, untied)


def _flag_ties(model: Any, rename: dict[str, str], saved: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """The ties the class makes when ``tie_word_embeddings`` is true, for the (sub)models whose config sets it
    false: saved name -> the saved name it would share its tensor with (:attr:`LoaderView.untied`)."""
    from transformers import PreTrainedModel

    out: dict[str, str] = {}
    for prefix, sub in model.named_modules(remove_duplicate=False):
        if not isinstance(sub, PreTrainedModel) or getattr(sub.config, "tie_word_embeddings", None) is not False:
            continue
        try:
            sub.config.tie_word_embeddings = True  # this view's own meta model: restored at once
            keys = sub.get_expanded_tied_weights_keys()
        except Exception:  # noqa: BLE001 - a class whose ties cannot be listed: none known
            keys = {}
        finally:
            sub.config.tie_word_embeddings = False
        for alias, holder in keys.items():
            a, h = (f"{prefix}.{n}" if prefix else n for n in (alias, holder))
            if rename.get(a, a) in saved and rename.get(h, h) in saved:
                out[rename.get(a, a)] = rename.get(h, h)
    return out


def _diffusers_view(cls: Any, config: dict[str, Any]) -> LoaderView:
    with torch.device("meta"):
        model = cls.from_config(dict(config))
    saved = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    return LoaderView(f"diffusers.{cls.__name__}", saved, {}, {}, {})


def peft_expected(
    config_file: Path, planned: dict[str, tuple[int, ...]], adapter_name: str = "default"
) -> tuple[dict[str, tuple[int, ...]] | None, str]:
    """What PEFT's loader reads for the adapter folder whose ``adapter_config.json`` is ``config_file``, when
    the adapter written holds ``planned`` (saved name -> shape): (the names and shapes of
    ``get_peft_model_state_dict`` of a stub base model built on the meta device with a ``Linear`` at every
    module the adapter names, wrapped by PEFT from this config), or (None, why not built).

    So a config that asks for more or other weights than the export writes (another ``target_modules``,
    ``layers_to_transform``, ``use_dora``, extra parameters such as KaSA's) is seen before it is shipped. The stub
    is wrapped as ``adapter_name``, so PEFT's own rule removes that name from the names it expects.

    Raises:
        ForeignFileError: PEFT cannot wrap the stub from this config (the message names the file).
    """
    if importlib.util.find_spec("peft") is None:
        return None, "peft is not installed"
    modules = _stub_modules(planned)
    if modules is None:
        return None, "the adapter has weights other than Linear LoRA, DoRA and modules_to_save"
    with _quiet():
        from peft import PeftConfig, get_peft_model
        from peft.utils import get_peft_model_state_dict

        try:
            config = PeftConfig.from_pretrained(str(config_file.parent))
            with torch.device("meta"):
                wrapped = get_peft_model(_stub(modules), config, adapter_name=adapter_name)
            saved = get_peft_model_state_dict(wrapped, adapter_name=adapter_name)
            return {n: tuple(t.shape) for n, t in saved.items()}, ""
        except Exception as e:  # noqa: BLE001 - any failure of PEFT on this config is the finding, named
            raise ForeignFileError(
                f"like (--like): {config_file}: PEFT cannot build this adapter over the modules the EMA names "
                f"({type(e).__name__}: {str(e)[:300]})"
            ) from None


def _stub_modules(planned: dict[str, tuple[int, ...]]) -> dict[str, dict[str, Any]] | None:
    """Module path -> ``{"in", "out", "bias"}`` of a ``Linear``, from the adapter's saved names and shapes."""
    modules: dict[str, dict[str, Any]] = {}
    for name, shape in planned.items():
        parts = name.split(".")
        parts = parts[2:] if parts[:2] == ["base_model", "model"] else parts
        for marker, key, dim in (("lora_A", "in", 1), ("lora_B", "out", 0)):
            if marker in parts and len(shape) == 2:
                modules.setdefault(".".join(parts[: parts.index(marker)]), {})[key] = shape[dim]
                break
        else:
            if parts[-1] == "lora_magnitude_vector":
                continue
            if parts[-1] == "weight" and len(shape) == 2:  # a modules_to_save copy of a Linear
                modules.setdefault(".".join(parts[:-1]), {}).update(out=shape[0], **{"in": shape[1]})
            elif parts[-1] == "bias" and len(shape) == 1:
                modules.setdefault(".".join(parts[:-1]), {})["bias"] = True
            else:
                return None
    return modules if all({"in", "out"} <= set(d) for d in modules.values()) else None


class _StubBase(torch.nn.Module):
    """The stub's root. PEFT's generation task classes (``task_type`` ``CAUSAL_LM``, ``SEQ_2_SEQ_LM``: what TRL's
    ``peft_config`` runs save) keep the base model's ``prepare_inputs_for_generation`` when they wrap it; the
    stub has one, so the check builds the class ``PeftModel.from_pretrained`` builds for this config (the
    classification classes' ``modules_to_save`` included) instead of refusing a sound adapter."""

    def prepare_inputs_for_generation(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return kwargs  # never called: the stub is only wrapped and read


def _stub(modules: dict[str, dict[str, Any]]) -> torch.nn.Module:
    root = _StubBase()
    for path, d in modules.items():
        node = root
        *parents, leaf = path.split(".")
        for p in parents:
            if not hasattr(node, p):
                node.add_module(p, torch.nn.Module())
            node = getattr(node, p)
        node.add_module(leaf, torch.nn.Linear(d["in"], d["out"], bias=bool(d.get("bias"))))
    return root
