"""bdn/proto holds formats and rules only: no module in it imports os, mmap, threading or concurrent
(issue 14; file-level work is bdn.fileops). Checked on the source's AST, every import statement
anywhere in the module (function-level ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import bdn.proto

FORBIDDEN = ("os", "mmap", "threading", "concurrent")
PROTO = Path(bdn.proto.__file__).parent
#: Known exceptions, to be removed by the change that fixes them (strict: the test fails once fixed).
PENDING: dict[str, str] = {}  # module -> reason, for a module known to still do I/O


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


@pytest.mark.parametrize("name", sorted(p.name for p in PROTO.glob("*.py")))
def test_proto_module_imports_no_io(name: str, request: pytest.FixtureRequest) -> None:
    if name in PENDING:
        request.applymarker(pytest.mark.xfail(reason=PENDING[name], strict=True))
    bad = sorted(_imports(PROTO / name) & set(FORBIDDEN))
    assert not bad, f"bdn/proto/{name} imports {', '.join(bad)}: file and thread work belongs in bdn.fileops"
