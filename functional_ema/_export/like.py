"""The ``--like`` folder: which kind of folder it is, its config, its weights' names and shapes, what is copied.

The folder kind and the weight file names follow the loaders' own rules, never a directory listing:

=============  ==========================  =============================================================
kind           recognised by               weights read (``save_pretrained``'s names)
=============  ==========================  =============================================================
transformers   ``config.json``             ``model.safetensors``, else ``model.safetensors.index.json``
diffusers      ``config.json`` with        ``diffusion_pytorch_model.safetensors``, else its index
               ``_class_name``
peft           ``adapter_config.json``     ``adapter_model.safetensors``; a non-default adapter in
                                           ``<like>/<adapter_name>/`` (where PEFT saves it)
=============  ==========================  =============================================================

Other ``*.safetensors`` files (``consolidated.safetensors``, a stray ``adapter_model.safetensors`` in a
model folder) are ignored: not read, not copied, listed in the record (``ignored_in_like``); so are the folder's
subfolders (``tokenizer/``, ``scheduler/``: named with a trailing ``/``, never followed), broken links and special
files (FIFOs, sockets), and a training checkpoint's own files (:data:`CHECKPOINT_FILES`: ``trainer_state.json``,
DeepSpeed's ``latest`` and ``zero_to_fp32.py``, ``ema_latest``, Accelerate's ``random_states_*``), where a
checkpoint folder is given as ``--like``. A folder with both a model's weights and ``adapter_config.json`` is
refused as ambiguous; so is one whose weights exist only as pickles (``pytorch_model.bin``: this library never
unpickles). A file the export reads (the config, the index, a weight file) that is a FIFO, a socket or a device, or a
link to one, is refused naming it, never opened (opening a FIFO waits for a writer for ever); so is a
config with ``quantization_config`` (``from_pretrained`` would quantize the EMA on load). A folder without a config
whose subfolders hold one (a diffusers pipeline's root) is refused naming them.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from .. import _io
from .._checkpoint.errors import ForeignFileError
from .foreign import not_regular, read_index, read_json_object, read_weights_header, special_kind

__all__ = ["LikeFolder", "read_like", "EXPORT_RECORD", "WEIGHT_SUFFIXES"]

EXPORT_RECORD = "ema_export.json"
#: Files never copied from ``--like``: weights of any format (the export writes its own) and the record.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".index.json", ".gguf")
#: Files of a training checkpoint folder (Trainer, DeepSpeed, Accelerate, this library) that are not the model's:
#: never copied from a checkpoint folder given as ``--like``, listed in ``ignored_in_like``.
CHECKPOINT_FILES = frozenset({"trainer_state.json", "latest", "latest_universal", "zero_to_fp32.py", "ema_latest"})
_STEMS = MappingProxyType({"transformers": "model", "diffusers": "diffusion_pytorch_model", "peft": "adapter_model"})
_PICKLES = MappingProxyType(
    {"transformers": "pytorch_model", "diffusers": "diffusion_pytorch_model", "peft": "adapter_model"}
)


class LikeFolder(NamedTuple):
    """What the export takes from ``--like``.

    Attributes:
        given: the folder named by ``like``.
        folder: the folder whose files are copied (``given``, or ``given/<adapter>`` for a non-default PEFT adapter).
        kind: ``"transformers"``, ``"diffusers"`` or ``"peft"``.
        config: ``config.json`` (or ``adapter_config.json``) as a JSON object.
        config_file: its path.
        weights: saved name -> (file, header entry); empty when the folder holds no weights.
        copied: the files copied into the export (every regular file that is not a weight file).
        ignored: weight-like files present that the loader of this kind does not read, a training checkpoint's
            own files, the subfolders (named with a trailing ``/``), broken links and special files: none copied.
    """

    given: Path
    folder: Path
    kind: str
    config: dict[str, Any]
    config_file: Path
    weights: dict[str, tuple[Path, _io.TensorEntry]]
    copied: list[Path]
    ignored: list[str]

    @property
    def stem(self) -> str:
        """The weight files' name: ``model``, ``diffusion_pytorch_model`` or ``adapter_model``."""
        return _STEMS[self.kind]


