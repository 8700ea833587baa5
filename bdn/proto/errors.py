"""Error types shared by every part of bdn.

Kraken-style: each subsystem maps its own failures onto these few kinds, so the daemon can turn
any of them into a status code and one line of text. Every message is a single line that says
what was wrong with the input, never a traceback.
"""

from __future__ import annotations


class BdnError(Exception):
    """Base class of every error bdn raises on purpose."""


class ProtocolError(BdnError):
    """Untrusted input (from a bucket, a peer, a request or a file) broke a rule of the format."""


class IdentityError(ProtocolError):
    """A snapshot identity broke the identity rule (one path segment, not reserved)."""


class PathError(ProtocolError):
    """A file path inside a snapshot broke the path rule (relative, '/'-separated, no '..')."""


class ManifestError(ProtocolError):
    """``bdn.manifest.json`` did not parse or broke the ``bdn.snapshot/1`` rules."""


class ChecksumError(ProtocolError):
    """Bytes did not match the digest or checksum that the manifest or diff file promised."""


class UnsupportedFormat(ProtocolError):
    """A compression or checksum format bdn does not implement (the message lists those it does)."""


class TensorMismatch(BdnError):
    """Base and target checkpoints differ in a tensor's name, shape or dtype (message names it)."""


class AuthError(BdnError):
    """A peer request failed authentication. Callers answer 401 and never say why."""
