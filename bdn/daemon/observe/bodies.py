"""Reading whole request and response bodies with a size limit.

``StreamReader.read(n)`` returns what has arrived so far, not ``n`` bytes: a body split across
TCP segments would be cut short. These helpers read to the end of the body and refuse one that
grows past ``limit`` bytes.
"""

from __future__ import annotations

from aiohttp import StreamReader


class BodyTooLarge(Exception):
    """The body is longer than the limit (``limit`` bytes)."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"body is larger than {limit} bytes")
        self.limit = limit


async def read_body(stream: StreamReader, limit: int, content_length: int | None = None) -> bytes:
    """The whole body, at most ``limit`` bytes.

    Raises:
        BodyTooLarge: the declared or actual length is over ``limit``.
    """
    if content_length is not None and content_length > limit:
        raise BodyTooLarge(limit)
    parts: list[bytes] = []
    total = 0
    while True:
        piece = await stream.readany()
        if not piece:
            break
        total += len(piece)
        if total > limit:
            raise BodyTooLarge(limit)
        parts.append(piece)
    return b"".join(parts)
