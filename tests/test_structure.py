"""The layering rules of DESIGN.md, checked on the source: arrows point down.

The import graph is read with `ast` from every module of `jaxinfer`, `serve`
and `pallas_kernels`, counting every `import` and `from ... import`, at the
top of a module or inside a function. Importing a submodule runs its parent
packages' `__init__` too, but that is Python's doing, not an arrow the code
draws, so only the modules a statement names are edges.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("jaxinfer", "serve", "pallas_kernels")
NO_JAX = ("jaxinfer.engine.scheduler", "jaxinfer.engine.block_manager")
NO_JAX_TO_PARSE = ("jaxinfer.cli", "serve.cli")  # `jaxinfer --help` answers at once


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES
            for path in sorted((ROOT / package).rglob("*.py"))}


def _target(name: str, modules: dict[str, Path]) -> str | None:
    """The deepest project module `name` names (a.b.Thing -> a.b), or None."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - node.level + 1]
    return ".".join([*base, node.module] if node.module else base)


def imports_of(module: str, modules: dict[str, Path]) -> set[str]:
    """Project modules `module` imports anywhere in its source."""
    path = modules[module]
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            named += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, module, path.name == "__init__.py")
            named += [f"{base}.{alias.name}" for alias in node.names]
    targets = {_target(name, modules) for name in named}
    return {t for t in targets if t is not None and t != module}


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    return {module: imports_of(module, modules) for module in modules}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a path that returns to its start, or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, then "done"
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_graph_sees_lazy_and_relative_imports() -> None:
    graph = import_graph()
    assert "jaxinfer.engine.block_manager" in graph["jaxinfer.engine.scheduler"]  # relative
    assert "pallas_kernels.ragged_gpu" in graph["jaxinfer.ops.attention"]  # in a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle() -> None:
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_jaxinfer_never_imports_serve() -> None:
    up = {m: sorted(t for t in targets if t.split(".")[0] == "serve")
          for m, targets in import_graph().items() if m.split(".")[0] == "jaxinfer"}
    assert not {m: t for m, t in up.items() if t}


def test_kernels_import_nothing_of_jaxinfer() -> None:
    up = {m: sorted(t for t in targets if t.split(".")[0] != "pallas_kernels")
          for m, targets in import_graph().items() if m.split(".")[0] == "pallas_kernels"}
    assert not {m: t for m, t in up.items() if t}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_every_module_imports_in_a_fresh_interpreter() -> None:
    names = sorted(project_modules())
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n")
    run = _python(code)
    assert run.returncode == 0, run.stderr


def _jax_modules_after(code: str) -> str:
    """The jax modules loaded by `code` in a fresh interpreter: sys.modules counts
    an import through another module too."""
    run = _python(code + "\nimport sys\n"
                  "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib')))")
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


def test_scheduler_and_block_manager_load_no_jax() -> None:
    assert _jax_modules_after("".join(f"import {name}\n" for name in NO_JAX)) == "[]"


def test_the_command_line_parses_without_jax() -> None:
    code = "".join(f"import {name}\n{name}.build_parser().parse_args(['generate', 'hi'])\n"
                   for name in NO_JAX_TO_PARSE)
    assert _jax_modules_after(code) == "[]"


def test_every_package_is_installed() -> None:
    """A package missing from pyproject's list works in an editable install and is
    absent from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    found = {module_name(path.parent) for package in PACKAGES
             for path in (ROOT / package).rglob("__init__.py")}
    assert found - listed == set()
