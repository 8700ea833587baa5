"""The soak's trainer: publish tinygpt checkpoints with ``bdn.publish`` and hot-load each one.

Step 1 is an anchor (``publish_full`` + ``publish_startup``); every later step is a simulated
optimizer step (``tinygpt.optimizer_step``, about ``frac`` of the bf16 values change) published
as an ``arc_v2`` delta against the step before, except every ``anchor_every``-th step, which is a
new anchor. Each step after the first is POSTed once to the fleet hot-load API on a random live
daemon's peer port with the bearer token, ``interval`` s apart (uniform in the range).

The last hot-load gets ``end_grace_s`` past the run's end to finish (nothing supersedes it).
A hot-load is **done** when every live daemon (up since its last start, per :class:`Fleet`)
lists itself in the fleet answer with ``current_snapshot_identity`` the new identity and stage
``done``; **ready** when every live daemon holds it ready (stage ``ready``, ``loading`` or
``done``). Both times are measured from the POST. A hot-load that is not done when the next one
is POSTed is recorded with the replicas that were not done, and their stage and reason as the
fleet GET listed them; then each of those replicas is asked itself (:meth:`Trainer.probe`): its
own row from its own GET (``own``), whether the fleet view listed it at all (``in_view``), and
how the daemon that answered the view sees it as a member (``viewer_peer``: alive, penalised).

A POST answered 409 because the chosen daemon does not serve ``previous_snapshot_identity`` (a
replica that is behind) is sent to another live daemon; when every one answers 409 it is sent
without ``previous_snapshot_identity``. A 5xx answer (the daemon could not read the manifest
during a bucket burst) or no answer is tried again on the others, for up to a minute, as a
trainer would. Each attempt is recorded.
"""

from __future__ import annotations

import hashlib
import random
import shutil
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.soak.fleet import REPO, Fleet, http_json

sys.path.insert(0, str(REPO / "examples" / "engine"))
import tinygpt

from bdn.publish import publish_delta, publish_full, publish_startup

HOT_LOAD = "/hot_load/v1/models/hot_load"


@dataclass
class Published:
    """What the trainer wrote: the sha256 of every file, and the engine-side weights digest."""

    identity: str
    policy_version: int
    kind: str
    base: str | None
    files: dict[str, str]
    sizes: dict[str, int]
    weights_digest: str
    dir: Path
    stored_bytes: int
    publish_s: float


@dataclass
class HotLoad:
    identity: str
    policy_version: int
    kind: str
    t_post: float
    faults_before: int
    attempts: list[dict[str, Any]] = field(default_factory=list)
    accepted_by: str | None = None
    ready_s: float | None = None
    done_s: float | None = None
    live_at_done: list[str] = field(default_factory=list)
    not_done: list[dict[str, Any]] = field(default_factory=list)
    view_from: str | None = None  # the daemon whose fleet GET the last check read
    view_identity: str | None = None  # that daemon's target when it answered
    outcome: str = "pending"  # done | not_done_before_next | not_done_at_end | rejected


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


