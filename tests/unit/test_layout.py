"""The product's structure: what the backend boundary promises, checked on the source tree.

- the model and the engine name no device kernel (they call a backend's ops and attention);
- no module-level switches under workers/ (tests and benchmarks pick a backend or an option);
- no C++ inside Python files (it lives in workers/backends/cpu/csrc/);
- the product packages import nothing from bench/, and their module-level imports form no cycle.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT = ("workers", "kvstore", "deploy", "cluster")


def _sources(*packages: str) -> list[Path]:
    return sorted(p for package in packages for p in (ROOT / package).rglob("*.py"))


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_model_and_the_engine_name_no_device_kernel():
    kernels = r"backends\.(cpu|cuda)\.(fused|panels|amx|paged|prefill|lean_decode|attention|linears|build|triton_paged)"
    pattern = re.compile(r"cpu_(fused|linear|amx|paged|prefill)|lean_decode|" + kernels)
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in _sources("workers/models", "workers/engine")
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert found == [], found


def test_no_module_level_switches_under_workers():
    found = []
    for path in _sources("workers"):
        for node in ast.parse(path.read_text()).body:
            targets = node.targets if isinstance(node, ast.Assign) else []
            if any(isinstance(t, ast.Name) and t.id == "enabled" for t in targets):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == [], found


def test_no_cpp_inside_python_files():
    markers = re.compile(r'extern "C"|#include <|__m512|__m256|#pragma omp')
    found = [
        str(path.relative_to(ROOT))
        for path in _sources(*PRODUCT, "tests", "bench")
        if path.name != "test_layout.py" and markers.search(path.read_text())
    ]
    assert found == [], found


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The product modules ``path`` imports at module level (not inside functions or under
    TYPE_CHECKING: those run later, or never). ``from package import submodule`` depends on the
    submodule; a module's own parent packages are not counted (Python runs them first anyway)."""
    names: set[str] = set()
    tree = ast.parse(path.read_text())
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    for node in tree.body:
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else [])
                )
            submodules = {f"{base}.{alias.name}" for alias in node.names} & modules
            names.update(submodules)
            if len(submodules) < len(node.names):
                names.add(base)
    own = _module(path)
    parents = {own.rsplit(".", i)[0] for i in range(1, own.count(".") + 1)}
    return {n for n in names if n.split(".")[0] in PRODUCT and n not in parents}


def test_the_product_imports_nothing_from_bench():
    found = [
        str(path.relative_to(ROOT))
        for path in _sources(*PRODUCT)
        for node in ast.walk(ast.parse(path.read_text()))
        if (isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "bench")
        or (isinstance(node, ast.Import) and any(a.name.split(".")[0] == "bench" for a in node.names))
    ]
    assert found == [], found


def test_no_import_cycle_in_the_product():
    modules = {_module(p): p for p in _sources(*PRODUCT)}
    graph = {name: _imports(path, set(modules)) - {name} for name, path in modules.items()}
    # a package's import of its submodule runs the package first: count the edge to the package too
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt) :] + [nxt])
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [name])
    assert cycles == [], cycles[:5]
