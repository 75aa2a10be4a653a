"""Choosing what is averaged: an include/exclude selection of parameters by name.

``local_shards(x, include=..., exclude=...)`` (and the integrations, which pass the same two arguments on)
keeps the parameters whose names the selection picks:

* ``include``: ``None`` (the default) selects every parameter ``local_shards`` reads; a pattern, a list of
  patterns, or a predicate ``(name) -> bool`` selects the names that match one pattern, or for which the
  predicate returns ``True``.
* ``exclude``: ``None`` (the default) leaves nothing out; otherwise the same forms, and a name it matches is
  left out even when ``include`` matches it too (**exclude wins**).

Patterns are shell-style, matched by :func:`fnmatch.fnmatchcase` against the whole dotted name as
``named_parameters()`` gives it (case-sensitive; ``*`` also crosses dots, so ``"unet.*"`` is everything under
``unet``; ``?`` one character; ``[seq]`` one of a set). They are not regular expressions.

Checked where the argument enters (``local_shards``, the integrations' constructors for the types), each with
one error naming the argument: a pattern that is not a ``str``, an empty pattern, an empty ``include`` list, a
pattern that matches none of the model's parameter names (a typo, or a regular expression; a frozen parameter's
name counts; under pipeline parallelism a stage checks its own names only, so a pattern matching nothing on any
stage goes undetected there) or only tied aliases, one whose brackets spell names it does not match (``"a[0].*"`` for a
``ModuleDict`` key ``"a[0]"``: write ``"a[[]0].*"``), a selection that decides a tied parameter one way under a later
name and the other way under its first, a predicate that raises or returns anything but a ``bool``, and a selection
that leaves no parameter (under pipeline parallelism: a stage it leaves nothing averages nothing, as a frozen stage).

This module is a leaf: it imports nothing from the package at import time.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping, Sequence
from typing import Any

__all__ = ["Selection", "SelectionLike", "make_selection", "selection_record", "check_loaded_selection"]

#: What ``include`` / ``exclude`` take: a pattern, patterns, or a predicate on the parameter name.
SelectionLike = str | Sequence[str] | Callable[[str], bool] | None

_Part = tuple[str, ...] | Callable[[str], bool] | None


class Selection:
    """An include/exclude selection, checked for its types; immutable. See the module docstring.

    Attributes:
        include: the patterns (a tuple), the predicate, or ``None`` (every name).
        exclude: the patterns (a tuple), the predicate, or ``None`` (no name).
        key: what two selections are compared by (patterns by value, predicates by their own equality: identity
            for a function, ``(self, function)`` for a bound method).
    """

    __slots__ = ("include", "exclude", "key")
    include: _Part
    exclude: _Part
    key: tuple

    def __init__(self, include: _Part, exclude: _Part) -> None:
        object.__setattr__(self, "include", include)
        object.__setattr__(self, "exclude", exclude)
        object.__setattr__(self, "key", (_key(include), _key(exclude)))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Selection is immutable")

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selection) and self.key == other.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        return f"Selection({self.describe()})"

    def describe(self) -> str:
        """``include=..., exclude=...`` as the user would write it (predicates by their qualified name)."""
        return f"include={_shown(self.include)}, exclude={_shown(self.exclude)}"

    def record(self) -> dict[str, Any]:
        """JSON for a checkpoint's manifest: patterns as lists, a predicate as ``"<predicate module.name>"``."""
        return {"include": _recorded(self.include), "exclude": _recorded(self.exclude)}

    def apply(
        self,
        names: Sequence[str],
        unread: Callable[[], Mapping[str, str | None]] | None = None,
        partial: bool = False,
    ) -> list[str]:
        """The selected ``names``, in their order; every pattern and predicate checked (see the module docstring).

        ``unread``: gives the model's other parameter names, each mapped to the read name it is a tied alias of, or
        to ``None`` (a parameter not read: frozen). Asked once per selection and reading (the result is cached
        with the reading): a pattern that matches no name read is checked against it (one that names a frozen
        parameter is no typo: frozen later, or unfrozen later, it selects it then; one that names only tied aliases
        is refused naming the name they are read under), and so are the tied aliases the selection decides.

        ``partial``: ``names`` are one pipeline stage's, not the model's. A pattern matching none of them may name
        another stage's parameters, and a selection may leave this stage nothing (it then averages nothing), so
        neither is refused here: one selection, the same on every stage, must describe the whole model."""
        others: Mapping[str, str | None] | None = None

        def other_names() -> Mapping[str, str | None] | None:
            nonlocal others
            if others is None and unread is not None:
                others = unread()
            return others

        for part, what in ((self.include, "include"), (self.exclude, "exclude")):
            if isinstance(part, tuple):
                for pattern in part:
                    if "[" in pattern:
                        _check_literal(what, pattern, names, other_names())
                    if not any(fnmatch.fnmatchcase(n, pattern) for n in names):
                        _check_unread(what, pattern, names, other_names(), partial)
        chosen = [n for n in names if self.picks(n)]
        if unread is not None:
            self._check_aliases(chosen, other_names() or {})
        if not chosen and not partial:
            raise ValueError(
                f"the selection ({self.describe()}) leaves none of the {len(names)} parameters read "
                f"(e.g. {', '.join(map(repr, names[:4]))}): nothing would be averaged. Widen include or narrow exclude"
            )
        return chosen

    def _check_aliases(self, chosen: Sequence[str], others: Mapping[str, str | None]) -> None:
        """Refuse a selection whose ``include`` or ``exclude`` names a tied parameter by a later name (an alias)
        and is overruled: the parameter is read once, under its first name, so ``include="head.*"`` with
        ``head.weight`` tied to ``emb.weight`` would leave the head's weight out, and ``exclude="head.*"`` would
        keep it, without a word. (Naming only the first name decides for both: ``exclude="*wte*"`` leaves out a
        tied language-model head too.)"""
        picked = set(chosen)
        for alias, first in others.items():
            if first is None:
                continue
            if self.include is not None and first not in picked and self.picks(alias) and not self._excluded(first):
                said, part = "selects", "include"
            elif self.exclude is not None and first in picked and self._excluded(alias):
                said, part = "leaves out", "exclude"
            else:
                continue
            raise ValueError(
                f"{part} ({self.describe()}) {said} {alias!r}, a tied alias of {first!r}: one parameter, read once "
                f"under its first name {first!r}, which the selection {'leaves out' if first not in picked else 'keeps'}"
                f", so the choice made for {alias!r} would be dropped. Name the parameter by {first!r} (select both "
                "names or neither)"
            )

    def picks(self, name: str) -> bool:
        """Whether the selection picks ``name`` (``include`` matches it and ``exclude`` does not)."""
        return _matches(self.include, name, "include", True) and not self._excluded(name)

    def _excluded(self, name: str) -> bool:
        return _matches(self.exclude, name, "exclude", False)


