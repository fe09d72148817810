"""The layers of the project go one way, and no two files import each other, even through others.

Layers, bottom to top: `dora_tasks.core` (imports no module of the project), `storage` (imports only
`dora_tasks.core`), the rest of `dora_tasks` (imports `dora_tasks.core` and `storage`, never `pipelines`),
`pipelines` (anything). Every `.py` file of the three packages is parsed with `ast`; every import counts, at the top
of a file or inside a function, since a lazy import is a dependency all the same. An import names the deepest module
it loads (`from pkg import mod` is `pkg.mod`, `from pkg.mod import name` is `pkg.mod`); parent packages whose
`__init__` runs on the way are not counted. Imports by name at run time (`importlib.import_module(variable)`) are not
seen.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("pipelines", "dora_tasks", "storage")
LAYERS = ("dora_tasks.core", "storage", "dora_tasks", "pipelines")  # bottom to top


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module of the project
    path: str  # file of `source`, relative to the root
    line: int


def layer(module: str) -> int:
    """Index in LAYERS of the most specific layer holding `module`."""
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS.index(best)


def project_modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of PACKAGES under `root`."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str:
    """The deepest module of the project that `name` is or lies in ("" if none)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name


def imports_of(module: str, path: Path, modules: dict[str, Path], root: Path) -> list[Import]:
    """Every import of a project module in one file, top-level and nested."""
    found = []
    is_package = path.name == "__init__.py"
    rel = str(path.relative_to(root))
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [_known(alias.name, modules) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the package of this file, `level - 1` packages up
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            targets = [f"{name}.{alias.name}" if f"{name}.{alias.name}" in modules else _known(name, modules)
                       for alias in node.names]
        found += [Import(module, target, rel, node.lineno) for target in dict.fromkeys(targets) if target]
    return found


def import_graph(root: Path) -> list[Import]:
    modules = project_modules(root)
    return [imp for module, path in modules.items() for imp in imports_of(module, path, modules, root)]


def upward_imports(imports: list[Import]) -> list[str]:
    """One line per import from a lower layer to a higher one."""
    return [f"{i.path}:{i.line}: {i.source} (layer {LAYERS[layer(i.source)]}) imports {i.target} "
            f"(layer {LAYERS[layer(i.target)]}, above it)"
            for i in imports if layer(i.target) > layer(i.source)]


def import_cycles(imports: list[Import]) -> list[str]:
    """One line per strongly connected set of modules (Tarjan), shown as one cycle through it with each import's
    file and line."""
    graph: dict[str, dict[str, Import]] = {}
    for imp in imports:
        graph.setdefault(imp.source, {}).setdefault(imp.target, imp)
        graph.setdefault(imp.target, {})
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[list[str]] = []

    def visit(node: str) -> None:  # recursion depth is bounded by the number of files
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1 or node in graph[node]:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_describe_cycle(component, graph) for component in components]


def _describe_cycle(component: list[str], graph: dict[str, dict[str, Import]]) -> str:
    """A shortest cycle through the first module of `component` (breadth-first inside it)."""
    start, members = component[0], set(component)
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for nxt in sorted(graph[node]):
            if nxt == start:
                cycle = paths[node] + [start]
                steps = [graph[a][b] for a, b in zip(cycle, cycle[1:])]
                return " -> ".join(cycle) + "  (" + ", ".join(f"{s.path}:{s.line}" for s in steps) + ")"
            if nxt in members and nxt not in paths:
                paths[nxt] = paths[node] + [nxt]
                queue.append(nxt)
    raise AssertionError(f"no cycle through {start}")  # a strongly connected set always has one


# ---- the project ---------------------------------------------------------------------------------------------------
def test_no_import_goes_up_a_layer():
    imports = import_graph(ROOT)
    assert len(imports) > 100  # the parse found the project's imports
    upward = upward_imports(imports)
    assert not upward, "imports against the order of layers:\n" + "\n".join(upward)


def test_no_import_cycle_between_files():
    cycles = import_cycles(import_graph(ROOT))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_ground_floor_loads_without_the_project_or_heavy_libraries():
    code = ("import sys\n"
            "import dora_tasks.core.config, dora_tasks.core.records, dora_tasks.core.contracts\n"
            "heavy = ('torch', 'transformers', 'distributed', 'zarr', 'mlflow', 'pipelines', 'storage')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or (m.startswith('dora_tasks.') and "
            "not m.startswith('dora_tasks.core'))))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]", out.stdout


# ---- the checker itself, on a small tree that breaks both rules -----------------------------------------------------
def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checker_finds_an_upward_import_and_a_cycle(tmp_path):
    _write(tmp_path, {
        "pipelines/__init__.py": "",
        "pipelines/settings.py": "X = 1\n",
        "pipelines/driver.py": "from storage import store\nfrom dora_tasks.core import records\n",
        "storage/__init__.py": "",
        "storage/store.py": "from dora_tasks.core.records import Group\n",
        "dora_tasks/__init__.py": "",
        "dora_tasks/core/__init__.py": "",
        "dora_tasks/core/records.py": "Group = object\n",
        "dora_tasks/core/config.py": "def names():\n    from dora_tasks.algorithms import registry\n",
        "dora_tasks/algorithms/__init__.py": "",
        "dora_tasks/algorithms/registry.py": "import dora_tasks.core.config\n",
        "dora_tasks/engines/__init__.py": "",
        "dora_tasks/engines/a.py": "from . import b\nfrom pipelines.settings import X\n",
        "dora_tasks/engines/b.py": "def f():\n    from .c import g\n",
        "dora_tasks/engines/c.py": "from dora_tasks.engines.a import f\n",
    })
    imports = import_graph(tmp_path)
    upward = upward_imports(imports)
    assert upward == [
        "dora_tasks/core/config.py:2: dora_tasks.core.config (layer dora_tasks.core) imports "
        "dora_tasks.algorithms.registry (layer dora_tasks, above it)",
        "dora_tasks/engines/a.py:2: dora_tasks.engines.a (layer dora_tasks) imports pipelines.settings "
        "(layer pipelines, above it)",
    ], upward
    assert sorted(import_cycles(imports)) == [
        "dora_tasks.algorithms.registry -> dora_tasks.core.config -> dora_tasks.algorithms.registry  "
        "(dora_tasks/algorithms/registry.py:1, dora_tasks/core/config.py:2)",
        "dora_tasks.engines.a -> dora_tasks.engines.b -> dora_tasks.engines.c -> dora_tasks.engines.a  "
        "(dora_tasks/engines/a.py:1, dora_tasks/engines/b.py:2, dora_tasks/engines/c.py:1)",
    ]
