"""The suite's own layout."""

from __future__ import annotations

from pathlib import Path


def test_test_modules_have_names_of_their_own():
    """pytest's default import mode imports test modules (and the helpers beside them) by
    basename: two of one name in different folders stop the whole suite from collecting."""
    tests = Path(__file__).parent
    names: dict[str, list[str]] = {}
    for path in tests.rglob("*.py"):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            names.setdefault(path.name, []).append(str(path.relative_to(tests)))
    assert {n: p for n, p in names.items() if len(p) > 1} == {}
