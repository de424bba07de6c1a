"""The packages draw the architecture: every import, module level or not (in functions, under
TYPE_CHECKING, through importlib with a literal name), points to its own top-level package or
one lower in the layer order that docs/architecture.md writes down. Tests sit on top, unchecked.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[2]
# Bottom layer first: an import may point only down this list (or within its own package).
LAYERS = (
    "api",
    "engine",
    "kv_transfer",
    "prefill_workers",
    "decode_workers",
    "control",
    "autoscaling",
    "router",
    "deploy",
    "bench",
    "pdserve_cli",
)
NOT_LAYERS = {"tests", "scripts", "docs"}


class Edge(NamedTuple):
    source: Path
    line: int
    target: str  # the imported module, absolute

    @property
    def target_layer(self) -> str:
        return self.target.split(".")[0]

    def __str__(self) -> str:
        return f"{self.source.relative_to(REPO)}:{self.line} imports {self.target}"


def layer_of(path: Path) -> str:
    return path.relative_to(REPO).parts[0].removesuffix(".py")


def python_files(layer: str) -> list[Path]:
    root = REPO / layer
    return [root.with_suffix(".py")] if not root.is_dir() else sorted(root.rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> Iterator[Edge]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    yield from imports_in(path.read_text(), package, path)


def imports_in(source: str, package: str, path: Path) -> Iterator[Edge]:
    """Every import in `source`, wherever it sits, as absolute module names."""
    for node in ast.walk(ast.parse(source, str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(path, node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: `level` dots, the first one is the file's own package
                parts = package.split(".")
                base = parts[: len(parts) - node.level + 1]
                yield Edge(path, node.lineno, ".".join([*base, *filter(None, [node.module])]))
            else:
                yield Edge(path, node.lineno, node.module or "")
        elif isinstance(node, ast.Call) and _is_dynamic_import(node.func):
            first = node.args[0] if node.args else None
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                yield Edge(path, node.lineno, first.value)


def _is_dynamic_import(func: ast.expr) -> bool:
    if isinstance(func, ast.Name):
        return func.id in ("__import__", "import_module")
    return isinstance(func, ast.Attribute) and func.attr == "import_module"


def all_edges() -> list[Edge]:
    return [edge for layer in LAYERS for path in python_files(layer) for edge in imports_of(path)]


def test_every_top_level_package_has_a_layer() -> None:
    found = {
        p.name.removesuffix(".py")
        for p in REPO.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py")
    }
    assert found - NOT_LAYERS == set(LAYERS)


def test_no_import_points_up_the_layers() -> None:
    rank = {layer: index for index, layer in enumerate(LAYERS)}
    upward = [
        str(edge)
        for edge in all_edges()
        if edge.target_layer in rank and rank[edge.target_layer] > rank[layer_of(edge.source)]
    ]
    assert not upward, "imports that point up the layer order:\n" + "\n".join(upward)


def test_the_checker_sees_every_kind_of_import() -> None:
    source = """
from typing import TYPE_CHECKING
import importlib
if TYPE_CHECKING:
    from router.service import RouterService
def later():
    import deploy.app
    importlib.import_module("bench.cli")
from . import settings
from ..control import keys
"""
    path = REPO / "engine" / "probe.py"
    targets = {edge.target for edge in imports_in(source, "engine", path)}
    assert {"router.service", "deploy.app", "bench.cli", "engine", "control"} <= targets


def test_the_documented_order_is_the_checked_one() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    documented = tuple(re.findall(r"^\d+\. `([a-z_]+)/?`", section, flags=re.M))
    assert documented == LAYERS


def test_structures_lists_every_module_once_in_layer_order() -> None:
    text = (REPO / "docs" / "structures.md").read_text()
    listed = re.findall(r"^\| `([^`]+)` \|", text, flags=re.M)
    in_layers = [name for name in listed if layer_of(REPO / name) in LAYERS]
    modules = {
        str(path.relative_to(REPO))
        for layer in LAYERS
        for path in python_files(layer)
        if path.name != "__init__.py" and "gen" not in path.relative_to(REPO).parts
    }
    listed_modules = [name for name in in_layers if name.endswith(".py")]
    assert sorted(listed_modules) == sorted(modules)
    assert all(list(REPO.glob(name)) for name in listed), "listed, not in the tree"
    ranks = [LAYERS.index(layer_of(REPO / name)) for name in in_layers]
    assert ranks == sorted(ranks), "docs/structures.md groups modules by layer, bottom first"