def make_selection(include: Any, exclude: Any) -> Selection | None:
    """``include`` / ``exclude`` checked for their types; ``None`` when both select everything (no selection)."""
    inc = _part(include, "include")
    exc = _part(exclude, "exclude")
    if isinstance(inc, tuple) and not inc:
        raise ValueError(
            "include=[] selects no parameter: nothing would be averaged. Pass include=None (the default) for every "
            "parameter, or the patterns to keep"
        )
    if isinstance(exc, tuple) and not exc:
        exc = None  # nothing to leave out
    if inc is None and exc is None:
        return None
    return Selection(inc, exc)


def selection_record(tree: Any) -> dict[str, Any] | None:
    """The record of the selection a state's EMA (or a ``Shards``) was made with; ``None`` without one."""
    selection = getattr(tree, "selection", None)
    return selection.record() if isinstance(selection, Selection) else None


def check_loaded_selection(
    where: str, saved: Any, selection: Selection | None, mine: Sequence[str], theirs: Sequence[str]
) -> None:
    """Refuse a load whose selected names (``mine``) differ from the checkpoint's (``theirs``) when either side
    was made with a selection (``saved``: the manifest's record), naming the names that differ and both
    selections. Without a selection on either side the checkpoint's own name check speaks."""
    from ._checkpoint.errors import CheckpointMismatchError
    from ._tree import short_list

    mine_set, theirs_set = set(mine), set(theirs)
    if mine_set == theirs_set or (saved is None and selection is None):
        return
    only_saved = [n for n in theirs if n not in mine_set]
    only_mine = [n for n in mine if n not in theirs_set]
    lines = [
        f"{where} was saved with the selection {_describe_record(saved)}, and this load selects "
        f"{'every parameter (no include/exclude)' if selection is None else selection.describe()}: the names differ:"
    ]
    if only_saved:
        lines.append(f"  saved but not selected by this load: {short_list(only_saved)}")
    if only_mine:
        lines.append(f"  selected by this load but not in the checkpoint: {short_list(only_mine)}")
    lines.append(
        "Load with the include/exclude the EMA was saved with (fe.load(x, dir, include=..., exclude=...), or the "
        "integration's include=/exclude=); to average another selection, start a new EMA with init_ema"
    )
    raise CheckpointMismatchError("\n".join(lines))