class Trainer:
    """Publishes and hot-loads; ``published`` and ``hotloads`` are read by the verifier and report.

    ``faults`` is a callable giving the number of faults injected so far (the chaos loop's count).
    """

    def __init__(
        self,
        fleet: Fleet,
        workdir: Path,
        rng: random.Random,
        clock: Any,
        faults: Any,
        *,
        n_embd: int,
        n_layer: int,
        anchor_every: int,
        interval: tuple[float, float],
        frac: float = 0.02,
        chunk_size: int = 1 << 20,
        keep_dirs: int = 10,
        end_grace_s: float = 60.0,
    ) -> None:
        self.fleet, self.workdir, self.rng, self.clock, self.faults = fleet, workdir, rng, clock, faults
        self.cfg = tinygpt.TinyGPTConfig(n_layer=n_layer, n_embd=n_embd, n_head=max(1, n_embd // 64))
        self.anchor_every, self.interval, self.frac = anchor_every, interval, frac
        self.chunk_size, self.keep_dirs = chunk_size, keep_dirs
        self.end_grace_s = end_grace_s
        self.published: dict[str, Published] = {}
        self.order: list[str] = []
        self.hotloads: list[HotLoad] = []
        self.weights: dict[str, Any] | None = None
        self.step = 0
        self.lock = threading.Lock()

    # ---- publishing --------------------------------------------------------------------------
    def _identity(self, step: int) -> str:
        return f"step{step:06d}"

    def publish_next(self) -> Published:
        """Write the next step's checkpoint and publish it (anchor or delta); its record."""
        self.step += 1
        ident = self._identity(self.step)
        prev = self.order[-1] if self.order else None
        if self.weights is None:
            self.weights = tinygpt.init_weights(self.cfg, seed=self.rng.randrange(1 << 30))
        else:
            self.weights = tinygpt.optimizer_step(self.weights, self.frac, seed=self.rng.randrange(1 << 30))
        d = tinygpt.save_checkpoint(self.workdir / "trainer" / ident, self.cfg, self.weights)
        anchor = prev is None or (self.step - 1) % self.anchor_every == 0
        t0 = time.monotonic()
        if anchor:
            m = publish_full(self.fleet.bucket_url, ident, self.step, dir=d, chunk_size=self.chunk_size, workers=4)
        else:
            assert prev is not None
            m = publish_delta(
                self.fleet.bucket_url,
                ident,
                self.step,
                prev,
                dir=d,
                base_dir=self.published[prev].dir,
                chunk_size=self.chunk_size,
                workers=4,
            )
        files = {p.name: sha256_file(p) for p in sorted(d.iterdir())}
        pub = Published(
            ident,
            self.step,
            "full" if anchor else "delta",
            None if anchor else prev,
            files,
            {p.name: p.stat().st_size for p in d.iterdir()},
            tinygpt.weights_digest(self.weights),
            d,
            m.stored_bytes,
            time.monotonic() - t0,
        )
        with self.lock:
            self.published[ident] = pub
            self.order.append(ident)
            for old in self.order[: -self.keep_dirs]:  # hashes stay; the bytes of old steps go
                shutil.rmtree(self.published[old].dir, ignore_errors=True)
        return pub

    def publish_first(self) -> Published:
        pub = self.publish_next()
        publish_startup(self.fleet.bucket_url, pub.identity)
        return pub

    # ---- hot-load --------------------------------------------------------------------------
    def post(self, pub: Published, give_up_s: float = 60.0) -> HotLoad:
        """POST the hot-load of ``pub`` (see module doc for 409 handling); 5xx and unreachable
        daemons are retried on others for up to ``give_up_s``; other 4xx answers are final."""
        hl = HotLoad(pub.identity, pub.policy_version, pub.kind, self.clock(), self.faults())
        meta = None
        if pub.kind == "delta":
            meta = {
                "previous_snapshot_identity": pub.base,
                "compression_format": "arc_v2",
                "checksum_format": "alder32",
            }
        with_prev = meta is not None
        deadline = time.monotonic() + give_up_s
        while True:
            live = [n.daemon for n in self.fleet.live()]
            self.rng.shuffle(live)
            all_409 = bool(live)
            for d in live:
                m = dict(meta or {})
                if not with_prev:
                    m.pop("previous_snapshot_identity", None)
                body = {"identity": pub.identity, **({"incremental_snapshot_metadata": m} if meta else {})}
                try:
                    status, ans = http_json("POST", d.peer_url + HOT_LOAD, body, token=self.fleet.token, timeout=60)
                except OSError as e:
                    hl.attempts.append({"node": d.node_id, "error": f"{type(e).__name__}: {e}"[:200]})
                    all_409 = False
                    continue
                hl.attempts.append(
                    {
                        "node": d.node_id,
                        "status": status,
                        "with_previous": with_prev,
                        **({"error": str(ans.get("error"))[:300]} if status != 200 else {}),
                    }
                )
                if status == 200:
                    hl.accepted_by = d.node_id
                    hl.t_post = self.clock()
                    return hl
                if status == 409 and with_prev:
                    continue
                all_409 = False
                if status < 500:
                    hl.outcome = "rejected"
                    return hl
            if all_409 and with_prev:
                with_prev = False
                continue
            if time.monotonic() > deadline:
                hl.outcome = "rejected"
                return hl
            time.sleep(1.0)

    def fleet_view(self, hl: HotLoad | None = None) -> list[dict[str, Any]] | None:
        """The fleet's replicas as a live daemon's local API lists them, or None. With ``hl``, the
        daemon that answered and its target are kept in ``hl.view_from`` / ``hl.view_identity``."""
        live = self.fleet.live()
        live.sort(key=lambda n: n.daemon.node_id)
        for node in live:
            try:
                status, body = http_json("GET", node.daemon.url + HOT_LOAD, timeout=20)
            except OSError:
                continue
            if status == 200 and isinstance(body.get("replicas"), list):
                if hl is not None:
                    hl.view_from, hl.view_identity = node.daemon.node_id, body.get("identity")
                return body["replicas"]
        return None

    def probe(self, hl: HotLoad) -> None:
        """Ask each replica of ``hl.not_done`` itself: ``own`` is its own row in its own fleet GET
        (stage, identity, current, reason, engines; None when it did not answer), ``in_view``
        whether the fleet view the last check read listed it, ``viewer_peer`` how the daemon that
        answered that view lists it among its members (``alive``, ``penalised``; None if absent)."""
        by_id = {n.daemon.node_id: n.daemon for n in self.fleet.live()}
        viewer_peers: dict[str, dict[str, Any]] = {}
        if hl.view_from in by_id:
            try:
                status, body = http_json("GET", by_id[hl.view_from].url + "/v1/status", timeout=20)
                if status == 200:
                    viewer_peers = {p.get("node_id"): p for p in body.get("peers", []) if isinstance(p, dict)}
            except OSError:
                pass
        for nd in hl.not_done:
            d = by_id.get(nd["node"])
            own = None
            if d is not None:
                try:
                    status, body = http_json("GET", d.url + HOT_LOAD, timeout=20)
                    if status == 200:
                        row = next((r for r in body.get("replicas", []) if r.get("replica_id") == nd["node"]), None)
                        if row is not None:
                            ls = row.get("loading_state") or {}
                            own = {
                                "stage": ls.get("stage"),
                                "identity": ls.get("identity"),
                                "reason": ls.get("reason"),
                                "current": row.get("current_snapshot_identity"),
                                "engines": row.get("engines"),
                                "t_s": round(self.clock() - hl.t_post, 1),
                            }
                except OSError:
                    pass
            nd["own"] = own
            p = viewer_peers.get(nd["node"])
            nd["viewer_peer"] = {"alive": p.get("alive"), "penalised": p.get("penalised")} if p else None

    def check(self, hl: HotLoad) -> bool:
        """Update ``hl``'s ready/done times from the fleet's answer; True once done."""
        reps = self.fleet_view(hl)
        if reps is None:
            return False
        live = {n.daemon.node_id for n in self.fleet.live()}
        by_id = {r.get("replica_id"): r for r in reps}
        now = self.clock() - hl.t_post

        def ready(r: dict[str, Any] | None) -> bool:
            if r is None:
                return False
            ls = r.get("loading_state") or {}
            return r.get("current_snapshot_identity") == hl.identity or (
                ls.get("identity") == hl.identity and ls.get("stage") in ("ready", "loading", "done")
            )

        def done(r: dict[str, Any] | None) -> bool:
            return (
                r is not None
                and r.get("current_snapshot_identity") == hl.identity
                and (r.get("loading_state") or {}).get("stage") == "done"
            )

        if not live:
            return False
        if hl.ready_s is None and all(ready(by_id.get(n)) for n in live):
            hl.ready_s = round(now, 3)
        if all(done(by_id.get(n)) for n in live):
            hl.done_s = round(now, 3)
            hl.ready_s = hl.ready_s if hl.ready_s is not None else hl.done_s
            hl.live_at_done = sorted(live)
            hl.not_done = []
            hl.outcome = "done"
            return True
        hl.not_done = [
            {
                "node": n,
                "current": (by_id.get(n) or {}).get("current_snapshot_identity"),
                "engines": (by_id.get(n) or {}).get("engines"),
                **{
                    k: ((by_id.get(n) or {}).get("loading_state") or {}).get(k) for k in ("stage", "identity", "reason")
                },
                "in_view": n in by_id,
            }
            for n in sorted(live)
            if not done(by_id.get(n))
        ]
        return False

    def run(self, stop: threading.Event, end_t: float) -> None:
        """Publish and hot-load until ``end_t`` (harness clock) or ``stop``."""
        next_post = self.clock() + self.rng.uniform(*self.interval)
        while not stop.is_set() and self.clock() < end_t:
            if stop.wait(max(0.0, min(next_post, end_t) - self.clock())):
                break
            if self.clock() >= end_t:
                break
            pub = self.publish_next()
            hl = self.post(pub)
            next_post = hl.t_post + self.rng.uniform(*self.interval)
            with self.lock:
                if self.hotloads and self.hotloads[-1].outcome == "pending":
                    self.hotloads[-1].outcome = "not_done_before_next"
                self.hotloads.append(hl)
            if hl.outcome == "rejected":
                continue
            # the run's last hot-load gets end_grace_s past the end to finish (no POST supersedes it)
            until = next_post if next_post < end_t else end_t + self.end_grace_s
            while not stop.is_set() and self.clock() < until:
                if self.check(hl):
                    break
                stop.wait(0.5)
            if hl.outcome == "pending" and hl.not_done and not stop.is_set():
                self.probe(hl)  # not done when the next POST is due (or the run ends): ask them
        with self.lock:
            if self.hotloads and self.hotloads[-1].outcome == "pending":
                self.hotloads[-1].outcome = "not_done_at_end"

    def records(self) -> list[dict[str, Any]]:
        with self.lock:
            return [asdict(h) for h in self.hotloads]
