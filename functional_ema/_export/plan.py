"""The export's plan: which tensor goes under which name, from where, in which dtype; checked before writing.

Inputs: the source's names, shapes and dtypes; the ``--like`` folder (:class:`LikeFolder`); the loader's
view (:class:`LoaderView`, or ``None``). The plan is refused (one error naming the tensors) when:

* an EMA tensor has no place among the names the loader reads, or the names fit only by dropping
  different prefixes (an accident, not a framework's prefix);
* a shape differs from ``--like``'s (or the loader's), or ``--like`` holds an integer tensor where the EMA
  holds a floating one;
* two EMA tensors land on one name; no EMA tensor is placed at all;
* PEFT: no EMA tensor of adapter ``adapter_name``, or a tensor PEFT does not save (the tensors of the EMA's
  other adapters are left out, as PEFT saves each adapter on its own);
* a weight the loader needs has no EMA and ``--like`` has none to copy (or ``missing="error"``); the message names
  the checkpoint's include/exclude selection when it records one;
* a weight the class ties to another when ``tie_word_embeddings`` is true, under a config that sets it false, has no
  EMA while its pair has one (trained tied or frozen: a checkpoint does not say), unless the selection left it out.

A tied alias (``lm_head.weight`` tied to the input embedding) is not written, as ``save_pretrained``
does; the caller checks that its EMA value equals the tensor it is tied to (:attr:`Plan.ties`).
"""

from __future__ import annotations

import fnmatch
from collections import Counter
from typing import Any, NamedTuple

import torch

from .._checkpoint.errors import CheckpointMismatchError, ForeignFileError
from .._checkpoint.format import short_list
from .like import LikeFolder
from .loader import LoaderView
from .names import adapters_in, peft_name, strip_wrappers

__all__ = ["Item", "Plan", "make_plan"]


class Item(NamedTuple):
    name: str  # the name written
    dtype: torch.dtype  # the dtype written
    shape: tuple[int, ...]
    origin: str  # "ema" (read from the source) or "like" (copied from --like's weights)
    key: str  # the source's name, or --like's


class Plan(NamedTuple):
    items: list[Item]
    ties: list[tuple[str, str]]  # (source name of a tied alias left out, the name written that holds its value)
    prefix: str  # the prefix dropped from every EMA name to fit --like's ("" when none)
    other_adapters: list[str]  # PEFT: the EMA tensors of adapters other than the one exported (not written)


def make_plan(
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    like: LikeFolder,
    view: LoaderView | None,
    adapter_name: str,
    cast: torch.dtype | None,
    missing: str,
    selection: dict[str, Any] | None = None,
) -> Plan:
    """The plan (see the module docstring). ``selection``: the checkpoint's include/exclude record, if any."""
    names = _own_names(list(shapes), like, adapter_name)
    other_adapters = [s for s in shapes if s not in names]
    expected = _expected(like, view)
    aliases = view.aliases if view is not None else {}
    placed, ties, prefix = _place(names, expected, aliases, view, like)
    _check_shapes(placed, ties, shapes, dtypes, expected, like)

    def out_dtype(d: torch.dtype) -> torch.dtype:
        return cast if cast is not None and d.is_floating_point else d

    items = [Item(hf, out_dtype(dtypes[src]), shapes[src], "ema", src) for src, hf in placed.items()]
    if not items:
        raise CheckpointMismatchError("the source holds no EMA tensor to export (an empty or foreign file?)")
    lacking = [n for n in (expected or {}) if n not in set(placed.values())]
    _check_lacking(lacking, like, missing, selection)
    _check_untied(lacking, set(placed.values()), view, like, prefix, selection)
    for n in lacking:
        _file, entry = like.weights[n]
        items.append(Item(n, out_dtype(entry.dtype), entry.shape, "like", n))
    return Plan(items, ties, prefix, other_adapters)


