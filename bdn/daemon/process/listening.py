"""Binding the daemon's ports: an address that cannot be bound is a configuration error that
names its key ("peer_listen 127.0.0.1:7080 is in use (...)"), so ``bdnd`` exits 2 with
one line, as for any other configuration error, and systemd (``RestartPreventExitStatus=2``)
does not restart it into the same failure forever."""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager

from bdn.proto.errors import BdnError

__all__ = ["CannotListen", "binding", "clear_unix_socket", "describe"]


class CannotListen(BdnError):
    """A listen address (``peer_listen``, ``local_listen``, ``local_socket``, an explicit
    ``transfer_listen``) cannot be bound; the message is the one line ``bdnd`` prints."""


def describe(key: str, address: str, e: OSError) -> str:
    """The one line for ``e`` raised binding ``address`` (the value of config key ``key``)."""
    code = e.errno
    why = os.strerror(code) if code else (str(e) or type(e).__name__)
    if code == errno.EADDRINUSE:
        return f"{key} {address} is in use ({why}: another process listens there; stop it or choose another address)"
    if code == errno.EACCES:
        return f"{key} {address} cannot be bound ({why}: ports below 1024 need privileges)"
    if code == errno.EADDRNOTAVAIL:
        return f"{key} {address} cannot be bound ({why}: no interface of this host has that address)"
    return f"{key} {address} cannot be bound ({why})"


@contextmanager
def binding(key: str, address: str) -> Iterator[None]:
    """Run a bind of ``address`` (config key ``key``); an OSError becomes CannotListen."""
    try:
        yield
    except OSError as e:
        raise CannotListen(describe(key, address, e)) from None


def clear_unix_socket(path: str) -> None:
    """Remove a stale unix socket file at ``path`` (a previous bdnd's, left by a crash) before
    binding it; raises CannotListen when a process still accepts connections there (unlinking it
    would silently take the socket from that process: another bdnd with the same
    ``local_socket``)."""
    if not os.path.exists(path):
        return
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except OSError:  # refused (no listener), not a socket, ...: stale, safe to remove
            pass
        else:
            raise CannotListen(
                f"local_socket {path} is in use (another process accepts connections on it; "
                "stop it or choose another path)"
            )
    os.unlink(path)
