"""Dependencies point one way (ARCHITECTURE.md): every import in the package, read with `ast`, goes down
the layers, and no modules import each other in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import elastic_local

ROOT = Path(elastic_local.__file__).parent
# lower layers first; a module may import its own package and anything in a lower layer
LAYERS = [
    {"version", "paths", "progress", "lazy"},
    {"errors"},
    {"model"},
    {"quant"},
    {"checkpoint"},
    {"elastic"},
    {"ptq", "hardware"},
    {"engine"},
    {"cli", "tui", "batch", "evaluate", "train", "tasks", "__init__"},
]
RANK = {part: i for i, layer in enumerate(LAYERS) for part in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(name: str, file: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports, anywhere in the file (lazy imports in functions included;
    imports for type checkers only, under `if TYPE_CHECKING:`, are not dependencies)."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(file.read_text(), str(file))
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and getattr(node.test, "id", None) == "TYPE_CHECKING" for n in ast.walk(node)}
    out = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != name}
    return out


def _part(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, file, modules) for name, file in modules.items()}


def test_every_module_belongs_to_a_layer():
    unplaced = sorted({_part(m) for m in _graph()} - set(RANK))
    assert not unplaced, f"place these in LAYERS (and ARCHITECTURE.md): {unplaced}"


def _allowed(a: str, b: str) -> bool:
    """Down the layers, or sideways in the top layer of front ends (which nothing below imports)."""
    pa, pb = _part(a), _part(b)
    top = len(LAYERS) - 1
    return pa == pb or RANK[pb] < RANK[pa] or (RANK[pa] == top and RANK[pb] == top and pb != "__init__")


def test_imports_only_go_down_the_layers():
    wrong = [f"{a} -> {b}" for a, deps in _graph().items() for b in deps if not _allowed(a, b)]
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []
    cycles = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                cycles.append(" -> ".join(path[path.index(d):] + [d]))
            elif d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)
