"""The package's layout rules (issue 14), checked over the AST of every module of ``bdn/``:

- no import cycle between bdn's modules (function-level imports count: they must not hide one);
- no function-level import of a ``bdn`` module in ``bdn/daemon`` (dependencies are explicit);
- no module of ``bdn/daemon`` over ``MAX_DAEMON_STATEMENTS`` statements (one responsibility
  each; statements, not lines, so that the formatter's line breaks do not move the rule);
- ``bdn/proto`` imports none of os, mmap, threading, concurrent (formats and rules only);
- the composition root (``bdn/daemon/app.py``) assigns attributes of ``self`` only: every other
  part gets its collaborators at construction;
- a snapshot's record (``SnapshotJob``) is written only in ``bdn/daemon/snapshots/snapshot.py``
  (its ``apply``): no other module assigns, augments or deletes one of its fields (nor an item
  of one), on a job or in a subclass.
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


SNAPSHOT_PY = PKG / "daemon" / "snapshots" / "snapshot.py"
#: The names a job goes by in bdn (every parameter typed ``SnapshotJob`` is named one of these
#: today; parameters and variables typed or built as a job are added per module).
JOB_NAMES = {"job", "j", "part"}
#: What a job is given to work with, not its state: calls on them and writes to their attributes
#: are theirs (``job.store.discard(...)``).
JOB_COLLABORATORS = {"store", "cond", "on_change"}
#: Methods that change a container (or a bitfield) in place: called on a job's field (or a part
#: of one, ``job.foreign_restored.add``) outside snapshot.py, they change the record.
MUTATORS = {
    "add", "append", "clear", "discard", "extend", "insert", "pop", "popitem", "remove", "setdefault",
    "update", "difference_update", "intersection_update", "symmetric_difference_update",
    "set", "set_all", "__setitem__", "__delitem__", "__setattr__",
}  # fmt: skip


def _stores(node: ast.AST) -> list[ast.expr]:
    """The expressions ``node`` writes to (assignment, augmented or annotated assignment,
    ``for`` and ``with`` targets, ``del``), tuples and starred targets unpacked."""
    if isinstance(node, ast.Assign):
        todo = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)):
        todo = [node.target]
    elif isinstance(node, ast.withitem) and node.optional_vars is not None:
        todo = [node.optional_vars]
    elif isinstance(node, ast.Delete):
        todo = list(node.targets)
    else:
        return []
    out = []
    while todo:
        t = todo.pop()
        if isinstance(t, (ast.Tuple, ast.List)):
            todo += t.elts
        elif isinstance(t, ast.Starred):
            todo.append(t.value)
        else:
            out.append(t)
    return out


def _job_fields() -> set[str]:
    """Every attribute ``SnapshotJob`` sets on ``self`` (snapshot.py)."""
    tree = ast.parse(SNAPSHOT_PY.read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SnapshotJob")
    return {
        t.attr
        for n in ast.walk(cls)
        for t in _stores(n)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }


def _job_writes(source: str, where: str, fields: set[str]) -> list[str]:
    """``where:line writes <target>`` for every write in ``source`` to a field of a job: an
    attribute in ``fields`` (or an item of one) of a name in ``JOB_NAMES``, of a parameter
    annotated with a job type, of a variable built by a job class, of ``<x>.job``, or of
    ``self`` in a subclass of ``SnapshotJob``."""
    tree = ast.parse(source, where)
    job_types = {"SnapshotJob"} | {
        n.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and any(ast.unparse(b).endswith("SnapshotJob") for b in n.bases)
    }
    names = set(JOB_NAMES)
    for n in ast.walk(tree):
        if isinstance(n, ast.arg) and n.annotation is not None:
            if any(isinstance(x, ast.Name) and x.id in job_types for x in ast.walk(n.annotation)):
                names.add(n.arg)
            elif isinstance(n.annotation, ast.Constant) and any(t in str(n.annotation.value) for t in job_types):
                names.add(n.arg)
        elif isinstance(n, ast.Assign) and isinstance(n.value, ast.Call):
            if isinstance(n.value.func, ast.Name) and n.value.func.id in job_types:
                names |= {t.id for t in n.targets if isinstance(t, ast.Name)}
    subclass_lines = {
        x.lineno
        for c in ast.walk(tree)
        if isinstance(c, ast.ClassDef) and c.name in job_types - {"SnapshotJob"}
        for x in ast.walk(c)
        if hasattr(x, "lineno")
    }

    def is_job(e: ast.expr, line: int) -> bool:
        if isinstance(e, ast.Name):
            return e.id in names or (e.id == "self" and line in subclass_lines)
        return isinstance(e, ast.Attribute) and e.attr in names

    def field_in(t: ast.expr, line: int, deep: bool = False) -> ast.Attribute | None:
        # the job field ``t`` is, or is part of (an item or attribute of one: job.stages["x"],
        # job.foreign.verified); the collaborators a job is given are not its state
        while isinstance(t, (ast.Subscript, ast.Attribute)):
            if isinstance(t, ast.Attribute) and t.attr in fields and is_job(t.value, line):
                return t if not (deep and t.attr in JOB_COLLABORATORS) else None
            deep, t = True, t.value
        return None

    out = []
    for node in ast.walk(tree):
        for t in _stores(node):
            line = getattr(node, "lineno", t.lineno)  # (a ``with`` item has none)
            if (f := field_in(t, line)) is not None:
                out.append(f"{where}:{line} writes {ast.unparse(f)}")
        if not isinstance(node, ast.Call):
            continue
        fn = ast.unparse(node.func)
        if isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS and fn != "object.__setattr__":
            if (f := field_in(node.func.value, node.lineno, deep=True)) is not None:
                out.append(f"{where}:{node.lineno} changes {ast.unparse(f)} ({node.func.attr})")
        elif fn in ("setattr", "delattr", "object.__setattr__", "object.__delattr__") and node.args:
            target, name = node.args[0], node.args[1] if len(node.args) > 1 else None
            own = is_job(target, node.lineno) and isinstance(name, ast.Constant) and name.value in fields
            if own or field_in(target, node.lineno, deep=True) is not None:
                out.append(f"{where}:{node.lineno} changes {ast.unparse(target)} ({fn})")
    return out


def test_the_job_write_finder_finds_writes() -> None:
    snippet = (
        "class P(SnapshotJob):\n"
        "    def f(self):\n"
        "        self.reason = 'x'\n"
        "def g(job, other: SnapshotJob, x):\n"
        "    job.bytes_local += 1\n"
        "    other.state, y = 'ready', 2\n"
        "    x.job.stages['q'] = 0.0\n"
        "    k = P()\n"
        "    k.manifest = None\n"
        "    del job.foreign\n"
        "    x.reason = 'a member, not a job'\n"
        "    job.apply(e)\n"
        "    job.foreign.verified = True\n"
        "    job.foreign_restored.add((0, 1))\n"
        "    x.job.foreign_senders.update({})\n"
        "    job.stored.set(3)\n"
        "    object.__setattr__(job.foreign, 'hint', None)\n"
        "    job.store.discard('s')\n"
        "    job.foreign.table.objects.count(1)\n"
        "    job.cond.notify_all()\n"
        "    setattr(job, 'reason', 'x')\n"
        "    setattr(job, 'unknown', 1)\n"
    )
    found = _job_writes(snippet, "s", _job_fields())
    assert sorted(int(f.split(" ", 1)[0][2:]) for f in found) == [3, 5, 6, 7, 9, 10, 13, 14, 15, 16, 17, 21], found


def test_only_the_snapshot_record_writes_its_fields() -> None:
    """A snapshot's state changes only by events applied in one place (``SnapshotJob.apply``,
    bdn/daemon/snapshots/events.py); every other module reads it or sends events."""
    fields = _job_fields()
    assert {"state", "reason", "bytes_from_peers", "manifest_digest", "tensor_index"} <= fields
    bad = []
    for path in MODULES.values():
        if path != SNAPSHOT_PY:
            bad += _job_writes(path.read_text(), str(path.relative_to(ROOT)), fields)
    assert not bad, "send an event (SnapshotJob.apply) instead: " + "; ".join(bad)


def test_the_foreign_table_a_job_holds_is_a_frozen_value() -> None:
    """``job.foreign`` (``ForeignState``) is an immutable value: what changes while a snapshot
    without a manifest loads is the job's own fields, changed by its events; no method of the
    value writes to it (``__post_init__`` derives a field once)."""
    import dataclasses

    from bdn.daemon.snapshots.foreign_state import ForeignState, Hint

    assert ForeignState.__dataclass_params__.frozen and Hint.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert {f.name for f in dataclasses.fields(ForeignState)} >= {"table", "checksums", "unverifiable"}
    tree = ast.parse((PKG / "daemon" / "snapshots" / "foreign_state.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "ForeignState")
    bad = []
    for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__post_init__"):
        for node in ast.walk(fn):
            for t in _stores(node):
                while isinstance(t, (ast.Subscript, ast.Attribute)):
                    t = t.value
                if isinstance(t, ast.Name) and t.id == "self":
                    bad.append(f"{fn.name} writes {ast.unparse(node)}")
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
                bad.append(f"{fn.name} calls {ast.unparse(node.func)}")
    assert not bad, "the foreign table is a value: send the job an event instead: " + "; ".join(bad)
