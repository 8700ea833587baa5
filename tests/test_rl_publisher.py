"""StepPublisher (bdn/rl/publisher.py) on a real file:// bucket: steps published in order from a
background thread (an anchor, then deltas against the previous step's arrays), STARTUP_SNAPSHOT
after the anchor; a failed hot-load is raised to the trainer's thread and stops publishing; and
the engine answers BdnRollouts trusts only after checking them (bdn/rl/engines.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from bdn.rl.engines import EngineAnswerError, parse_answer
from bdn.rl.publisher import StepPublisher, StepPublishFailed, identity_of

FILES = {"config.json": b'{"model_type": "llama"}'}


def _state(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "a.weight": rng.standard_normal((64, 32)).astype(ml_dtypes.bfloat16),
        "b.weight": rng.standard_normal((32,)).astype(np.float32),
    }


def _manifest(root: Path, ident: str) -> dict:
    return json.loads((root / ident / "bdn.manifest.json").read_text())


def test_steps_are_published_in_order_anchor_then_deltas(tmp_path: Path) -> None:
    root = tmp_path / "bucket"
    pub = StepPublisher(f"file://{root}", extra_files=FILES, anchor_every=3, chunk_size=4096)
    s = _state(0)
    for v in range(5):
        s = dict(s, **{"a.weight": (s["a.weight"].astype(np.float32) + 0.25 * (v > 0)).astype(ml_dtypes.bfloat16)})
        pub.submit(v, s)
    pub.close(timeout=120)
    assert [(p.identity, p.kind, p.policy_version) for p in pub.published] == [
        ("step000000", "full", 0),
        ("step000001", "delta", 1),
        ("step000002", "delta", 2),
        ("step000003", "full", 3),
        ("step000004", "delta", 4),
    ]
    assert all(p.hot_loaded_at is None and p.stored_bytes > 0 for p in pub.published)
    m = _manifest(root, "step000004")
    assert m["policy_version"] == 4 and m["kind"] == "delta" and m["base_identity"] == "step000003"
    assert (root / "STARTUP_SNAPSHOT").read_text() == "step000003\n"
    assert (root / "step000002" / "config.json").read_bytes() == FILES["config.json"]


def test_a_failed_hot_load_reaches_the_trainer_and_stops_publishing(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    root = tmp_path / "bucket"
    pub = StepPublisher(f"file://{root}", dead, extra_files=FILES)
    pub.submit(0, _state(0))
    with pytest.raises(StepPublishFailed, match=r"^step000000: \w+"):
        pub.flush(timeout=120)
    with pytest.raises(StepPublishFailed, match="step000000"):
        pub.submit(1, _state(1))
    with pytest.raises(StepPublishFailed):
        pub.close(timeout=60)
    assert pub.published == [] and not (root / "step000001").exists()


def test_versions_must_increase_and_the_prefix_must_make_identities(tmp_path: Path) -> None:
    pub = StepPublisher(f"file://{tmp_path}/bucket", extra_files=FILES)
    pub.submit(3, _state(0))
    with pytest.raises(ValueError, match="not above the last one submitted"):
        pub.submit(3, _state(1))
    pub.close(timeout=120)
    with pytest.raises(Exception, match="identity"):
        StepPublisher(f"file://{tmp_path}/bucket", prefix="../x")
    assert identity_of("run7-step", 12) == "run7-step000012"


GOOD = {
    "choices": [{"token_ids": [5, 6], "logprobs": {"content": [{"logprob": -1.0}, {"logprob": -0.5}]}}],
    "prompt_token_ids": [1, 2, 3],
    "nvext": {"engine_data": {"policy_versions": [4], "replica_id": "node0", "snapshot_identity": "step000004"}},
}


def test_an_engine_answer_is_checked_before_it_becomes_a_rollout() -> None:
    r = parse_answer("http://e", GOOD)
    assert (r.prompt_ids, r.completion_ids, r.logprobs, r.policy_versions) == ([1, 2, 3], [5, 6], [-1.0, -0.5], [4])
    assert (r.replica_id, r.identity, r.engine_url) == ("node0", "step000004", "http://e")


@pytest.mark.parametrize(
    "path, value, what",
    [
        (("choices", 0, "token_ids"), [5, "6"], "token_ids is not a list of integers"),
        (("choices", 0, "token_ids"), [5, True], "token_ids is not a list of integers"),
        (("prompt_token_ids",), None, "prompt_token_ids is not a list of integers"),
        (("choices", 0, "logprobs"), {"content": [{"logprob": -1.0}]}, "not one entry per completion token"),
        (("choices", 0, "logprobs"), {"content": [{"logprob": -1.0}, {"logprob": "x"}]}, "a logprob is not a number"),
        (("nvext", "engine_data", "policy_versions"), [], "policy_versions is empty"),
        (("nvext", "engine_data", "policy_versions"), [1.5], "policy_versions is not a list of integers"),
        (("nvext",), {}, "lacks 'engine_data'"),
        (("choices",), [], "lacks"),
    ],
)
def test_a_malformed_engine_answer_is_refused_with_one_line(path: tuple, value: object, what: str) -> None:
    ans = json.loads(json.dumps(GOOD))
    node = ans
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    with pytest.raises(EngineAnswerError, match="^engine http://e: .*" + what.replace("(", r"\(")) as e:
        parse_answer("http://e", ans)
    assert "\n" not in str(e.value)
    with pytest.raises(EngineAnswerError, match="not a JSON object"):
        parse_answer("http://e", [GOOD])
