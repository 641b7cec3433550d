"""NeMo-RL config composition: defaults (string, list, relative, chains), _override_, interpolation, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_fp8.config.loader import load_config, load_config_report
from megatron_fp8.config.nemo_rl.inheritance import OVERRIDE_SOURCE, compose_file, resolve
from megatron_fp8.errors import ConfigError


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _load(path: Path) -> dict:
    return resolve(compose_file(path))


def test_string_parent_chain_and_relative_paths(tmp_path):
    _write(tmp_path / "base.yaml", "a: 1\nsec: {x: 1, y: 2}\n")
    _write(tmp_path / "mid" / "mid.yaml", "defaults: ../base.yaml\nsec: {y: 3}\nb: 2\n")
    child = _write(tmp_path / "mid" / "deep" / "child.yaml", "defaults: ../mid.yaml\nsec: {x: 9}\n")
    tree = compose_file(child)
    assert resolve(tree) == {"a": 1, "sec": {"x": 9, "y": 3}, "b": 2}
    assert [p.name for p in tree.files] == ["base.yaml", "mid.yaml", "child.yaml"]
    assert Path(tree.sources["a"]).name == "base.yaml"
    assert Path(tree.sources["sec.y"]).name == "mid.yaml"
    assert Path(tree.sources["sec.x"]).name == "child.yaml"


def test_list_parents_later_wins_and_absolute_path(tmp_path):
    one = _write(tmp_path / "one.yaml", "v: 1\nonly_one: true\n")
    _write(tmp_path / "two.yaml", "v: 2\n")
    child = _write(tmp_path / "c.yaml", f"defaults:\n  - {one}\n  - two.yaml\n")
    assert _load(child) == {"v": 2, "only_one": True}


def test_override_marker_replaces_section_at_any_depth(tmp_path):
    _write(tmp_path / "p.yaml", "data: {a: 1, b: 2}\npolicy: {gen: {x: 1, y: 2}, keep: 1}\n")
    child = _write(
        tmp_path / "c.yaml",
        "defaults: p.yaml\ndata: {_override_: true, c: 3}\npolicy: {gen: {_override_: true, z: 0}}\n",
    )
    tree = compose_file(child)
    assert resolve(tree) == {"data": {"c": 3}, "policy": {"gen": {"z": 0}, "keep": 1}}
    assert "data.a" not in tree.sources and "policy.gen.x" not in tree.sources


def test_interpolation_sees_child_values_and_nemo_rl_resolvers(tmp_path):
    _write(
        tmp_path / "p.yaml",
        "n: 2\nm: 3\nprod: ${mul:${n},${m}}\nbig: ${max:${n},${m}}\ns: ${add:${n},1}\nq: ${div:${m},2}\n"
        "gen: {t: 1.0, vt: '${.t}'}\nmandatory: 5\n",
    )
    child = _write(tmp_path / "c.yaml", "defaults: p.yaml\nn: 10\ngen: {t: 0.5}\nmandatory: ???\n")
    out = _load(child)
    assert (out["prod"], out["big"], out["s"], out["q"]) == (30, 10, 11, 1.5)
    assert out["gen"] == {"t": 0.5, "vt": 0.5}
    assert out["mandatory"] == 5  # "???" never replaces an inherited value


def test_overrides_feed_interpolations_and_are_sourced(tmp_path):
    cfg = _write(
        tmp_path / "c.yaml",
        "policy:\n  max_total_sequence_length: 512\n  generation:\n    vllm_cfg:\n"
        "      max_model_len: ${policy.max_total_sequence_length}\n",
    )
    loaded = load_config_report(cfg, ["policy.max_total_sequence_length=1024"])
    assert loaded.config.policy.generation.vllm_cfg.max_model_len == 1024
    assert loaded.sources["policy.max_total_sequence_length"] == OVERRIDE_SOURCE


def test_null_env_vars_as_nemo_rl_writes_it(tmp_path):
    cfg = _write(tmp_path / "c.yaml", "policy:\n  megatron_cfg:\n    env_vars: null\n")
    assert load_config(cfg).policy.megatron_cfg.env_vars == {}


def test_missing_parent_names_the_file(tmp_path):
    child = _write(tmp_path / "c.yaml", "defaults: nowhere.yaml\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: parent config 'nowhere\.yaml' named in 'defaults' not found"):
        compose_file(child)


def test_inheritance_cycle(tmp_path):
    _write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    _write(tmp_path / "b.yaml", "defaults: a.yaml\n")
    with pytest.raises(ConfigError, match="inheritance cycle"):
        compose_file(tmp_path / "a.yaml")


def test_interpolation_cycle_names_key_and_file(tmp_path):
    child = _write(tmp_path / "c.yaml", "sec:\n  a: ${sec.b}\n  b: ${sec.a}\n")
    with pytest.raises(ConfigError, match=r"c\.yaml: cannot resolve 'sec\.(a|b)': Recursive interpolation"):
        load_config(child)


def test_resolver_error_names_key_and_file(tmp_path):
    _write(tmp_path / "p.yaml", "x:\n  y: ${mul:1}\n")
    child = _write(tmp_path / "c.yaml", "defaults: p.yaml\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: cannot resolve 'x\.y': .*mul|p\.yaml: cannot resolve 'x\.y'"):
        load_config(child)
    child2 = _write(tmp_path / "c2.yaml", "x: ${nope:1,2}\n")
    with pytest.raises(ConfigError, match=r"c2\.yaml: cannot resolve 'x': Unsupported interpolation type nope"):
        load_config(child2)


def test_malformed_yaml_has_line_and_column(tmp_path):
    bad = _write(tmp_path / "bad.yaml", "a: 1\nb: [1, 2\nc: 3\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:3:2: malformed YAML"):
        load_config(bad)
    _write(tmp_path / "p_bad.yaml", "a: [\n")
    child = _write(tmp_path / "c.yaml", "defaults: p_bad.yaml\n")
    with pytest.raises(ConfigError, match=r"p_bad\.yaml:\d+:\d+: malformed YAML"):
        load_config(child)


def test_defaults_must_be_names(tmp_path):
    child = _write(tmp_path / "c.yaml", "defaults: {a: 1}\n")
    with pytest.raises(ConfigError, match="'defaults' must be a file name or a list"):
        compose_file(child)
