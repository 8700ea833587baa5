"""Word-level swaps: the transformers engine applies a ``bdn_planes_v1`` delta's changed words to
its own parameters in place, from the verified diff files the daemon's offer names
(``changed_words``; bdn.engines.hf_words, docs/ENGINES.md "Word-level swaps").

A tiny LlamaForCausalLM (bf16) is published as an anchor and six ``bdn_planes_v1`` deltas, each
changing 2 % of the values of every matrix; one real bdnd serves them. Through the engine
service (its driver, real hot-load POSTs), each swap is word-level and the engine's weights are
the trainer's bit for bit after every step. With offers built from the daemon's own files, a diff
that is missing falls back to staging in prepare and a corrupted one is caught in the pause and
read from the snapshot instead, each with one log line, the weights correct. The daemon keeps an
offered snapshot's diff files while the offer is outstanding, through GC and a later target.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest

from bdn.engines.hf import torch_available

_why = torch_available()
if _why:
    pytest.skip(f"the transformers engine needs torch and transformers ({_why})", allow_module_level=True)

import torch  # noqa: E402
import xxhash  # noqa: E402

from bdn.client import hot_load, hot_load_status, open_snapshot  # noqa: E402
from bdn.engines import hf_words  # noqa: E402
from bdn.engines.hf import HFEngine  # noqa: E402
from bdn.engines.options import HotLoadOptions  # noqa: E402
from bdn.engines.service import HFService  # noqa: E402
from bdn.fileops import read_header  # noqa: E402
from bdn.proto import arc  # noqa: E402
from bdn.publish import publish_delta, publish_full, publish_startup  # noqa: E402
from support.api import http, wait_for  # noqa: E402
from support.swarm import Swarm, free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "engine"))
import tiny_llama  # noqa: E402

CHUNK = 64 << 10
STEPS = 7  # the anchor and six deltas
IDS = [f"step{i:06d}" for i in range(1, STEPS + 1)]


def digests(state: dict[str, torch.Tensor]) -> dict[str, str]:
    return {
        k: xxhash.xxh3_128_hexdigest(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for k, v in state.items()
    }


def replica_done(url: str, identity: str):
    reps = hot_load_status(url)
    errs = [r for r in reps if r["loading_state"]["stage"] == "error"]
    assert not errs, errs
    return (
        reps
        if all(r["current_snapshot_identity"] == identity and r["loading_state"]["stage"] == "done" for r in reps)
        else None
    )


@pytest.fixture(scope="module")
def trainer(tmp_path_factory: pytest.TempPathFactory):
    """An anchor and six bdn_planes_v1 deltas, each on the one before: 2 % of every matrix's values."""
    root = tmp_path_factory.mktemp("words")
    bucket = f"file://{root}/bucket"
    dirs = [root / "ck1"]
    _model, s = tiny_llama.make_tiny_llama(dirs[0], hidden=64, layers=2, seed=5)
    states = [s]
    publish_full(bucket, IDS[0], 1, dir=dirs[0], chunk_size=CHUNK)
    for i in range(1, STEPS):
        states.append(tiny_llama.optimizer_step(states[-1], 0.02, seed=20 + i, tensors=1000))
        dirs.append(tiny_llama.save_state(root / f"ck{i + 1}", dirs[0], states[-1]))
        publish_delta(
            bucket,
            IDS[i],
            i + 1,
            IDS[i - 1],
            dir=dirs[i],
            base_dir=dirs[i - 1],
            compression_format="bdn_planes_v1",
            chunk_size=CHUNK,
        )
    publish_startup(bucket, IDS[0])
    return {"bucket": bucket, "states": states}


@pytest.fixture
def node(trainer, tmp_path: Path):
    env = {"BDN_KEEP_READY": "1", "BDN_GC_GRACE_S": "0"}
    with Swarm(tmp_path / "nodes", 1, trainer["bucket"], extra_env=env) as swarm:
        yield swarm.daemons[0]


