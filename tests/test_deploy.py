"""The deploy files (deploy/**) and bdnd's process contract with its supervisors.

- deploy/bdnd.toml.example documents every Config key with its true default, and loads;
- every Kubernetes manifest in deploy/k8s validates against a recent Kubernetes version's
  schemas, strictly (unknown fields fail), with kubernetes-validate (PyPI; it ships the schemas,
  so this runs offline);
- the systemd unit has the directives the operator guide promises and passes
  ``systemd-analyze verify`` where that tool exists;
- a real bdnd process speaks the sd_notify protocol: ``READY=1`` only once both ports answer,
  ``STOPPING=1`` on SIGTERM, to a path or an abstract-namespace socket;
- configuration errors stop bdnd with exit status 2 and one stderr line naming the key or file.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from bdn.daemon.config import Config
from support.api import wait_for
from support.swarm import SECRET, Daemon, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
EXAMPLE = DEPLOY / "bdnd.toml.example"
UNIT = DEPLOY / "systemd" / "bdnd.service"

# "# key = value" or "key = value" at the start of a line: the example's one line per key.
KEY_LINE = re.compile(r"^(#\s*)?([a-z][a-z0-9_]*)\s*=\s*(.*)$")


def _secret_file(tmp_path: Path) -> Path:
    p = tmp_path / "partition.secret"
    p.write_text(SECRET + "\n")
    return p


def _clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without BDN_* or NOTIFY_SOCKET, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BDN_") and k != "NOTIFY_SOCKET"}
    env.update(extra)
    return env


# ---- the example config ------------------------------------------------------------------------


def _example_key_lines() -> list[tuple[bool, str, str]]:
    """``(commented, key, value_text)`` for each key line of the example, in order."""
    out = []
    for line in EXAMPLE.read_text().splitlines():
        m = KEY_LINE.match(line)
        if m:
            out.append((m.group(1) is not None, m.group(2), m.group(3)))
    return out


def test_example_loads(tmp_path: Path) -> None:
    cfg = Config.load(EXAMPLE, env={"BDN_PARTITION_SECRET_FILE": str(_secret_file(tmp_path))})
    assert cfg.bucket.startswith(("s3://", "gs://", "file://"))
    assert cfg.partition_secret == SECRET


def test_example_documents_every_key_once() -> None:
    fields = [f.name for f in dataclasses.fields(Config)]
    keys = [k for _, k, _ in _example_key_lines()]
    missing = [f for f in fields if f not in keys]
    assert not missing, f"deploy/bdnd.toml.example does not document: {missing}"
    unknown = sorted(set(keys) - set(fields))
    assert not unknown, f"deploy/bdnd.toml.example has key lines Config does not know: {unknown}"
    twice = sorted({k for k in keys if keys.count(k) > 1})
    assert not twice, f"keys with more than one line in deploy/bdnd.toml.example: {twice}"


def test_example_commented_values_are_the_defaults(tmp_path: Path) -> None:
    """Uncommenting any "# key = value" line must not change the configuration."""
    commented = [(k, v) for c, k, v in _example_key_lines() if c]
    assert len(commented) > 10
    doc = tomllib.loads("\n".join(f"{k} = {v}" for k, v in commented))
    defaults = Config()
    for k, v in doc.items():
        assert v == getattr(defaults, k), f"example says {k} = {v!r}, Config's default is {getattr(defaults, k)!r}"
    # and the fully uncommented file still loads: every shown value has the right type
    text = "\n".join(re.sub(r"^#\s*(?=[a-z][a-z0-9_]*\s*=)", "", line) for line in EXAMPLE.read_text().splitlines())
    full = tmp_path / "full.toml"
    full.write_text(text)
    token = tmp_path / "token"
    token.write_text("t0k3n\n")
    Config.load(full, env={"BDN_PARTITION_SECRET_FILE": str(_secret_file(tmp_path)), "BDN_API_TOKEN_FILE": str(token)})


# ---- Kubernetes manifests ----------------------------------------------------------------------


def _k8s_docs() -> list[tuple[str, dict[str, Any]]]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                docs.append((f"{path.name}#{i}", doc))
    return docs


def _is_kustomization(doc: dict[str, Any]) -> bool:
    return doc.get("kind") == "Kustomization"


def _validate(doc: dict[str, Any]) -> str:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate not installed (pip install -e .[test])")
    return kv.validate(doc, kv.latest_version(), strict=True)


K8S_DOCS = [(n, d) for n, d in _k8s_docs() if not _is_kustomization(d)]


def test_k8s_has_the_expected_objects() -> None:
    kinds = {(d["kind"], d["metadata"]["name"]) for _, d in K8S_DOCS}
    assert {("DaemonSet", "bdnd"), ("Service", "bdn-peers"), ("ConfigMap", "bdnd-config")} <= kinds


@pytest.mark.parametrize("name,doc", K8S_DOCS, ids=[n for n, _ in K8S_DOCS])
def test_k8s_manifest_validates_strictly(name: str, doc: dict[str, Any]) -> None:
    try:
        _validate(doc)
    except Exception as e:  # kubernetes_validate's errors carry the path and message
        path = ".".join(str(p) for p in getattr(e, "path", []))
        pytest.fail(f"{name} ({doc.get('kind')}): {path}: {getattr(e, 'message', e)}")


def test_validator_rejects_unknown_fields() -> None:
    """The strict check is not vacuous: a misspelt field in the DaemonSet fails."""
    ds = copy.deepcopy(next(d for _, d in K8S_DOCS if d["kind"] == "DaemonSet"))
    c = ds["spec"]["template"]["spec"]["containers"][0]
    c["readinesProbe"] = c.pop("readinessProbe")
    with pytest.raises(Exception, match="readinesProbe"):
        _validate(ds)


def test_daemonset_wiring() -> None:
    """The names the operator guide promises, and the pieces that must agree with each other."""
    ds = next(d for _, d in K8S_DOCS if d["kind"] == "DaemonSet")
    svc = next(d for _, d in K8S_DOCS if d["kind"] == "Service")
    pod = ds["spec"]["template"]["spec"]
    assert svc["metadata"]["name"] == "bdn-peers" and svc["spec"]["clusterIP"] == "None"
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= labels.items()
    vols = {v["name"]: v for v in pod["volumes"]}
    secrets = {v["secret"]["secretName"] for v in vols.values() if "secret" in v}
    assert secrets == {"rl-bdn-partition", "rl-checkpoint-reader"}
    shm = next(v for v in vols.values() if "hostPath" in v)
    assert shm["hostPath"] == {"path": "/dev/shm/bdn", "type": "DirectoryOrCreate"}
    c = pod["containers"][0]
    for probe, path in (("readinessProbe", "/v1/ready"), ("livenessProbe", "/v1/health")):
        get = c[probe]["httpGet"]
        # The local API is loopback-only; with hostNetwork the kubelet reaches it at 127.0.0.1.
        assert pod["hostNetwork"] and get["host"] == "127.0.0.1" and get["path"] == path
    assert "memory" in c["resources"]["limits"] and "cpu" in c["resources"]["requests"]
    # The ConfigMap's bdnd.toml loads, with the per-node values the DaemonSet sets.
    cm = next(d for _, d in K8S_DOCS if d["kind"] == "ConfigMap")
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    script = "\n".join(c["command"])
    assert f"{mounts['config']}/bdnd.toml" in script
    toml = tomllib.loads(cm["data"]["bdnd.toml"])
    assert toml["partition_secret_file"].startswith(mounts["partition-secret"] + "/")
    assert toml["credentials_file"].startswith(mounts["reader-credentials"] + "/")
    assert toml["shm_dir"] == mounts["shm"] == "/dev/shm/bdn"


def test_daemonset_start_command_seeds_peers(tmp_path: Path) -> None:
    """The container's start command: resolve the peers' Service name, drop itself, exec bdnd.

    ``bdnd`` here is a stand-in on PATH that prints what it was given: the thing under test is
    the start command, not the daemon.
    """
    ds = next(d for _, d in K8S_DOCS if d["kind"] == "DaemonSet")
    cmd = ds["spec"]["template"]["spec"]["containers"][0]["command"]
    stub = tmp_path / "bdnd"
    stub.write_text('#!/bin/sh\necho "peers=$BDN_PEERS"\necho "umask=$(umask)"\necho "args=$*"\n')
    stub.chmod(0o755)
    env = _clean_env(PATH=f"{tmp_path}:{os.environ['PATH']}", BDN_PEERS_SERVICE="localhost", POD_IP="127.0.0.1")
    out = subprocess.run([sys.executable, *cmd[1:]], env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    got = dict(line.split("=", 1) for line in out.stdout.splitlines())
    peers = [p for p in got["peers"].split(",") if p]
    assert "http://127.0.0.1:7080" not in peers  # itself
    assert all(p in ("http://[::1]:7080",) for p in peers), peers
    assert got["umask"] == "0027"
    assert got["args"] == "--config /etc/bdn/config/bdnd.toml"


def test_configmap_toml_loads(tmp_path: Path) -> None:
    cm = next(d for _, d in K8S_DOCS if d["kind"] == "ConfigMap")
    p = tmp_path / "bdnd.toml"
    p.write_text(cm["data"]["bdnd.toml"])
    cfg = Config.load(
        p,
        env={
            "BDN_PARTITION_SECRET_FILE": str(_secret_file(tmp_path)),
            "BDN_NODE_ID": "gpu-node-17",
            "BDN_ADVERTISE_URL": "http://10.1.2.3:7080",
        },
    )
    assert cfg.local_listen.startswith("127.0.0.1:")


def test_kustomization_lists_every_manifest() -> None:
    kust = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    others = sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")
    assert sorted(kust["resources"]) == others


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomize_build_validates() -> None:
    out = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    assert len(docs) == len(K8S_DOCS)
    for d in docs:
        assert d["kind"] == "Namespace" or d["metadata"]["namespace"] == "bdn"
        _validate(d)


# ---- systemd unit ------------------------------------------------------------------------------


def _unit_directives() -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in UNIT.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out.setdefault(k.strip(), []).append(v.strip())
    return out


def test_systemd_unit_directives() -> None:
    d = _unit_directives()
    want = {
        "Type": "notify",
        "Restart": "on-failure",
        "User": "bdn",
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "NoNewPrivileges": "yes",
        "PrivateTmp": "yes",
        "RuntimeDirectory": "bdn",
        "ReadWritePaths": "/dev/shm/bdn",
        "RemoveIPC": "no",
        "LoadCredential": "partition-secret:/etc/bdn/partition.secret",
        "ExecStart": "/usr/local/bin/bdnd --config /etc/bdn/bdnd.toml",
    }
    for k, v in want.items():
        assert v in d.get(k, []), f"bdnd.service: expected {k}={v}, has {d.get(k)}"
    assert "BDN_PARTITION_SECRET_FILE=%d/partition-secret" in d["Environment"]
    assert "DynamicUser" not in d
    # the environment names the unit sets are Config keys
    for env in d["Environment"]:
        name = env.split("=", 1)[0]
        assert name.startswith("BDN_") and name[4:].lower() in {f.name for f in dataclasses.fields(Config)}


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    # verify checks that ExecStart's program exists: point it at this environment's bdnd.
    bdnd = Path(sys.executable).with_name("bdnd")
    if not bdnd.exists():
        pytest.skip("no bdnd console script next to the interpreter")
    unit = tmp_path / "bdnd.service"
    unit.write_text(UNIT.read_text().replace("/usr/local/bin/bdnd", str(bdnd)))
    out = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)], capture_output=True, text=True, timeout=240
    )
    # Unknown or malformed directives are only warnings (exit 0): any output about the unit fails.
    complaints = [ln for ln in (out.stdout + out.stderr).splitlines() if "bdnd.service" in ln]
    assert out.returncode == 0 and not complaints, out.stdout + out.stderr


# ---- the notify protocol, with a real bdnd -----------------------------------------------------


def _recv_state(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.splitlines() if "=" in line)


def _http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify_ready_and_stopping(tmp_path: Path, abstract: bool) -> None:
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    (bucket / "README").write_text("a run's bucket\n")  # an empty one is a misconfiguration (not ready)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if abstract:
        name = f"bdn-test-{os.getpid()}-{free_port()}"
        sock.bind("\0" + name)
        notify = "@" + name
    else:
        notify = str(tmp_path / "notify.sock")
        sock.bind(notify)
    sock.settimeout(240)  # READY=1 comes after bdnd's imports: 60+ s on a loaded machine
    d = Daemon(tmp_path, "node0", bucket.as_uri(), extra_env={"NOTIFY_SOCKET": notify})
    try:
        d.start([])
        try:
            state = _recv_state(sock)
        except TimeoutError:
            pytest.fail(f"no READY=1 from bdnd:\n{d.log()}")
        assert state.get("READY") == "1", state
        # STATUS= says readiness in words (a file:// bucket with no snapshot: reachable, nothing to load).
        assert state.get("STATUS") == "ready", state
        # READY=1 means both ports listen: the local API answers, the peer port refuses unsigned requests.
        assert d.get("/v1/health")["status"] == "ok"
        assert _http_status(f"{d.peer_url}/bdn/v1/0000000000000000/members") == 401
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        assert _recv_state(sock).get("STOPPING") == "1"
        assert d.proc.wait(120) == 0  # a deadline for a hang: at load 27 an exit took 12.5 s
    finally:
        d.stop()
        sock.close()


def test_sd_notify_status_says_not_ready_naming_a_missing_bucket(tmp_path: Path) -> None:
    """Issue 12, item 11: systemd's STATUS= carries readiness, not only READY=1: with a bucket
    that does not exist it names it (``systemctl status bdnd`` shows the line)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify = str(tmp_path / "notify.sock")
    sock.bind(notify)
    sock.settimeout(240)  # READY=1 comes after bdnd's imports: 60+ s on a loaded machine
    d = Daemon(
        tmp_path,
        "node0",
        (tmp_path / "no-such-bucket").as_uri(),
        extra_env={"NOTIFY_SOCKET": notify, "BDN_STARTUP_SETTLE_S": "0"},
    )
    try:
        d.start([])
        try:
            state = _recv_state(sock)
        except TimeoutError:
            pytest.fail(f"no READY=1 from bdnd:\n{d.log()}")
        assert state.get("READY") == "1", state
        while "no-such-bucket" not in state.get("STATUS", ""):  # (a later STATUS= if the first was sent too early)
            state = _recv_state(sock)
        status = state["STATUS"]
        assert status.startswith("not ready: ") and "bucket unreachable" in status and "no such directory" in status, (
            status
        )
        assert d.get("/v1/health")["status"] == "ok"  # alive all the same: liveness is not readiness
    finally:
        d.stop()
        sock.close()


