"""What may import what (the module boundaries of the design), read from the source with `ast`.

Nothing is imported: every module of the project's packages is parsed, and every import in it counts,
at module level or inside a function, under `if TYPE_CHECKING:` too, and `importlib.import_module("...")`
with a literal name. The layers, from the ground up: kernels; the model engine (the target's and the model
drafters' Llama math and paged KV cache); the shared package specd (its generated stubs specd/v1 included);
the services drafter_svc, target_svc, gateway; the CLI specd_cli above them.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("specd", "specd_cli", "gateway", "target_svc", "drafter_svc", "engine", "kernels")
SERVICES = ("gateway", "target_svc", "drafter_svc")


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. specd.client
    line: int
    name: str  # specd.defaults for `from specd import defaults`; specd.types for `from specd.types import X`

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.name}"


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def _sources() -> dict[str, Path]:
    """Every project module by dotted name."""
    return {_module_name(path): path for package in PACKAGES for path in sorted((REPO / package).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The module a `from ... import` reads from, relative imports resolved."""
    if not node.level:
        return node.module
    package = module.split(".") if is_package else module.split(".")[:-1]
    return ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])])


def _imported_names(node: ast.AST, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        base = _absolute(node, module, is_package)
        return list(dict.fromkeys(f"{base}.{alias.name}" if f"{base}.{alias.name}" in _sources() else base
                                  for alias in node.names))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module" \
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
        return [node.args[0].value]
    return []


@cache
def all_imports() -> tuple[Import, ...]:
    found = []
    for module, path in _sources().items():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            found += [Import(module, node.lineno, name)
                      for name in _imported_names(node, module, path.name == "__init__.py")]
    return tuple(found)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


def assert_imports_none(package: str, of: tuple[str, ...]) -> None:
    """No module of `package` imports anything of the packages `of`; else each such import, one a line."""
    found = [str(i) for i in all_imports() if _within(i.module, (package,)) and _within(i.name, of)]
    assert not found, "\n".join(found)


def import_cycles() -> list[list[str]]:
    """Sets of project modules that import each other in a loop (Tarjan's strongly connected components)."""
    graph: dict[str, set[str]] = {module: set() for module in _sources()}
    for i in all_imports():
        if i.name in graph:
            graph[i.module].add(i.name)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for imported in graph[module]:
            if imported not in index:
                visit(imported)
                low[module] = min(low[module], low[imported])
            elif imported in stack:
                low[module] = min(low[module], index[imported])
        if low[module] == index[module]:
            component = []
            while not component or component[-1] != module:
                component.append(stack.pop())
            if len(component) > 1 or module in graph[module]:
                cycles.append(sorted(component))

    for module in graph:
        if module not in index:
            visit(module)
    return cycles


def test_the_reader_sees_every_package_and_imports_inside_functions():
    assert {module.partition(".")[0] for module in _sources()} == set(PACKAGES)
    assert "specd.v1.common_pb2" in _sources(), "stubs not generated: python scripts/gen_protos.py"
    # `specd serve` imports each service inside the function that starts it
    assert any(i.module == "specd_cli.main" and i.name == "target_svc.server" for i in all_imports())


def test_the_shared_package_imports_no_service_and_not_the_cli():
    assert_imports_none("specd", of=(*SERVICES, "specd_cli"))


def test_kernels_take_tensors_and_import_nothing_of_specd_nor_grpc_nor_protobuf():
    assert_imports_none("kernels", of=("engine", "specd", "specd_cli", *SERVICES, "grpc", "google.protobuf"))


def test_the_engine_is_model_math_on_kernels_and_imports_nothing_of_specd_nor_the_services_nor_grpc():
    assert_imports_none("engine", of=("specd", "specd_cli", *SERVICES, "grpc", "google.protobuf"))


def test_drafters_never_import_the_target_the_gateway_or_the_cli():
    assert_imports_none("drafter_svc", of=("target_svc", "gateway", "specd_cli"))


def test_the_target_never_imports_a_drafter_the_gateway_or_the_cli():
    assert_imports_none("target_svc", of=("drafter_svc", "gateway", "specd_cli"))


def test_the_gateway_holds_no_model_code_and_imports_no_other_service_kernels_torch_or_the_cli():
    assert_imports_none("gateway", of=("target_svc", "drafter_svc", "engine", "kernels", "specd_cli", "torch"))


def test_no_project_modules_import_each_other_in_a_cycle():
    cycles = import_cycles()
    assert not cycles, "\n".join(f"import cycle: {', '.join(cycle)}" for cycle in cycles)
