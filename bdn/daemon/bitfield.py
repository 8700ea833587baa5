"""Have-bitfields over a manifest's chunk list (bit order as BitTorrent's: MSB of byte 0 first)."""

from __future__ import annotations


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
            self.count = sum(bin(b).count("1") for b in self.bits)

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
        for i in range(self.n):
            self.set(i)

    @property
    def complete(self) -> bool:
        return self.count == self.n

    def to_bytes(self) -> bytes:
        return bytes(self.bits)
