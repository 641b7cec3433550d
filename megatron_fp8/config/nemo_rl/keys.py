"""NeMo-RL's known config keys, kept as data (``keys.yaml``, package data), and why each has no effect.

A key megatron-fp8 does not implement is one of two kinds:

* **known** to NeMo-RL (or retired from megatron-fp8): accepted, listed once at load in a warning
  ("no effect in megatron-fp8: ..."), and shown by ``megatron-fp8 config --explain`` with its reason;
* **unknown**: rejected by the loader with a did-you-mean.

The data file holds ``keys`` (every dotted path, sections included, that NeMo-RL's example configs
use), ``open`` (paths whose contents are free-form in NeMo-RL, e.g. ``vllm_kwargs``: anything below
them is known), ``reasons`` (dotted prefix -> why it has no effect here; the longest matching prefix
wins) and ``retired`` (former megatron-fp8 keys -> why they have no effect now). ``keys`` is
regenerated from a NeMo-RL checkout with :func:`collect_keys`::

    python -m megatron_fp8.config.nemo_rl.keys /path/to/NeMo-RL/examples/configs
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import yaml

from megatron_fp8.config.nemo_rl.inheritance import DEFAULTS_KEY, OVERRIDE_MARKER, read_yaml
from megatron_fp8.errors import ConfigError

logger = logging.getLogger(__name__)

DATA_FILE = "keys.yaml"
"""The key-set file beside this module, ``megatron_fp8/config/nemo_rl/`` (package data)."""

DEFAULT_REASON = "NeMo-RL key that megatron-fp8 does not implement"
"""Reason given when no prefix in the data file's ``reasons`` matches."""


@dataclass(frozen=True)
class KnownKeys:
    """NeMo-RL's key set and the no-effect reasons (see the module docstring).

    Attributes:
        keys: every known dotted path (sections included).
        open: paths below which any key is known.
        reasons: dotted prefix -> why keys under it have no effect in megatron-fp8.
        retired: former megatron-fp8 keys -> why they have no effect now.
        source: where ``keys`` came from (repository, commit, paths).
    """

    keys: frozenset[str]
    open: frozenset[str]
    reasons: Mapping[str, str]
    retired: Mapping[str, str]
    source: str

    def is_known(self, path: str) -> bool:
        """Whether ``path`` (dotted) is a NeMo-RL key, a retired megatron-fp8 key, or under an open one."""
        if path in self.keys or path in self.retired:
            return True
        parts = path.split(".")
        return any(".".join(parts[:i]) in self.open for i in range(1, len(parts)))

    def reason(self, path: str) -> str:
        """Why ``path`` has no effect in megatron-fp8 (longest matching prefix of ``reasons``)."""
        if path in self.retired:
            return self.retired[path]
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            reason = self.reasons.get(".".join(parts[:i]))
            if reason is not None:
                return reason
        return DEFAULT_REASON

    def children(self, prefix: str) -> list[str]:
        """Known key names directly under ``prefix`` (``""`` = top level), for did-you-mean hints."""
        depth = prefix.count(".") + 1 if prefix else 0
        names = {
            k.split(".")[depth]
            for k in (*self.keys, *self.retired)
            if (k.startswith(prefix + ".") if prefix else True) and k.count(".") >= depth
        }
        return sorted(names)


@functools.cache
def known_keys() -> KnownKeys:
    """The shipped key set (``megatron_fp8/config/nemo_rl/keys.yaml``), read once."""
    text = resources.files("megatron_fp8.config.nemo_rl").joinpath(DATA_FILE).read_text()
    return parse_known_keys(text, where=DATA_FILE)


def parse_known_keys(text: str, *, where: str) -> KnownKeys:
    """Parse a key-set file (the format of ``keys.yaml``).

    Raises:
        ConfigError: a missing section or a section of the wrong shape.
    """
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping with keys, open, reasons, retired")
    keys, open_, reasons, retired = (data.get(k) for k in ("keys", "open", "reasons", "retired"))
    if not isinstance(keys, list) or not isinstance(open_, list):
        raise ConfigError(f"{where}: 'keys' and 'open' must be lists of dotted paths")
    if not isinstance(reasons, dict) or not isinstance(retired, dict):
        raise ConfigError(f"{where}: 'reasons' and 'retired' must be mappings of dotted path -> reason")
    all_keys = {str(k) for k in keys}
    for key in list(all_keys):  # every section above a key is a key too
        parts = key.split(".")
        all_keys.update(".".join(parts[:i]) for i in range(1, len(parts)))
    return KnownKeys(
        keys=frozenset(all_keys),
        open=frozenset(str(k) for k in open_),
        reasons={str(k): str(v) for k, v in reasons.items()},
        retired={str(k): str(v) for k, v in retired.items()},
        source=str(data.get("source", "")),
    )


def collect_keys(config_dir: str | Path) -> tuple[list[str], list[str]]:
    """Every dotted key path used by the YAML files under ``config_dir``, and the free-form (``{}``) ones.

    Each file is read on its own (``defaults`` and ``_override_`` dropped, interpolations unresolved);
    lists are leaves (their items are not walked).

    Returns:
        ``(keys, open)``: sorted dotted paths (leaves and sections), and the paths whose value is an empty
        mapping in some file.
    """
    keys: set[str] = set()
    open_: set[str] = set()

    def walk(node: Mapping[str, object], prefix: str) -> None:
        for key, value in node.items():
            if key in (DEFAULTS_KEY, OVERRIDE_MARKER) and not prefix or key == OVERRIDE_MARKER:
                continue
            path = f"{prefix}.{key}" if prefix else str(key)
            keys.add(path)
            if isinstance(value, dict):
                if not value:
                    open_.add(path)
                walk(value, path)

    for path in sorted(Path(config_dir).rglob("*.yaml")):
        try:
            walk(read_yaml(path.read_text(), where=str(path)), "")
        except ConfigError as exc:
            logger.warning("skipping %s: %s", path, exc)
    return sorted(keys), sorted(open_)


def main(argv: list[str] | None = None) -> int:
    """Print the ``keys`` and ``open`` sections for a NeMo-RL ``examples/configs`` folder (as YAML)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        logger.error("usage: python -m megatron_fp8.config.nemo_rl.keys NEMO_RL/examples/configs")
        return 2
    keys, open_ = collect_keys(args[0])
    sys.stdout.write(yaml.safe_dump({"open": open_, "keys": keys}, sort_keys=False, width=120))
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    raise SystemExit(main())
