"""A checkpoint's parameter names -> the names ``save_pretrained`` writes (wrappers, PEFT adapters).

PEFT's own rule (``peft.utils.get_peft_model_state_dict``, peft 0.21), for adapter ``a``:

* ``x.modules_to_save.a.y`` -> ``x.y`` (a fully trained copy of a module, saved under the module's name);
* ``x.lora_magnitude_vector.a.weight`` -> ``x.lora_magnitude_vector`` (DoRA keeps its older name);
* then, for every name, ``a`` is removed only as the last or the second-to-last component
  (``q_proj.lora_A.a.weight`` -> ``q_proj.lora_A.weight``); a module path component equal to ``a`` elsewhere
  (adapter ``mlp`` in ``layers.0.mlp.gate_proj...``, adapter ``0`` in ``layers.0...``) is kept.
"""

from __future__ import annotations

__all__ = ["WRAPPER_PREFIXES", "PEFT_MARKERS", "strip_wrappers", "peft_name", "adapters_in"]

#: Module-path components that wrappers insert: removed from every name (``module`` only in front).
WRAPPER_PREFIXES = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_forward_module")
#: Components after which PEFT puts the adapter name (LoRA, DoRA, IA3, ``modules_to_save``).
PEFT_MARKERS = (
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
    "modules_to_save",
    "ia3_l",
)


def strip_wrappers(name: str) -> str:
    """``name`` without :data:`WRAPPER_PREFIXES` components anywhere and without leading ``module.`` components."""
    parts = [p for p in name.split(".") if p not in WRAPPER_PREFIXES]
    while len(parts) > 1 and parts[0] == "module":
        parts.pop(0)
    return ".".join(parts)


def peft_name(name: str, adapter_name: str) -> str:
    """A PEFT model's parameter name as PEFT saves it for ``adapter_name`` (see the module docstring)."""
    parts = name.split(".")
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if parts[i + 1 : i + 2] == [adapter_name]:
            del parts[i : i + 2]
    elif parts[-3:] == ["lora_magnitude_vector", adapter_name, "weight"]:
        parts.pop()
    return _remove_adapter_component(parts, adapter_name)


def _remove_adapter_component(parts: list[str], adapter_name: str) -> str:
    """PEFT's ``_remove_adapter_name_from_state_dict_key``: only the last or the second-to-last component equal to
    the adapter name is removed, so a module path component that happens to equal it (adapter ``mlp``, ``0``) stays."""
    if len(parts) > 1 and parts[-1] == adapter_name:
        del parts[-1]
    elif len(parts) > 2 and parts[-2] == adapter_name:
        del parts[-2]
    return ".".join(parts)


def adapters_in(names: list[str]) -> dict[str, list[str]]:
    """The PEFT adapter names found in ``names`` (the component after a :data:`PEFT_MARKERS` one) -> the names."""
    found: dict[str, list[str]] = {}
    for name in names:
        parts = name.split(".")
        for i, p in enumerate(parts[:-1]):
            if p in PEFT_MARKERS:
                found.setdefault(parts[i + 1], []).append(name)
                break
    return found
