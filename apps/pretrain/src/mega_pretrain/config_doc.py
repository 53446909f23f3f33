"""The config described from its own source: ``--help``'s settings, ``config``'s TOML, typos.

Everything here is derived from the dataclasses of ``mega_pretrain.config`` (the sections of
``TrainerConfig`` and their fields) and from the docstring under each field, read with ``ast``
from the class's source, so a field added there shows up in the help, in ``mega-pretrain
config`` and in the suggestions without an edit here. The model's own fields (``--model.NAME``,
any field of ``GPTConfig``/``HybridConfig``) are read the same way from ``mega_models``, which
is imported (with torch) only when one is named or printed.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import inspect
import json
import math
import re
import textwrap
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from mega_pretrain.config import TrainerConfig

__all__ = ["SHORTCUTS", "check_file_settings", "check_setting", "cli_value", "config_toml",
           "field_docs", "first_sentence", "sections", "settings_help", "toml_value",
           "type_label"]  # fmt: skip

#: ``--tp`` and friends: ``config.py`` maps these bare names to ``parallel.*``.
SHORTCUTS = ("tp", "pp", "cp", "ep", "etp", "vpp")

#: The model section's table of model-config changes; every other ``model.NAME`` lands in it.
_MODEL_TABLE = ("model", "overrides")


def field_docs(cls: type[Any]) -> dict[str, str]:
    """Each field's docstring (the string literal under it), inherited fields included."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):  # no source (a frozen app): fields go undocumented
            continue
        node = ast.parse(source).body[0]
        if not isinstance(node, ast.ClassDef):
            continue
        for item, after in zip(node.body, node.body[1:], strict=False):
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[item.target.id] = inspect.cleandoc(after.value.value)
    return docs


def first_sentence(doc: str) -> str:
    """The doc on one line, up to its first full stop before a capital (so ``e.g.`` stays)."""
    flat = " ".join(doc.replace("``", "`").split())
    return re.split(r"(?<=\.)\s+(?=[A-Z])", flat, maxsplit=1)[0]


def sections() -> list[tuple[str, type[Any]]]:
    """``(name, dataclass)`` of each section of ``TrainerConfig``, in declaration order."""
    hints = typing.get_type_hints(TrainerConfig)
    out = []
    for f in dataclasses.fields(TrainerConfig):
        tp = hints[f.name]
        if isinstance(tp, type) and dataclasses.is_dataclass(tp):
            out.append((f.name, tp))
    return out


def type_label(tp: Any) -> str:
    """A field's type as a user writes it: ``int``, ``float or none``, ``cosine|linear``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        named = [type_label(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or none" if type(None) in args else "")
    if origin is Literal:
        return "|".join(str(a) for a in args)
    if origin is tuple:
        return f"list of {type_label(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "table"
    if tp is bool:
        return "true|false"
    if tp is str:
        return "text"
    return getattr(tp, "__name__", str(tp))


def toml_value(value: Any) -> str:
    """``value`` as TOML (strings quoted, tuples as arrays, dicts as inline tables)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        return repr(value) if math.isfinite(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, str):
        # a JSON string is a TOML basic string, once DEL (raw in JSON, not in TOML) is escaped
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(value, list | tuple):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{_key(k)} = {toml_value(v)}" for k, v in value.items()) + "}"
    if value is None:
        return '"none"'  # config.py reads "none" as unset
    raise ValueError(f"a value of type {type(value).__name__} ({value!r}) has no TOML form")


def cli_value(value: Any) -> str:
    """``value`` as it is written after ``--section.field`` (lists comma-separated)."""
    if value is None:
        return "none"
    if isinstance(value, list | tuple):
        return ",".join(cli_value(v) for v in value) if value else '""'
    if isinstance(value, str):
        return value if value and not value.isspace() else json.dumps(value)
    return toml_value(value)


