"""The code's layers, as docs/design.md states them: Hydra stays at the top, kernels stand alone, no cycles,
and the constants the docs quote are the code's."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kernels.control
import rlsweep.spec
import rlsweep.synthetic

ROOT = Path(__file__).parent.parent
CONFIG_LAYER = {"rlsweep.__main__", "rlsweep.callbacks", "rlsweep.config"}  # docs/design.md
CONFIG_PACKAGES = {"hydra", "omegaconf"}


def executed(tree: ast.AST):
    """Every node of ``tree`` that can run: ``if TYPE_CHECKING:`` blocks (annotations only) are left out."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from executed(node)


def imports(package: str) -> dict[str, set[str]]:
    """Module name -> the modules it imports where it runs (module level or inside functions)."""
    found = {}
    for path in sorted((ROOT / package).glob("*.py")):
        name = f"{package}.{path.stem}" if path.stem != "__init__" else package
        targets = set()
        for node in executed(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                targets.add(node.module)
                targets.update(f"{node.module}.{alias.name}" for alias in node.names)
        found[name] = targets
    return found


def test_only_the_config_layer_imports_hydra_or_omegaconf():
    offenders = {
        module: sorted(t for t in targets if t.split(".")[0] in CONFIG_PACKAGES)
        for module, targets in imports("rlsweep").items()
        if module not in CONFIG_LAYER
    }
    assert {m: t for m, t in offenders.items() if t} == {}
    assert all(any(t.split(".")[0] in CONFIG_PACKAGES for t in imports("rlsweep")[m]) for m in CONFIG_LAYER)


def test_kernels_import_nothing_from_rlsweep_and_no_module_imports_itself_back():
    graph = imports("kernels")
    from_rlsweep = {m: sorted(t for t in ts if t.startswith("rlsweep")) for m, ts in graph.items()}
    assert {m: ts for m, ts in from_rlsweep.items() if ts} == {}
    edges = {m: {t for t in ts if t in graph and t != m} for m, ts in graph.items() if m != "kernels"}
    edges = {m: ts - {"kernels"} for m, ts in edges.items()}

    def cycle_from(start: str, seen: tuple[str, ...]) -> tuple[str, ...] | None:
        for nxt in sorted(edges.get(start, ())):
            if nxt in seen:
                return (*seen[seen.index(nxt) :], nxt)
            found = cycle_from(nxt, (*seen, nxt))
            if found:
                return found
        return None

    cycles = {m: cycle_from(m, (m,)) for m in edges}
    assert {m: c for m, c in cycles.items() if c} == {}


DOC_QUOTES = [
    ("kernels.md", f"`1 + (T - 1) mod {kernels.control.SPLIT_CYCLE}`"),
    ("kernels.md", f"Every `tp` up to {rlsweep.spec.MAX_TP} is served"),
    ("index.md", f"| `tp` | 1 to {rlsweep.spec.MAX_TP} "),
    ("index.md", f"each split keeps {kernels.control.KEPT_MANTISSA_BITS} mantissa bits"),
    ("index.md", f"integers in [0, 2**{64 - rlsweep.synthetic.STREAM_BITS} - 1]"),
    ("index.md", f"`seed * {2**rlsweep.synthetic.STREAM_BITS} + stream`"),
]


@pytest.mark.parametrize("doc, quote", DOC_QUOTES, ids=[quote for _, quote in DOC_QUOTES])
def test_the_docs_quote_the_constants_the_code_has(doc, quote):
    assert quote in (ROOT / "docs" / doc).read_text()
