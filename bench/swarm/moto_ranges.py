"""moto's S3 server with ranged GETs that read only their range: the bench's bucket.

    python -m bench.swarm.moto_ranges -H 0.0.0.0 -p 9000     (the arguments of moto.server)

Why: moto 5's ``GET`` with a ``Range`` header reads the whole object out of its buffer and then
slices it (``S3Response.get_object`` returns ``FakeKey.value``, all of it; ``_handle_range_header``
cuts the range out). A 1 MiB range of a 268 MB file costs a 268 MB copy, so the emulated bucket's
rate depended on how many ranged GETs a client made (57 MB/s with 16 MiB ranges on an idle
machine, 26 MB/s under load), not on the shaped link, and a client splitting reads finer looked
slower. Real S3 serves a range at the cost of the range. Here ``FakeKey.value``, read inside
``get_object``, gives a view that reads from the key's buffer only the bytes sliced out of it;
a GET without a range still gets the whole object (the view becomes bytes). Nothing else in
moto changes; this is bench harness only, never part of bdn.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from moto.s3 import models, responses

_in_get = threading.local()
_plain_value = models.FakeKey.value


class _LazyValue:
    """``len`` and slices of a key's bytes, reading only the sliced range from its buffer."""

    def __init__(self, key: Any) -> None:
        self.key = key

    def __len__(self) -> int:
        return int(self.key.size)

    def __bool__(self) -> bool:
        return len(self) > 0

    def __getitem__(self, s: slice) -> bytes:
        if not isinstance(s, slice):
            raise TypeError("only slices")
        start, stop, step = s.indices(len(self))
        if step != 1:
            return _plain_value.fget(self.key)[s]  # type: ignore[attr-defined]
        with self.key.lock:
            buf = self.key._value_buffer
            buf.seek(start)
            return buf.read(max(0, stop - start))

    def whole(self) -> bytes:
        return _plain_value.fget(self.key)  # type: ignore[attr-defined,no-any-return]


def _value(self: Any) -> Any:
    if getattr(_in_get, "on", False):
        return _LazyValue(self)
    return _plain_value.fget(self)  # type: ignore[attr-defined]


models.FakeKey.value = property(_value, _plain_value.fset)  # type: ignore[method-assign,assignment]
_get_object = responses.S3Response.get_object


def get_object(self: Any, *a: Any, **kw: Any) -> Any:
    _in_get.on = True
    try:
        return _get_object(self, *a, **kw)
    finally:
        _in_get.on = False


_key_response = responses.S3Response.key_response


def key_response(self: Any, *a: Any, **kw: Any) -> Any:
    status, headers, body = _key_response(self, *a, **kw)
    if isinstance(body, _LazyValue):  # no range asked: the whole object
        body = body.whole()
    return status, headers, body


responses.S3Response.get_object = get_object  # type: ignore[method-assign]
responses.S3Response.key_response = key_response  # type: ignore[method-assign]


def main() -> None:
    from moto.server import main as moto_main

    moto_main(sys.argv[1:])


if __name__ == "__main__":
    main()
