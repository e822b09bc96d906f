"""The package's layers (docs/architecture.md): a module imports only from its own layer or those below it, and
no two modules import each other, directly or around a cycle. Function-level imports count: a late import
hides a cycle from Python, not from this test."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "quantkit"
LAYERS = [  # lowest first; a module's layer is the first prefix it starts with
    ["quantkit.errors"],
    ["quantkit.formats"],
    ["quantkit.quant"],
    ["quantkit.kernels"],
    ["quantkit.runtime"],
    ["quantkit.inspect", "quantkit.convert", "quantkit.plan", "quantkit.evaluate", "quantkit.generate"],
    ["quantkit.cli", "quantkit.__main__"],
]


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of docs/architecture.md")


def _imports(module: str) -> set[str]:
    """The quantkit modules `module` imports anywhere in its body (`from pkg import sub` counts as pkg.sub)."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("quantkit")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("quantkit"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & MODULES.keys()
            out |= subs or {node.module}
    return {m for m in out if m != module and m != "quantkit"}


GRAPH = {m: _imports(m) for m in MODULES}


def test_every_module_is_in_a_layer():
    for m in MODULES:
        if m != "quantkit":
            _layer(m)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m != "quantkit"))
def test_no_upward_import(module):
    up = sorted(m for m in GRAPH[module] if _layer(m) > _layer(module))
    assert not up, f"{module} (layer {_layer(module)}) imports from a higher layer: {up}"


def test_no_import_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]):
        state[m] = 1
        for n in sorted(GRAPH.get(m, ())):
            if n.startswith(m + "."):
                continue  # a package importing its own submodule (models/__init__ -> models.llama)
            if state.get(n) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n in GRAPH and state.get(n) is None:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(GRAPH):
        if state.get(m) is None:
            visit(m, [m])
