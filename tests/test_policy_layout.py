"""The package's layout rules (issue 14), checked over the AST of every module of ``bdn/``:

- no import cycle between bdn's modules (function-level imports count: they must not hide one);
- no function-level import of a ``bdn`` module in ``bdn/daemon`` (dependencies are explicit);
- no module of ``bdn/daemon`` over ``MAX_DAEMON_STATEMENTS`` statements (one responsibility
  each; statements, not lines, so that the formatter's line breaks do not move the rule);
- ``bdn/proto`` imports none of os, mmap, threading, concurrent (formats and rules only);
- the composition root (``bdn/daemon/app.py``) assigns attributes of ``self`` only: every other
  part gets its collaborators at construction.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "bdn"
# A prompt to look for a second responsibility, not a target: modules split by cohesion (store.py
# lost its shm lock to shmlock.py). Counted in AST statements (docstrings and comments are free).
MAX_DAEMON_STATEMENTS = 350
IO_MODULES = {"os", "mmap", "threading", "concurrent"}


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def _imports(name: str, tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """``(imported module, node)`` for every import statement of ``name`` (any depth)."""
    pkg = name if _is_package(name) else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = pkg.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full if full in MODULES else base, node))
    return out


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[name] = {m for m, _ in _imports(name, tree) if m in MODULES and m != name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules, or None (iterative DFS, three colours)."""
    colour: dict[str, int] = {}
    for start in graph:
        if colour.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        colour[start] = 1
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                colour[node] = 2
                stack.pop()
                path.pop()
            elif colour.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            elif not colour.get(nxt):
                colour[nxt] = 1
                stack.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
    return None


def _function_level(tree: ast.AST) -> list[ast.AST]:
    """Import statements inside a function body."""
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [n for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))]
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_cycle_in_bdn() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_no_function_level_bdn_import_in_daemon() -> None:
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("bdn.daemon"):
            continue
        for node in _function_level(ast.parse(path.read_text(), str(path))):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or "."]
            if isinstance(node, ast.ImportFrom) and node.level or any(m == "bdn" or m.startswith("bdn.") for m in mods):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "function-level bdn imports: " + ", ".join(bad)


def test_daemon_modules_are_small() -> None:
    big = {}
    for name, p in MODULES.items():
        if name.startswith("bdn.daemon"):
            n = sum(isinstance(node, ast.stmt) for node in ast.walk(ast.parse(p.read_text())))
            if n > MAX_DAEMON_STATEMENTS:
                big[str(p.relative_to(ROOT))] = n
    assert not big, f"modules of bdn/daemon over {MAX_DAEMON_STATEMENTS} statements: {big}"


def test_proto_does_no_io() -> None:
    bad = []
    for name, path in MODULES.items():
        if not name.startswith("bdn.proto"):
            continue
        for mod, node in _imports(name, ast.parse(path.read_text(), str(path))):
            if mod.split(".")[0] in IO_MODULES:
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {mod}")
    assert not bad, "bdn/proto must be formats and rules only: " + "; ".join(bad)


PURE_POLICIES = (
    "bdn.daemon.fetch.policy",
    "bdn.daemon.serve.uploads",
    "bdn.daemon.snapshots.retention",
    "bdn.daemon.replica.target",
)
IO_OR_ASYNC = IO_MODULES | {"asyncio", "aiohttp", "socket", "subprocess", "httpx", "select", "selectors"}


def test_pure_policies_import_no_io_nor_asyncio() -> None:
    """The policies run unchanged in a fleet simulator: none of them (nor what they import of
    bdn, transitively) touches asyncio, sockets, files or threads."""
    graph = _graph()
    bad = []
    for start in PURE_POLICIES:
        seen, todo = set(), [start]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            todo += graph[name]
            path = MODULES[name]
            for mod, node in _imports(name, ast.parse(path.read_text(), str(path))):
                if mod.split(".")[0] in IO_OR_ASYNC:
                    bad.append(f"{start} -> {path.relative_to(ROOT)}:{node.lineno} imports {mod}")
    assert not bad, "; ".join(bad)


def _patched(path: Path) -> list[str]:
    """``file:line assigns <target>`` for every assignment in ``path`` to an attribute of
    anything but ``self`` (``fetcher.hook = ...``, ``self.a.b = ...``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        else:
            continue
        for t in targets:
            for sub in ast.walk(t):
                if isinstance(sub, ast.Attribute) and not (isinstance(sub.value, ast.Name) and sub.value.id == "self"):
                    out.append(f"{path.name}:{node.lineno} assigns {ast.unparse(sub)}")
    return out


def test_the_composition_root_patches_no_other_object() -> None:
    """app.py passes every collaborator at construction (DESIGN.md, "Parts and interfaces"):
    none is set on another object afterwards."""
    bad = _patched(PKG / "daemon" / "app.py")
    assert not bad, "set at construction instead: " + "; ".join(bad)
