"""Baseline (c): one BitTorrent node of the swarm, with libtorrent (PyPI ``libtorrent``).

The seed node first fetches the files from the bucket (bench.swarm.s3get, the same ranged GETs as
baseline b) and then seeds them; the other nodes download from the swarm. No tracker and no DHT:
every node is told the others' addresses and keeps dialing them (libtorrent drops duplicates).
TCP only (uTP costs more CPU and is slower on a LAN). libtorrent checks every piece's SHA-1 as it
arrives, so "finished" means verified. Prints JSON lines: ``fetched`` (seed), ``done``, and on
SIGTERM ``stats`` with the payload bytes it sent and received.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import libtorrent as lt


def emit(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def make_torrent(src: Path, names: list[str], out: Path, piece: int) -> None:
    """Write a v1 .torrent for ``src/names`` (files at the torrent's top level, dir name = src.name)."""
    fs = lt.file_storage()
    for n in names:
        fs.add_file(f"{src.name}/{n}", (src / n).stat().st_size)
    t = lt.create_torrent(fs, piece, flags=lt.create_torrent.v1_only)
    lt.set_piece_hashes(t, str(src.parent))
    out.write_bytes(lt.bencode(t.generate()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--torrent", required=True, type=Path)
    ap.add_argument("--save", required=True, type=Path, help="save_path; files go to save/<dirname>/")
    ap.add_argument("--ip", required=True)
    ap.add_argument("--port", type=int, default=6881)
    ap.add_argument("--peers", default="", help="ip:port,... of the other nodes")
    ap.add_argument("--seed-from-bucket", action="store_true")
    ap.add_argument("--endpoint")
    ap.add_argument("--bucket")
    ap.add_argument("--prefix")
    ap.add_argument("--timeout", type=float, default=1800)
    a = ap.parse_args()

    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    t0 = time.time()
    emit(event="start", t=t0)
    ti = lt.torrent_info(str(a.torrent))
    atp = lt.add_torrent_params()
    atp.ti = ti
    atp.save_path = str(a.save)
    a.save.mkdir(parents=True, exist_ok=True)
    if a.seed_from_bucket:
        from bench.swarm.s3get import fetch

        fs = ti.files()
        dirname = Path(fs.file_path(0)).parts[0]
        names = [Path(fs.file_path(i)).name for i in range(fs.num_files())]
        n = fetch(a.endpoint, a.bucket, a.prefix, names, a.save / dirname, 10)
        emit(event="fetched", t=time.time(), bytes=n)
        atp.flags |= lt.torrent_flags.seed_mode  # it has the files: skip re-hashing them

    ses = lt.session(
        {
            "listen_interfaces": f"{a.ip}:{a.port}",
            "enable_dht": False,
            "enable_lsd": False,
            "enable_upnp": False,
            "enable_natpmp": False,
            "enable_outgoing_utp": False,
            "enable_incoming_utp": False,
            "allow_multiple_connections_per_ip": True,
            "alert_mask": lt.alert_category.error,
            "unchoke_slots_limit": 64,
            "connections_limit": 256,
            "max_queued_disk_bytes": 64 * 2**20,
            "send_buffer_watermark": 8 * 2**20,
            "send_buffer_low_watermark": 1 * 2**20,
            "aio_threads": 4,
            "hashing_threads": 2,
            "user_agent": "bdn-bench",
        }
    )
    h = ses.add_torrent(atp)
    peers = [(p.rsplit(":", 1)[0], int(p.rsplit(":", 1)[1])) for p in a.peers.split(",") if p]
    done_sent = False
    last_dial = 0.0
    last_prog = 0.0
    while not stop and time.time() - t0 < a.timeout:
        now = time.time()
        if now - last_dial > 1.0:
            last_dial = now
            for p in peers:
                h.connect_peer(p)
        st = h.status()
        if now - last_prog > 0.5 and not done_sent:
            last_prog = now
            emit(event="progress", t=now, p=st.progress)
        if not done_sent and st.is_seeding:
            emit(event="done", t=time.time())
            done_sent = True
        for al in ses.pop_alerts():
            if isinstance(al, (lt.torrent_error_alert, lt.file_error_alert)):
                emit(event="error", msg=al.message())
        time.sleep(0.05 if not done_sent else 0.25)
    st = h.status()
    emit(
        event="stats",
        t=time.time(),
        upload=st.total_payload_upload,
        download=st.total_payload_download,
        seeding=st.is_seeding,
    )


if __name__ == "__main__":
    sys.exit(main())
