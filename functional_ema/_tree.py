"""Pytree helpers: flattening with parameter names and mismatch errors that name them."""

from __future__ import annotations

from typing import Any

import optree
import torch

from ._errors import MismatchError

__all__ = ["flatten_named", "check_same_names", "check_same_tree", "path_name", "TreeMismatchError", "short_list"]


class TreeMismatchError(MismatchError):
    """Two trees that must match (names, shapes) do not."""


def path_name(path: tuple) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


def flatten_named(tree: Any, what: str = "shards") -> tuple[list[str], list[torch.Tensor], optree.PyTreeSpec]:
    """Flatten ``tree`` (dict keys in sorted order, the same on every rank) into names and tensors."""
    paths, leaves, spec = optree.tree_flatten_with_path(tree, none_is_leaf=False)
    names = [path_name(p) for p in paths]
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"{what}[{name!r}] is a {type(leaf).__name__}, expected a torch.Tensor")
    return names, leaves, spec


def check_same_names(
    expected: list[str],
    got: list[str],
    expected_what: str = "the EMA state",
    got_what: str = "shards",
    why: str = "",
) -> None:
    """Raise :class:`TreeMismatchError` naming the missing and extra names unless the lists are equal.

    Names are optree paths (``flatten_named``), so a ``dict`` and a ``Shards`` with the same keys match. ``why``:
    the caller's explanation of a mismatch (e.g. two selections), given instead of the usual one.
    """
    if expected == got:
        return
    exp, have = set(expected), set(got)
    missing, extra = sorted(exp - have), sorted(have - exp)
    parts = []
    if missing:
        parts.append(f"missing from {got_what}: {short_list(missing)}")
    if extra:
        parts.append(f"not in {expected_what}: {short_list(extra)}")
    if not parts:
        parts.append("same names, different nesting or order")
    hint = (
        why
        or compile_hint(missing, extra)
        or (_new_names_hint(expected_what) if extra and got_what == "shards" else "")
    )
    raise TreeMismatchError(f"{got_what} do not match {expected_what}; " + "; ".join(parts) + hint)


def _new_names_hint(state: str) -> str:
    """Why shards hold names a state lacks, the usual way: a parameter unfrozen (or added) since the state was made."""
    return (
        f" ({state} holds the parameters read when it was made: a name it lacks was frozen then and is trained now, or "
        "was added to the model since. For progressive unfreezing, make the state from the model read before anything "
        'is frozen: docs/core.md, "What is averaged")'
    )


def compile_hint(missing: list[str], extra: list[str]) -> str:
    """A note for a name mismatch that is only ``torch.compile``'s ``_orig_mod.`` prefix (a compiled model read
    on one side, the model it wraps on the other); ``""`` for any other."""
    unwrap = lambda names: {n.replace("_orig_mod.", "") for n in names}  # noqa: E731
    if not missing or not extra or unwrap(missing) != unwrap(extra):
        return ""
    return (
        " (the names differ only by torch.compile's '_orig_mod.' prefix: pass the same object every time, the "
        "compiled model or the model it wraps)"
    )


def check_same_tree(
    expected_names: list[str],
    expected_spec: optree.PyTreeSpec,
    got_names: list[str],
    got_spec: optree.PyTreeSpec,
    expected_what: str = "the EMA state",
    got_what: str = "shards",
) -> None:
    """:func:`check_same_names`, for trees that must also have the same structure (the same spec)."""
    if expected_spec == got_spec:
        return
    check_same_names(expected_names, got_names, expected_what, got_what)
    raise TreeMismatchError(
        f"{got_what} do not match {expected_what}; same names, different structure: "
        f"expected {expected_spec}, got {got_spec}"
    )


def short_list(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")
