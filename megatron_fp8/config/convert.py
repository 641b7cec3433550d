"""A plain config tree converted strictly into the schema's frozen dataclasses.

Every value is checked against its field's type (``Literal`` / ``OneOf`` choices, ``X | None``, tuples from lists or
``a,b`` strings, string mappings, nested sections) and converted (lists -> tuples, ints -> floats); a mismatch is one
:class:`~megatron_fp8.errors.ConfigError` naming the dotted key, the expected type and, for keys whose type does not
say what to write, the format (:data:`FORMATS`). An unknown key gets a did-you-mean within its section, or the
sections it is a key of. :mod:`megatron_fp8.config.loader` composes the tree; this module only types it.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from typing import Annotated, Literal, TypeVar

from megatron_fp8.config.schema import OneOf, RunConfig
from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def _choices(tp: object) -> tuple[object, ...] | None:
    """The allowed values of a ``Literal[...]`` or ``Annotated[str, OneOf(...)]`` type, else ``None``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return typing.get_args(tp)
    if origin is Annotated:
        for meta in typing.get_args(tp)[1:]:
            if isinstance(meta, OneOf):
                return meta.choices
    return None


def _type_name(tp: object) -> str:
    origin = typing.get_origin(tp)
    choices = _choices(tp)
    if choices is not None:
        return "one of " + ", ".join(repr(a) for a in choices)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if origin is dict:
        return "mapping of name -> string"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    return getattr(tp, "__name__", str(tp))


FORMATS = {
    "checkpointing.checkpoint_must_save_by": "NeMo-RL's DD:HH:MM:SS after the training loop starts: e.g. "
    "checkpointing.checkpoint_must_save_by=00:03:30:00 for 3.5 hours, quoted in a YAML file; all four fields, two "
    "digits each: YAML reads an unquoted 1:30 as the base-60 number 90",
}
"""Keys whose type alone does not say what to write: dotted path -> the format, named in a type error."""


def _type_error(path: str, tp: object, value: object) -> ConfigError:
    fmt = f" ({FORMATS[path]})" if path in FORMATS else ""
    return ConfigError(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}{fmt}")


def _convert(tp: object, value: object, path: str) -> object:
    """``value`` checked against the schema type ``tp`` (and converted: lists -> tuples, ints -> floats)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None:
            if type(None) in args:
                return None
            raise _type_error(path, tp, value)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(arg, value, path)
            except ConfigError:
                if len([a for a in args if a is not type(None)]) == 1:
                    raise
        raise _type_error(path, tp, value)
    choices = _choices(tp)
    if choices is not None:
        if value not in choices:
            raise _type_error(path, tp, value)
        return value
    if origin is Annotated:
        return _convert(typing.get_args(tp)[0], value, path)
    if origin is tuple:
        if isinstance(value, str):  # `grpo.arms=bf16,fp8` means what `--arms bf16,fp8` means
            value = [v.strip() for v in value.split(",")]
            if not all(value):
                raise ConfigError(f"{path}: {','.join(value)!r} has an empty item; give e.g. a,b or [a, b]")
        if not isinstance(value, (list, tuple)):
            raise _type_error(path, tp, value)
        (item,) = typing.get_args(tp)[:1]
        return tuple(_convert(item, v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin is dict:
        if value is None:  # NeMo-RL writes `env_vars: null` for "none"
            return {}
        if not isinstance(value, dict):
            raise _type_error(path, tp, value)
        out: dict[str, str] = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, (str, int, float)):
                raise ConfigError(f"{path}.{k}: expected a string (or number), got {type(v).__name__} {v!r}")
            out[str(k)] = str(v)
        return out
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path)
    if tp is bool:
        if not isinstance(value, bool):
            raise _type_error(path, tp, value)
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise _type_error(path, tp, value)
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _type_error(path, tp, value)
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _type_error(path, tp, value)
        return value
    raise TypeError(f"schema type {tp!r} at {path} is not handled by the config converter")  # schema bug


def _schema_paths(cls: type, path: str = "") -> list[str]:
    """Every dotted key of the schema dataclass ``cls`` (sections included), e.g. ``policy.megatron_cfg.optimizer.lr``."""
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        full = f"{path}.{f.name}" if path else f.name
        out.append(full)
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += _schema_paths(tp, full)
    return out


def _key_elsewhere(key: str, path: str) -> str:
    """A hint naming where ``key`` (a leaf name) is a key of another section, ``""`` when it is none."""
    places = [p for p in _schema_paths(RunConfig) if p.rsplit(".", 1)[-1] == key and p.rsplit(".", 1)[0] != path]
    if not places:
        return ""
    return f"'{key}' is a key of another section: {' or '.join(places[:3])}; "


def build_dataclass(cls: type[T], data: object, path: str = "") -> T:
    """Build a schema dataclass from a plain mapping, strictly.

    Args:
        cls: a frozen schema dataclass (``RunConfig`` or a section).
        data: mapping of key -> value (``None`` means all defaults).
        path: dotted path of ``data`` in the whole config, for messages.

    Raises:
        ConfigError: unknown key (with a did-you-mean and the valid keys), type mismatch, or an alias given
            together with its canonical key.
    """
    where = path or "the config root"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__} {data!r}")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a schema dataclass")  # programming error, not a config error
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in dataclasses.fields(cls)]
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    value_aliases: dict[str, dict[str, str]] = getattr(cls, "VALUE_ALIASES", {})
    kwargs: dict[str, object] = {}
    for key, value in data.items():
        key = str(key)
        name = aliases.get(key, key)
        full = f"{path}.{key}" if path else key
        if name not in names:
            valid = names + list(aliases)
            close = difflib.get_close_matches(key, valid, n=1, cutoff=0.6)
            hint = f"did you mean '{(path + '.') if path else ''}{close[0]}'? " if close else _key_elsewhere(key, path)
            raise ConfigError(f"unknown key '{full}'; {hint}valid keys in {where}: {', '.join(names)}")
        if name in kwargs:
            raise ConfigError(
                f"'{full}' and '{(path + '.') if path else ''}{name}' are the same setting ('{key}' is an alias); "
                "give only one"
            )
        if name != key:
            logger.debug("config: %s is an alias of %s", full, name)
        if isinstance(value, str) and value in value_aliases.get(name, {}):
            logger.debug("config: %s: %r is an alias of %r", full, value, value_aliases[name][value])
            value = value_aliases[name][value]
        kwargs[name] = _convert(hints[name], value, f"{path}.{name}" if path else name)
    return cls(**kwargs)
