"""A census of a soak daemon's Python objects over time: what a structure holds, not where it was
allocated (issue 31).

tracemalloc (bench/soak/tmprobe.py) charges a block to the code that allocated it; CPython's free
lists (tuples, floats, dicts) hand a freed block to a later object without a new allocation, so
a long-lived structure's entries can be charged to an unrelated line. This probe counts what is
live instead. The fleet starts a daemon as ``python -m bench.soak.objprobe`` when its
environment has ``SOAK_OBJPROBE=START_S,EVERY_S`` (``--node-env nodeN:SOAK_OBJPROBE=240,240``);
a thread appends one JSON line every ``EVERY_S`` seconds from ``START_S`` on to
``<SOAK_OBJPROBE_DIR>/objprobe.jsonl``::

    {"t_s": float,
     "types": {type name: [count, bytes]},   # every object reachable from the collector's objects
     "owned": {"Class.attr": [entries, nested entries, bytes]}}   # containers held by bdn's instances

``types`` walks every object the cyclic collector tracks and, one level down, what they refer
to (strings, bytes, ints and dicts of atomic values are not tracked themselves); ``bytes`` is
``sys.getsizeof`` (shallow). ``owned`` covers every attribute of every instance of a class
defined in ``bdn.*`` (and ``bdn.*`` module globals, as ``module:name``) that is a dict, list,
set, deque or OrderedDict: its length, the summed lengths of the containers in it (one level) and
the shallow sizes of it, its entries and theirs (two levels; an object held twice counts twice).
A structure whose entries keep rising with the number of hot-loads is a leak or a bound not yet
reached. Costs a few seconds of the GIL per line on a daemon (the loop stalls meanwhile): a
diagnosis, not a measurement of speed.

Then the daemon's own ``__main__`` runs in this process (runpy), so signals and exit codes are the
daemon's own.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import runpy
import sys
import threading
import time
from pathlib import Path
from typing import Any

ENV = "SOAK_OBJPROBE"
DIR_ENV = "SOAK_OBJPROBE_DIR"
_T0 = time.monotonic()
_CONTAINERS = (dict, list, set, frozenset, collections.deque)


def _items(v: Any) -> list[Any]:
    """The keys and values of a mapping, the members of another container (a copy)."""
    for _ in range(3):
        try:
            return [*v.keys(), *v.values()] if isinstance(v, dict) else list(v)
        except RuntimeError:  # changed size meanwhile (another thread): try again
            continue
    return []


def _nested(v: Any) -> tuple[int, int]:
    """``(entries, bytes)`` of container ``v`` two levels deep: the summed lengths of the
    containers directly in it, and ``sys.getsizeof`` of ``v``, of what it holds and of what
    those containers hold (shallow sizes; an object held twice counts twice)."""
    n, size = 0, sys.getsizeof(v)
    for x in _items(v):
        size += sys.getsizeof(x)
        if isinstance(x, _CONTAINERS):
            inner = _items(x)
            n += len(inner) if not isinstance(x, dict) else len(inner) // 2
            size += sum(sys.getsizeof(y) for y in inner)
    return n, size


def census() -> dict[str, Any]:
    """One line's ``types`` and ``owned`` (see the module)."""
    types: dict[str, list[int]] = {}
    owned: dict[str, list[int]] = {}
    seen: set[int] = set()

    def count(o: Any) -> None:
        i = id(o)
        if i in seen:
            return
        seen.add(i)
        t = types.setdefault(type(o).__name__, [0, 0])
        t[0] += 1
        try:
            t[1] += sys.getsizeof(o)
        except TypeError:
            pass

    def own(key: str, v: Any) -> None:
        if isinstance(v, _CONTAINERS):
            row = owned.setdefault(key, [0, 0, 0])
            nested, size = _nested(v)
            row[0] += len(v)
            row[1] += nested
            row[2] += size

    objs = gc.get_objects()
    for o in objs:
        count(o)
        for r in gc.get_referents(o):
            if not gc.is_tracked(r):
                count(r)
        cls = type(o)
        mod = getattr(cls, "__module__", None)
        if isinstance(mod, str) and mod.startswith("bdn.") and hasattr(o, "__dict__"):
            try:
                attrs = list(vars(o).items())
            except TypeError:
                continue
            for name, v in attrs:
                own(f"{cls.__name__}.{name}", v)
    del objs
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("bdn.") and mod is not None:
            for name, v in list(vars(mod).items()):
                own(f"{mod_name}:{name}", v)
    return {"types": types, "owned": owned}


def _probe(start_s: float, every_s: float, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "objprobe.jsonl"
    due = start_s
    while True:
        t = time.monotonic() - _T0
        if t >= due:
            t0 = time.monotonic()
            line = {"t_s": round(t, 1), **census()}
            line["took_s"] = round(time.monotonic() - t0, 2)
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
            due += every_s
        time.sleep(max(0.5, due - (time.monotonic() - _T0)))


def growth(path: Path, top: int = 30, first: int = 0) -> str:
    """A text table: the ``top`` largest growths of ``owned`` and of ``types`` between line
    ``first`` and the last line of an objprobe file."""
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    a, b = lines[first], lines[-1]
    out = [f"{path}: t {a['t_s']} -> {b['t_s']} s ({len(lines) - first} lines)"]
    rows = []
    for k, (n, nn, sz) in b["owned"].items():
        n0, nn0, sz0 = a["owned"].get(k, [0, 0, 0])
        series = [ln["owned"].get(k, [0, 0, 0])[0] for ln in lines[first:]]
        rows.append((sz - sz0, n + nn - n0 - nn0, k, series, nn0, nn, sz))
    rows.sort(key=lambda r: (-r[0], -r[1]))
    out.append("owned containers: growth of bytes (KiB) and of entries (+ nested), entries per line")
    out += [
        f"  {ds / 1024:+8.1f} KiB {d:+7d}  {k}  {series}  nested {nn0} -> {nn}, now {sz / 1024:.1f} KiB"
        for ds, d, k, series, nn0, nn, sz in rows[:top]
    ]
    trows = []
    for k, (n, sz) in b["types"].items():
        n0, sz0 = a["types"].get(k, [0, 0])
        trows.append((sz - sz0, n - n0, k, [ln["types"].get(k, [0, 0])[1] >> 10 for ln in lines[first:]]))
    trows.sort(key=lambda r: -r[0])
    out.append("types: growth of bytes (KiB), count, KiB per line")
    out += [f"  {ds / 1024:+9.1f} KiB {dn:+8d}  {k}  {series}" for ds, dn, k, series in trows[:top]]
    return "\n".join(out)


def main() -> None:
    if sys.argv[1:2] == ["growth"]:
        print(growth(Path(sys.argv[2]), first=int(sys.argv[3]) if len(sys.argv) > 3 else 0))
        return
    spec = os.environ.get(ENV)
    if spec:
        start_s, every_s = (float(x) for x in spec.split(","))
        out = Path(os.environ.get(DIR_ENV) or ".")
        threading.Thread(target=_probe, args=(start_s, every_s, out), name="objprobe", daemon=True).start()
    sys.argv = ["bdnd", *sys.argv[1:]]
    runpy.run_module("bdn.daemon.main", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
