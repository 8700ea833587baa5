"""bdn-publish refuses a checkpoint whose ``*.safetensors`` file the safetensors library does not
open, before it uploads anything (new-user report: a truncated copy was published with exit 0,
then every daemon failed the snapshot with "the safetensors library refuses its header").
Real files, a real file:// bucket, the real command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from bdn.fileops import save
from bdn.publish import publish_delta, publish_full
from bdn.publish.errors import PublishError

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(d: Path, scale: float = 1.0) -> Path:
    d.mkdir(parents=True)
    save(d / "model.safetensors", {"w": np.arange(4096, dtype=np.float32) * scale, "b": np.ones(16, np.float16)})
    (d / "config.json").write_text('{"model_type": "toy"}')
    return d


def _truncate(path: Path, keep: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _publish_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "bdn.cli.publish", *args], env=env, text=True, capture_output=True, timeout=120
    )


def test_a_truncated_safetensors_file_is_refused_and_nothing_is_uploaded(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    _truncate(ckpt / "model.safetensors", 1000)
    bucket = tmp_path / "bucket"
    bucket.mkdir()
    r = _publish_cli(
        "full", "--dir", str(ckpt), "--bucket", f"file://{bucket}", "--identity", "step000001", "--policy-version", "1"
    )
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "bdn-publish: error: model.safetensors: the safetensors library refuses its header"
    ), r.stderr
    assert list(bucket.rglob("*")) == [], list(bucket.rglob("*"))


def test_a_delta_target_that_does_not_open_is_refused_before_the_base_is_read(tmp_path: Path) -> None:
    bucket = f"file://{tmp_path / 'bucket'}"
    base = _checkpoint(tmp_path / "base")
    publish_full(bucket, "step000001", 1, dir=base)
    target = _checkpoint(tmp_path / "target", 2.0)
    _truncate(target / "model.safetensors", 8 + 20)  # the header's length, then part of its JSON
    with pytest.raises(PublishError, match=r"model\.safetensors: the safetensors library refuses its header"):
        publish_delta(bucket, "step000002", 2, "step000001", dir=target, base_dir=base)
    assert not (tmp_path / "bucket" / "step000002").exists()


def test_a_whole_checkpoint_still_publishes(tmp_path: Path) -> None:
    ckpt = _checkpoint(tmp_path / "ckpt")
    m = publish_full(f"file://{tmp_path / 'bucket'}", "step000001", 1, dir=ckpt)
    assert {f.path for f in m.files} == {"config.json", "model.safetensors"}