def read_like(like: Any, adapter_name: str) -> LikeFolder:
    """Read and validate ``like`` (see the module docstring).

    Raises:
        ForeignFileError: not a folder, no config, an ambiguous or pickle-only folder, or any malformed file.
    """
    if not isinstance(like, (str, os.PathLike)) or not os.fspath(like) or "\x00" in os.fspath(like):
        raise ForeignFileError(f"like (--like) must name the model's save_pretrained folder, got {like!r}")
    given = Path(like)
    if not given.is_dir():
        raise ForeignFileError(f"like (--like): {given} is not a folder (give the model's save_pretrained folder)")
    folder, kind = _kind(given, adapter_name)
    config_file = folder / ("adapter_config.json" if kind == "peft" else "config.json")
    config = read_json_object(config_file, "like (--like)")
    if kind != "peft" and ("_class_name" in config or "_diffusers_version" in config):  # diffusers writes both
        if not isinstance(config.get("_class_name"), str):
            raise ForeignFileError(
                f"like (--like): {config_file}: field '_class_name' must be a diffusers class name, got "
                f"{config.get('_class_name')!r}"
            )
        kind = "diffusers"
    _check_config(config, config_file, kind)
    weights, used = _weights(folder, kind)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    skipped = [p for p in files if p.name in CHECKPOINT_FILES or p.name.startswith("random_states_")]
    copied = [p for p in files if not p.name.endswith(WEIGHT_SUFFIXES) and p.name != EXPORT_RECORD and p not in skipped]
    ignored = [p.name for p in files if p.name.endswith(WEIGHT_SUFFIXES) and p.name not in used]
    # the rest is not copied: subfolders (tokenizer/, scheduler/, a Trainer's global_step*/, a link to one: a "/"
    # ends each name; the loaders read the folder's own files), broken links, sockets, FIFOs, devices; listed, never
    # followed or opened, so nothing is dropped silently
    others = [f"{p.name}/" if p.is_dir() else p.name for p in folder.iterdir() if not p.is_file()]
    ignored = sorted({*ignored, *(p.name for p in skipped), *others})
    return LikeFolder(given, folder, kind, config, config_file, weights, copied, ignored)


