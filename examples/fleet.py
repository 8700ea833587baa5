#!/usr/bin/env python3
"""Part two of the demo: a serving fleet moves from policy 1 to 2 to 3, one hot-load POST each.

The engine: with torch and transformers installed, a Hugging Face ``LlamaForCausalLM``
(examples/engine/tiny_llama.py makes a small one locally; served by ``python -m bdn.engines hf``,
which swaps only the tensors a delta changed); without them, the numpy tiny GPT
(examples/engine/tinygpt.py, served by examples/engine/server.py). ``BDN_DEMO_ENGINE=numpy``
forces the fallback.

The trainer publishes the model as anchor ``step000001`` with STARTUP_SNAPSHOT. Three bdnd
daemons and three engines (OpenAI-compatible chat) start; every engine serves policy 1. Then,
twice: the trainer takes a simulated optimizer step, publishes the delta, and sends ONE
``POST /hot_load/v1/models/hot_load`` to ONE daemon over the network (bearer token); the daemons
fan it out, rebuild the snapshot, the engines prepare it while serving, pause, swap and
acknowledge. The demo prints the fleet's per-replica state, every replica's swap pause, and the
same greedy chat completion from each engine with the ``policy_version`` it reports
(``nvext.engine_data``): the tokens and log-probabilities change with the policy.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "engine"))
import tinygpt  # noqa: E402

from bdn.client.swap_report import describe_swap  # noqa: E402
from bdn.engines.hf import torch_available  # noqa: E402

BIN = Path(sys.executable).parent
IDS = ["step000001", "step000002", "step000003"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(method: str, url: str, body: object | None = None, token: str | None = None, timeout: float = 30) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode() if body is not None else None, method=method)
    req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read() or b"{}")


def wait_until(pred, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.1)
    sys.exit(f"fleet demo: timed out waiting for {what}")


class NumpyTrainer:
    """The fallback model: the numpy tiny GPT, served by examples/engine/server.py."""

    label = "a tiny GPT (numpy, bf16)"
    startup = "starting Python and numpy, and loading step000001 from the local daemon"
    # Its greedy answer is the same token for all three policies; a seeded sample shows the change.
    sampling = {"temperature": 1.0, "seed": 7, "max_tokens": 12}

    def __init__(self) -> None:
        self.cfg = tinygpt.TinyGPTConfig()
        self.weights: list = []

    def save(self, i: int, out: Path) -> str:
        w = (
            tinygpt.init_weights(self.cfg, seed=7)
            if i == 0
            else tinygpt.optimizer_step(self.weights[-1], 0.02, seed=100 + i)
        )
        self.weights.append(w)
        tinygpt.save_checkpoint(out, self.cfg, w)
        return tinygpt.weights_digest(w)

    def engine_cmd(self, nd: dict) -> list:
        return [
            sys.executable,
            HERE / "engine" / "server.py",
            "--bdn-url",
            f"http://127.0.0.1:{nd['local']}",
            "--listen",
            f"127.0.0.1:{nd['engine']}",
            "--replica-id",
            nd["id"],
        ]

    def served_digest(self, base: str) -> str:
        return http("GET", base + "/debug/weights_digest")["digest"]


class HFTrainer:
    """A Hugging Face LlamaForCausalLM made locally, served by ``python -m bdn.engines hf``."""

    label = "a small LlamaForCausalLM (transformers, bf16)"
    startup = "importing torch and transformers in each engine process, and building the model"
    sampling = {"temperature": 0, "max_tokens": 8}

    def __init__(self) -> None:
        import tiny_llama

        self.tl = tiny_llama
        self.states: list = []
        self.first: Path | None = None

    def save(self, i: int, out: Path) -> str:
        if i == 0:
            _model, st = self.tl.make_tiny_llama(out, hidden=128, layers=2, seed=7)
            self.first = out
        else:  # a sparse RL step: 2 % of the values of a few tensors
            st = self.tl.optimizer_step(self.states[-1], 0.02, seed=100 + i, tensors=4)
            self.tl.save_state(out, self.first, st)
        self.states.append(st)
        return self.digest(st)

    @staticmethod
    def digest(st: dict) -> str:
        import torch
        import xxhash

        parts = {
            k: xxhash.xxh3_128_hexdigest(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
            for k, v in st.items()
        }
        return xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True).encode())

    def engine_cmd(self, nd: dict) -> list:
        return [
            sys.executable,
            "-m",
            "bdn.engines",
            "hf",
            "--bdn-url",
            f"http://127.0.0.1:{nd['local']}",
            "--listen",
            f"127.0.0.1:{nd['engine']}",
            "--replica-id",
            nd["id"],
            "--served-model-name",
            "tiny-llama",
            "--log-level",
            "warning",
        ]

    def served_digest(self, base: str) -> str:
        import xxhash

        parts = http("GET", base + "/debug/weights")["tensors"]
        return xxhash.xxh3_128_hexdigest(json.dumps(parts, sort_keys=True).encode())


def pick_trainer():
    why = torch_available()
    if os.environ.get("BDN_DEMO_ENGINE", "").lower() == "numpy":
        why = "BDN_DEMO_ENGINE=numpy"
    if why:
        print(f"  (engine: the numpy tiny GPT; the transformers engine needs torch and transformers: {why})")
        return NumpyTrainer()
    return HFTrainer()


def run(root: Path, shm: Path, nodes_n: int = 3) -> bool:
    import shutil

    for d in (root / "bucket-fleet", root / "fleet-trainer"):
        shutil.rmtree(d, ignore_errors=True)
    for d in shm.glob("fleet-*"):
        shutil.rmtree(d, ignore_errors=True)
    bucket = f"file://{root / 'bucket-fleet'}"
    token = os.urandom(16).hex()
    secret_file = root / "fleet.secret"
    secret_file.write_text(os.urandom(32).hex() + "\n")
    trainer = [root / "fleet-trainer" / i for i in IDS]

    tr = pick_trainer()
    print(f"\n== fleet: the trainer initialises {tr.label} and publishes it as step000001", flush=True)
    digests = [tr.save(0, trainer[0])]
    from bdn.publish import publish_delta, publish_full, publish_startup

    m = publish_full(bucket, IDS[0], 1, dir=trainer[0], chunk_size=64 << 10)
    publish_startup(bucket, IDS[0])
    print(f"  {IDS[0]}: {m.stored_bytes} bytes, weights digest {digests[0]}")

    nodes = [
        {"id": f"node{i}", "peer": free_port(), "local": free_port(), "engine": free_port()} for i in range(nodes_n)
    ]
    procs: list[subprocess.Popen] = []
    try:
        for nd in nodes:
            env = dict(
                os.environ,
                BDN_BUCKET=bucket,
                BDN_NODE_ID=nd["id"],
                BDN_API_TOKEN=token,
                BDN_PEER_LISTEN=f"127.0.0.1:{nd['peer']}",
                BDN_ADVERTISE_URL=f"http://127.0.0.1:{nd['peer']}",
                BDN_LOCAL_LISTEN=f"127.0.0.1:{nd['local']}",
                BDN_SHM_DIR=str(shm / f"fleet-{nd['id']}"),
                BDN_PARTITION_SECRET_FILE=str(secret_file),
                BDN_PEERS=",".join(f"http://127.0.0.1:{o['peer']}" for o in nodes if o is not nd),
            )
            log = open(root / f"fleet-{nd['id']}.log", "wb")
            procs.append(subprocess.Popen([BIN / "bdnd"], env=env, stdout=log, stderr=subprocess.STDOUT))
            elog = open(root / f"fleet-engine-{nd['id']}.log", "wb")
            procs.append(subprocess.Popen(tr.engine_cmd(nd), stdout=elog, stderr=subprocess.STDOUT))
        print(f"  {nodes_n} bdnd + {nodes_n} engines started; waiting until every replica serves {IDS[0]}")
        # The hot-load API listens on the daemon's peer port (the one other hosts reach), behind the
        # bearer token; the local port stays for the engines on the node.
        hot = f"http://127.0.0.1:{nodes[0]['peer']}/hot_load/v1/models/hot_load"

        def fleet_done(ident: str):
            try:
                reps = http("GET", hot, token=token)["replicas"]
            except OSError:
                return None
            ok = len(reps) == nodes_n and all(
                r["current_snapshot_identity"] == ident
                and r["loading_state"]["stage"] == "done"
                and r.get("engines", 0) >= 1
                for r in reps
            )
            return reps if ok else None

        t0 = time.monotonic()

        told = [t0]

        def engines_up() -> bool:
            for i, nd in enumerate(nodes):
                if procs[2 * i + 1].poll() is not None:
                    sys.exit(
                        f"fleet demo: engine {nd['id']} exited ({procs[2 * i + 1].returncode}); "
                        f"its log: {root / ('fleet-engine-' + nd['id'] + '.log')}"
                    )
                try:
                    http("GET", f"http://127.0.0.1:{nd['engine']}/health", timeout=2)
                except OSError:
                    if time.monotonic() - told[0] >= 30:  # on a busy machine this takes minutes: say so
                        told[0] = time.monotonic()
                        print(
                            f"  ... still waiting for the engines ({time.monotonic() - t0:.0f} s: {tr.startup})",
                            flush=True,
                        )
                    return False
            return True

        # 153 s on a fresh clone at load 18 (2 cores): 180 s was too short at load 25
        wait_until(engines_up, 900, "the engines to load their first snapshot")
        t_engines = time.monotonic() - t0
        reps = wait_until(lambda: fleet_done(IDS[0]), 120, f"{IDS[0]} on every replica")
        print(
            f"  fleet serves {IDS[0]} after {time.monotonic() - t0:.1f} s: the engines answered /health after "
            f"{t_engines:.1f} s (most of it {tr.startup}), then every replica reported done"
        )
        ok = check_engines(tr, nodes, 1, digests[0])

        for i in (1, 2):
            ident = IDS[i]
            print(
                f"\n== fleet: optimizer step {i + 1}, publish delta {ident}, ONE hot-load POST to node0's "
                f"peer port (:{nodes[0]['peer']}, where the hot-load API listens)",
                flush=True,
            )
            digests.append(tr.save(i, trainer[i]))
            md = publish_delta(
                bucket, ident, i + 1, IDS[i - 1], dir=trainer[i], base_dir=trainer[i - 1], chunk_size=64 << 10
            )
            print(f"  {ident}: delta {md.stored_bytes} bytes (rebuilds {md.result_bytes})")
            t0 = time.monotonic()
            ans = http(
                "POST",
                hot,
                {
                    "identity": ident,
                    "incremental_snapshot_metadata": {
                        "previous_snapshot_identity": IDS[i - 1],
                        "compression_format": "arc_v2",
                        "checksum_format": "alder32",
                    },
                },
                token=token,
            )
            print(f"  POST {hot} -> 200 {json.dumps(ans)}")
            reps = wait_until(lambda: fleet_done(ident), 120, f"{ident} on every replica")
            print(f"  every replica done in {time.monotonic() - t0:.2f} s:")
            for r in reps:
                print(
                    f"    {r['replica_id']}: serves {r['current_snapshot_identity']} (policy_version "
                    f"{r['policy_version']}), stage {r['loading_state']['stage']}, "
                    f"swap pause {r.get('last_swap_pause_ms') or 0:.3f} ms"
                )
            ok &= check_engines(tr, nodes, i + 1, digests[-1])
        return ok
    finally:
        # Engines first: an engine unregisters from its daemon on the way out, and would log a
        # warning if the daemon were already gone.
        stop_all(procs[1::2])
        stop_all(procs[0::2])


def stop_all(procs: list[subprocess.Popen]) -> None:
    """SIGTERM every process, wait up to 10 s each, SIGKILL what is left."""
    for p in procs:
        p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()


def check_engines(tr, nodes: list[dict], policy: int, digest: str) -> bool:
    """The same request to every engine (greedy, or seeded): its policy version, answer and weights."""
    ok = True
    for nd in nodes:
        base = f"http://127.0.0.1:{nd['engine']}"
        ans = http(
            "POST",
            base + "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hello"}],
                **tr.sampling,
                "top_logprobs": 1,
                "nvext": {"extra_fields": ["engine_data"]},
            },
        )
        ed = ans["nvext"]["engine_data"]
        ch = ans["choices"][0]
        lp = ch["logprobs"]["content"]
        same = tr.served_digest(base) == digest
        ok &= ed["policy_version"] == policy and same
        swap = ""
        try:
            last = http("GET", base + "/debug/state").get("last_swap") or {}
            if last:
                swap = f"; last swap: {describe_swap(last)}"
        except OSError:
            pass  # the numpy engine has no /debug/state
        print(
            f"    {nd['id']} engine: policy_version {ed['policy_version']}, token_ids {ch['token_ids']}, "
            f"logprob[0] {lp[0]['logprob']:.4f}, "
            f"weights {'== trainer' if same else 'DIFFER from trainer'}{swap}"
        )
    return ok


if __name__ == "__main__":
    root = Path.cwd() / "demo-run"
    root.mkdir(exist_ok=True)
    import hashlib

    shm = (
        Path("/dev/shm") / f"bdn-demo-{hashlib.sha1(str(root).encode()).hexdigest()[:8]}"
        if Path("/dev/shm").is_dir()
        else root / "shm"
    )
    sys.exit(0 if run(root, shm) else 1)