@pytest.mark.parametrize("words", ["inplace", "pingpong"])
def test_a_chain_of_six_deltas_swaps_word_level_and_ends_bit_for_bit(trainer, node, words: str) -> None:
    """In place (the pause XORs the parameters) and onto ping-pong spare buffers one step behind
    (the pause rebinds them): the first delta copies the changed parameters, every later one
    writes only the changed words of two deltas (the last one, caught up after its swap, and its
    own)."""
    states = trainer["states"]
    with HFService(node.url, "127.0.0.1", free_port(), replica_id="node0", poll_timeout=2.0, words=words) as svc:
        wait_for(lambda: replica_done(node.url, IDS[0]), 120, f"{IDS[0]} served")
        assert svc.engine.weights_digest() == digests(states[0])
        seen: set[str] = set()  # tensors some delta changed (each has a spare buffer from then on)
        for i in range(1, STEPS):
            assert hot_load(node.url, IDS[i], previous=IDS[i - 1])["accepted"] is True
            wait_for(lambda i=i: replica_done(node.url, IDS[i]), 120, f"{IDS[i]} served")
            rep = svc.engine.last_swap
            assert rep["mode"] == "partial" and rep["changed_source"] == (
                "words" if words == "inplace" else "words-pingpong"
            ), rep
            assert rep["swap_method"] == ("words-in-place" if words == "inplace" else "rebind")
            assert rep["words_fallback"] is None and rep["words_kernel"] in ("compiled", "numpy")
            changed = [
                k
                for k in states[i]
                if not torch.equal(states[i][k].view(torch.uint8), states[i - 1][k].view(torch.uint8))
            ]
            assert sorted(svc.engine.last_swap_tensors) == sorted(changed) and len(changed) > 10
            # only the changed words were written: about 2 % of the changed tensors' bytes
            whole = sum(states[i][k].numel() * states[i][k].element_size() for k in changed)
            pp = rep["pingpong"]
            if words == "pingpong":
                fresh = sum(states[i][k].numel() * states[i][k].element_size() for k in changed if k not in seen)
                seen.update(changed)
                assert pp["copied"] == fresh and (i > 1 or fresh == whole), (i, pp)  # a spare buffer: made once
                assert pp["caught_up"] == 0 and (pp["background"] > 0) == (i > 1), pp  # the last delta: caught up
                assert 0 < pp["written"] < whole / 10, pp
                svc.engine.pingpong.wait()  # the catch-up after the swap: the spare buffers hold it too
                assert svc.engine.pingpong.holds == IDS[i] and svc.engine.pingpong.kept is None
            else:
                assert pp is None and 0 < rep["bytes_copied"] < whole / 10, (rep["bytes_copied"], whole)
            assert svc.engine.weights_digest() == digests(states[i]), f"{IDS[i]}: parameters differ from the trainer's"
            status, w = http("GET", svc.url + "/debug/weights")
            assert status == 200 and w["identity"] == IDS[i] and w["tensors"] == digests(states[i])


def _offer(base: str, files: dict[str, str]) -> dict[str, Any]:
    return {"changed_words": {"codec": "bdn_planes_v1", "base": base, "files": files}}


def _diff_files(node, identity: str) -> dict[str, str]:
    root = Path(node.wait_ready(identity)["path"]).parent
    stored = root / ".stored" / identity
    return {p.relative_to(stored).as_posix(): str(p) for p in stored.rglob("*.safetensors")}


