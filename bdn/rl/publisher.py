"""Publish a trainer's weights after every optimizer step and hot-load them, off the training thread.

``StepPublisher`` is what a trainer callback hands each step's weights to: ``submit(version,
state_dict)`` returns once the weights are queued (the caller's copy may then change), and one
background thread publishes them in order with :mod:`bdn.publish` (the first, and every
``anchor_every``-th, as a full snapshot, the others as deltas against the previous step, with the
previous step's arrays as the base: nothing is read back from the bucket) and then sends one
hot-load to a daemon, which fans it out to the fleet (:func:`bdn.client.hot_load`, without
``previous``, so a daemon that has not finished the previous step folds the chain). After an anchor
it writes ``STARTUP_SNAPSHOT``, so replicas that join later start from it.

The queue holds at most ``max_queued`` steps: a trainer faster than publishing waits in
``submit`` (memory stays bounded at that many copies of the weights plus the published base). A
failed publish or hot-load is raised, as :class:`StepPublishFailed`, by the next ``submit`` or by
``flush``/``close``; nothing after it is published (a delta needs its base in the bucket).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from bdn.client.fleet import hot_load
from bdn.proto.identity import validate_identity
from bdn.publish import publish_delta, publish_full, publish_startup

__all__ = ["PublishedStep", "StepPublishFailed", "StepPublisher", "identity_of"]


def identity_of(prefix: str, version: int) -> str:
    """The snapshot identity of policy ``version``: ``prefix`` + the version in 6+ digits
    (``step000012``); IdentityError when the result breaks the identity rule."""
    return validate_identity(f"{prefix}{version:06d}")


class StepPublishFailed(RuntimeError):
    """Publishing or hot-loading a step failed; the message names the step and the cause."""


@dataclass(frozen=True)
class PublishedStep:
    """One published step: ``identity``, ``policy_version``, ``kind`` (``full``/``delta``), the
    bytes stored in the bucket, the seconds the publish took and when the hot-load was accepted
    (``time.monotonic()``; None without a daemon)."""

    identity: str
    policy_version: int
    kind: str
    stored_bytes: int
    publish_s: float
    hot_loaded_at: float | None


_STOP = object()


class StepPublisher:
    """A background publisher of one training run's steps to ``bucket`` (any bdn bucket URL).

    Args:
        daemon_url: a bdnd to send each step's hot-load to (its local API, or its peer port with
            ``token``); None publishes only.
        prefix: identities are ``prefix`` + 6-digit version.
        extra_files: the checkpoint's other files (``config.json``, tokenizer files), relative
            path -> bytes, published with every step (a delta is a whole checkpoint too).
        anchor_every: publish a full snapshot every this many versions (0: only the first), which
            bounds the delta chain a new replica walks (``max_delta_chain`` on the daemons).
        chunk_size, compression_format: as for :func:`bdn.publish.publish_delta`.
        max_queued: steps queued before ``submit`` waits (>= 1).
        hot_load_options: passed to :func:`bdn.client.hot_load` (``inflight_policy`` etc.).
    """

    def __init__(
        self,
        bucket: str,
        daemon_url: str | None = None,
        *,
        token: str | None = None,
        prefix: str = "step",
        extra_files: Mapping[str, bytes] | None = None,
        anchor_every: int = 0,
        chunk_size: int | None = None,
        compression_format: str = "arc_v2",
        max_queued: int = 2,
        hot_load_options: Mapping[str, Any] | None = None,
    ) -> None:
        if max_queued < 1 or anchor_every < 0:
            raise ValueError("max_queued must be >= 1 and anchor_every >= 0")
        identity_of(prefix, 0)  # refuse a bad prefix now, not in the thread
        self.bucket, self.daemon_url, self.token, self.prefix = bucket, daemon_url, token, prefix
        self.extra_files = dict(extra_files or {})
        self.anchor_every = anchor_every
        self.size_kw: dict[str, Any] = {} if chunk_size is None else {"chunk_size": chunk_size}
        self.compression_format = compression_format
        self.hot_load_options = dict(hot_load_options or {})
        #: Every step published so far, in order (appended by the publishing thread).
        self.published: list[PublishedStep] = []
        self._base: tuple[str, Mapping[str, np.ndarray]] | None = None
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued)
        self._error: BaseException | None = None
        self._failed = ""
        self._last_version: int | None = None
        self._thread = threading.Thread(target=self._run, name="bdn-step-publisher", daemon=True)
        self._thread.start()

    def submit(self, version: int, state_dict: Mapping[str, np.ndarray]) -> None:
        """Queue the weights of policy ``version`` (name -> array, owned by the publisher from now
        on: pass a copy). Versions must increase. Raises StepPublishFailed for an earlier
        failure, ValueError for a version not above the last one."""
        self._raise_failed()
        if self._last_version is not None and version <= self._last_version:
            raise ValueError(f"policy version {version} is not above the last one submitted ({self._last_version})")
        self._last_version = version
        while True:
            try:
                self._queue.put((version, state_dict), timeout=0.5)
                return
            except queue.Full:
                self._raise_failed()

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every submitted step is published and hot-loaded (or failed: raised).
        TimeoutError after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._queue.unfinished_tasks:
            self._raise_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"steps still publishing after {timeout} s")
            time.sleep(0.02)
        self._raise_failed()

    def close(self, timeout: float | None = None) -> None:
        """``flush`` then stop the thread; a failure is raised after the thread stopped."""
        try:
            self.flush(timeout)
        finally:
            self._queue.put(_STOP)
            self._thread.join(timeout)

    def _raise_failed(self) -> None:
        if self._error is not None:
            raise StepPublishFailed(self._failed) from self._error

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                if self._error is None:
                    version, state = item
                    try:
                        self.published.append(self._publish(version, state))
                    except Exception as e:  # noqa: BLE001 -- any failure goes to the trainer's thread; nothing later is published
                        self._failed = f"{identity_of(self.prefix, version)}: {type(e).__name__}: {e}"
                        self._error = e
            finally:
                self._queue.task_done()

    def _publish(self, version: int, state: Mapping[str, np.ndarray]) -> PublishedStep:
        ident = identity_of(self.prefix, version)
        t0 = time.monotonic()
        full = self._base is None or (self.anchor_every > 0 and version % self.anchor_every == 0)
        if full:
            m = publish_full(
                self.bucket, ident, version, state_dict=state, extra_files=self.extra_files, **self.size_kw
            )
        else:
            assert self._base is not None
            base_ident, base_state = self._base
            m = publish_delta(
                self.bucket,
                ident,
                version,
                base_ident,
                state_dict=state,
                base_state_dict=base_state,
                extra_files=self.extra_files,
                compression_format=self.compression_format,
                **self.size_kw,
            )
        if full:
            publish_startup(self.bucket, ident)
        publish_s = time.monotonic() - t0
        self._base = (ident, state)
        at = None
        if self.daemon_url is not None:
            hot_load(self.daemon_url, ident, token=self.token, **self.hot_load_options)
            at = time.monotonic()
        return PublishedStep(ident, version, "full" if full else "delta", m.stored_bytes, publish_s, at)