def check_recut_selection(where: str, saved: Any, selection: Selection | None) -> None:
    """Refuse a load that joins and re-cuts saved parts (another pipeline partitioning or stage count) with
    another selection than the save's (``saved``: the manifest's record): such a load takes this rank's names from
    the joined parts, so a narrower selection would silently drop EMAs that the names alone cannot show missing."""
    from ._checkpoint.errors import CheckpointMismatchError

    def normal(record: Any) -> Any:  # the patterns' order does not change what they select
        if not isinstance(record, dict):
            return None
        return {k: sorted(map(str, v)) if isinstance(v, list) else v for k, v in record.items()}

    if normal(saved) == normal(None if selection is None else selection.record()):
        return
    raise CheckpointMismatchError(
        f"{where} was saved with the selection {_describe_record(saved)}, and this load selects "
        f"{'every parameter (no include/exclude)' if selection is None else selection.describe()}; a load into "
        "another model-parallel layout (the saved parts joined and re-cut) needs the selection the EMA was saved "
        "with: pass the same include/exclude (or, to average another selection, start a new EMA with init_ema)"
    )


# ------------------------------------------------------------------------------------------ helpers


def _part(value: Any, what: str) -> _Part:
    if value is None:
        return None
    if isinstance(value, str):
        return (_pattern(value, what),)
    if callable(value):
        return value  # a predicate; what it returns is checked per call
    if isinstance(value, (set, frozenset)):
        value = sorted(value, key=repr)  # no order of its own: a stable one for the record
    if isinstance(value, (list, tuple)):
        return tuple(_pattern(p, f"{what}[{i}]") for i, p in enumerate(value))
    raise TypeError(
        f"{what} must be None, a name pattern (str), a list of patterns, or a predicate (name) -> bool; got "
        f"{type(value).__name__} {value!r:.80}"
    )


def _pattern(p: Any, what: str) -> str:
    if not isinstance(p, str):
        raise TypeError(f"{what} must be a name pattern (str), got {type(p).__name__} {p!r:.80}")
    if not p:
        raise ValueError(f"{what} is an empty pattern, which matches no parameter name; give a pattern like 'unet.*'")
    return p


def _matches(part: _Part, name: str, what: str, default: bool) -> bool:
    if part is None:
        return default
    if isinstance(part, tuple):
        return any(fnmatch.fnmatchcase(name, p) for p in part)
    try:
        got = part(name)
    except Exception as e:
        raise ValueError(
            f"{what}: the predicate {_qualname(part)} raised {type(e).__name__} on parameter {name!r}: {e}"
        ) from e
    if type(got) is not bool:  # a truthy tensor or string would select by accident
        raise TypeError(
            f"{what}: the predicate {_qualname(part)} returned {_type_name(got)} {got!r:.60} for parameter "
            f"{name!r}; it must return a Python bool (True or False)"
        )
    return got


def _check_unread(
    what: str, pattern: str, names: Sequence[str], unread: Mapping[str, str | None] | None, partial: bool = False
) -> None:
    """Refuse ``pattern`` (which matches no name read) unless it names a parameter that is not read (frozen), or
    ``names`` are one pipeline stage's (``partial``: another stage may hold what it matches)."""
    hits = [n for n in unread or () if fnmatch.fnmatchcase(n, pattern)]
    if not hits:
        if partial:
            return
        raise ValueError(_no_match(what, pattern, names, None if unread is None else [*names, *unread]))
    aliases = {n: unread[n] for n in hits if unread is not None and unread[n] is not None}
    if len(aliases) == len(hits):
        shown = ", ".join(f"{n!r} of {of!r}" for n, of in list(aliases.items())[:4])
        raise ValueError(
            f"{what} pattern {pattern!r} matches only tied aliases ({shown}): a tied parameter is read once, under "
            "the first name named_parameters() gives it, so the pattern would select nothing. Name it by that name"
        )


