"""Wrong bytes handed out: re-verify every snapshot a daemon reports ``ready``, while it is served.

Each pass asks every live daemon for ``GET /v1/snapshots``. A ready snapshot seen for the first
time in a daemon's life (pid) is checked at once; one already checked again after ``reverify_s``
seconds. A check hashes (sha256) every file the trainer wrote for that identity in the directory
the daemon points to and compares it with the trainer's digest; on the first check it also reads
a random range (at most 1 MiB) of the largest file over the local API
(``GET /v1/snapshots/{id}/files/{name}`` with ``Range``) and compares it with the trainer's bytes
while the trainer still has them. The engine's ``/debug/weights_digest`` is compared with the
trainer's ``tinygpt.weights_digest`` of the identity it reports.

A file that disappears during a check is a **vanished** snapshot (GC) when the daemon no longer
lists the snapshot ready at that path afterwards, and a wrong answer otherwise. Wrong answers are
kept with the node, pid, identity, file, both digests and the harness time.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.soak.fleet import Fleet, http_json
from bench.soak.trainer import Trainer, sha256_file

RANGE_BYTES = 1 << 20


class Verifier:
    def __init__(
        self,
        fleet: Fleet,
        trainer: Trainer,
        rng: random.Random,
        clock: Any,
        reverify_s: float = 30.0,
        interval_s: float = 2.0,
    ) -> None:
        self.fleet, self.trainer, self.rng, self.clock = fleet, trainer, rng, clock
        self.reverify_s, self.interval_s = reverify_s, interval_s
        self.last: dict[tuple[str, int, str, str], float] = {}  # (node, pid, identity, path) -> time
        self.wrong: list[dict[str, Any]] = []
        self.notes: list[dict[str, Any]] = []  # odd but not wrong (extra files in a snapshot dir)
        self.counts = {
            "snapshot_checks": 0,
            "distinct_ready": 0,
            "files_hashed": 0,
            "bytes_hashed": 0,
            "vanished": 0,
            "http_range_checks": 0,
            "engine_checks": 0,
            "engine_no_model": 0,
        }
        self.engine_served: dict[str, int] = {}  # identity -> checks that saw the engine serve it
        self.failed: dict[tuple[str, str], dict[str, Any]] = {}  # (node, identity) -> first failure seen

    # ---- one snapshot ----------------------------------------------------------------------
    def _still_ready(self, d: Any, identity: str, path: str) -> bool:
        try:
            status, rec = http_json("GET", f"{d.url}/v1/snapshots/{identity}", timeout=20)
        except OSError:
            return False  # the daemon died meanwhile: it is not handing anything out
        return status == 200 and rec.get("state") == "ready" and rec.get("path") == path

    def _wrong(self, **what: Any) -> None:
        self.wrong.append({"t_s": round(self.clock(), 1), **what})

    def check_snapshot(self, node_id: str, pid: int, d: Any, rec: dict[str, Any], first: bool) -> None:
        identity, path = rec["identity"], rec.get("path")
        pub = self.trainer.published.get(identity)
        if pub is None:
            self._wrong(node=node_id, pid=pid, identity=identity, what="ready snapshot the trainer never published")
            return
        if not path:
            self._wrong(node=node_id, pid=pid, identity=identity, what="ready without a path")
            return
        root = Path(path)
        self.counts["snapshot_checks"] += 1
        for name, want in pub.files.items():
            try:
                got = sha256_file(root / name)
            except FileNotFoundError:
                if self._still_ready(d, identity, path):
                    self._wrong(node=node_id, pid=pid, identity=identity, file=name, what="file missing while ready")
                else:
                    self.counts["vanished"] += 1
                return
            self.counts["files_hashed"] += 1
            self.counts["bytes_hashed"] += pub.sizes[name]
            if got != want:
                still = self._still_ready(d, identity, path)
                self._wrong(
                    node=node_id,
                    pid=pid,
                    identity=identity,
                    file=name,
                    want=want,
                    got=got,
                    still_ready=still,
                    what="file bytes differ from the trainer's",
                )
        try:
            extra = sorted(p.name for p in root.iterdir() if p.name not in pub.files and p.name != "READY")
        except OSError:
            extra = []
        if extra and first:
            self.notes.append({"node": node_id, "identity": identity, "extra_files": extra[:10]})
        if first:
            self.check_range(node_id, pid, d, identity, pub, path)

    def check_range(self, node_id: str, pid: int, d: Any, identity: str, pub: Any, path: str) -> None:
        name = max(pub.sizes, key=lambda n: pub.sizes[n])
        local = pub.dir / name
        size = pub.sizes[name]
        start = self.rng.randrange(max(1, size - RANGE_BYTES))
        end = min(size, start + RANGE_BYTES) - 1
        try:
            with open(local, "rb") as f:
                f.seek(start)
                want = f.read(end - start + 1)
        except FileNotFoundError:
            return  # the trainer already dropped this step's bytes
        req = urllib.request.Request(
            f"{d.url}/v1/snapshots/{identity}/files/{name}", headers={"Range": f"bytes={start}-{end}"}
        )
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                got = r.read()
        except urllib.error.HTTPError as e:
            if self._still_ready(d, identity, path):  # refused while listed ready: odd, not wrong bytes
                self.notes.append({"node": node_id, "identity": identity, "range_refused": e.code})
            return
        except OSError:
            return
        self.counts["http_range_checks"] += 1
        if got != want:
            self._wrong(
                node=node_id,
                pid=pid,
                identity=identity,
                file=name,
                range=[start, end],
                want=hashlib.sha256(want).hexdigest(),
                got=hashlib.sha256(got).hexdigest(),
                got_len=len(got),
                what="local API range differs from the trainer's bytes",
            )

    # ---- the engine ------------------------------------------------------------------------
    def check_engine(self) -> None:
        if not self.fleet.engine_port or self.fleet.engine is None:
            return
        try:
            status, ans = http_json("GET", self.fleet.engine_url + "/debug/weights_digest", timeout=10)
        except OSError:
            return
        if status == 503:
            self.counts["engine_no_model"] += 1
            return
        if status != 200:
            return
        self.counts["engine_checks"] += 1
        ident = ans.get("identity")
        pub = self.trainer.published.get(ident)
        self.engine_served[str(ident)] = self.engine_served.get(str(ident), 0) + 1
        if pub is None or ans.get("digest") != pub.weights_digest:
            self._wrong(
                node=self.fleet.engine_node,
                identity=ident,
                want=pub.weights_digest if pub else None,
                got=ans.get("digest"),
                what="engine serves weights that differ from the trainer's",
            )

    # ---- the loop --------------------------------------------------------------------------
    def one_pass(self) -> None:
        for node in self.fleet.live():
            d = node.daemon
            pid = d.proc.pid if d.proc else 0
            try:
                status, body = http_json("GET", d.url + "/v1/snapshots", timeout=20)
            except OSError:
                continue
            if status != 200:
                continue
            for rec in body.get("snapshots", []):
                if rec.get("state") == "failed" and (d.node_id, rec.get("identity")) not in self.failed:
                    self.failed[(d.node_id, rec.get("identity"))] = {
                        "t_s": round(self.clock(), 1),
                        "node": d.node_id,
                        "identity": rec.get("identity"),
                        "reason": str(rec.get("reason"))[:300],
                    }
                if rec.get("state") != "ready":
                    continue
                key = (d.node_id, pid, rec["identity"], str(rec.get("path")))
                seen = self.last.get(key)
                if seen is not None and self.clock() - seen < self.reverify_s:
                    continue
                if seen is None:
                    self.counts["distinct_ready"] += 1
                self.last[key] = self.clock()
                self.check_snapshot(d.node_id, pid, d, rec, first=seen is None)
        self.check_engine()

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            self.one_pass()
            stop.wait(max(0.2, self.interval_s - (time.monotonic() - t0)))

    def summary(self) -> dict[str, Any]:
        return {
            **self.counts,
            "wrong_bytes_handed_out": len(self.wrong),
            "wrong": self.wrong[:50],
            "notes": self.notes[:20],
            "engine_served": self.engine_served,
            "failed_snapshots": sorted(self.failed.values(), key=lambda f: f["t_s"]),
        }