def _selected_by(selection: dict[str, Any] | None) -> str:
    """The selection as the user wrote it, for a message ("" when the EMA averages every parameter)."""
    if selection is None:
        return ""
    return f"include={selection.get('include')!r}, exclude={selection.get('exclude')!r}"


def _check_lacking(lacking: list[str], like: LikeFolder, missing: str, selection: dict[str, Any] | None) -> None:
    """Weights the loader reads that the EMA lacks: refused for an adapter, with ``missing="error"``, or when
    ``--like`` has no weights to copy them from."""
    chosen = _selected_by(selection)
    # An adapter's own weights all come from the EMA; the frozen base layers PEFT saves beside them (a LoRA of
    # ``embed_tokens`` stores ``embed_tokens.base_layer.weight``: save_embedding_layers) are copied, as for a model.
    adapter_own = [n for n in lacking if "base_layer" not in n.split(".")] if like.kind == "peft" else []
    if adapter_own:
        lacking = adapter_own
        why = (
            f" The checkpoint's selection ({chosen}) left them out of the EMA: export an EMA of every adapter weight "
            "(no include/exclude)."
            if chosen
            else " Is the EMA of this adapter (its names, --adapter-name)?"
        )
        raise CheckpointMismatchError(
            f"{len(lacking)} weight(s) of the adapter in {like.folder} have no EMA: {short_list(lacking, 6)}; the "
            f"exported adapter would hold their initial values.{why}"
        )
    if lacking and (missing == "error" or not like.weights):
        why = (
            'pass missing="like" (--missing like) to copy them from there'
            if like.weights
            else "and --like has no weights to copy them from: the loader would leave them randomly initialised"
        )
        what = f"left out by the checkpoint's selection ({chosen}), or frozen" if chosen else "frozen"
        raise CheckpointMismatchError(
            f"{len(lacking)} weight(s) the loader reads have no EMA: {short_list(lacking, 6)} ({what} parameters or "
            f"buffers); {why}"
        )


def _left_out(name: str, prefix: str, selection: dict[str, Any] | None) -> bool:
    """The checkpoint's selection may have left ``name`` out (a predicate: it may have)."""
    if selection is None:
        return False
    inc, exc = selection.get("include"), selection.get("exclude")
    if isinstance(inc, str) or isinstance(exc, str):  # "<predicate ...>": not known here
        return True
    names = [name, f"{prefix}.{name}"] if prefix else [name]
    hit = [any(fnmatch.fnmatchcase(n, p) for n in names for p in pats or ()) for pats in (inc, exc)]
    return (inc is not None and not hit[0]) or hit[1]


def _check_untied(
    lacking: list[str],
    placed: set[str],
    view: LoaderView | None,
    like: LikeFolder,
    prefix: str,
    selection: dict[str, Any] | None,
) -> None:
    """A weight the class ties when ``tie_word_embeddings`` is true, which --like's config sets false, lacking in an
    EMA that holds its pair: trained tied, its EMA is the pair's; frozen, --like's. A checkpoint does not say which."""
    for alias, holder in (view.untied if view is not None else {}).items():
        if alias in lacking and holder in placed and not _left_out(alias, prefix, selection):
            raise CheckpointMismatchError(
                f"the EMA has no {alias!r} but has {holder!r}, which {view.cls if view else ''} ties it to when "
                f"tie_word_embeddings is true; --like's config ({like.config_file}) sets tie_word_embeddings to false, "
                f"so the export would ship --like's own {alias!r}. If the model was trained with tied embeddings, "
                f"{alias!r}'s EMA is {holder!r}'s: give --like the tied model's folder (tie_word_embeddings true). A "
                f"frozen {alias!r} of an untied model cannot be told from a tie (a checkpoint does not record ties): "
                "load the EMA into the model (fe.swapped) and call save_pretrained"
            )


