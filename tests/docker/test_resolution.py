"""The image's pip requirement set resolves for Python 3.12 manylinux x86_64, and the two known conflicts fail.

docker/resolve.py asks pip's resolver (``pip install --dry-run --report``, metadata only) for the set the
Dockerfile installs in one call, with the base image's torch/TE/triton stood in at their NGC versions. CI resolves
the representative subset (``resolve.SUBSET``: the Hugging Face stack, setuptools, torch users; about a minute);
the whole set (about 170 packages, several minutes) is the ``slow`` test. Needs an index (PyPI): skips when it is
unreachable.

Every resolution the selected tests check starts together when the first of them needs one (the ``resolutions``
fixture): each is one pip process that uses ~60% of a core and waits on the index the rest, so on a machine with an
empty cache the module takes about its longest resolution (the whole set's) rather than the sum of four.
"""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


resolve = _load(REPO / "docker" / "resolve.py", "mfp8_docker_resolve")


@pytest.fixture(scope="module", autouse=True)
def _index_reachable():
    try:
        socket.create_connection(("pypi.org", 443), timeout=10).close()
    except OSError as exc:
        pytest.skip(f"PyPI unreachable ({exc}): the resolution test needs the package index")


def _pins_with(tmp_path: Path, name: str, version: str) -> Path:
    """A copy of docker/constraints-container.txt with ``name`` pinned to ``version``."""
    lines = []
    for line in resolve.pins.CONTAINER_CONSTRAINTS.read_text().splitlines():
        if line.split("==")[0].strip() == name:
            line = f"{name}=={version}"
        lines.append(line)
    out = tmp_path / "constraints-container.txt"
    out.write_text("\n".join(lines) + "\n")
    return out


_RESOLUTIONS = {  # a test -> its resolution: (the pin it changes to make a known conflict, or None; subset only?)
    "test_container_requirement_set_resolves": (None, True),
    "test_datasets_needing_a_newer_hub_than_transformers_is_a_conflict": (("datasets", "5.2.0"), True),
    "test_modelopt_needing_setuptools_80_is_a_conflict": (("nvidia-modelopt", "0.47.0"), True),
    "test_whole_container_requirement_set_resolves": (None, False),
}


@pytest.fixture(scope="module")
def resolutions(request, tmp_path_factory, _index_reachable) -> Iterator[dict[str, Future]]:
    """Test name -> its resolution, for the tests of this module that this session runs, all started at once."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    tmp = tmp_path_factory.mktemp("resolutions")
    jobs = {}
    for name, (pin, subset) in _RESOLUTIONS.items():
        if name in selected:
            jobs[name] = {"only": resolve.SUBSET if subset else None}
            if pin is not None:
                (tmp / name).mkdir()
                jobs[name]["container_pins"] = _pins_with(tmp / name, *pin)
    with ThreadPoolExecutor(max_workers=max(1, len(jobs)), thread_name_prefix="resolve") as pool:
        yield {name: pool.submit(resolve.resolve, **kwargs) for name, kwargs in jobs.items()}


@pytest.fixture
def resolution(request, resolutions) -> resolve.Resolution:
    """The resolution this test checks (started with the module's others)."""
    return resolutions[request.node.originalname].result()


def test_container_requirement_set_resolves(resolution):
    assert resolution.ok, resolution.log[-4000:]
    assert resolution.installed["transformers"] == "4.57.1"
    assert resolution.installed["datasets"] == resolve.pins.parse_container_pins().pins["datasets"].version
    assert resolution.installed["huggingface-hub"].split(".")[0] == "0"  # transformers 4.57 needs huggingface-hub < 1
    assert int(resolution.installed["setuptools"].split(".")[0]) < 80  # vLLM 0.11 on Python 3.12
    assert resolution.installed["torch"].startswith("2.8.0a0")  # the base image's own torch, not a second one


def test_datasets_needing_a_newer_hub_than_transformers_is_a_conflict(resolution):
    assert not resolution.ok
    assert "huggingface-hub" in resolution.log and "conflict" in resolution.log.lower(), resolution.log[-3000:]


def test_modelopt_needing_setuptools_80_is_a_conflict(resolution):
    assert not resolution.ok
    assert "setuptools" in resolution.log and "conflict" in resolution.log.lower(), resolution.log[-3000:]


def test_base_file_names_the_from_base_packages():
    base = resolve.parse_base(resolve.DEFAULT_BASE)
    assert set(base) == set(resolve.pins.parse_container_pins().from_base)
    assert base["torch"][1] and base["torch"][0].startswith("2.8.0a0")  # stood in as NGC's pre-release


@pytest.mark.slow
def test_whole_container_requirement_set_resolves(resolution):
    assert resolution.ok, resolution.log[-4000:]
    for name in ("ray", "xgrammar", "transformers", "numba", "setuptools"):  # vLLM 0.11's own dependencies
        assert name in resolution.installed


def test_a_resolution_is_kept_by_the_hash_of_its_pins_and_a_changed_pin_asks_again(tmp_path, monkeypatch, resolutions):
    """The cache in front of the index: the same pins are answered from the user cache (the index is not asked),
    a changed pin file is a new key and is resolved; a failure that is not a conflict is never kept."""
    for started in resolutions.values():  # the module's real resolutions are done before pip is faked below
        started.result()
    calls = []

    def fake(**kwargs):
        calls.append(kwargs["container_pins"])
        ok = "datasets==5.2.0" not in kwargs["container_pins"].read_text()
        return resolve.Resolution(
            ok=ok,
            installed={"six": "1.16.0"} if ok else {},
            requirements=("six",),
            log="" if ok else "ResolutionImpossible: conflict on huggingface-hub",
        )

    monkeypatch.setattr(resolve, "_resolve", fake)
    cache = tmp_path / "cache"
    first = resolve.resolve(only=resolve.SUBSET, cache_dir=cache)
    again = resolve.resolve(only=resolve.SUBSET, cache_dir=cache, report=tmp_path / "r.json")
    assert first == again and len(calls) == 1 and len(list(cache.glob("*.json"))) == 1
    assert json.loads((tmp_path / "r.json").read_text())["installed"] == {"six": "1.16.0"}
    changed = _pins_with(tmp_path, "datasets", "5.2.0")
    assert not resolve.resolve(container_pins=changed, only=resolve.SUBSET, cache_dir=cache).ok
    assert not resolve.resolve(container_pins=changed, only=resolve.SUBSET, cache_dir=cache).ok
    assert len(calls) == 2 and len(list(cache.glob("*.json"))) == 2  # the conflict is kept too
    assert resolve.resolve(only=None, cache_dir=cache).ok and len(calls) == 3  # the whole set: another key
    monkeypatch.setattr(resolve, "_resolve", lambda **kw: resolve.Resolution(False, {}, (), "Network is unreachable"))
    other = tmp_path / "other"
    assert not resolve.resolve(only=resolve.SUBSET, cache_dir=other).ok
    assert not other.exists() or not list(other.glob("*.json"))  # an index failure is not a resolution
