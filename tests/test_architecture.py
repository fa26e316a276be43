"""The package layout as a contract: no import cycles, and imports only along the layers.

Every `import` in `src/recover` counts, the ones inside functions too (a lazy import only hides a
cycle until it runs). Every part of the package is in the table below, the entry points too: a
new module or package fails the test until it is given its place. The layers, from the README's
"Code layout": the shared leaves import only each other; the coordinator nothing else; the runtime
only the coordinator's client side; the checkpoints the runtime; the built-in trainer and the
tooling what is below them; the supervisor, launcher and node agent what they drive; the command
line anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

import recover

SRC = Path(recover.__file__).parent

# The shared leaves: modules every layer may import, which import only each other.
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
    "settings",
}
# Every other part (a package, or a module of the top level) -> the parts it may import besides
# itself and the leaves. "recover" is the package's own __init__.
ANYTHING = "*"
ALLOWED: dict[str, set[str] | str] = {
    "recover": set(),
    "coordinator": set(),
    "runtime": {"coordinator"},
    "checkpoint": {"runtime"},
    "training": {"runtime", "coordinator", "checkpoint"},
    "tooling": {"runtime", "coordinator", "training", "checkpoint", "launch"},
    "zygote": {"runtime"},
    "supervisor": {"runtime", "zygote"},
    "launch": {"runtime", "coordinator", "training", "supervisor", "zygote"},
    "agent": {"runtime", "coordinator", "supervisor", "launch"},
    "jobconfig": {"runtime"},
    "cli": ANYTHING,
    "clidoc": {"cli"},
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


def _part(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "recover"


def test_every_part_of_the_package_has_its_place():
    parts = {_part(m) for m in _graph()}
    unplaced = sorted(parts - set(ALLOWED) - LEAVES)
    assert not unplaced, f"not in ALLOWED or LEAVES (give each its layer): {unplaced}"
    assert not sorted(set(ALLOWED) - parts), "ALLOWED names a part that is gone"


def test_imports_follow_the_layers():
    wrong = []
    for module, imported in _graph().items():
        mine = _part(module)
        allowed = ALLOWED.get(mine, set())
        for target in imported:
            theirs = _part(target)
            if theirs == mine or (theirs in LEAVES and mine not in LEAVES):
                continue
            if mine in LEAVES:
                ok = theirs in LEAVES
            else:
                ok = allowed == ANYTHING or theirs in allowed
            if not ok:
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


def test_the_launcher_and_the_coordinator_start_without_torch():
    """A launcher (`recover train --replicas R`, `recover run`, `recover agent`) and a refused
    command line never import torch: 3 s of CPU per process on these machines, paid by every
    launch (the replicas import it, forked from one warm process). A module-level import of a
    torch-importing package (recover.checkpoint, once) put it back unnoticed."""
    import subprocess
    import sys

    probe = (
        "import sys, recover.cli, recover.cli.train, recover.cli.jobs, recover.launch, "
        "recover.launch.local, recover.agent, recover.coordinator.cli; "
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]", f"imported at start: {r.stdout.strip()}"