def _own_names(sources: list[str], like: LikeFolder, adapter_name: str) -> dict[str, str]:
    """source name -> the name it is saved under before fitting (wrappers removed; PEFT's adapter rule)."""
    stripped = {s: strip_wrappers(s) for s in sources}
    if like.kind != "peft":
        return stripped
    found = adapters_in(list(stripped.values()))
    if adapter_name not in found:
        got = ", ".join(f"{a!r} ({len(v)} tensors, e.g. {v[0]!r})" for a, v in sorted(found.items())) or "none"
        raise CheckpointMismatchError(
            f"--like {like.given} is a PEFT adapter folder and adapter_name (--adapter-name) is {adapter_name!r}, but "
            f"the EMA's adapter names are: {got}. Pass the adapter name the EMA was trained with"
        )
    if like.config.get("trainable_token_indices") is not None and not any(
        "trainable_tokens_delta" in n for n in stripped.values()
    ):
        raise CheckpointMismatchError(
            f"{like.config_file}: field 'trainable_token_indices' asks PEFT for trainable token embeddings, but the EMA "
            "holds none (no trainable_tokens_delta): PEFT could not load the export. Give the adapter's own config"
        )
    dora = any("lora_magnitude_vector" in n.split(".") for n in found[adapter_name])
    if bool(like.config.get("use_dora", False)) != dora:
        raise CheckpointMismatchError(
            f"{like.config_file}: field 'use_dora' is {like.config.get('use_dora', False)!r}, but the EMA "
            f"{'holds' if dora else 'holds no'} DoRA magnitudes (lora_magnitude_vector): PEFT would "
            f"{'ignore them' if dora else 'initialise them from the base weights'}. Give the adapter's own config"
        )
    marked = {n for v in found.values() for n in v}
    others = {n for a, v in found.items() if a != adapter_name for n in v}  # PEFT saves each adapter on its own
    stripped = {s: n for s, n in stripped.items() if n not in others}
    other = [s for s, n in stripped.items() if n not in marked]
    if other:
        raise CheckpointMismatchError(
            f"--like {like.given} is a PEFT adapter folder, but {len(other)} EMA tensor(s) are neither adapter weights "
            f"nor modules_to_save: {short_list(other, 4)}; PEFT saves only those. To ship these too, export with "
            "--like the base model's folder after merging, or train them as modules_to_save"
        )
    return {s: peft_name(n, adapter_name) for s, n in stripped.items()}


def _expected(like: LikeFolder, view: LoaderView | None) -> dict[str, tuple[int, ...]] | None:
    """The names and shapes the loader reads: ``--like``'s weights (checked against the loader's view), else
    the view's, else ``None`` (no constraint: a weightless folder without a view)."""
    have = {n: e.shape for n, (_, e) in like.weights.items()}
    if view is None:
        return have or None
    if have and have != view.saved:
        odd = sorted(set(have) ^ set(view.saved)) or sorted(n for n in have if have[n] != view.saved[n])
        shown = [
            f"{n} {list(have[n]) if n in have else 'absent'} vs {list(view.saved.get(n, ())) or 'absent'}"
            for n in odd[:4]
        ]
        raise ForeignFileError(
            f"like (--like): the weights in {like.folder} are not what {view.cls} built from {like.config_file.name} "
            f"saves ({len(odd)} name(s) differ, weights vs config: {'; '.join(shown)}): the folder is not laid out as "
            "this transformers saves that model. Its weights may be saved from the base model (names without the "
            "head model's prefix, as in older Hub folders), hold keys the loader drops or lack tied ones it fills, "
            "or its config (a flag such as tie_word_embeddings, or a size) was edited. Load it with from_pretrained, "
            "save_pretrained it to a new folder, and pass that as --like"
        )
    return dict(view.saved)


