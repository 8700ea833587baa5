"""Delta chains for tests: checkpoints a few optimizer steps apart, published to a ``file://``
bucket as one anchor (``step000001``, policy version 1) and deltas each on the step before
(``step00000{i}``, policy version ``i``), and a daemon that holds the anchor ready.

The set-up the fold tests (tests/test_fold.py, tests/test_adversarial_fold.py) and the hot-load
tests share; each test keeps its own assertions.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bdn.proto.manifest import MANIFEST_NAME
from bdn.publish import publish_delta, publish_full
from support.checkpoints import make_state, optimizer_step, write_hf_dir
from support.swarm import Daemon, Swarm

ANCHOR = "step000001"


def step_id(version: int) -> str:
    """The identity the chain gives policy version ``version``: ``step000003`` for 3."""
    return f"step{version:06d}"


def chain_states(steps: int, *, scale: int = 1, frac: float = 0.05) -> list[dict[str, np.ndarray]]:
    """``steps + 1`` state dicts: ``make_state(0, scale)``, then ``steps`` optimizer steps each
    changing about ``frac`` of the values of the one before (seeds 1, 2, ...)."""
    states = [make_state(0, scale=scale)]
    for i in range(1, steps + 1):
        states.append(optimizer_step(states[-1], frac, i))
    return states


def write_chain(root: Path, states: Sequence[dict[str, np.ndarray]]) -> list[Path]:
    """``states[i]`` as the Hugging Face directory ``root/step{i+1:06d}`` (two shards); the dirs in order."""
    return [write_hf_dir(root / step_id(i), s, i) for i, s in enumerate(states, 1)]


def publish_chain(url: str, dirs: Sequence[Path], *, chunk_size: int, formats: Mapping[int, str] | None = None) -> None:
    """Publish ``dirs[0]`` as the anchor and ``dirs[i]`` as a delta on ``dirs[i-1]``, in order.

    ``formats``: policy version -> ``compression_format`` of that delta (``arc_v2`` otherwise).
    """
    publish_full(url, ANCHOR, 1, dir=dirs[0], chunk_size=chunk_size)
    for v in range(2, len(dirs) + 1):
        publish_delta(
            url,
            step_id(v),
            v,
            step_id(v - 1),
            dir=dirs[v - 1],
            base_dir=dirs[v - 2],
            chunk_size=chunk_size,
            compression_format=(formats or {}).get(v, "arc_v2"),
        )


@dataclass
class Chain:
    """A published chain: the bucket directory, its ``file://`` URL, the trainer's checkpoint dirs
    (``dirs[v - 1]`` is policy version ``v``)."""

    bucket: Path
    url: str
    dirs: list[Path]

    def edit_manifest(self, identity: str, edit: Callable[[dict[str, Any]], None]) -> None:
        """Rewrite ``identity``'s published ``bdn.manifest.json`` after ``edit`` changed its JSON
        object in place (what a confused publisher leaves in the bucket)."""
        path = self.bucket / identity / MANIFEST_NAME
        m = json.loads(path.read_text())
        edit(m)
        path.write_text(json.dumps(m))


def file_chain(
    tmp_path: Path,
    steps: int,
    *,
    chunk_size: int,
    scale: int = 1,
    frac: float = 0.05,
    formats: Mapping[int, str] | None = None,
) -> Chain:
    """:func:`chain_states` written under ``tmp_path/src`` and published to ``tmp_path/bucket``
    (see :func:`publish_chain`): ``steps`` deltas on the anchor."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    url = f"file://{bucket}"
    dirs = write_chain(tmp_path / "src", chain_states(steps, scale=scale, frac=frac))
    publish_chain(url, dirs, chunk_size=chunk_size, formats=formats)
    return Chain(bucket, url, dirs)


@contextmanager
def daemon_on_anchor(tmp_path: Path, url: str, extra_env: Mapping[str, str] | None = None) -> Iterator[Daemon]:
    """One bdnd (``node0``, its files under ``tmp_path/work``) on bucket ``url`` that does not
    load ``STARTUP_SNAPSHOT`` and has :data:`ANCHOR` prefetched and ready; stopped on the way out."""
    d = Daemon(tmp_path / "work", "node0", url, extra_env={"BDN_LOAD_STARTUP": "false", **(extra_env or {})})
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch(ANCHOR)[0] == 202
        d.wait_ready(ANCHOR)
        yield d
    finally:
        d.stop()


@contextmanager
def anchor_swarm(tmp_path: Path, n: int = 2, chunk_size: int = 64 << 10) -> Iterator[Swarm]:
    """``make_state(0)`` published as :data:`ANCHOR` to ``tmp_path/bucket``, and a started
    :class:`Swarm` of ``n`` daemons on it (files under ``tmp_path/work``) that load nothing on
    their own (``BDN_LOAD_STARTUP=false``); stopped on the way out."""
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    ck = write_hf_dir(tmp_path / "ck", make_state(0), 1)
    publish_full(f"file://{bucket}", ANCHOR, 1, dir=ck, chunk_size=chunk_size)
    with Swarm(tmp_path / "work", n, f"file://{bucket}", extra_env={"BDN_LOAD_STARTUP": "false"}) as s:
        yield s


def load_step(d: Daemon, chain_dirs: Sequence[Path], v: int, shards: Sequence[str], timeout: float = 300) -> str:
    """Hot-load ``step_id(v)`` on ``d`` (after ``step_id(v - 1)``), wait until it is READY and check
    each of ``shards`` byte for byte against the trainer's files (``chain_dirs[v - 1]``); its id."""
    from bdn.client.fleet import hot_load

    ident = step_id(v)
    hot_load(d.url, ident, previous=step_id(v - 1) if v > 1 else None)
    d.wait_ready(ident, timeout)
    for shard in shards:
        assert (d.store / ident / shard).read_bytes() == (chain_dirs[v - 1] / shard).read_bytes(), f"{ident}/{shard}"
    return ident