def _kind(given: Path, adapter_name: str) -> tuple[Path, str]:
    """(folder, kind) by the loaders' rules; PEFT saves a non-default adapter in ``<folder>/<adapter_name>/``."""
    for config in (given / adapter_name / "adapter_config.json", given / "adapter_config.json", given / "config.json"):
        kind = special_kind(config)  # a FIFO or a device by a config's name: refused, not taken for no config
        if kind not in (None, "a folder"):  # (a folder of that name: no config, as before)
            raise not_regular(config, "like (--like)", kind)
    if adapter_name != "default" and (given / adapter_name / "adapter_config.json").is_file():
        return given / adapter_name, "peft"
    has_adapter = (given / "adapter_config.json").is_file()
    has_model_weights = any(
        (given / f"{stem}{suffix}").exists()
        for stem in ("model", "diffusion_pytorch_model", "pytorch_model")
        for suffix in (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")
    )
    if has_adapter and has_model_weights:
        raise ForeignFileError(
            f"like (--like): {given} holds both a model's weights and adapter_config.json (a PEFT adapter): give the "
            "base model's folder to export full weights, or the adapter's folder to export a PEFT adapter"
        )
    if has_adapter:
        if adapter_name != "default":
            raise ForeignFileError(
                f"like (--like): adapter_name (--adapter-name) is {adapter_name!r}, but PEFT saves a non-default "
                f"adapter in {given / adapter_name}/, which does not exist; {given}/adapter_config.json is the "
                "'default' adapter's"
            )
        return given, "peft"
    if (given / "config.json").is_file():
        if adapter_name != "default":
            raise ForeignFileError(
                f"adapter_name (--adapter-name) is {adapter_name!r}, but like (--like) {given} is a model folder, not a "
                "PEFT adapter folder (no adapter_config.json): the adapter name applies to a PEFT export only"
            )
        return given, "transformers"
    raise ForeignFileError(
        f"like (--like): {given} holds no config.json (a Hugging Face model folder) and no adapter_config.json "
        f"(a PEFT adapter folder){_subfolder_hint(given)}"
    )


def _subfolder_hint(given: Path) -> str:
    """Where the configs are when ``given`` holds none: the subfolders of a diffusers pipeline (``model_index.json``,
    ``unet/``, ``vae/``) or of any folder of models, each holding its own ``config.json``; "" when none does."""
    try:
        subs = sorted(
            p.name
            for p in given.iterdir()
            if p.is_dir() and any((p / c).is_file() for c in ("config.json", "adapter_config.json"))
        )
    except OSError:
        return ""
    if not subs:
        return ""
    pick = next((s for s in ("unet", "transformer", "prior", "decoder") if s in subs), subs[0])
    pipeline = " a diffusers pipeline's root (model_index.json):" if (given / "model_index.json").is_file() else ""
    shown = ", ".join(f"{s}/" for s in subs[:6]) + (", ..." if len(subs) > 6 else "")
    return (
        f"; it is{pipeline} a folder of models, each in its own subfolder holding a config.json ({shown}): give the "
        f"model the EMA is of, e.g. --like {given / pick}"
    )


#: The sub-configs of a composite model's config.json: each must be an object when given.
_SUBCONFIGS = ("text_config", "vision_config", "audio_config")


def _check_config(config: dict[str, Any], path: Path, kind: str) -> None:
    """The fields the export reads, typed; anything else in the config is copied as it is."""

    def bad(field: str, want: str) -> ForeignFileError:
        return ForeignFileError(f"like (--like): {path}: field {field!r} must be {want}, got {config.get(field)!r}")

    if kind == "peft":
        mts = config.get("modules_to_save")
        if mts is not None and not (isinstance(mts, list) and all(isinstance(m, str) for m in mts)):
            raise bad("modules_to_save", "null or a list of module names")
        if not isinstance(config.get("peft_type"), str):
            raise bad("peft_type", "a PEFT method name")
        tti = config.get("trainable_token_indices")
        if tti is not None and not isinstance(tti, (list, dict)):
            raise bad("trainable_token_indices", "null, a list or an object")
        for field, ok, want in _PEFT_FIELDS:
            if field in config and not ok(config[field]):
                raise bad(field, want)
        _peft_parses(path)
        return
    _check_not_quantized(config, path)
    if not any(config.get(k) for k in _NAMING_KEYS):
        raise ForeignFileError(
            f"like (--like): {path} names no model (none of {list(_NAMING_KEYS)}): no loader could build a model from "
            "it; give the model's save_pretrained folder"
        )
    arch = config.get("architectures")
    if arch is not None and not (isinstance(arch, list) and all(isinstance(a, str) for a in arch)):
        raise bad("architectures", "a list of class names")
    if "tie_word_embeddings" in config and not isinstance(config["tie_word_embeddings"], bool):
        raise bad("tie_word_embeddings", "true or false")
    for sub in _SUBCONFIGS:
        if sub in config and config[sub] is not None and not isinstance(config[sub], dict):
            raise bad(sub, "an object")
    for key in ("dtype", "torch_dtype"):
        if config.get(key) is not None and not isinstance(config[key], str):
            raise bad(key, "a dtype name")


def _check_not_quantized(config: dict[str, Any], path: Path) -> None:
    """A config with ``quantization_config`` (a bitsandbytes, GPTQ, AWQ, fp8 ... base) makes ``from_pretrained``
    quantize the weights it loads, or expect quantized tensors (``qweight``, scales): the loaded model would not be
    the EMA, or would not load. Refused rather than the field dropped: a config edited behind the user's back is not
    the folder they gave, and quantizing is a step of its own, after the export.

    Looked for in every nested object: transformers reads it at the top or in the decoder's text config wherever a
    composite config nests it (``text_config``, ``llm_config``, ``thinker_config.text_config``, ...). One in a
    vision or audio sub-config only is refused too: transformers ignores it, but it declares quantized weights that
    the export (full-precision EMA) does not write, so any loader that reads it (another library, a later
    transformers) would misread the folder; removing the field is the user's one-line fix."""
    todo: list[tuple[str, dict[str, Any]]] = [("", config)]
    while todo:  # a stack, not recursion: a JSON file's nesting is bounded only by the parser's own limit
        where, cfg = todo.pop()
        q = cfg.get("quantization_config")
        if q is not None:
            method = q.get("quant_method") if isinstance(q, dict) else None
            raise ForeignFileError(
                f"like (--like): {path}: field '{where}quantization_config' (quant_method {method!r}) makes "
                "from_pretrained quantize the weights it loads (or expect quantized ones): the loaded model would not "
                "be the EMA. Give --like the full-precision model's folder, whose config.json has no "
                "quantization_config (or a copy of this folder with the field removed), and quantize the exported "
                "folder afterwards if you need it so"
            )
        todo.extend((f"{where}{k}.", v) for k, v in cfg.items() if isinstance(v, dict))


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and abs(v) != float("inf")


#: The fields PEFT computes with when it builds the adapter's layers at load (a LoRA scale ``lora_alpha / r``,
#: ``nn.Dropout(lora_dropout)``), which its config parser takes as they are: checked here, so a config the
#: loader would fail on is refused rather than copied into the export.
_PEFT_FIELDS: tuple[tuple[str, Any, str], ...] = (
    ("r", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "an int > 0"),
    ("lora_alpha", _real, "a number"),
    ("lora_dropout", lambda v: _real(v) and 0 <= v <= 1, "a number in [0, 1]"),
    (
        "rank_pattern",
        lambda v: isinstance(v, dict) and all(isinstance(x, int) and x > 0 for x in v.values()),
        "an object of ints > 0",
    ),
    ("alpha_pattern", lambda v: isinstance(v, dict) and all(_real(x) for x in v.values()), "an object of numbers"),
    (
        "target_modules",
        lambda v: v is None or isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
        "null, a name or a list of names",
    ),
    ("bias", lambda v: v in ("none", "all", "lora_only"), "'none', 'all' or 'lora_only'"),
    *(
        (f, lambda v: isinstance(v, bool), "true or false")
        for f in ("use_dora", "use_rslora", "fan_in_fan_out", "inference_mode")
    ),
)

#: Fields by which a config names its model: transformers, diffusers, timm and other libraries' folders.
_NAMING_KEYS = ("architectures", "model_type", "_class_name", "architecture")


def _peft_parses(path: Path) -> None:
    """PEFT's own reading of ``adapter_config.json`` (``PeftConfig.from_pretrained``, local, no remote code), when
    PEFT is installed: what ``PeftModel.from_pretrained`` does first, so a config it refuses is refused here."""
    import importlib.util

    if importlib.util.find_spec("peft") is None:
        return
    import warnings

    from peft import PeftConfig

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            parsed = PeftConfig.from_pretrained(str(path.parent))  # by path: read_json_object's narrow window
    except Exception as e:  # noqa: BLE001 - any refusal of PEFT's own parser is the finding, named
        raise ForeignFileError(
            f"like (--like): {path}: PEFT cannot read this adapter config ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    _check_declared_types(path, read_json_object(path, "like (--like)"), type(parsed))


def _check_declared_types(path: Path, config: dict[str, Any], cls: type) -> None:
    """Each field of ``config`` that ``cls`` (PEFT's config dataclass) declares has a value of the declared type:
    PEFT's parser takes them as they are, and its loader computes with them."""
    import dataclasses
    import typing

    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - a class whose annotations cannot be resolved: no declared types to check
        return
    for f in dataclasses.fields(cls) if dataclasses.is_dataclass(cls) else ():
        if f.name in config and f.name in hints and not _conforms(config[f.name], hints[f.name]):
            shown = repr(config[f.name])
            raise ForeignFileError(
                f"like (--like): {path}: field {f.name!r} is {shown[:60]}, not of the type PEFT declares for it "
                f"({hints[f.name]}): PEFT could not load the export"
            )


def _conforms(value: Any, hint: Any) -> bool:
    """``value`` (parsed JSON) fits the annotation ``hint``; types this does not model are accepted."""
    import typing

    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return value is None
    if origin is typing.Union or str(origin) == "<class 'types.UnionType'>":
        return any(_conforms(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if origin is list:
        return isinstance(value, list) and (not args or all(_conforms(v, args[0]) for v in value))
    if origin is tuple:  # JSON has no tuples: a list of the tuple's length (any length for tuple[X, ...])
        if not isinstance(value, list):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_conforms(v, args[0]) for v in value)
        return len(value) == len(args) and all(_conforms(v, a) for v, a in zip(value, args))
    if origin is dict or hint is dict:
        return isinstance(value, dict) and (not args or all(_conforms(v, args[1]) for v in value.values()))
    if hint is bool:
        return isinstance(value, bool)
    if hint in (int, float):
        return _real(value)
    if hint is str:
        return isinstance(value, str)
    return True


def _weights(folder: Path, kind: str) -> tuple[dict[str, tuple[Path, _io.TensorEntry]], set[str]]:
    """(saved name -> (file, entry), the names of the files read)."""
    stem = _STEMS[kind]
    single, index = folder / f"{stem}.safetensors", folder / f"{stem}.safetensors.index.json"
    what = "like (--like)"
    if single.exists():  # the loaders read the single file first (a FIFO or a device: refused, never opened)
        return {n: (single, e) for n, e in read_weights_header(single, what).items()}, {single.name}
    if index.exists():
        wmap = read_index(index, what)
        out: dict[str, tuple[Path, _io.TensorEntry]] = {}
        for file in sorted(set(wmap.values())):
            path = folder / file
            special = special_kind(path)
            if special not in (None, "a folder"):  # never opened: a FIFO would block the read (a folder: below)
                raise not_regular(path, what, special)
            if not path.is_file():
                raise ForeignFileError(f"{what}: {index} names {file!r}, which is not a file in {folder}")
            header = read_weights_header(path, what)
            listed = {n for n, f in wmap.items() if f == file}
            if listed != set(header):
                odd = sorted(listed ^ set(header))[:3]
                raise ForeignFileError(
                    f"{what}: {index}: field 'weight_map' and the tensors of {file} disagree (e.g. {odd}): the index "
                    "does not describe this folder's files"
                )
            out.update({n: (path, header[n]) for n in listed})
        return out, {index.name, *wmap.values()}
    pickles = [
        f"{_PICKLES[kind]}{s}" for s in (".bin", ".bin.index.json") if (folder / f"{_PICKLES[kind]}{s}").exists()
    ]
    if pickles:
        raise ForeignFileError(
            f"{what}: {folder} holds its weights only as pickles ({', '.join(pickles)}), which this library never "
            "loads: save the model with save_pretrained(..., safe_serialization=True) and give that folder"
        )
    return {}, set()
