"""Config files as NeMo-RL writes them: ``defaults:`` inheritance, ``_override_``, interpolation, resolvers.

Semantics (those of NeMo-RL's ``load_config_with_inheritance``, re-implemented here):

* ``defaults:`` at the top of a file names one parent (a string) or several (a list). Relative paths
  are relative to the directory of the file that names them; absolute paths are taken as they are.
  Parents are composed depth-first (a parent's own ``defaults`` first) and merged in list order, then
  the file itself is merged on top: later wins.
* Merging is recursive for mappings; anything else (scalars, lists, ``null``) replaces. A ``???``
  (OmegaConf's "mandatory") in a child does not replace a parent's value.
* A mapping carrying ``_override_: true`` replaces the parent's mapping at that key instead of merging
  into it (NeMo-RL honours the marker on top-level sections; it is honoured at any depth here). The
  marker itself is dropped.
* After the whole tree is composed (and the dotted command-line overrides merged), OmegaConf
  interpolations resolve against the final tree, so ``${policy.max_total_sequence_length}`` in a
  parent sees the child's value. NeMo-RL's resolvers are available: ``add``, ``mul``, ``div``, ``max``
  (two arguments each).

Every leaf remembers the file that set it last (:attr:`ComposedTree.sources`), which is what
``megatron-fp8 config --explain`` prints. Errors name the file (and line/column, or the key).
"""

from __future__ import annotations

import logging
import operator
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from megatron_fp8.config.schema import JSONValue
from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULTS_KEY = "defaults"
"""Top-level key naming the parent file(s)."""

OVERRIDE_MARKER = "_override_"
"""Key inside a mapping: replace the parent's mapping instead of merging into it."""

MANDATORY = "???"
"""OmegaConf's mandatory-value marker: never replaces an inherited value."""

OVERRIDE_SOURCE = "<override>"
"""Source name of values given as dotted command-line overrides."""

RESOLVERS: Mapping[str, Callable[[object, object], object]] = {
    "add": operator.add,
    "mul": operator.mul,
    "div": operator.truediv,
    "max": max,
}
"""NeMo-RL's OmegaConf resolvers (``${mul:a,b}``): name -> two-argument function."""


@dataclass(frozen=True)
class ComposedTree:
    """A composed but not yet resolved config tree.

    Attributes:
        data: the merged tree (plain nested dicts; interpolation strings still unresolved).
        sources: dotted leaf path -> the file (or :data:`OVERRIDE_SOURCE`) that set it last.
        files: every file read, parents before children.
    """

    data: dict[str, JSONValue]
    sources: dict[str, str]
    files: tuple[Path, ...]


MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB): anything bigger is a wrong path (a checkpoint, a dataset), refused at once."""


def register_resolvers() -> None:
    """Register :data:`RESOLVERS` with OmegaConf (idempotent; an existing resolver of the name is kept)."""
    for name, fn in RESOLVERS.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def read_yaml(text: str, *, where: str) -> dict[str, JSONValue]:
    """Parse one YAML document into a plain mapping (interpolations left as strings).

    Args:
        text: the YAML text.
        where: the file name (or a description) for messages.

    Raises:
        ConfigError: malformed YAML (with line and column), or a top level that is not a mapping.
    """
    try:
        cfg = OmegaConf.create(text) if text.strip() else OmegaConf.create({})
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        raise ConfigError(f"{where}{at}: malformed YAML: {exc.problem or exc}") from exc
    except (yaml.YAMLError, OmegaConfBaseException) as exc:
        raise ConfigError(f"{where}: cannot parse YAML: {_first_line(exc)}") from exc
    if not OmegaConf.is_dict(cfg):
        raise ConfigError(f"{where}: the top level must be a YAML mapping, got a list")
    plain = OmegaConf.to_container(cfg, resolve=False)
    return nest_dotted_keys(plain, where=where) if isinstance(plain, dict) else {}


def nest_dotted_keys(data: dict, *, where: str, prefix: str = "") -> dict[str, JSONValue]:
    """A mapping whose dotted keys are read as nesting, as on the command line: ``{"grpo.max_num_steps": 3}`` ->
    ``{"grpo": {"max_num_steps": 3}}`` (at any depth; merged with the nested spelling of the same section).

    Raises:
        ConfigError: one setting given twice (dotted and nested), or a dotted key through a value that is not a
            mapping; the message names the file and both spellings.
    """
    out: dict[str, JSONValue] = {}
    spelled: dict[str, str] = {}  # dotted path in out -> how the file spelled it
    for raw_key, value in data.items():
        key = str(raw_key)
        parts = key.split(".")
        if any(not p for p in parts):
            raise ConfigError(f"{where}: key {prefix + key!r} has an empty part; write nested mappings or a.b.c")
        if isinstance(value, dict):
            value = nest_dotted_keys(value, where=where, prefix=f"{prefix}{key}.")
        target = out
        for i, part in enumerate(parts[:-1]):
            nxt = target.setdefault(part, {})
            if not isinstance(nxt, dict):
                path = prefix + ".".join(parts[: i + 1])
                raise ConfigError(
                    f"{where}: {prefix + key!r} goes through {path!r}, which {spelled.get(path, path)!r} sets to a "
                    "value, not a mapping; keep one of them"
                )
            target = nxt
        leaf = parts[-1]
        path = prefix + key
        if leaf in target:
            old, new = target[leaf], value
            if isinstance(old, dict) and isinstance(new, dict):
                _merge_disjoint(old, new, where=where, path=path, spelled=spelled, by=path)
                continue
            raise ConfigError(
                f"{where}: {path!r} is given twice (as {spelled.get(path, path)!r} and as {key!r} under "
                f"{prefix.rstrip('.') or 'the top level'}); keep one of them"
            )
        target[leaf] = value
        spelled[path] = path
    return out


def _merge_disjoint(old: dict, new: dict, *, where: str, path: str, spelled: dict[str, str], by: str) -> None:
    """Merge ``new`` into ``old`` (the same section spelled two ways); a leaf in both is refused."""
    for k, v in new.items():
        if k in old and isinstance(old[k], dict) and isinstance(v, dict):
            _merge_disjoint(old[k], v, where=where, path=f"{path}.{k}", spelled=spelled, by=by)
        elif k in old:
            raise ConfigError(f"{where}: '{path}.{k}' is given twice (nested and dotted, via {by!r}); keep one of them")
        else:
            old[k] = v


def check_config_size(path: str | Path) -> None:
    """Refuse a config file larger than :data:`MAX_CONFIG_BYTES` by its size alone, before any byte is parsed.

    Raises:
        ConfigError: naming the file, its size and the limit.
        OSError: the file cannot be stat'ed (the caller names it).
    """
    size = Path(path).stat().st_size
    if size > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path} is {size / 2**20:.1f} MiB ({size} bytes), not a config file (the limit is "
            f"{MAX_CONFIG_BYTES >> 20} MiB; NeMo-RL's largest example is ~10 KiB): check the --config path"
        )


def compose_file(path: str | Path) -> ComposedTree:
    """Read ``path`` and its ``defaults:`` parents (recursively) into one unresolved tree.

    Raises:
        ConfigError: a missing file or parent (naming the file that names it), a malformed ``defaults``
            entry, an inheritance cycle, or malformed YAML (line/column).
    """
    p = Path(path)
    if p.is_dir():
        found = sorted(q.name for q in p.glob("*.yaml"))[:3]
        example = f" (it holds {', '.join(found)}{', ...' if len(found) == 3 else ''})" if found else ""
        raise ConfigError(
            f"config {str(p)!r} is a directory{example}; pass one YAML file of it, e.g. --config {p / 'NAME.yaml'}"
        )
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} not found; pass an existing YAML file or omit --config")
    files: list[Path] = []
    data, sources = _compose(p.resolve(), chain=(), files=files)
    return ComposedTree(data=data, sources=sources, files=tuple(files))


def compose_text(text: str, *, where: str) -> ComposedTree:
    """One YAML text without parents (the embedded default); ``defaults:`` is refused (no directory)."""
    data = read_yaml(text, where=where)
    if DEFAULTS_KEY in data:
        raise ConfigError(f"{where}: 'defaults:' needs a config file on disk to resolve parents against")
    overridden: list[str] = []
    _strip_markers(data, "", overridden)
    return ComposedTree(data=data, sources={k: where for k in leaf_paths(data)}, files=())


def _parents(data: dict[str, JSONValue], path: Path) -> list[Path]:
    raw = data.pop(DEFAULTS_KEY, None)
    if raw is None:
        return []
    entries = [raw] if isinstance(raw, str) else raw
    if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
        raise ConfigError(f"{path}: 'defaults' must be a file name or a list of file names, got {raw!r}")
    out: list[Path] = []
    for entry in entries:
        parent = Path(entry) if Path(entry).is_absolute() else path.parent / entry
        if not parent.is_file():
            raise ConfigError(
                f"{path}: parent config {entry!r} named in 'defaults' not found (looked for {parent}); "
                "fix the path (relative paths are relative to this file's directory)"
            )
        out.append(parent.resolve())
    return out


def _compose(path: Path, *, chain: tuple[Path, ...], files: list[Path]) -> tuple[dict[str, JSONValue], dict[str, str]]:
    if path in chain:
        cycle = " -> ".join(str(c) for c in (*chain[chain.index(path) :], path))
        raise ConfigError(f"inheritance cycle in 'defaults': {cycle}; remove one of these parents")
    try:
        check_config_size(path)
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path} is not a text (YAML) file: check the --config path") from exc
    own = read_yaml(text, where=str(path))
    parents = _parents(own, path)
    base: dict[str, JSONValue] = {}
    base_sources: dict[str, str] = {}
    for parent in parents:
        parent_data, parent_sources = _compose(parent, chain=(*chain, path), files=files)
        base, base_sources = merge_trees(base, base_sources, parent_data, parent_sources)
    files.append(path)
    return merge_trees(base, base_sources, own, {k: str(path) for k in leaf_paths(own)})


def merge_trees(
    base: dict[str, JSONValue],
    base_sources: dict[str, str],
    top: dict[str, JSONValue],
    top_sources: Mapping[str, str],
) -> tuple[dict[str, JSONValue], dict[str, str]]:
    """``top`` merged onto ``base`` (module docstring rules), with the merged per-leaf sources.

    Neither input is modified. ``top_sources`` names the source of ``top``'s leaves (computed before
    ``_override_`` markers are dropped is fine: markers are not leaves).
    """
    top = _copy(top)
    overridden: list[str] = []
    _strip_markers(top, "", overridden)
    merged = _copy(base)
    for prefix in overridden:
        _delete(merged, prefix)
    sources = {k: v for k, v in base_sources.items() if not any(_under(k, p) for p in overridden)}
    _deep_merge(merged, top)
    for key in leaf_paths(top):
        value = _value_at(top, key)
        if value == MANDATORY and key in sources:
            continue  # "???" never replaces an inherited value
        if not isinstance(value, dict):  # a scalar/list/null replaces whatever subtree was there
            for stale in [k for k in sources if k.startswith(key + ".")]:
                del sources[stale]
        sources[key] = top_sources.get(key, OVERRIDE_SOURCE)
    # a scalar/list/null replacing a mapping drops the mapping's leaves
    live = set(leaf_paths(merged))
    return merged, {k: v for k, v in sources.items() if k in live}


def resolve(tree: ComposedTree) -> dict[str, JSONValue]:
    """Resolve every interpolation of ``tree`` against the whole tree.

    Raises:
        ConfigError: an unknown key referenced, an interpolation cycle, an unknown resolver or a resolver
            that failed, each naming the key and the file that set it.
    """
    register_resolvers()
    try:
        cfg = OmegaConf.create(tree.data)
        plain = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        key = getattr(exc, "full_key", None) or "?"
        where = tree.sources.get(str(key)) or (tree.files[-1] if tree.files else "the config")
        reason = _first_line(exc)
        unset = re.search(r"Environment variable '([^']+)' not found", reason)
        fix = f"; set {unset[1]}, or give the file a default: ${{oc.env:{unset[1]},VALUE}}" if unset else ""
        raise ConfigError(f"{where}: cannot resolve '{key}': {reason}{fix}") from exc
    return {str(k): v for k, v in plain.items()} if isinstance(plain, dict) else {}


ENV_INTERPOLATION = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)(?:,([^}]*))?\}")
"""``${oc.env:NAME}`` or ``${oc.env:NAME,default}`` in a config value: the variable and its default."""


def env_hints(tree: ComposedTree) -> dict[str, str]:
    """What each value read from an environment variable came from, for messages about that key.

    Returns:
        Dotted leaf path -> e.g. ``"the config sets it as ${oc.env:DATA_DIR,data}/x.jsonl with DATA_DIR unset (its
        default 'data' used): set DATA_DIR, or give data.train.data_path=..."``; only keys whose value names one.
    """
    hints: dict[str, str] = {}
    for key in leaf_paths(tree.data):
        raw = _value_at(tree.data, key)
        found = ENV_INTERPOLATION.findall(raw) if isinstance(raw, str) else []
        if not found:
            continue
        states = [
            f"{name}={os.environ[name]!r}" if name in os.environ else f"{name} unset (its default {default!r} used)"
            for name, default in found
        ]
        names = " / ".join(dict.fromkeys(name for name, _ in found))
        hints[key] = f"the config sets it as {raw} with {', '.join(states)}: set {names}, or give {key}=..."
        if key.endswith(".data_path"):
            hints[key] += '; docs/cluster.md, "Stage the data", has the commands that stage a dataset as local files'
    return hints


def with_env_hints(message: str, hints: Mapping[str, str]) -> str:
    """``message`` with the :func:`env_hints` of every key a line of it starts with (``"  - key: ..."``)."""
    lines = []
    for line in message.splitlines():
        key = line.strip().removeprefix("- ").split(":", 1)[0]
        lines.append(f"{line}; {hints[key]}" if key in hints and hints[key] not in line else line)
    return "\n".join(lines)


def leaf_paths(data: Mapping[str, JSONValue], prefix: str = "") -> list[str]:
    """Dotted paths of the leaves of ``data`` (non-mappings and empty mappings), in order."""
    out: list[str] = []
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            out += leaf_paths(value, path)
        elif key != OVERRIDE_MARKER:
            out.append(path)
    return out


# --------------------------------------------------------------------------- helpers


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _copy(data: JSONValue) -> JSONValue:
    if isinstance(data, dict):
        return {k: _copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_copy(v) for v in data]
    return data


def _strip_markers(data: dict[str, JSONValue], prefix: str, overridden: list[str]) -> None:
    """Drop ``_override_`` markers in place; record the paths whose marker was true."""
    for key, value in list(data.items()):
        if isinstance(value, dict):
            path = f"{prefix}.{key}" if prefix else key
            if value.pop(OVERRIDE_MARKER, False):
                overridden.append(path)
            _strip_markers(value, path, overridden)


def _deep_merge(base: dict[str, JSONValue], top: Mapping[str, JSONValue]) -> None:
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)  # type: ignore[arg-type]
        elif value == MANDATORY and key in base:
            continue
        else:
            base[key] = _copy(value)


def _under(key: str, prefix: str) -> bool:
    return key == prefix or key.startswith(prefix + ".")


def _value_at(data: Mapping[str, JSONValue], dotted: str) -> JSONValue:
    node: JSONValue = dict(data)
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def _delete(data: dict[str, JSONValue], dotted: str) -> None:
    parts = dotted.split(".")
    node: JSONValue = data
    for part in parts[:-1]:
        if not isinstance(node, dict) or part not in node:
            return
        node = node[part]
    if isinstance(node, dict):
        node.pop(parts[-1], None)