def _check_literal(what: str, pattern: str, names: Sequence[str], others: Mapping[str, str | None] | None) -> None:
    """Refuse ``pattern`` when its brackets, read literally, spell parameter names it does not match: ``[...]`` is
    one character of a set in a shell-style pattern, so ``"blocks[0].*"`` selects ``blocks0.*``, or nothing,
    instead of a ``ModuleDict`` entry named ``"blocks[0]"``."""
    every = [*names, *(others or {})]
    literal = pattern.replace("[", "[[]")
    spelled = [n for n in every if fnmatch.fnmatchcase(n, literal)]
    if not spelled or all(fnmatch.fnmatchcase(n, pattern) for n in spelled):
        return
    from ._tree import short_list

    matched = [n for n in every if fnmatch.fnmatchcase(n, pattern)]
    raise ValueError(
        f"{what} pattern {pattern!r}: in a shell-style pattern '[...]' is one character of a set, so it matches "
        f"{short_list(matched, 4) if matched else 'no parameter name'}, not {short_list(spelled, 4)}, which its "
        f"brackets spell. Write a literal '[' as '[[]': {literal!r}"
    )


def _type_name(value: Any) -> str:
    """``int``, or ``numpy.bool`` where a builtin's name would mislead (numpy's bool is named ``bool`` too)."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _no_match(what: str, pattern: str, names: Sequence[str], every: Sequence[str] | None = None) -> str:
    """``every``: the model's parameter names, frozen ones and tied aliases included, where they were searched too
    (``None``: only the ``names`` read)."""
    total = None if every is None else len(every)
    regex = any(c in pattern for c in "^$+\\(|")
    hint = " It looks like a regular expression: patterns are shell-style (fnmatch: * ? [seq])." if regex else ""
    if "[" in pattern and not regex:
        hint = " In a shell-style pattern '[...]' is one character of a set: write a literal '[' as '[[]'."
    among = f"{len(names)} parameters read" if total is None else f"{total} parameter names of the model"
    unread = "; frozen parameters are not read" if total is None else ""
    check = " Check the names with [n for n, _ in model.named_parameters()]"
    inner = _unwrapped(pattern)
    # The wrapper's names list the prefix, the names read (the wrapped module's) do not. Only where the rest names a
    # parameter: a model may have a submodule of its own called "module" (its names then do start so: a typo there)
    if inner != pattern and any(fnmatch.fnmatchcase(n, inner) for n in every or names):
        check = (
            f" The names are the wrapped module's, without DDP's 'module.' or torch.compile's '_orig_mod.' prefix: "
            f"write {inner!r}; check them with [n for n, _ in model.module.named_parameters()] (DDP) or "
            "model._orig_mod.named_parameters() (torch.compile)"
        )
    return (
        f"{what} pattern {pattern!r} matches none of the {among} (e.g. {', '.join(map(repr, names[:4]))}{unread})."
        f"{hint}{check}"
    )


def _unwrapped(pattern: str) -> str:
    """``pattern`` without the leading ``module.`` / ``_orig_mod.`` prefixes DDP and torch.compile add to names."""
    while pattern.startswith(("module.", "_orig_mod.")):
        pattern = pattern.split(".", 1)[1]
    return pattern


def _key(part: _Part) -> Any:
    if not callable(part):
        return part
    try:  # by the callable's own equality: ``obj.method`` is a new bound method at every access, equal to the last
        hash(part)
    except TypeError:
        return ("predicate", id(part))
    return ("predicate", part)


def _qualname(fn: Callable) -> str:
    return f"{getattr(fn, '__module__', None) or '?'}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _shown(part: _Part) -> str:
    if part is None:
        return "None"
    if callable(part):
        return f"<predicate {_qualname(part)}>"
    return repr(part[0]) if len(part) == 1 else repr(list(part))


def _recorded(part: _Part) -> Any:
    if part is None:
        return None
    if callable(part):
        return f"<predicate {_qualname(part)}>"
    return list(part)


def _describe_record(saved: Any) -> str:
    if not isinstance(saved, dict):
        return "of every parameter (no include/exclude)"

    def one(v: Any) -> str:
        return "None" if v is None else (repr(v[0]) if isinstance(v, list) and len(v) == 1 else repr(v))

    return f"include={one(saved.get('include'))}, exclude={one(saved.get('exclude'))}"
