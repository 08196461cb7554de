"""The import graph, laid out as installed (`runtime/decode/loop.py` is `pcgtts.runtime.decode.loop`):
no cycles, and no private name imported across modules. Imports inside functions count too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# folder -> import name, as pyproject.toml maps them
FOLDERS = {"pcgtts": "pcgtts", "runtime": "pcgtts.runtime", "groups": "pcgtts.groups", "export": "pcgtts.export",
           "cli": "pcgtts.cli", "tools": "pcgtts.tools", "train": "pcgtts.train", "quality": "pcgtts.quality",
           "serve": "pcgtts.serve"}


def modules() -> dict[str, Path]:
    """{dotted module name: its file} for every module of the installed package."""
    out = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).glob("**/*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if folder == "pcgtts" and len(parts) > 1:
                continue  # pcgtts/ holds only the public API (and the voice's data)
            name = ".".join((package, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in [child, *runtime_nodes(child)])
            continue
        yield node
        yield from runtime_nodes(node)


def imported(path: Path, known: dict[str, Path]) -> list[tuple[str, str | None]]:
    """(module, name taken from it or None) for every pcgtts import in `path` that runs (not those
    for annotations only); `from P import m` of a submodule m counts as importing P.m."""
    found = []
    for node in runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names if alias.name.startswith("pcgtts")]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module.startswith("pcgtts"):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.append((sub, None) if sub in known else (node.module, alias.name))
    return [(module, name) for module, name in found if module in known]


def test_the_import_graph_has_no_cycles():
    known = modules()
    graph = {name: {module for module, _ in imported(path, known) if module != name} for name, path in known.items()}
    # a package's __init__ that re-exports its submodules is not a cycle with them: drop edges into a
    # package from its own submodules
    graph = {name: {m for m in deps if not name.startswith(m + ".")} for name, deps in graph.items()}
    cycles, index, low, stack, on_stack, counter = [], {}, {}, [], set(), [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for dep in graph[node]:
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_no_private_name_is_imported_across_modules():
    known = modules()
    private = [f"{name} takes {taken} from {module}" for name, path in known.items()
               for module, taken in imported(path, known)
               if taken is not None and taken.startswith("_") and module != name]
    assert not private, "\n".join(private)


# The layers, bottom up: a module imports only from its own layer or the ones below. The package's
# front (`pcgtts`, `pcgtts.builtin`, `pcgtts.front`: the built-in voice, prepared with the tools on
# first use) sits above everything it uses and below the server and the command line.
LAYERS = ("groups", "runtime", "export", "train", "tools", "quality", "pcgtts", "serve", "cli")


def layer(module: str) -> int:
    parts = module.split(".")
    return LAYERS.index(parts[1] if len(parts) > 1 and parts[1] in LAYERS else "pcgtts")


def test_imports_point_down_the_layers():
    known = modules()
    upward = sorted({(name, module) for name, path in known.items() for module, _ in imported(path, known)
                     if layer(module) > layer(name)})
    assert not upward, "\n".join(f"{a} -> {b}" for a, b in upward)


def test_the_front_is_above_the_tools_and_below_the_server():
    """Nothing below the front reaches the built-in voice or the public names; the front prepares with
    the tools, and the server and the command line use it."""
    assert layer("pcgtts.builtin") == layer("pcgtts") == layer("pcgtts.front")
    assert layer("pcgtts.tools.prepare") < layer("pcgtts.builtin") < layer("pcgtts.serve.pool") < layer("pcgtts.cli")
    assert all(layer(f"pcgtts.{below}") < layer("pcgtts")
               for below in ("groups", "runtime", "export", "train", "tools", "quality"))