def _key(name: Any) -> str:
    text = str(name)
    return text if re.fullmatch(r"[A-Za-z0-9_-]+", text) else json.dumps(text)


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _is_model_table(section: str, name: str) -> bool:
    return (section, name) == _MODEL_TABLE


def settings_help() -> str:
    """Every setting, one block each: ``--section.field TYPE = DEFAULT`` and its first sentence."""
    shortcut_of = {f"parallel.{s}": s for s in SHORTCUTS}
    lines = [
        "settings (--SECTION.FIELD VALUE on the command line, or FIELD = VALUE under [SECTION]",
        "in the config file; lists are comma-separated on the command line, a,b; `mega-pretrain",
        "config` prints every setting as TOML with its full doc):",
    ]
    for section, cls in sections():
        doc = first_sentence(inspect.getdoc(cls) or "")
        lines += ["", f"[{section}]  {doc}".rstrip()]
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            dotted = f"{section}.{f.name}"
            if _is_model_table(section, f.name):
                lines.append(f"  --model.NAME VALUE  ({dotted}: any field of the model's config)")
                lines.append(f"      {first_sentence(docs.get(f.name, ''))} `mega-pretrain config` "
                             "lists the model's fields with their values.")  # fmt: skip
                continue
            default = _default(f)
            shown = "" if default is dataclasses.MISSING else f" = {cli_value(default)}"
            short = f"  (or --{shortcut_of[dotted]})" if dotted in shortcut_of else ""
            lines.append(f"  --{dotted} {type_label(hints[f.name])}{shown}{short}")
            lines.append(f"      {first_sentence(docs.get(f.name, 'undocumented'))}")
    return "\n".join(lines)


def _comment(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.replace("``", "`").splitlines()]


def config_toml(config: TrainerConfig) -> str:
    """The config as a TOML file that ``load_config`` reads back to the same config.

    Each ``[section]`` has its class doc above it and each ``key = value`` its field doc, type
    and default; the model's fields that are not overridden are listed commented out, with the
    values of ``model.size`` (uncomment one to change it).
    """
    lines = [
        "# mega-pretrain config: every setting with its value. Start a config file from it:",
        "#   mega-pretrain config [--config FILE] [--SECTION.FIELD VALUE ...] > my.toml",
        "#   mega-pretrain --config my.toml",
    ]
    for section, cls in sections():
        value = getattr(config, section)
        lines += ["", *_comment(inspect.getdoc(cls) or ""), f"[{section}]"]
        hints = typing.get_type_hints(cls)
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            current = getattr(value, f.name)
            if _is_model_table(section, f.name):
                lines += _model_lines(config, docs.get(f.name, ""))
                continue
            default = _default(f)
            about = type_label(hints[f.name])
            if default is not dataclasses.MISSING:
                about += f"; default {cli_value(default)}"
            lines += ["", *_comment(docs.get(f.name, "")), f"# ({about})"]
            lines.append(f"{_key(f.name)} = {toml_value(current)}")
    return "\n".join(lines) + "\n"


def _model_lines(config: TrainerConfig, table_doc: str) -> list[str]:
    from mega_pretrain.build import gpt_config

    model = gpt_config(config)  # the size's config with the overrides applied
    overrides = config.model.overrides
    hints = typing.get_type_hints(type(model))
    docs = field_docs(type(model))
    lines = ["", *_comment(table_doc),
             f"# The fields of {type(model).__name__} for model.size {config.model.size!r}; "
             "the lines that are not commented out are overrides."]  # fmt: skip
    for name, value in overrides.items():  # unknown names were refused by gpt_config
        about = type_label(hints[name]) if name in hints else "not a field of this model"
        lines += ["", *_comment(docs.get(name, "")), f"# ({about})",
                  f"{_key(name)} = {toml_value(value)}"]  # fmt: skip
    for f in dataclasses.fields(model):
        if not f.init or f.name in overrides:
            continue
        value = getattr(model, f.name)
        shown = "(unset)" if value is None else toml_value(value)
        lines += ["", *_comment(docs.get(f.name, "")), f"# ({type_label(hints[f.name])})",
                  f"# {_key(f.name)} = {shown}"]  # fmt: skip
    return lines


