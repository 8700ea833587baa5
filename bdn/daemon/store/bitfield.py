"""Have-bitfields over a manifest's chunk list (bit order as BitTorrent's: MSB of byte 0 first)."""

from __future__ import annotations

import numpy as np


class Bitfield:
    """``n`` bits, all clear; ``count`` tracks how many are set."""

    __slots__ = ("n", "bits", "count")

    def __init__(self, n: int, data: bytes | None = None) -> None:
        self.n = n
        nbytes = (n + 7) // 8
        if data is None:
            self.bits = bytearray(nbytes)
            self.count = 0
        else:
            if len(data) != nbytes:
                raise ValueError(f"bitfield of {n} bits needs {nbytes} bytes, got {len(data)}")
            self.bits = bytearray(data)
            if n % 8 and self.bits:
                self.bits[-1] &= (0xFF00 >> (n % 8)) & 0xFF  # spare bits are ignored, not trusted
            self.count = int.from_bytes(self.bits, "big").bit_count()

    def __getitem__(self, i: int) -> bool:
        return bool(self.bits[i >> 3] & (0x80 >> (i & 7)))

    def set(self, i: int) -> bool:
        """Set bit ``i``; True if it was clear."""
        mask = 0x80 >> (i & 7)
        if self.bits[i >> 3] & mask:
            return False
        self.bits[i >> 3] |= mask
        self.count += 1
        return True

    def clear(self, i: int) -> bool:
        """Clear bit ``i``; True if it was set."""
        mask = 0x80 >> (i & 7)
        if not self.bits[i >> 3] & mask:
            return False
        self.bits[i >> 3] &= ~mask & 0xFF
        self.count -= 1
        return True

    def set_all(self) -> None:
        """Set every bit ``0 .. n-1`` (the pad bits of the last byte stay clear)."""
        nbytes = len(self.bits)
        self.bits[:] = b"\xff" * nbytes
        if self.n % 8 and nbytes:
            self.bits[-1] = (0xFF00 >> (self.n % 8)) & 0xFF
        self.count = self.n

    @property
    def complete(self) -> bool:
        """Whether all ``n`` bits are set."""
        return self.count == self.n

    def to_bytes(self) -> bytes:
        """The bits as ``ceil(n / 8)`` bytes, most significant bit first (bit 0 is ``0x80`` of byte 0)."""
        return bytes(self.bits)

    def clear_positions(self) -> np.ndarray:
        """The positions of the clear bits, ascending (uint32 array; milliseconds for millions)."""
        return self._positions(0)

    def set_positions(self) -> np.ndarray:
        """The positions of the set bits, ascending (uint32 array)."""
        return self._positions(1)

    def _positions(self, value: int) -> np.ndarray:
        if not self.n:
            return np.zeros(0, dtype=np.uint32)
        bits = np.unpackbits(np.frombuffer(bytes(self.bits), dtype=np.uint8))[: self.n]
        return np.flatnonzero(bits == value).astype(np.uint32)
