"""The engine hand-off and the reference serving process (examples/engine/server.py).

First the server's own parts (the policy lock, the chat endpoint's shapes) over a real aiohttp
server, then the whole issue-4 path: three real bdnd processes and three real engine processes,
an anchor named by STARTUP_SNAPSHOT, then one hot-load of a delta POSTed to one daemon
(``bdnctl hot-load --wait``) until every engine answers with policy version 2 and the trainer's
exact weights.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bdn.client import DaemonError, EngineLink, hot_load, hot_load_status
from bdn.publish import publish_delta, publish_full, publish_startup
from support.api import http, wait_for
from support.swarm import Swarm, free_port

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "engine" / "server.py"
sys.path.insert(0, str(SERVER.parent))
import server as engine_server  # noqa: E402
import tinygpt  # noqa: E402

CFG = tinygpt.TinyGPTConfig(n_layer=2, n_head=4, n_embd=64, n_positions=256)
CHUNK = 64 << 10
PROMPT = [{"role": "user", "content": "Tell me about checkpoints."}]
ENGINE_DATA = {"nvext": {"extra_fields": ["engine_data"]}}


# -- the server's parts, without a daemon ------------------------------------------------------


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tinygpt.Model]:
    w1 = tinygpt.init_weights(CFG, 0)
    w2 = tinygpt.optimizer_step(w1, 0.02, 1)
    out = {}
    for v, w in ((1, w1), (2, w2)):
        d = tinygpt.save_checkpoint(tmp_path_factory.mktemp(f"m{v}"), CFG, w)
        m = tinygpt.load_checkpoint(d)
        m.identity, m.policy_version = f"step00000{v}", v
        out[v] = m
    return out


def test_policy_slot_swap_waits_for_readers_and_blocks_new_ones(models: dict[int, tinygpt.Model]) -> None:
    slot = engine_server.PolicySlot()
    slot.swap(models[1])
    in_read, release = threading.Event(), threading.Event()
    seen: list[int | None] = []

    def long_request() -> None:
        with slot.reading() as m:
            in_read.set()
            release.wait(120)
            seen.append(m.policy_version if m else None)

    def late_request() -> None:
        with slot.reading() as m:
            seen.append(m.policy_version if m else None)

    def blocked() -> int:  # threads waiting on the slot's condition (CPython's Condition keeps them in _waiters)
        return len(slot._cond._waiters)  # type: ignore[attr-defined]

    r1 = threading.Thread(target=long_request)
    r1.start()
    assert in_read.wait(120)
    w = threading.Thread(target=slot.swap, args=(models[2],))
    w.start()
    # States, not windows: the swap is pending and blocked while the request reads ...
    wait_for(lambda: slot._writers_waiting == 1 and blocked() == 1, 120, "the swap to wait for the in-flight request")
    assert w.is_alive() and slot.peek() is models[1], "the swap must wait for the in-flight request"
    r2 = threading.Thread(target=late_request)
    r2.start()
    # ... and a request arriving meanwhile blocks too (had it read, it would have seen policy 1)
    wait_for(lambda: blocked() == 2, 120, "the late request to wait for the pending swap")
    assert r2.is_alive() and seen == [], "a request arriving during a pending swap must wait for it"
    assert slot.peek() is models[1]
    release.set()
    for t in (r1, w, r2):
        t.join(120)
    # The in-flight request finished on policy 1, the late one ran on policy 2.
    assert seen == [1, 2]


@pytest.fixture
async def chat_client(aiohttp_client: Any, models: dict[int, tinygpt.Model]) -> Any:
    slot = engine_server.PolicySlot()
    srv = engine_server.EngineServer(slot, "tinygpt", "node-x", workers=2)
    client = await aiohttp_client(srv.app())
    client.slot = slot
    yield client
    srv.pool.shutdown(wait=True)


async def test_chat_endpoint_shapes(chat_client: Any, models: dict[int, tinygpt.Model]) -> None:
    r = await chat_client.get("/health")
    assert r.status == 503 and (await r.json())["status"] == "loading"
    r = await chat_client.post("/v1/chat/completions", json={"messages": PROMPT})
    assert r.status == 503 and (await r.json())["error"]["code"] == 503
    chat_client.slot.swap(models[1])

    body = {
        "model": "tinygpt",
        "messages": PROMPT,
        "max_tokens": 12,
        "temperature": 0,
        "top_logprobs": 3,
        **ENGINE_DATA,
    }
    r = await chat_client.post("/v1/chat/completions", json=body)
    assert r.status == 200
    ans = await r.json()
    assert ans["object"] == "chat.completion" and ans["id"].startswith("chatcmpl-") and ans["model"] == "tinygpt"
    assert isinstance(ans["created"], int)
    (choice,) = ans["choices"]
    m = models[1]
    prompt = m.tokenizer.encode_chat(PROMPT)
    want = m.generate_detailed(prompt, 12, 0.0, top_logprobs=3)
    assert ans["prompt_token_ids"] == prompt
    assert choice["token_ids"] == want.token_ids
    assert choice["message"] == {"role": "assistant", "content": m.tokenizer.decode(want.token_ids)}
    assert choice["finish_reason"] == want.finish_reason
    content = choice["logprobs"]["content"]
    assert [c["logprob"] for c in content] == pytest.approx(want.logprobs)
    assert [c["bytes"] for c in content] == [list(m.tokenizer.token_bytes(t)) for t in want.token_ids]
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["logprob"] >= c["logprob"] for c in content)
    assert ans["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": len(want.token_ids),
        "total_tokens": len(prompt) + len(want.token_ids),
    }
    assert ans["nvext"] == {
        "engine_data": {"policy_version": 1, "replica_id": "node-x", "snapshot_identity": "step000001"}
    }

    # Without the extra field there is no nvext; the RL fields can be turned off.
    r = await chat_client.post(
        "/v1/chat/completions",
        json={"messages": PROMPT, "max_tokens": 3, "logprobs": False, "return_token_ids": False, "seed": 4},
    )
    ans = await r.json()
    assert "nvext" not in ans and "prompt_token_ids" not in ans
    assert ans["choices"][0]["logprobs"] is None and "token_ids" not in ans["choices"][0]

    r = await chat_client.get("/v1/models")
    (card,) = (await r.json())["data"]
    assert card["id"] == "tinygpt" and card["root"] == "step000001" and card["max_model_len"] == CFG.n_positions
    r = await chat_client.get("/debug/weights_digest")
    assert (await r.json()) == {"digest": m.digest, "identity": "step000001", "policy_version": 1}
    chat_client.slot.swap(models[2])
    r = await chat_client.post("/v1/chat/completions", json={"messages": PROMPT, "max_tokens": 2, **ENGINE_DATA})
    assert (await r.json())["nvext"]["engine_data"]["policy_version"] == 2


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"messages": []}, 400, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role must be one of"),
        ({"messages": [{"role": "user", "content": 5}]}, 400, "content must be a string"),
        ({"messages": PROMPT, "temperature": 9}, 400, "temperature must be a number in [0, 2]"),
        ({"messages": PROMPT, "max_tokens": -1}, 400, "max_tokens must be an integer"),
        ({"messages": PROMPT, "max_tokens": 10**6}, 400, "maximum context length is 256 tokens"),
        ({"messages": PROMPT, "n": 2}, 400, "n must be"),
        ({"messages": PROMPT, "stream": True}, 400, "stream is not supported"),
        ({"messages": PROMPT, "logprobs": "yes"}, 400, "logprobs must be true or false"),
        ({"messages": PROMPT, "nvext": {"extra_fields": "engine_data"}}, 400, "extra_fields is a list"),
        ({"messages": PROMPT, "model": "gpt-4"}, 404, "does not exist"),
        ([1, 2], 400, "must be a JSON object"),
    ],
)
async def test_chat_endpoint_refuses_bad_requests(
    chat_client: Any, models: dict[int, tinygpt.Model], body: Any, status: int, needle: str
) -> None:
    chat_client.slot.swap(models[1])
    r = await chat_client.post("/v1/chat/completions", json=body)
    assert r.status == status
    err = (await r.json())["error"]
    assert needle in err["message"] and err["code"] == status and "\n" not in err["message"]


async def test_chat_endpoint_refuses_broken_json(chat_client: Any, models: dict[int, tinygpt.Model]) -> None:
    chat_client.slot.swap(models[1])
    r = await chat_client.post("/v1/chat/completions", data=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]


# -- the fleet: three bdnd, three engines ------------------------------------------------------


class Engine:
    """One examples/engine/server.py process next to one bdnd."""

    def __init__(self, workdir: Path, daemon_url: str, replica_id: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.replica_id = replica_id
        self.log_path = workdir / f"engine-{replica_id}.log"
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(SERVER),
                "--bdn-url",
                daemon_url,
                "--listen",
                f"127.0.0.1:{self.port}",
                "--replica-id",
                replica_id,
                "--poll-timeout",
                "2",
                "--log-level",
                "debug",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        log.close()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def wait_policy(self, version: int, timeout: float = 120.0) -> dict[str, Any]:
        def health() -> Any:
            assert self.proc.poll() is None, f"engine {self.replica_id} exited {self.proc.returncode}:\n{self.log()}"
            try:
                status, body = http("GET", self.url + "/health", timeout=5)
            except OSError:
                return None
            return body if status == 200 and body["policy_version"] == version else (status, body)

        return wait_for(
            health,
            timeout,
            f"engine {self.replica_id} on policy {version}",
            0.1,
            until=lambda v: isinstance(v, dict),
            detail=self.log,
        )

    def chat(self, **extra: Any) -> dict[str, Any]:
        body = {"model": "tinygpt", "messages": PROMPT, "max_tokens": 16, "temperature": 0, **ENGINE_DATA, **extra}
        status, ans = http("POST", self.url + "/v1/chat/completions", body)
        assert status == 200, ans
        return ans

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[dict[str, Any]]:
    bucket = f"file://{tmp_path}/bucket"
    w1 = tinygpt.init_weights(CFG, 0)
    w2 = tinygpt.optimizer_step(w1, 0.02, 1)  # a simulated optimizer step: ~2% of the bf16 values
    d1 = tinygpt.save_checkpoint(tmp_path / "trainer" / "step000001", CFG, w1)
    d2 = tinygpt.save_checkpoint(tmp_path / "trainer" / "step000002", CFG, w2)
    publish_full(bucket, "step000001", 1, dir=d1, chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    publish_delta(bucket, "step000002", 2, "step000001", dir=d2, base_dir=d1, chunk_size=CHUNK)
    swarm = Swarm(tmp_path / "nodes", 3, bucket)
    engines: list[Engine] = []
    try:
        swarm.start()
        engines = [Engine(tmp_path, d.url, d.node_id) for d in swarm.daemons]
        yield {"swarm": swarm, "engines": engines, "weights": {1: w1, 2: w2}, "dirs": {1: d1, 2: d2}}
    finally:
        codes = [e.stop() for e in engines]
        swarm.stop()
        assert codes == [0] * len(engines), "engines must stop cleanly on SIGTERM:\n" + "\n".join(
            e.log() for e in engines
        )


def fleet_at(url: str, identity: str) -> list[dict[str, Any]] | None:
    """The fleet's replicas as ``url`` reports them, once all 3 are done serving ``identity``."""
    reps = hot_load_status(url)
    done = len(reps) == 3 and all(
        r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps
    )
    return reps if done else None