# ---- configuration errors ----------------------------------------------------------------------


def test_config_error_exits_2_with_one_line(tmp_path: Path) -> None:
    """A config file bdnd refuses, end to end: exit 2 and one line. Every other config error is
    tested in-process through the loader (tests/test_config.py)."""
    cfg = tmp_path / "bdnd.toml"
    cfg.write_text(f'bucket = "file:///tmp/b"\npartition_secret_file = "{_secret_file(tmp_path)}"\nbogus_key = 1\n')
    # Ports held by this test: a daemon that got as far as listening would fail with exit 1.
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = _clean_env(BDN_PEER_LISTEN=f"127.0.0.1:{port}", BDN_LOCAL_LISTEN=f"127.0.0.1:{port}")
        out = subprocess.run(
            [sys.executable, "-m", "bdn.daemon.main", "--config", str(cfg)],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("bdnd: error: "), out.stderr
    assert "bogus_key" in lines[0] and str(cfg) in lines[0], lines[0]
    assert out.stdout == ""


def test_json_logs_name_the_snapshot(tmp_path: Path) -> None:
    """With log_json, every line a snapshot's work logs carries its identity as a field."""
    import json as _json

    from bdn.publish import publish_full
    from support.checkpoints import make_state, write_hf_dir
    from support.swarm import Daemon

    bucket = f"file://{tmp_path}/bucket"
    publish_full(bucket, "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10)
    d = Daemon(tmp_path / "nodes", "node0", bucket, extra_env={"BDN_LOG_JSON": "true", "BDN_LOAD_STARTUP": "false"})
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001")
    finally:
        d.stop()
    lines = [_json.loads(x) for x in d.log_path.read_text().splitlines() if x.startswith("{")]
    about = [x for x in lines if "step000001" in x["msg"]]
    assert about and all(x.get("snapshot") == "step000001" for x in about), about


# ---- liveness and readiness (issue 12, item 11) --------------------------------------------------


def _ready(d: Any, want: bool, timeout: float = 120.0) -> dict[str, Any]:
    """Poll /v1/ready until its answer is ``want``; the last document."""

    def ready() -> dict[str, Any]:
        status, body = d.request("GET", "/v1/ready", timeout=30)
        assert status in (200, 503) and body["ready"] == (status == 200), (status, body)
        return body

    return wait_for(
        ready, timeout, f"/v1/ready to say {want}", 0.1, until=lambda body: body["ready"] == want, detail=d.log
    )


def test_ready_fails_naming_a_missing_bucket_while_health_answers(tmp_path: Path) -> None:
    from support.swarm import Daemon

    d = Daemon(tmp_path, "node0", (tmp_path / "no-such-bucket").as_uri(), extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    try:
        d.start([])
        d.wait_healthy()
        assert d.get("/v1/health")["status"] == "ok"
        body = wait_for(
            lambda: _ready(d, False),
            120,
            "a reason naming the missing bucket directory",
            0.1,
            until=lambda body: any("no-such-bucket" in r and "no such directory" in r for r in body["reasons"]),
        )
        assert all("\n" not in r for r in body["reasons"])
    finally:
        d.stop()


def test_ready_fails_naming_an_s3_bucket_that_does_not_exist(tmp_path: Path, moto_endpoint: str) -> None:
    from support.swarm import Daemon

    d = Daemon(
        tmp_path,
        "node0",
        "s3://bdn-no-such-bucket/run1",
        extra_env={"BDN_STARTUP_SETTLE_S": "0", "BDN_ENDPOINT_URL": moto_endpoint},
    )
    try:
        d.start([])
        d.wait_healthy()
        wait_for(
            lambda: _ready(d, False),
            120,
            "a reason saying the bucket does not exist",
            0.2,
            until=lambda body: any("does not exist" in r for r in body["reasons"]),
        )
    finally:
        d.stop()


def test_ready_once_listening_and_the_startup_snapshot_loads(tmp_path: Path) -> None:
    from bdn.publish import publish_full, publish_startup
    from support.checkpoints import make_state, write_hf_dir
    from support.swarm import Daemon

    bucket = f"file://{tmp_path}/bucket"
    publish_full(bucket, "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10)
    publish_startup(bucket, "step000001")
    d = Daemon(tmp_path / "nodes", "node0", bucket, extra_env={"BDN_STARTUP_SETTLE_S": "0"})
    try:
        d.start([])
        d.wait_healthy()
        assert _ready(d, True)["reasons"] == []
        d.wait_ready("step000001")
        assert _ready(d, True)["ready"]
    finally:
        d.stop()


# Python reprs an operator should never read in a log message: quoted names, dicts, lists, paths.
REPR = re.compile(r"'step\d|\{'|\['|PosixPath\(|\(stages \{")


def test_json_logs_plain_messages_node_id_on_every_line_and_no_botocore(tmp_path: Path, s3_bucket: Any) -> None:
    """Issue 12, item 14: against a real S3 API (moto), a snapshot loaded and one that fails:
    every line is one JSON object with node_id; messages carry no Python reprs; botocore's
    INFO lines (credential lookups) do not reach the daemon's log."""
    import json as _json

    from bdn.bucket import open_bucket
    from bdn.publish import publish_full
    from support.checkpoints import make_state, write_hf_dir

    bucket, endpoint = s3_bucket
    b = open_bucket(bucket, endpoint_url=endpoint)
    try:
        publish_full(b, "step000001", 1, dir=write_hf_dir(tmp_path / "ck", make_state(0), 1), chunk_size=64 << 10)
    finally:
        b.close()
    d = Daemon(
        tmp_path / "nodes",
        "node0",
        bucket,
        extra_env={
            "BDN_LOG_JSON": "true",
            "BDN_LOAD_STARTUP": "false",
            "BDN_ENDPOINT_URL": endpoint,
            "BDN_MANIFEST_WAIT_S": "0.5",
            "BDN_LOG_LEVEL": "debug",
            "BDN_STARTUP_SETTLE_S": "0",
        },
    )
    d.start([])
    try:
        d.wait_healthy()
        assert d.prefetch("step000001")[0] == 202
        d.wait_ready("step000001")
        assert d.prefetch("step000009")[0] == 202  # never published: fails with a reason
        wait_for(
            lambda: d.get("/v1/snapshots/step000009")["state"] == "failed", 120, "step000009 to fail", 0.1, detail=d.log
        )
    finally:
        d.stop()
    raw = [x for x in d.log_path.read_text().splitlines() if x.strip()]
    lines = [_json.loads(x) for x in raw]  # every line is one JSON object
    assert lines and all(x["node_id"] == "node0" for x in lines)
    assert not [
        x
        for x in lines
        if x["logger"].startswith(("botocore", "boto3", "urllib3", "s3transfer")) and x["level"] in ("debug", "info")
    ]
    bad = [x["msg"] for x in lines if REPR.search(x["msg"])]
    assert not bad, bad
    assert any("ready at" in x["msg"] and "stages: " in x["msg"] for x in lines)
    assert any("step000009" in x["msg"] and "failed" in x["msg"] for x in lines)


def test_engine_pod_shares_the_daemonsets_shm_and_starts_on_the_current_snapshot() -> None:
    ds = next(d for _, d in K8S_DOCS if d["kind"] == "DaemonSet" and d["metadata"]["name"] == "bdnd")
    eng = next(d for _, d in K8S_DOCS if d["metadata"]["name"] == "vllm-engine")
    dpod, epod = ds["spec"]["template"]["spec"], eng["spec"]["template"]["spec"]
    shm = next(v for v in dpod["volumes"] if "hostPath" in v)["hostPath"]["path"]
    evols = {v["name"]: v for v in epod["volumes"]}
    (name,) = [n for n, v in evols.items() if v.get("hostPath", {}).get("path") == shm]
    assert evols[name]["hostPath"]["type"] == "Directory"  # the daemon creates it; the engine never does
    assert epod["hostNetwork"] and 10001 in epod["securityContext"]["supplementalGroups"]
    for c in epod["containers"]:
        mounts = [m for m in c.get("volumeMounts", []) if m["name"] == name]
        if mounts:
            assert mounts[0]["mountPath"] == shm and mounts[0]["readOnly"] is True
    init = " ".join(epod["initContainers"][0]["command"])
    assert "path current --wait" in init and "/run/bdn/model-path" in init
    vllm = next(c for c in epod["containers"] if c["name"] == "vllm")
    assert "/run/bdn/model-path" in " ".join(vllm["command"])