def _place(
    names: dict[str, str],
    expected: dict[str, tuple[int, ...]] | None,
    aliases: dict[str, str],
    view: LoaderView | None,
    like: LikeFolder,
) -> tuple[dict[str, str], list[tuple[str, str]], str]:
    """(source -> name written, ties, prefix): one prefix dropped from every EMA name, the same for all."""
    rename = view.rename if view is not None else {}
    if expected is None:
        as_named = {s: rename.get(n, n) for s, n in names.items()}
        _no_collisions(as_named)
        return as_named, [], ""
    viable: dict[str, list[tuple[str, str, bool]]] = {}
    for src, n in names.items():
        parts = n.split(".")
        for k in range(len(parts)):
            cand = ".".join(parts[k:])
            for c in dict.fromkeys((cand, rename.get(cand, cand))):
                if c in expected or c in aliases:
                    viable.setdefault(src, []).append((".".join(parts[:k]), c, c in aliases))
    counts = Counter(p for opts in viable.values() for p in {o[0] for o in opts})
    prefix = min(counts, key=lambda p: (-counts[p], len(p))) if counts else ""
    out: dict[str, str] = {}
    ties: list[tuple[str, str]] = []
    unplaced = []
    for src in names:
        fit = [o for o in viable.get(src, []) if o[0] == prefix]
        if not fit:
            unplaced.append(src)
        elif fit[0][2]:
            ties.append((src, aliases[fit[0][1]]))
        else:
            out[src] = fit[0][1]
    converted = [s for s in unplaced if view is not None and names[s] in view.converted]
    if converted:
        c = names[converted[0]]
        raise CheckpointMismatchError(
            f"{len(converted)} EMA tensor(s) are saved by {view.cls if view else ''}.save_pretrained as several "
            f"tensors each (e.g. {c!r} -> {short_list(view.converted[c] if view else [], 3)}: fused MoE experts), "
            "which this export does not convert: load the EMA into the model (fe.swapped, or copy_to_model) and call "
            "save_pretrained"
        )
    if unplaced:
        others = [p for p in counts if p != prefix]
        hint = (
            f" (they fit only after dropping other prefixes than {prefix!r}: {short_list(others, 3)})" if others else ""
        )
        peft = " PEFT saves only the adapters and modules_to_save." if like.kind == "peft" else ""
        raise CheckpointMismatchError(
            f"{len(unplaced)} EMA tensor(s) have no place in {like.folder}'s weights: {short_list(unplaced, 6)}{hint} "
            f"(its weights are named like {short_list(sorted(expected), 3)}).{peft} Is --like the model this EMA was "
            "trained from?"
        )
    _no_collisions(out)
    return out, ties, prefix


def _no_collisions(out: dict[str, str]) -> None:
    seen: dict[str, str] = {}
    for src, hf in out.items():
        if hf in seen:
            raise CheckpointMismatchError(f"EMA tensors {seen[hf]!r} and {src!r} both export as {hf!r}")
        seen[hf] = src


def _check_shapes(
    placed: dict[str, str],
    ties: list[tuple[str, str]],
    shapes: dict[str, tuple[int, ...]],
    dtypes: dict[str, torch.dtype],
    expected: dict[str, tuple[int, ...]] | None,
    like: LikeFolder,
) -> None:
    if expected is None:
        return
    bad = []
    for src, hf in [*placed.items(), *ties]:
        if tuple(shapes[src]) != tuple(expected[hf]):
            bad.append(f"{src} {list(shapes[src])} -> {hf} {list(expected[hf])}")
        elif hf in like.weights and dtypes[src].is_floating_point and not like.weights[hf][1].dtype.is_floating_point:
            bad.append(f"{src} ({dtypes[src]}) -> {hf}, an integer tensor ({like.weights[hf][1].dtype}) in --like")
    if bad:
        raise CheckpointMismatchError(
            f"{len(bad)} EMA tensor(s) do not fit what the loader expects (EMA shape -> --like's): "
            f"{short_list(bad, 4)}; is --like the model this EMA was trained from, at the same size?"
        )
