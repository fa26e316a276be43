"""The package layout as a contract: no import cycles, and imports only along the layers.

Every `import` in `src/recover` counts, the ones inside functions too (a lazy import only hides a
cycle until it runs). The layers, from the README's "Code layout": the entry points (`cli`,
`launch`) may import anything; `training` and `tooling` may import the runtime; the runtime may
import only the coordinator's client side and the shared leaves; the coordinator and the leaves
import neither the runtime nor what sits above it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import recover

SRC = Path(recover.__file__).parent

# package -> the packages (besides itself and the shared leaves) it may import
ALLOWED = {
    "runtime": {"coordinator"},
    "coordinator": set(),
    "training": {"runtime", "coordinator"},
    "tooling": {"runtime", "coordinator", "training", "launch"},
    "data": set(),
}
LEAVES = {
    "policy",
    "record",
    "exits",
    "data",
    "logs",
    "checks",
    "addresses",
    "dashboards",
    "processes",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The recover modules `path` imports, resolved to module names (not attributes)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name.startswith("recover."):
                found.add(name)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in SRC.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count("."))}
        graph[name] = _imports(path, modules) - {name} - parents
    return graph


def test_no_module_imports_itself_back():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(path[path.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_imports_follow_the_layers():
    def part(module: str) -> str:
        return module.split(".")[1] if module.count(".") else "recover"

    wrong = []
    for module, imported in _graph().items():
        mine = part(module)
        if mine not in ALLOWED:
            continue  # the entry points and the package itself
        for target in imported:
            theirs = part(target)
            if theirs in (mine, "recover") or theirs in LEAVES:
                continue
            if theirs not in ALLOWED[mine]:
                wrong.append(f"{module} imports {target}")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_the_runtime_reaches_the_coordinator_only_through_its_client():
    wrong = [
        f"{m} imports {t}"
        for m, targets in _graph().items()
        if m.startswith("recover.runtime.")
        for t in targets
        if t.startswith("recover.coordinator.")
        and t not in ("recover.coordinator.client", "recover.coordinator.protocol")
    ]
    assert not wrong, "\n".join(wrong)
