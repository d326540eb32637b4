"""The library's shape, as docs/architecture.md describes it: small modules, and one boundary
to Redis (the modules that talk to redis-py)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

LIBRARY = sorted((ROOT / "keyserial").glob("*.py"))


def imported_modules(path: Path) -> set[str]:
    """The top-level packages ``path`` imports (``redis`` for ``from redis.asyncio import x``)."""
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_boundary_and_the_resp_connection_import_redis() -> None:
    assert LIBRARY, "no library modules found"
    importing = {path.name for path in LIBRARY if "redis" in imported_modules(path)}
    assert importing == {"_backend.py", "_resp.py"}
