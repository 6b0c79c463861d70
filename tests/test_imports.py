"""The layering, read from the source (``ast``, nothing imported): which package may import which, and no
import circles.

Layers, lowest first: ``sinkserve_kernels`` (attention math) < ``engine`` < ``app``; ``evals``,
``training`` and ``bench`` sit beside ``app`` and may use everything below. ``sinkserve_kernels`` imports
nothing from ``engine`` or ``app``; ``engine`` nothing from ``app``, ``evals`` or ``training``; ``app``
nothing from ``evals`` or ``training`` (the wheel ships ``sinkserve_kernels``, ``engine`` and ``app``
only), except the guarded ``model train-indexer`` subcommand, which a wheel install leaves out.

No shipped package may take an import name that an installed dependency also provides: transformers 5.25
depends on Hugging Face's ``kernels`` package, and our old top-level ``kernels/`` shadowed it (every
``import transformers`` model then failed; ``test_no_shipped_package_shadows_a_dependency``).

Every import counts, including those inside functions (a function-level import that closes a circle only
moves the circle to run time). ``if TYPE_CHECKING:`` imports do not count: they never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("sinkserve_kernels", "engine", "app", "evals", "training")
FORBIDDEN = {"sinkserve_kernels": {"engine", "app", "evals", "training"}, "engine": {"app", "evals", "training"},
             "app": {"evals", "training"}}
# Source-tree tools reached from the shipped CLI behind a ModuleNotFoundError guard (app/cli/model.py,
# app/cli/canary.py's --set instruction).
GUARDED = {("app.cli.model", "training.train_indexer"), ("app.cli.model", "training.indexer_report"),
           ("app.cli.canary", "evals.first_last_task"), ("app.cli.canary", "training.model_card")}
SHIPPED = ("sinkserve_kernels", "engine", "app")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = path.relative_to(REPO).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _owner(name: str, mods: dict[str, Path]) -> str | None:
    """The project module ``name`` (or its longest known prefix) lives in, if any."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def import_graph(top_level_only: bool = False) -> dict[str, set[str]]:
    """module -> project modules it imports (``from pkg import mod`` counts as ``pkg.mod``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_nodes(tree)
        nodes = tree.body if top_level_only else ast.walk(tree)
        is_pkg = path.name == "__init__.py"
        for node in nodes:
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    here = here[: len(here) - (node.level - 1)]
                    base = ".".join(here + ([node.module] if node.module else []))
                targets = [f"{base}.{a.name}" for a in node.names]
            for t in targets:
                owner = _owner(t, mods)
                if owner and owner != mod:
                    graph[mod].add(owner)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(frozenset(comp))
    return found


def test_circles_are_found() -> None:
    """The detector itself: a planted three-module circle and a clean chain."""
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(g) == [frozenset({"a", "b", "c"})]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_lower_layers_import_nothing_from_higher_ones() -> None:
    graph = import_graph()
    bad = sorted((m, d) for m, deps in graph.items() for d in deps
                 if d.split(".")[0] in FORBIDDEN.get(m.split(".")[0], set()) and (m, d) not in GUARDED)
    assert bad == []


# Inside app and engine, packages by layer, highest first; a layer imports only from the layers after it in
# its list and from the shared modules at the package's top (app/__init__.py and engine/__init__.py draw it).
INNER_LAYERS = {"app": ("cli", "http", "plan", "pool", "state"), "engine": ("frontend", "core", "worker", "memory")}
# Model code beside the engine's layers (architectures the worker loads; a transformers model class).
BESIDE_LAYERS = ("engine.models", "engine.attnres")


def _layer(mod: str) -> tuple[str, int] | None:
    """(package, rank) of the inner layer ``mod`` belongs to (0 = the highest), or None for a shared module."""
    parts = mod.split(".")
    layers = INNER_LAYERS.get(parts[0], ())
    return (parts[0], layers.index(parts[1])) if len(parts) > 1 and parts[1] in layers else None


def inner_layer_violations(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(module, import) pairs where a layer of app or engine imports from a layer above it."""
    return sorted((m, d) for m, deps in graph.items() for d in deps
                  if (lm := _layer(m)) and (ld := _layer(d)) and lm[0] == ld[0] and ld[1] < lm[1])


def test_the_inner_layer_check_finds_an_upward_import() -> None:
    graph = {"app.pool.server": {"app.plan.planner", "app.settings"}, "app.plan.planner": {"app.pool.server"},
             "engine.memory.block_manager": {"engine.core.scheduler"}, "engine.core.scheduler": {"engine.memory.retention"}}
    assert inner_layer_violations(graph) == [("app.pool.server", "app.plan.planner"),
                                             ("engine.memory.block_manager", "engine.core.scheduler")]


def test_inner_layers_import_nothing_from_the_layers_above_them() -> None:
    graph = import_graph()
    assert inner_layer_violations(graph) == []
    # every module of app and engine is in a layer, shared at the package's top, or model code beside them
    unplaced = sorted(m for m in graph if m.split(".")[0] in INNER_LAYERS and m.count(".") > 1 and not _layer(m)
                      and not m.startswith(BESIDE_LAYERS))
    assert unplaced == []


def test_the_wheel_ships_the_server_packages_only() -> None:
    """pyproject's package list, as setuptools reads it, holds sinkserve_kernels, engine and app and none of the
    source-tree tools; and no shipped module imports matplotlib (an extra, ``plots``)."""
    import tomllib

    from setuptools import find_packages

    find = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    tops = {p.split(".")[0] for p in find_packages(str(REPO), include=find["include"])}
    assert tops == set(SHIPPED)
    plots = [str(path.relative_to(REPO)) for pkg in SHIPPED for path in (REPO / pkg).rglob("*.py")
             if any(isinstance(n, (ast.Import, ast.ImportFrom)) and "matplotlib" in ast.unparse(n)
                    for n in ast.walk(ast.parse(path.read_text())))]
    assert plots == []


def test_no_shipped_package_shadows_a_dependency() -> None:
    """Each shipped top-level name is provided by this project's distribution only. A second distribution
    with the same import name (Hugging Face's ``kernels``, which transformers >= 5.25 requires, against our
    former ``kernels/``) means one of the two is unreachable: from the source tree ours wins and
    transformers' ``from kernels import ...`` fails; in site-packages the two overwrite each other."""
    import importlib.metadata

    providers = importlib.metadata.packages_distributions()
    clashes = {name: sorted(d for d in providers.get(name, []) if d != "sinkserve") for name in SHIPPED}
    assert {name: dists for name, dists in clashes.items() if dists} == {}


def test_transformers_model_code_imports() -> None:
    """The import that broke when ``kernels`` was ours: transformers' activations pull its hub-kernels
    integration, which imports the ``kernels`` distribution when one is installed."""
    import importlib

    activations = importlib.import_module("transformers.activations")
    assert callable(activations.ACT2FN["silu"])


def test_no_import_circle_at_module_level() -> None:
    assert circles(import_graph(top_level_only=True)) == []


def test_no_import_circle_at_all() -> None:
    """Function-level imports count too: a lazy import that closes a circle is a layering mistake deferred."""
    assert circles(import_graph()) == []