def _model_fields() -> list[str]:
    from mega_models import GPTConfig, HybridConfig

    names = {f.name for cls in (GPTConfig, HybridConfig) for f in dataclasses.fields(cls) if f.init}
    return sorted(names)


def _settings() -> list[str]:
    names = []
    for section, cls in sections():
        names += [f"{section}.{f.name}" for f in dataclasses.fields(cls)
                  if not _is_model_table(section, f.name)]  # fmt: skip
    return names


def _nearest(word: str, choices: Iterable[str]) -> str | None:
    found = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return found[0] if found else None


def check_setting(key: str, options: Sequence[str] = (), where: str = "") -> None:
    """Raise a one-sentence ``ValueError`` naming the nearest setting when ``key`` is unknown.

    ``key`` is a dotted setting (``train.lr``), a shortcut (``tp``) or a model field
    (``model.num_layers``); ``options`` are the command's own flags (``dry-run``), suggested as
    ``--dry-run``; ``where`` says where the key was read (`` in FILE``).
    """
    settings = _settings()
    parts = key.split(".")
    if key in settings or key in SHORTCUTS:
        return
    if (
        parts[0] == "model"
        and len(parts) in (2, 3)
        and (len(parts) == 2 or parts[1] == "overrides")
    ):
        model_fields = _model_fields()
        if parts[-1] in model_fields:
            return
        guess = _nearest(parts[-1], model_fields)
        if guess is not None:
            raise ValueError(f"unknown setting {key}{where}; did you mean model.{guess}?")
        raise ValueError(
            f"unknown setting {key}{where}; model.NAME takes a field of the model's config: "
            f"{', '.join(model_fields)}"
        )
    if len(parts) == 1:
        flag = _nearest(key.replace("_", "-"), options)
        if flag is not None:
            raise ValueError(
                f"unknown option --{key.replace('_', '-')}{where}; did you mean --{flag}?"
            )
    names = [s for s, _ in sections()]
    by_field = {s.split(".", 1)[1]: s for s in reversed(settings)}  # first section wins
    if parts[0] in names and len(parts) == 2:  # `--train.lrr`: the section's own fields first
        own = [s.split(".", 1)[1] for s in settings if s.startswith(f"{parts[0]}.")]
        name = _nearest(parts[1], own) or _nearest(parts[1], by_field)
        guess = None if name is None else f"{parts[0]}.{name}" if name in own else by_field[name]
        if guess is None:
            raise ValueError(
                f"unknown setting {key}{where}; the settings of [{parts[0]}] are {', '.join(own)}"
            )
    else:  # `--trian.lr`, `--lr`: the whole name, then the field's own name
        guess = _nearest(key, [*settings, *SHORTCUTS])
        name = None if guess is not None else _nearest(parts[-1], by_field)
        guess = guess if name is None else by_field[name]
    if guess is not None:
        raise ValueError(f"unknown setting {key}{where}; did you mean {guess}?")
    raise ValueError(
        f"unknown setting {key}{where}; settings are SECTION.FIELD with SECTION one of "
        f"{', '.join(names)} (`mega-pretrain --help` lists them all)"
    )


def check_file_settings(tree: Mapping[str, Any], where: str) -> None:
    """``check_setting`` for every key of a parsed config file (``[model]`` extras included)."""
    for section, body in tree.items():
        if not isinstance(body, Mapping):
            check_setting(section, where=where)
            continue
        for name, value in body.items():
            if section == "model" and name == "overrides" and isinstance(value, Mapping):
                for field_name in value:
                    check_setting(f"model.overrides.{field_name}", where=where)
            else:
                check_setting(f"{section}.{name}", where=where)