def test_one_hot_load_reaches_every_engine(fleet: dict[str, Any]) -> None:
    swarm, engines = fleet["swarm"], fleet["engines"]
    digests = {v: tinygpt.weights_digest(w) for v, w in fleet["weights"].items()}
    # What each policy answers to the prompt, greedily: a response must be one of these, whole.
    expected = {}
    for v, d in fleet["dirs"].items():
        m = tinygpt.load_checkpoint(d)
        expected[v] = m.generate(m.tokenizer.encode_chat(PROMPT), 16, 0.0)[0]

    # Start-up: each engine gets STARTUP_SNAPSHOT from its own daemon.
    for e in engines:
        e.wait_policy(1)
        ans = e.chat()
        assert ans["nvext"]["engine_data"] == {
            "policy_version": 1,
            "replica_id": e.replica_id,
            "snapshot_identity": "step000001",
        }
        assert ans["choices"][0]["token_ids"] == expected[1]
        assert http("GET", e.url + "/debug/weights_digest")[1]["digest"] == digests[1]
    # The fleet view is aggregated from the replicas' reports (asynchronous): wait for the state.
    reps = wait_for(
        lambda: fleet_at(swarm.daemons[0].url, "step000001"), 120, "every replica reporting step000001 done"
    )
    assert sorted(r["replica_id"] for r in reps) == ["node0", "node1", "node2"]

    # Requests keep flowing during the hot-load; each is answered by one policy, whole.
    stop = threading.Event()
    seen: list[tuple[str, int, list[int]]] = []
    errors: list[str] = []

    def traffic() -> None:
        while not stop.is_set():
            for e in engines:
                try:
                    ans = e.chat()
                    seen.append(
                        (e.replica_id, ans["nvext"]["engine_data"]["policy_version"], ans["choices"][0]["token_ids"])
                    )
                except (AssertionError, OSError) as exc:
                    errors.append(f"{e.replica_id}: {exc}")

    t = threading.Thread(target=traffic)
    t.start()
    try:
        # One POST, to one daemon, through bdnctl; it follows every replica until done.
        cmd = [
            sys.executable,
            "-m",
            "bdn.cli.bdnctl",
            "--url",
            swarm.daemons[1].url,
            "hot-load",
            "step000002",
            "--previous",
            "step000001",
            "--wait",
            "--timeout",
            "60",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT)
        assert res.returncode == 0, res.stdout + res.stderr + "\n".join(e.log() for e in engines)
        assert "step000002 served by 3 replica(s)" in res.stdout
        # Non-TTY: one line per change, ending with every replica done.
        for node in ("node0", "node1", "node2"):
            assert f"replica={node}  stage=done  identity=step000002" in res.stdout, res.stdout
    finally:
        stop.set()
        t.join(30)
    assert not errors, errors[:3]

    for e in engines:
        e.wait_policy(2, timeout=120)  # done means every engine acked: already there (a deadline, not a window)
        ans = e.chat()
        assert ans["nvext"]["engine_data"] == {
            "policy_version": 2,
            "replica_id": e.replica_id,
            "snapshot_identity": "step000002",
        }
        assert ans["choices"][0]["token_ids"] == expected[2]
        assert http("GET", e.url + "/debug/weights_digest")[1] == {
            "digest": digests[2],
            "identity": "step000002",
            "policy_version": 2,
        }
    assert seen and all(v in (1, 2) and ids == expected[v] for _r, v, ids in seen)
    # Per engine, the policy version never goes back.
    for e in engines:
        versions = [v for r, v, _ids in seen if r == e.replica_id]
        assert versions == sorted(versions)

    for d in swarm.daemons:  # every daemon answers for the whole fleet
        reps = wait_for(
            lambda d=d: fleet_at(d.url, "step000002"), 120, f"{d.url}: every replica reporting step000002 done"
        )
        assert len(reps) == 3
        for r in reps:
            assert r["current_snapshot_identity"] == "step000002" and r["policy_version"] == 2
            assert r["loading_state"]["stage"] == "done" and r["readiness"] is True
            assert r["engines"] == 1 and r["last_swap_pause_ms"] > 0  # the engines reported their pause

    # The same request again changes nothing; a wrong previous identity is refused.
    with pytest.raises(DaemonError) as info:
        hot_load(swarm.daemons[2].url, "step000002", previous="step000009")
    assert info.value.status == 409

    # peers and gc through bdnctl.
    res = subprocess.run(
        [sys.executable, "-m", "bdn.cli.bdnctl", "--url", swarm.daemons[0].url, "--json", "peers"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    peers = json.loads(res.stdout)["peers"]
    assert sorted(p["node_id"] for p in peers) == ["node1", "node2"] and all(p["alive"] for p in peers)
    res = subprocess.run(
        [sys.executable, "-m", "bdn.cli.bdnctl", "--url", swarm.daemons[0].url, "--json", "gc"],
        capture_output=True,
        text=True,
        timeout=240,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr
    gc = json.loads(res.stdout)
    assert "step000002" in gc["kept"] and "step000002" not in gc["removed"]


def test_engine_link_against_a_real_daemon(tmp_path: Path) -> None:
    """Register, long-poll, ack with an error, re-register after DELETE; no engine process.
    ``bdnctl engines`` shows the acked pause with two decimals."""
    bucket = f"file://{tmp_path}/bucket"
    w1 = tinygpt.init_weights(CFG, 0)
    publish_full(bucket, "step000001", 1, dir=tinygpt.save_checkpoint(tmp_path / "ck", CFG, w1), chunk_size=CHUNK)
    publish_startup(bucket, "step000001")
    with Swarm(tmp_path / "nodes", 1, bucket) as swarm:
        d = swarm.daemons[0]
        link = EngineLink(d.url, name="test-engine")
        try:
            offer = link.next_snapshot(None, timeout=120)
            assert offer is not None and offer["identity"] == "step000001" and offer["policy_version"] == 1
            assert Path(offer["path"]).is_dir() and offer["lease_id"]
            assert link.next_snapshot("step000001", timeout=0.2) is None  # nothing newer: 204
            # A broken engine reports its failure; the replica shows it.
            link.ack("step000001", 0.0, error="RuntimeError: out of memory\nsecond line")
            (rep,) = hot_load_status(d.url)
            assert rep["loading_state"]["stage"] == "error"
            assert rep["loading_state"]["reason"] == "RuntimeError: out of memory"
            link.ack("step000001", 1.5)
            (rep,) = hot_load_status(d.url)
            assert rep["loading_state"]["stage"] == "done" and rep["last_swap_pause_ms"] == 1.5
            # a pause as run_hot_swap_loop measures it (unrounded): the API keeps it, bdnctl shows 2 decimals
            link.ack("step000001", 0.0152587890625)
            (rep,) = hot_load_status(d.url)
            assert rep["last_swap_pause_ms"] == 0.0152587890625
            table = subprocess.run(
                [sys.executable, "-m", "bdn.cli.bdnctl", "--url", d.url, "engines"],
                capture_output=True,
                text=True,
                timeout=240,
                cwd=ROOT,
            ).stdout
            header, row = table.splitlines()
            assert row.split()[header.split().index("PAUSE_MS")] == "0.02", table
            with pytest.raises(DaemonError) as info:
                link.ack("step000009", 1.0)
            assert info.value.status == 409
            # The leased snapshot survives GC.
            gc = json.loads(
                subprocess.run(
                    [sys.executable, "-m", "bdn.cli.bdnctl", "--url", d.url, "--json", "gc"],
                    capture_output=True,
                    text=True,
                    timeout=240,
                    cwd=ROOT,
                ).stdout
            )
            assert "step000001" in gc["kept"]
            old = link.engine_id
            link.close()
            with pytest.raises(DaemonError) as info:
                link.next_snapshot(None, timeout=0)
            assert info.value.status == 404
            assert link.register() != old
            assert link.next_snapshot(None, timeout=120)["identity"] == "step000001"
        finally:
            link.close()
