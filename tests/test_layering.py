"""The package's layers, read from the imports of every module (functions' own imports too):
lower layers never import higher ones, parts of one layer never import each other, nothing of the
runtime imports dynemb.testing, and the DLRM job (dynemb.trainer) uses the library as a user
would: only the names dynemb.tables, dynemb.checkpoint and dynemb.publish export, never their modules."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import dynemb

ROOT = Path(dynemb.__file__).parent
# top to bottom; a part may import the parts of lower layers (docs/design.md)
LAYERS = [
    {"cli"},
    {"demo"},
    {"tf", "trainer"},
    {"publish"},
    {"checkpoint"},
    {"tables"},
    {"idtransformer", "ps_server"},
    {"protos", "common"},
]
LAYER = {part: depth for depth, parts in enumerate(LAYERS) for part in parts}
LIBRARY = ("tables", "checkpoint", "publish")  # what dynemb.trainer may use through their package's names only


def _imports(path: Path, runtime_only: bool = False) -> list[tuple[int, str]]:
    """(line, dotted name) of every dynemb import in the file; `from dynemb.x import y` gives
    dynemb.x, and dynemb.x.y where y is a module of dynemb.x. runtime_only leaves out those
    under `if TYPE_CHECKING:` (for the type checker only)."""
    tree = ast.parse(path.read_text(), str(path))
    skipped = set()
    if runtime_only:
        skipped = {
            id(node)
            for block in ast.walk(tree)
            if isinstance(block, ast.If) and isinstance(block.test, ast.Name) and block.test.id == "TYPE_CHECKING"
            for stmt in block.body
            for node in ast.walk(stmt)
        }
    out = []
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("dynemb")]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("dynemb"):
            out.append((node.lineno, node.module))
            base = ROOT.joinpath(*node.module.split(".")[1:])
            for a in node.names:
                if (base / f"{a.name}.py").exists() or (base / a.name / "__init__.py").exists():
                    out.append((node.lineno, f"{node.module}.{a.name}"))
    return out


def _part(path: Path) -> str:
    return path.relative_to(ROOT).parts[0].removesuffix(".py")


MODULES = sorted(p for p in ROOT.rglob("*.py") if _part(p) not in ("__init__", "testing"))


def test_every_part_has_a_layer():
    parts = {_part(p) for p in MODULES}
    assert parts <= set(LAYER), f"parts with no layer in this test: {parts - set(LAYER)}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_go_down_the_layers(path):
    mine = _part(path)
    wrong = []
    for line, name in _imports(path):
        parts = name.split(".")
        if len(parts) < 2 or parts[1] == mine:
            continue
        other = parts[1]
        if other == "testing":
            wrong.append(f"line {line}: {name} (test support: nothing of the runtime imports it)")
        elif other in LAYER and LAYER[other] <= LAYER[mine]:
            wrong.append(f"line {line}: {name} (layer {LAYER[other]} from layer {LAYER[mine]})")
        elif mine == "trainer" and other in LIBRARY and len(parts) > 2:
            wrong.append(f"line {line}: {name} (the job uses dynemb.{other}'s public names only)")
    assert not wrong, f"{path.relative_to(ROOT.parent)}:\n  " + "\n  ".join(wrong)


def test_the_check_sees_a_wrong_import(tmp_path):
    bad = ROOT / "ps_server" / "_layering_probe.py"
    bad.write_text("from dynemb.trainer.config import TrainConfig\n")
    try:
        with pytest.raises(AssertionError, match="dynemb.trainer.config"):
            test_imports_go_down_the_layers(bad)
    finally:
        bad.unlink()


def test_the_id_transformer_modules_import_each_other_in_no_circle():
    """dynemb/idtransformer reads top to bottom: no module imports, however late, one that
    imports it back (issue 43's layout: the records in results.py, each backend below the API)."""
    package, prefix = ROOT / "idtransformer", "dynemb.idtransformer."
    graph = {
        p.stem: {n.removeprefix(prefix) for _, n in _imports(p, runtime_only=True) if n.startswith(prefix)} - {p.stem}
        for p in package.glob("*.py")
        if p.stem != "__init__"
    }
    done: set[str] = set()

    def visit(module: str, trail: list[str]) -> None:
        if module in trail:
            raise AssertionError(" -> ".join(trail[trail.index(module) :] + [module]))
        if module in done or module not in graph:
            return
        for needed in sorted(graph[module]):
            visit(needed, trail + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
