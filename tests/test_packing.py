"""bdn.daemon.observe.packing.packb: the same bytes as ``msgpack.packb(obj, use_bin_type=True)``,
without the 256 KiB buffer msgpack's default ``Packer`` allocates per call (issue 12's soak:
those blocks fragmented glibc's heap)."""

from __future__ import annotations

import msgpack
import pytest

from bdn.daemon.observe.packing import BUF_SIZE, packb


@pytest.mark.parametrize(
    "obj",
    [
        {"ok": True},
        {"identity": "step000012", "row": {"stage": "done", "gen": 3, "at": 1.5, "why": None}},
        {"bits": b"\xff" * 10, "n": 80, "name": "naïve"},
        [b"x" * (3 * BUF_SIZE), "y" * (5 * BUF_SIZE)],  # grows past the first buffer
        {"bitfields": {f"n{i}": bytes(range(256)) * 40 for i in range(30)}},  # ~300 KB
    ],
)
def test_same_bytes_as_msgpack(obj: object) -> None:
    assert packb(obj) == msgpack.packb(obj, use_bin_type=True)
    assert msgpack.unpackb(packb(obj), raw=False) == obj


def test_unencodable_raises_like_msgpack() -> None:
    with pytest.raises(TypeError):
        packb({"x": object()})


def test_no_daemon_module_calls_msgpack_packb() -> None:
    """Every message the daemon packs goes through packing.packb (a ``msgpack.packb`` call
    would bring the 256 KiB buffer per message back)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "bdn"
    calls = [str(p) for p in root.rglob("*.py") if p.name != "packing.py" and "msgpack.packb(" in p.read_text()]
    assert calls == []
