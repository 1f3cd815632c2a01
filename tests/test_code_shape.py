"""Functions short enough to read at once in the middle of the house (issue 23): no function
in ``services/`` or ``gateway/`` runs over 60 lines, docstring included."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 60


def test_no_long_function_in_services_or_gateway() -> None:
    long = []
    for package in ("services", "gateway"):
        for path in sorted((REPO_ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > MAX_LINES:
                        long.append(f"{path.relative_to(REPO_ROOT)}:{node.lineno} "
                                    f"{node.name} ({lines} lines)")
    assert not long, "split these by concern:\n" + "\n".join(long)
