"""bdn/proto holds formats and rules only: no module in it imports os, mmap, threading or concurrent
(issue 14; file-level work is bdn.fileops). Checked on the source's AST, every import statement
anywhere in the module (function-level ones included)."""

from __future__ import annotations

import ast
import warnings
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


def test_moved_names_still_resolve_with_a_warning() -> None:
    """The old file-level names (bdn/daemon, bench and examples still use them) lead to bdn.fileops."""
    from bdn import fileops
    from bdn.proto import arc, chunks, safetensors_fmt

    moved = [
        (chunks, "file_digests", fileops.chunk_digests),
        (safetensors_fmt, "read_header", fileops.read_header),
        (safetensors_fmt, "save", fileops.save),
        (safetensors_fmt, "save_raw", fileops.save_raw),
        (arc, "write_diff_file", fileops.write_diff_file),
        (arc, "write_diff_file_from_arrays", fileops.write_diff_file_from_arrays),
    ]
    for module, old, new in moved:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert getattr(module, old) is new
        assert any(issubclass(w.category, DeprecationWarning) and "bdn.fileops" in str(w.message) for w in caught)
    with pytest.raises(AttributeError):
        arc.no_such_name  # noqa: B018