def test_a_missing_or_corrupted_diff_falls_back_with_one_line_and_correct_weights(
    trainer, node, tmp_path, caplog
) -> None:
    states = trainer["states"]
    for ident in IDS[:3]:  # each leased once ready: keep_ready 1 would collect the older ones
        node.prefetch(ident)
        node.wait_ready(ident)
        assert http("POST", f"{node.url}/v1/snapshots/{ident}/leases", {"holder": "test"})[0] in (200, 201)
    root = Path(node.wait_ready(IDS[0])["path"]).parent
    snaps = [open_snapshot(root / i) for i in IDS[:3]]
    engine = HFEngine(words="inplace")
    engine.kernel = hf_words.KernelWarmup(start=False)  # the numpy path (the service test runs the kernel's)
    try:
        engine.swap(engine.prepare(snaps[0], {}, HotLoadOptions()))
        # a diff file gone: refused in prepare, the changed tensors staged (compared here)
        files = _diff_files(node, IDS[1])
        gone = {rel: str(tmp_path / "no-such-file") for rel in files}
        with caplog.at_level(logging.INFO, logger="bdn.engines.hf"):
            rep = engine.swap(engine.prepare(snaps[1], _offer(IDS[0], gone), HotLoadOptions()))
        lines = [r for r in caplog.records if "word-level swap not used" in r.getMessage()]
        assert len(lines) == 1 and "FileNotFoundError" in lines[0].getMessage()
        assert (
            rep["mode"] == "partial"
            and rep["changed_source"] == "compared"
            and "FileNotFoundError" in rep["words_fallback"]
        )
        assert engine.weights_digest() == digests(states[1])
        # a diff for another base: refused in prepare
        files2 = _diff_files(node, IDS[2])
        prep = engine.prepare(snaps[2], _offer(IDS[0], files2), HotLoadOptions())
        assert prep.words is None and "this engine serves 'step000002'" in prep.words_fallback
        # a corrupted stream payload (its header intact): caught in the pause, read from the snapshot
        bad = {}
        for rel, path in files2.items():
            data = bytearray(Path(path).read_bytes())
            _, streams = arc.read_diff_header(bytes(data), len(data))
            big = max(streams.values(), key=lambda s: s.frame_end - s.frame_start)
            for at in range(big.frame_start + (big.frame_end - big.frame_start) // 2, big.frame_end):
                data[at] ^= 0x5A
            bad[rel] = str(tmp_path / rel.replace("/", "_"))
            Path(bad[rel]).write_bytes(bytes(data))
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bdn.engines.hf"):
            prep = engine.prepare(snaps[2], _offer(IDS[1], bad), HotLoadOptions())
            assert prep.words is not None, prep.words_fallback
            rep = engine.swap(prep)
        lines = [r for r in caplog.records if "word-level swap failed" in r.getMessage()]
        assert len(lines) == 1, [r.getMessage() for r in caplog.records]
        assert rep["changed_source"] == "words-restored" and rep["words_fallback"].startswith(
            "applying the words failed"
        )
        assert engine.weights_digest() == digests(states[2])
        assert engine.identity == IDS[2]
    finally:
        for s in snaps:
            s.close()


def test_the_daemon_keeps_the_offered_diff_files_until_the_engine_answers(trainer, node) -> None:
    """GC and a later target leave an outstanding offer's diff files in place, byte for byte."""
    status, reg = http("POST", node.url + "/v1/engines", {"name": "words-test"})
    assert status == 201
    eid = reg["engine_id"]

    def next_offer(after: str | None) -> dict[str, Any]:
        q = "?timeout=30" + (f"&after={after}" if after else "")
        status, offer = http("GET", f"{node.url}/v1/engines/{eid}/next{q}")
        assert status == 200, (status, offer)
        return offer

    first = next_offer(None)
    assert first["identity"] == IDS[0] and "changed_words" not in first  # a first load: no base
    assert http("POST", f"{node.url}/v1/engines/{eid}/ack", {"identity": IDS[0], "pause_ms": 0.1})[0] == 200
    assert hot_load(node.url, IDS[1], previous=IDS[0])["accepted"] is True
    offer = next_offer(IDS[0])
    assert offer["identity"] == IDS[1]
    cw = offer["changed_words"]
    assert cw["codec"] == "bdn_planes_v1" and cw["base"] == IDS[0]
    assert set(cw["files"]) == {"model.safetensors"}
    before = {p: xxhash.xxh3_128_hexdigest(Path(p).read_bytes()) for p in cw["files"].values()}
    for p in cw["files"].values():  # each is a diff file of the target's header
        _, streams = arc.read_diff_header(Path(p).read_bytes(), Path(p).stat().st_size)
        assert set(streams) == set(read_header(Path(offer["path"]) / "model.safetensors").tensors)
    # a later target becomes ready and GC runs (keep_ready 1, gc_grace_s 0) while the offer is out
    assert hot_load(node.url, IDS[2])["accepted"] is True
    node.wait_ready(IDS[2])
    assert http("POST", node.url + "/v1/gc", {})[0] == 200
    assert {p: xxhash.xxh3_128_hexdigest(Path(p).read_bytes()) for p in cw["files"].values()} == before


def _corrupted(files: dict[str, str], tmp_path: Path) -> dict[str, str]:
    """Copies of ``files`` (diff files) with the second half of the largest stream's payload
    flipped, headers intact: a plan accepts them, the apply fails."""
    bad = {}
    for rel, path in files.items():
        data = bytearray(Path(path).read_bytes())
        _, streams = arc.read_diff_header(bytes(data), len(data))
        big = max(streams.values(), key=lambda s: s.frame_end - s.frame_start)
        for at in range(big.frame_start + (big.frame_end - big.frame_start) // 2, big.frame_end):
            data[at] ^= 0x5A
        bad[rel] = str(tmp_path / rel.replace("/", "_"))
        Path(bad[rel]).write_bytes(bytes(data))
    return bad


def test_pingpong_a_corrupted_diff_stages_forgets_the_spare_and_the_chain_stays_correct(
    trainer, node, tmp_path, caplog
) -> None:
    """Ping-pong swaps on offers built from the daemon's files: a corrupted diff mid-chain fails on
    the spare buffers (one warning line), the step is staged, the spare buffers are forgotten and
    the next delta copies them again; a laggard's offer (another base) stages too. The weights
    are the trainer's after every step."""
    states = trainer["states"]
    for ident in IDS:  # each leased once ready: keep_ready 1 would collect the older ones
        node.prefetch(ident)
        node.wait_ready(ident)
        assert http("POST", f"{node.url}/v1/snapshots/{ident}/leases", {"holder": "test"})[0] in (200, 201)
    root = Path(node.wait_ready(IDS[0])["path"]).parent
    snaps = [open_snapshot(root / i) for i in IDS]
    engine = HFEngine(words="pingpong")
    engine.kernel = hf_words.KernelWarmup(start=False)  # the numpy path (the service test runs the kernel's)
    pp = engine.pingpong

    def step(i: int, offer: dict[str, Any]) -> dict[str, Any]:
        rep = engine.swap(engine.prepare(snaps[i], offer, HotLoadOptions()))
        assert engine.weights_digest() == digests(states[i]), f"{IDS[i]}: parameters differ from the trainer's"
        return rep

    try:
        step(0, {})
        for i in (1, 2):
            rep = step(i, _offer(IDS[i - 1], _diff_files(node, IDS[i])))
            assert rep["changed_source"] == "words-pingpong" and rep["swap_method"] == "rebind", rep
        assert rep["pingpong"]["copied"] == 0 and rep["pingpong"]["background"] > 0, rep["pingpong"]
        pp.wait()
        assert pp.holds == IDS[2] and pp.bufs
        # step 3's diff corrupted: the spare buffers fail their check, the step stages
        with caplog.at_level(logging.INFO, logger="bdn.engines.hf"):
            rep = step(3, _offer(IDS[2], _corrupted(_diff_files(node, IDS[3]), tmp_path)))
        lines = [r.getMessage() for r in caplog.records if "ping-pong swap not used" in r.getMessage()]
        assert len(lines) == 1 and len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
        assert rep["changed_source"] == "compared" and rep["pingpong"] is None, rep
        assert rep["words_fallback"].startswith("applying the words to the spare buffers failed"), rep
        assert pp.holds is None and not pp.bufs  # forgotten
        # the next delta copies the spare buffers again, then the chain goes on word-level
        rep = step(4, _offer(IDS[3], _diff_files(node, IDS[4])))
        assert rep["changed_source"] == "words-pingpong" and rep["pingpong"]["copied"] > 0, rep
        rep = step(5, _offer(IDS[4], _diff_files(node, IDS[5])))
        assert rep["changed_source"] == "words-pingpong" and rep["pingpong"]["copied"] == 0, rep
        # a laggard's offer (diffs on a base the engine does not serve): staged, the spare forgotten
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="bdn.engines.hf"):
            rep = step(6, _offer(IDS[4], _diff_files(node, IDS[6])))
        assert rep["changed_source"] == "compared" and "this engine serves 'step000006'" in rep["words_fallback"]
        assert [r.getMessage() for r in caplog.records if "word-level swap not used" in r.getMessage()]
        assert pp.holds is None and not pp.bufs
    finally:
        for s in snaps:
            s.close()
