"""The transformers engine's staging reads (bdn.engines.hf_staging.stage_tensors) on real files.

A real safetensors checkpoint (the reference writer, bf16) is turned into a READY snapshot
directory as bdnd writes it and opened with ``bdn.client.open_snapshot``; the served parameters
are torch tensors holding the previous step's values. Staged tensors must hold the target's bytes
bit for bit whether read by one thread or several, whole or by the offer's changed ranges; a file
that ends early fails the prepare with one line.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from safetensors.torch import save_file  # noqa: E402

from bdn.client import open_snapshot  # noqa: E402
from bdn.engines import changed as changed_mod  # noqa: E402
from bdn.engines.hf_staging import WHOLE_READ_FRACTION, _run, _whole, stage_tensors  # noqa: E402
from bdn.engines.weights import SpareBuffers  # noqa: E402
from bdn.fileops import chunk_digests  # noqa: E402
from bdn.proto.errors import BdnError  # noqa: E402

CHUNK = 64 << 10
SHAPES = {f"layers.{i}.w": (64 + 16 * i, 128) for i in range(6)}


def make_ready(directory: Path, identity: str) -> Path:
    """READY (format bdn.ready/1) over every file of ``directory``, as bdnd writes it."""
    files = [
        {"path": p.relative_to(directory).as_posix(), "size": p.stat().st_size, "chunks": chunk_digests(p, CHUNK)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != "READY"
    ]
    ready = {
        "format": "bdn.ready/1",
        "identity": identity,
        "kind": "full",
        "policy_version": 2,
        "base_identity": None,
        "chunk_size": CHUNK,
        "files": files,
    }
    (directory / "READY").write_text(json.dumps(ready))
    return directory


@pytest.fixture
def step(tmp_path: Path):
    """(served params, target tensors, opened target snapshot): 1 % of each tensor's values changed,
    in one run of its bytes (the first tensor) or scattered (the others)."""
    g = torch.Generator().manual_seed(7)
    served = {k: torch.randn(s, generator=g).to(torch.bfloat16) for k, s in SHAPES.items()}
    target = {}
    for i, (k, v) in enumerate(served.items()):
        flat = v.clone().reshape(-1)
        n = max(1, flat.numel() // 100)
        idx = torch.arange(100, 100 + n) if i == 0 else torch.randperm(flat.numel(), generator=g)[:n]
        flat[idx] = flat[idx] + 1.0
        target[k] = flat.reshape(v.shape)
    d = tmp_path / "step2"
    d.mkdir()
    save_file(target, str(d / "model.safetensors"))
    snap = open_snapshot(make_ready(d, "step2"))
    yield served, target, snap
    snap.close()


def changed_ranges(a, b) -> list[tuple[int, int]]:
    """Byte ranges [start, end) of the tensor where ``a`` and ``b`` differ (merged runs)."""
    x, y = a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
    out: list[tuple[int, int]] = []
    for i in (x != y).nonzero().reshape(-1).tolist():
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def same_bytes(a, b) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_staged_tensors_hold_the_target_bit_for_bit(step, threads: int) -> None:
    served, target, snap = step
    names = list(SHAPES)
    got = stage_tensors(snap, names, served, "cpu", SpareBuffers(), threads=threads)
    assert not isinstance(got, str)
    staged, nbytes = got
    assert nbytes == sum(t.numel() * 2 for t in target.values())
    for k in names:
        assert same_bytes(staged[k], target[k]), k
        assert staged[k].data_ptr() != served[k].data_ptr()


def test_ranges_read_only_those_bytes_and_dense_ranges_read_whole(step) -> None:
    """The first tensor's ranges are a small run: only they are read, over a copy of the served
    bytes. Another tensor's offer names one range over most of it (as the daemon's 4 KiB pages do
    at 2 % scattered): it is read whole, one pass, and counted whole."""
    served, target, snap = step
    names = list(SHAPES)
    ranges = {k: changed_ranges(served[k], target[k]) for k in names}
    dense = names[1]
    first, last = ranges[dense][0][0], ranges[dense][-1][1]
    ranges[dense] = [(first, last)]  # every changed byte, and most unchanged ones
    assert WHOLE_READ_FRACTION * served[dense].numel() * 2 <= last - first < served[dense].numel() * 2
    got = stage_tensors(snap, names, served, "cpu", SpareBuffers(), ranges, threads=2)
    assert not isinstance(got, str)
    staged, nbytes = got
    for k in names:
        assert same_bytes(staged[k], target[k]), k
    whole = {k for k in names if sum(e - s for s, e in ranges[k]) >= WHOLE_READ_FRACTION * served[k].numel() * 2}
    assert whole == {dense}
    expect = sum(served[k].numel() * 2 if k in whole else sum(e - s for s, e in ranges[k]) for k in names)
    assert nbytes == expect
    assert nbytes < sum(t.numel() * 2 for t in target.values())


def test_a_file_that_ends_early_fails_with_one_line(step) -> None:
    served, _target, snap = step
    infos = changed_mod.tensor_infos(snap)
    last = max(infos, key=lambda k: infos[k].end)
    path = snap.path / "model.safetensors"
    with open(path, "r+b") as f:
        f.truncate(infos[last].end - 10)
    with pytest.raises(BdnError, match="end at byte") as e:
        stage_tensors(snap, list(SHAPES), served, "cpu", SpareBuffers(), threads=2)
    assert "\n" not in str(e.value)


def test_a_failed_read_is_raised_once_every_read_ended(tmp_path: Path) -> None:
    """One of several threaded reads fails (a file shorter than the tensor): the error (one line)
    is raised only after the other reads finished, so no thread still writes a staged buffer."""
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    full = tmp_path / "full.bin"
    full.write_bytes(bytes(range(256)) * 4096)
    bufs = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(6)]
    jobs = [(b.numel(), functools.partial(_whole, full, 0, b)) for b in bufs]
    jobs.insert(1, (200, functools.partial(_whole, short, 0, torch.zeros(200, dtype=torch.uint8))))
    with pytest.raises(BdnError, match="ends after 100 bytes") as e:
        _run(jobs, threads=2)
    assert "\n" not in str(e.value)
    assert all(torch.equal(b[:256], torch.arange(256, dtype=torch.uint8)) for b in bufs)
    assert all(b[-1].item() == 255 for b in bufs)


def test_a_tensor_of_another_shape_is_refused(step) -> None:
    served, _target, snap = step
    names = list(SHAPES)
    wrong = dict(served, **{names[-1]: torch.zeros(3, 3, dtype=torch.bfloat16)})
    got = stage_tensors(snap, names, wrong, "cpu", SpareBuffers(), threads=2)
    assert isinstance(got, str) and "changed dtype or shape" in got and names[-1] in got


def test_buffers_prefilled_after_a_load_are_what_the_first_prepare_stages_into(step) -> None:
    """After a model load nothing was freed: ``SpareBuffers.prefill`` makes one faulted buffer of
    each parameter's size on a thread, and the first prepare stages into those (same storage),
    bit for bit; a swap's ``keep`` replaces them."""
    served, target, snap = step
    spares = SpareBuffers()
    th = spares.prefill(list(served.values()))
    assert th is not None
    th.join()
    prefilled = {b.data_ptr() for bufs in spares._free.values() for b in bufs}
    assert len(prefilled) == len(served)
    got = stage_tensors(snap, list(SHAPES), served, "cpu", spares, threads=2)
    assert not isinstance(got, str)
    staged, _ = got
    for k in SHAPES:
        assert same_bytes(staged[k], target[k]), k
    assert {t.data_ptr() for t in staged.values()} == prefilled
    spares.keep([])
    assert SpareBuffers(enabled=False).prefill(list(served.values())) is None
