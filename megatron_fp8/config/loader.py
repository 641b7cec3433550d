"""Load a :class:`~megatron_fp8.config.schema.RunConfig` from YAML plus dotted overrides.

The file is composed as NeMo-RL composes it (``defaults:`` parents, ``_override_``; see
:mod:`megatron_fp8.config.nemo_rl.inheritance`), the overrides
(``policy.generation.vllm_cfg.precision=fp8``) are merged on top, then interpolations and
NeMo-RL's resolvers resolve against the whole tree. The keys are then of three kinds:
those the schema implements (converted strictly, :mod:`megatron_fp8.config.convert`: type errors name the key
and the expected type), NeMo-RL keys megatron-fp8 does not implement (dropped, listed once in a
warning; :mod:`megatron_fp8.config.nemo_rl.keys`), and unknown keys (rejected with a
did-you-mean that names the full dotted path). Keys not given keep the schema defaults.
Then the model dimensions are filled from :mod:`megatron_fp8.models.dims` and the
cross-field rules of :mod:`megatron_fp8.config.validate` run.
"""

from __future__ import annotations

import dataclasses
import logging
import textwrap
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_fp8.config.algorithm_rules import low_cap_warning
from megatron_fp8.config.convert import build_dataclass
from megatron_fp8.config.nemo_rl import inheritance
from megatron_fp8.config.nemo_rl.datasets import translate_dataset_keys
from megatron_fp8.config.nemo_rl.importance_sampling import translate_is_keys
from megatron_fp8.config.nemo_rl.inheritance import ComposedTree, compose_file, compose_text, merge_trees, resolve
from megatron_fp8.config.nemo_rl.keys import known_keys
from megatron_fp8.config.schema import JSONValue, RunConfig
from megatron_fp8.config.validate import validate_config
from megatron_fp8.errors import ConfigError, UsageError
from megatron_fp8.models.dims import known_dims

logger = logging.getLogger(__name__)

DEFAULT_CONFIG_NAME = "tiny_cpu.yaml"
"""File name of the embedded default, shipped as package data in ``megatron_fp8/config/defaults/``."""


def default_config_text() -> str:
    """The embedded default config (``megatron_fp8/config/defaults/tiny_cpu.yaml``) as text."""
    return resources.files("megatron_fp8.config").joinpath("defaults", DEFAULT_CONFIG_NAME).read_text()


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
