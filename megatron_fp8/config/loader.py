"""Load a :class:`~megatron_fp8.config.schema.RunConfig` from YAML plus dotted overrides.

The file is composed as NeMo-RL composes it (``defaults:`` parents, ``_override_``; see
:mod:`megatron_fp8.config.nemo_rl.inheritance`), the overrides
(``policy.generation.vllm_cfg.precision=fp8``) are merged on top, then interpolations and
NeMo-RL's resolvers resolve against the whole tree. The keys are then of three kinds:
those the schema implements (converted strictly: type errors name the key and the
expected type), NeMo-RL keys megatron-fp8 does not implement (dropped, listed once in a
warning; :mod:`megatron_fp8.config.nemo_rl.keys`), and unknown keys (rejected with a
did-you-mean that names the full dotted path). Keys not given keep the schema defaults.
Then the model dimensions are filled from :mod:`megatron_fp8.config.models` and the
cross-field rules of :mod:`megatron_fp8.config.validate` run.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_fp8.config.algorithm_rules import low_cap_warning
from megatron_fp8.config.models import known_dims
from megatron_fp8.config.nemo_rl import inheritance
from megatron_fp8.config.nemo_rl.datasets import translate_dataset_keys
from megatron_fp8.config.nemo_rl.importance_sampling import translate_is_keys
from megatron_fp8.config.nemo_rl.inheritance import ComposedTree, compose_file, compose_text, merge_trees, resolve
from megatron_fp8.config.nemo_rl.keys import known_keys
from megatron_fp8.config.schema import JSONValue, OneOf, RunConfig
from megatron_fp8.config.validate import validate_config
from megatron_fp8.errors import ConfigError, UsageError

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_CONFIG_NAME = "tiny_cpu.yaml"
"""File name of the embedded default, shipped as package data in ``megatron_fp8/config/defaults/``."""


def default_config_text() -> str:
    """The embedded default config (``megatron_fp8/config/defaults/tiny_cpu.yaml``) as text."""
    return resources.files("megatron_fp8.config").joinpath("defaults", DEFAULT_CONFIG_NAME).read_text()


# --------------------------------------------------------------------------- strict conversion


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


# --------------------------------------------------------------------------- loading


@dataclass(frozen=True)
class LoadedConfig:
    """A loaded config and how it was put together (what ``megatron-fp8 config --explain`` prints).

    Attributes:
        config: the frozen, validated run config.
        no_effect: dotted path -> value of every key given that megatron-fp8 does not implement (the
            top-most such path: a whole NeMo-RL section is one entry).
        sources: dotted leaf path -> the file (or ``<override>``) that set it; keys not listed kept the
            schema default.
        files: every config file read, parents before children (empty for the embedded default).
        translated: NeMo-RL keys read through megatron-fp8's own (its IS keys, :mod:`.nemo_rl.importance_sampling`;
            a staged ``dataset_name``, :mod:`.nemo_rl.datasets`) -> value.
        env: dotted path -> where its ``${oc.env:NAME}`` value came from (:func:`.nemo_rl.inheritance.env_hints`).
    """

    config: RunConfig
    no_effect: dict[str, JSONValue]
    sources: dict[str, str]
    files: tuple[Path, ...]
    translated: dict[str, JSONValue] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


MOVED_KEYS: dict[str, str] = {
    "grpo.learning_rate": "policy.megatron_cfg.optimizer.lr",
    "grpo.max_new_tokens": "policy.generation.max_new_tokens",
    "grpo.temperature": "policy.generation.temperature",
    "grpo.warmup_steps": "policy.megatron_cfg.scheduler.lr_warmup_iters",
    "grpo.num_steps": "grpo.max_num_steps",
}
"""megatron-fp8's former keys for settings NeMo-RL has a key for: read for one more release (each source's value
moves to NeMo-RL's key, with a warning naming it), never written out. NeMo-RL's key is the one vocabulary."""


def _move_keys(data: JSONValue, where: str, renames: list[tuple[str, str]]) -> JSONValue:
    """Move every :data:`MOVED_KEYS` entry of one source (a file or the overrides) to NeMo-RL's key.

    Raises:
        ConfigError: the source gives both spellings.
    """
    if not isinstance(data, dict):
        return data
    for old, new in MOVED_KEYS.items():
        *old_parents, old_leaf = old.split(".")
        parent = data
        for part in old_parents:
            parent = parent.get(part) if isinstance(parent, dict) else None
        if not isinstance(parent, dict) or old_leaf not in parent:
            continue
        value = parent.pop(old_leaf)
        *new_parents, new_leaf = new.split(".")
        target = data
        for part in new_parents:
            nxt = target.get(part) if isinstance(target, dict) else None
            if nxt is None:
                nxt = target[part] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"{where}: {'.'.join(new_parents)} must be a mapping to hold {new}")
            target = nxt
        if new_leaf in target:
            raise ConfigError(f"{where} gives {old} and {new}, the same setting: keep {new} (NeMo-RL's key)")
        target[new_leaf] = value
        renames.append((old, new))
        logger.warning(
            "%s: %s is read as NeMo-RL's %s; write that key (the old name goes in a later release)", where, old, new
        )
    return data


MAX_OVERRIDE_BYTES = 64 << 10
"""Longest ``key=value`` override read (64 KiB; a path, a list of arms or a number is far shorter): a longer one is
refused by its size, before it is parsed."""


def _parse_overrides(overrides: Sequence[str]) -> dict[str, JSONValue]:
    cleaned: list[str] = []
    for item in overrides:
        size = len(item.encode())
        if size > MAX_OVERRIDE_BYTES:
            key = item.split("=", 1)[0][:80]
            raise UsageError(
                f"override {key}=... is {size} bytes (the limit is {MAX_OVERRIDE_BYTES} bytes); put a long value "
                "in a config file (--config) or the file it names, not on the command line"
            )
        text = item.lstrip("+")
        if "=" not in text or text.startswith("="):
            raise UsageError(f"override {item!r} is not of the form dotted.key=value (e.g. grpo.max_num_steps=3)")
        cleaned.append(text)
    try:
        plain = OmegaConf.to_container(OmegaConf.from_dotlist(cleaned), resolve=False)
    except (OmegaConfBaseException, yaml.YAMLError) as exc:  # a malformed value: a usage error (exit 2)
        reason = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
        raise UsageError(
            f"cannot parse overrides {list(overrides)}: {reason} (a value is not valid YAML: close its [ or {{)"
        ) from exc
    return {str(k): v for k, v in plain.items()} if isinstance(plain, dict) else {}


def _compose(path: str | Path | None, overrides: Sequence[str]) -> tuple[dict[str, JSONValue], ComposedTree]:
    """File (with its parents) + overrides, aliases renamed per source, then every interpolation resolved."""
    tree = compose_file(path) if path is not None else compose_text(default_config_text(), where=DEFAULT_CONFIG_NAME)
    renames: list[tuple[str, str]] = []
    # Aliases are renamed per source first, so an override spelled with an alias replaces the file's value.
    where = str(path) if path is not None else DEFAULT_CONFIG_NAME
    base = _canonicalize(_move_keys(tree.data, where, renames), RunConfig, "", renames)
    sources = dict(tree.sources)
    for old, new in renames:
        for key in [k for k in sources if k == old or k.startswith(old + ".")]:
            sources[new + key[len(old) :]] = sources.pop(key)
    over = _canonicalize(_move_keys(_parse_overrides(overrides), "the overrides", []), RunConfig, "", [])
    merged, merged_sources = merge_trees(base, sources, over, {})
    composed = ComposedTree(data=merged, sources=merged_sources, files=tree.files)
    return resolve(composed), composed


def _section_type(tp: object) -> type | None:
    """The schema dataclass inside ``tp`` (unwrapping ``X | None``), else ``None``."""
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        for arg in typing.get_args(tp):
            if isinstance(arg, type) and dataclasses.is_dataclass(arg):
                return arg
    return None


def _canonicalize(data: JSONValue, cls: type, path: str, renames: list[tuple[str, str]]) -> JSONValue:
    """Rename alias keys to their canonical names, recursively (unknown keys are left for the converter).

    Each rename is appended to ``renames`` as ``(old dotted path, new dotted path)``.
    """
    if not isinstance(data, dict):
        return data
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    prefix = f"{path}." if path else ""
    out: dict[str, JSONValue] = {}
    for key, value in data.items():
        name = aliases.get(str(key), str(key))
        if name in out:
            raise ConfigError(
                f"'{prefix}{key}' and '{prefix}{name}' are the same setting (one is an alias); give only one"
            )
        if name != key:
            renames.append((prefix + str(key), prefix + name))
        out[name] = value
    hints = typing.get_type_hints(cls)
    for name, value in out.items():
        section = _section_type(hints[name]) if name in hints else None
        if section is not None:
            out[name] = _canonicalize(value, section, prefix + name, renames)
    return out


def partition_keys(data: Mapping[str, JSONValue], cls: type = RunConfig, path: str = "") -> tuple[dict, dict]:
    """Split a config tree into the keys the schema implements and the known keys it does not.

    Args:
        data: a plain config tree (aliases already canonical).
        cls: the schema dataclass of ``data``.
        path: dotted path of ``data``.

    Returns:
        ``(implemented, no_effect)``: ``implemented`` is ``data`` without the known-but-unimplemented
        keys (unknown keys stay in it, for the converter's did-you-mean); ``no_effect`` maps the dotted
        path of each removed key to its value.
    """
    known = known_keys()
    hints = typing.get_type_hints(cls)
    prefix = f"{path}." if path else ""
    implemented: dict[str, JSONValue] = {}
    no_effect: dict[str, JSONValue] = {}
    for key, value in data.items():
        full = prefix + str(key)
        if key in hints:
            section = _section_type(hints[key])
            if section is not None and isinstance(value, dict):
                value, below = partition_keys(value, section, full)
                no_effect.update(below)
            implemented[key] = value
        elif known.is_known(full):
            no_effect[full] = value
        else:
            implemented[key] = value
    return implemented, no_effect


def no_effect_message(no_effect: Mapping[str, JSONValue], width: int = 80) -> str:
    """The one warning listing the keys given that have no effect: a header, then one line per section with its
    keys, wrapped to ``width`` columns."""
    groups: dict[str, list[str]] = {}
    for key in no_effect:
        head, _, rest = key.rpartition(".")
        groups.setdefault(head, []).append(rest)
    lines = [
        f"no effect in megatron-fp8 ({len(no_effect)} NeMo-RL key(s) it does not implement; "
        "`megatron-fp8 config --explain` says why):"
    ]
    for head, names in groups.items():
        lines.extend(
            textwrap.wrap(
                ", ".join(names), width=width, initial_indent=f"  {head or '(top)'}: ", subsequent_indent="      "
            )
        )
    return "\n".join(lines)


def _reconcile_model_name(raw: dict[str, JSONValue]) -> None:
    policy = raw.get("policy")
    if not isinstance(policy, dict) or policy.get("model_name") is None:
        return
    model = raw.setdefault("model", {})
    if not isinstance(model, dict):
        return
    given = model.get("name_or_path")
    if given is not None and given != policy["model_name"]:
        raise ConfigError(
            f"policy.model_name ({policy['model_name']!r}) and model.name_or_path ({given!r}) disagree; "
            "give one of them"
        )
    model["name_or_path"] = policy["model_name"]


def _fill_model(cfg: RunConfig) -> RunConfig:
    m = cfg.model
    dims = known_dims(m.name_or_path)
    updates: dict[str, object] = {}
    if dims is not None:
        for key in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "moe_intermediate_size",
            "num_experts",
        ):
            if getattr(m, key) is None:
                updates[key] = getattr(dims, key)
    if m.is_moe is None:
        experts = updates.get("num_experts", m.num_experts)
        updates["is_moe"] = bool(experts)
    if not updates:
        return cfg
    return dataclasses.replace(cfg, model=dataclasses.replace(m, **updates))


def _arms_follow_the_rollout(raw: Mapping[str, JSONValue], cfg: RunConfig) -> RunConfig:
    """Without ``grpo.arms``, the arms follow the rollout precision and ``loss_fn.use_importance_sampling_correction``:
    a NeMo-RL file runs the one arm it describes (``bf16``; ``fp8`` or ``fp8_tis`` as the key says). With an FP8
    rollout and the key not given, the three arms of :data:`megatron_fp8.vocab.ARMS` (the side-by-side comparison)."""
    grpo = raw.get("grpo")
    if isinstance(grpo, dict) and "arms" in grpo:
        return cfg
    switch = cfg.loss_fn.use_importance_sampling_correction
    fp8 = cfg.policy.generation.vllm_cfg.precision == "fp8"
    if fp8 and switch is None:
        return cfg
    arm = ("fp8_tis" if switch else "fp8") if fp8 else "bf16"
    said = "not given" if switch is None else str(switch).lower()
    logger.info(
        "grpo.arms not given: the %s rollout with loss_fn.use_importance_sampling_correction %s runs the %s arm%s "
        "(set grpo.arms to choose)",
        "FP8" if fp8 else "BF16",
        said,
        arm,
        ", corrected (weights near 1, as NeMo-RL)" if switch and not fp8 else "",
    )
    return dataclasses.replace(cfg, grpo=dataclasses.replace(cfg.grpo, arms=(arm,)))


def _build(implemented: Mapping[str, JSONValue]) -> RunConfig:
    raw = dict(implemented)
    _reconcile_model_name(raw)
    cfg = _arms_follow_the_rollout(raw, _fill_model(build_dataclass(RunConfig, raw)))
    validate_config(cfg)
    return cfg


def config_from_dict(data: Mapping[str, JSONValue]) -> RunConfig:
    """Build and validate a :class:`RunConfig` from a plain nested dict (e.g. :meth:`RunConfig.to_dict`).

    Known NeMo-RL keys megatron-fp8 does not implement are dropped with one warning.

    Raises:
        ConfigError: unknown keys, type errors, or a failed cross-field rule.
    """
    implemented, no_effect = partition_keys(_canonicalize(dict(data), RunConfig, "", []))
    config = _build(implemented)
    _warn_no_effect(no_effect, config)
    return config


def _warn_no_effect(no_effect: Mapping[str, JSONValue], config: RunConfig) -> None:
    """One warning listing the no-effect keys, less a ``dataset_name`` without a ``data_path``: the run is refused
    for it (:func:`megatron_fp8.config.refusals.unstaged_datasets`), a warning first would say it runs."""
    splits = [s for s in ("train", "validation") if getattr(getattr(config.data, s), "data_path", None) is None]
    unstaged = {f"data.{s}.dataset_name" for s in splits}
    shown = {k: v for k, v in no_effect.items() if k not in unstaged}
    if shown:
        logger.warning("%s", no_effect_message(shown))


def load_config_report(path: str | Path | None = None, overrides: Sequence[str] = ()) -> LoadedConfig:
    """:func:`load_config`, also returning the no-effect keys and where each value came from.

    Logs one warning listing the keys given that have no effect in megatron-fp8.

    Raises:
        ConfigError: as :func:`load_config`.
    """
    raw, composed = _compose(path, list(overrides))
    read = translate_is_keys(raw, composed.sources, composed.files)  # NeMo-RL's IS keys -> the correction run
    read |= translate_dataset_keys(raw, composed.sources)  # NeMo-RL's named datasets, staged locally
    implemented, no_effect = partition_keys(raw)
    config = _build(implemented)
    _warn_no_effect(no_effect, config)
    cap_warning = low_cap_warning(config.loss_fn, config.grpo.arms)
    if cap_warning:
        logger.warning("%s", cap_warning)
    return LoadedConfig(
        config=config,
        no_effect=no_effect,
        sources=composed.sources,
        files=composed.files,
        translated=read,
        env=inheritance.env_hints(composed),
    )


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Load, override, fill in and validate a run config.

    The file may be a NeMo-RL config as it is: ``defaults:`` parents, ``_override_``, interpolations and
    NeMo-RL's resolvers (:mod:`megatron_fp8.config.nemo_rl.inheritance`). NeMo-RL keys megatron-fp8 does not
    implement are accepted and listed once in a warning (:mod:`megatron_fp8.config.nemo_rl.keys`).

    Args:
        path: a YAML file; ``None`` loads the embedded default (``tiny_cpu.yaml``, package data).
        overrides: dotted ``key=value`` strings applied after the file (``grpo.max_num_steps=3``); values are
            parsed as YAML scalars / flow lists (``grpo.arms=[bf16,fp8]``); interpolations in the file
            see the overridden values.

    Returns:
        The frozen, validated :class:`RunConfig`.

    Raises:
        ConfigError: missing or unparsable file (line/column), missing parent, interpolation or resolver
            failure, malformed override, unknown key (did-you-mean), type error, or a failed cross-field
            rule; each message names the file or dotted key and the fix.
    """
    return load_config_report(path, overrides).config
