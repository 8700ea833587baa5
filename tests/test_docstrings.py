"""Every public module, class and function of ``bdn/`` has a docstring (STYLE: docstrings give
shapes, units, errors and the source spec or format), checked over the AST (nothing is imported).

Public: a module-level class or function whose name does not start with ``_``, and such a
method of a public class (nested classes too); a property's setter or deleter shares its
getter's docstring, and a method that overrides a documented one still says what *it* does.
A module with any code needs a module docstring (an empty ``__init__.py`` does not).

``MISSING`` is the allow-list of what is left, each entry ``path:qualified name``, all of them in
modules other engineers own right now: shrink it as they are written, never grow it. An entry
that now has its docstring, or no longer exists, fails the test too, so the list stays exact.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "bdn"

MISSING = frozenset(
    {
        "bdn/cli/commands/fleet.py:add_hot_load",
        "bdn/cli/commands/fleet.py:add_engines",
        "bdn/cli/commands/node.py:add_status",
        "bdn/cli/commands/node.py:add_peers",
        "bdn/cli/commands/node.py:add_gc",
        "bdn/cli/commands/snapshots.py:add_prefetch",
        "bdn/cli/commands/snapshots.py:add_cancel",
        "bdn/cli/commands/snapshots.py:add_snapshots",
        "bdn/cli/commands/snapshots.py:add_path",
        "bdn/cli/commands/verify.py:add_verify",
        "bdn/control/hotload.py:Target.order",
        "bdn/control/hotload.py:Target.wire",
        "bdn/control/hotload.py:ReplicaBoard.put",
        "bdn/control/members.py:MemberTable.get",
        "bdn/control/members.py:MemberTable.pop",
        "bdn/control/members.py:MemberTable.items",
        "bdn/control/owners.py:OwnerMap.is_reader",
        "bdn/control/peerset.py:PeerSet.complete",
        "bdn/control/peerset.py:PeerSet.missing",
        "bdn/control/peerset.py:PeerSet.holders",
        "bdn/control/peerset.py:PeerSet.bitfield",
        "bdn/control/peerset.py:PeerSet.remove",
        "bdn/control/peerset.py:PeerSet.next_flush",
        "bdn/control/probation.py:Probation.get",
        "bdn/control/swim.py:Swim.status",
        "bdn/control/swim.py:Swim.table_size",
        "bdn/daemon/app.py:App.install_signal_handlers",
        "bdn/daemon/app.py:App.handle_exit",
        "bdn/daemon/app.py:App.main_loop",
        "bdn/daemon/fetch/policy.py:Positions.clear_positions",
        "bdn/daemon/fetch/policy.py:Rounds.after_round",
        "bdn/daemon/fetch/targets.py:TargetMaps.release",
        "bdn/daemon/fetch/targets.py:TargetMaps.open_count",
        "bdn/daemon/swarm/gossip.py:encode_addr",
        "bdn/daemon/swarm/gossip.py:message_wire",
        "bdn/daemon/swarm/gossip.py:Gossip.close",
        "bdn/daemon/main.py:PlainArgs.filter",
        "bdn/daemon/swarm/membership.py:Membership.by_node",
        "bdn/daemon/serve/uploads.py:Admission",
        "bdn/transfer/announce.py:HaveSubscriber.subscribed",
        "bdn/transfer/announce.py:HaveSubscriber.count",
        "bdn/transfer/announce.py:HaveSubscriber.close",
        "bdn/transfer/files.py:FileCache.acquire",
        "bdn/transfer/files.py:FileCache.release",
        "bdn/transfer/files.py:FileCache.forget",
        "bdn/transfer/files.py:FileCache.close",
    }
)

Definition = ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef


def _shares_getter_doc(node: Definition) -> bool:
    """``@x.setter`` / ``@x.deleter``: documented by the property's getter."""
    return any(isinstance(d, ast.Attribute) and d.attr in ("setter", "deleter") for d in node.decorator_list)


def _public(body: list[ast.stmt], prefix: str = "") -> Iterator[tuple[str, Definition]]:
    """``(qualified name, node)`` of the public classes and functions in ``body``, and of the
    public methods of its public classes, depth first."""
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if node.name.startswith("_") or _shares_getter_doc(node):
            continue
        yield prefix + node.name, node
        if isinstance(node, ast.ClassDef):
            yield from _public(node.body, f"{prefix}{node.name}.")


def undocumented(path: Path, source: str) -> list[str]:
    """``path:qualified name`` of every public item of one module without a docstring; the name
    ``<module>`` for a module with code but no docstring."""
    tree = ast.parse(source, str(path))
    rel = path.relative_to(ROOT).as_posix() if path.is_absolute() else path.as_posix()
    out = [f"{rel}:<module>"] if tree.body and ast.get_docstring(tree) is None else []
    return out + [f"{rel}:{name}" for name, node in _public(tree.body) if ast.get_docstring(node) is None]


def _all_undocumented() -> set[str]:
    found: set[str] = set()
    for p in sorted(PKG.rglob("*.py")):
        found.update(undocumented(p, p.read_text()))
    return found


def test_the_check_sees_what_it_should() -> None:
    source = '''"""A module."""
class Public:
    """Doc."""
    def method(self): pass
    def _private(self): pass
    @property
    def value(self):
        """Doc."""
    @value.setter
    def value(self, v): pass
    class Inner:
        def deep(self): pass
def function(): pass
async def coroutine():
    """Doc."""
    def nested(): pass
def _helper(): pass
class _Hidden:
    def method(self): pass
'''
    assert undocumented(Path("m.py"), source) == [
        "m.py:Public.method",
        "m.py:Public.Inner",
        "m.py:Public.Inner.deep",
        "m.py:function",
    ]
    assert undocumented(Path("m.py"), "x = 1\n") == ["m.py:<module>"]
    assert undocumented(Path("m.py"), "") == []


def test_public_items_of_bdn_have_docstrings() -> None:
    missing = _all_undocumented()
    new = sorted(missing - MISSING)
    assert not new, "public items without a docstring (write one; do not add them to MISSING):\n" + "\n".join(new)


def test_the_allow_list_is_exact() -> None:
    stale = sorted(MISSING - _all_undocumented())
    assert not stale, "documented or gone now, remove from MISSING:\n" + "\n".join(stale)
