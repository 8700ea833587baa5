"""A vLLM worker extension that loads only the tensors a hot-load changed (runs inside vLLM).

Start vLLM with it and the adapter (bdn.engines.vllm) swaps partially::

    PYTHONPATH=/path/to/bdn-checkout VLLM_SERVER_DEV_MODE=1 python -m vllm.entrypoints.openai.api_server \\
        --model "$(bdnctl path current --wait)" --worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension ...

This module imports nothing but the standard library at import time (torch and vllm, which every
vLLM process has, inside the method), so vLLM's own venv needs only bdn's source on its path
(``PYTHONPATH`` naming a checkout, or ``pip install --no-deps bdn`` into vLLM's venv): none of
bdn's dependencies. vLLM mixes the class into its worker class
(``vllm/v1/worker/worker_base.py``, ``worker_extension_cls``), so ``self`` is the worker and
``self.model_runner`` its model runner.

``POST /collective_rpc {"method": "bdn_load_tensors", "kwargs": {"request": "<JSON>"}}`` calls
:meth:`BdnWorkerExtension.bdn_load_tensors` on every worker (``vllm/entrypoints/serve/dev/rpc``:
kwargs travel as strings, so the request is one JSON string). The request::

    {"snapshot_dir": "/dev/shm/bdn/<swarm>/step000003", "names": ["model.layers.0.self_attn.q_proj.weight"]}

How it loads (vLLM 0.32, ``vllm/model_executor/model_loader/reload/layerwise.py``): vLLM's kernels
do not use the checkpoint's tensors as they are: on CPU every linear layer's weight is repacked
(oneDNN / sgl-kernel) and the original parameter emptied; q/k/v and gate/up are stacked into one
parameter (``packed_modules_mapping``). So a changed tensor cannot be copied into a parameter;
its *module* has to be rebuilt from checkpoint-format tensors and processed again. vLLM's own
``reload_weights`` does that for every module of the model (restore each module on the meta
device, buffer its weights through wrapped weight loaders, and once a module has all of them:
materialize, load, ``process_weights_after_loading``, copy into the original storage). This
extension does the same for only the modules that hold a changed tensor:

1. each changed checkpoint name is mapped to its module (``a.b.q_proj.weight`` ->
   ``a.b.qkv_proj`` through the model's ``packed_modules_mapping``), and the module's *closure*
   is every checkpoint tensor of that module (q, k and v of a layer whose q changed): a module is
   rebuilt from all of its tensors, so those are read too (``bytes_read`` >= the changed bytes);
2. only those modules are set up for a layerwise reload; the closure's tensors are read from the
   snapshot's safetensors files (``os.preadv`` of each tensor's byte range into a torch buffer:
   exactly the tensor's bytes) and given to ``model.load_weights`` (the model's own name mapping);
3. a module that did not receive every element of the checkpoint tensors given for it is put
   back as it was and the call fails (the adapter then reloads fully): a partial module never
   serves. (A module may hold more elements than its checkpoint tensors: a vocabulary padded to a
   multiple of 64; vLLM's own reload processes such a module once loading ends, and so does this.)

Returns (per worker) ``{"ok": true, "tensors_changed", "tensors_read", "bytes_read",
"bytes_changed", "modules", "read_ms", "load_ms"}``. Raises ``ValueError`` (one line) for a bad
request (not JSON, unknown tensor, a tensor in two files, a tied embedding changed) and
``RuntimeError`` for a load that left a module incomplete; vLLM answers the route with 500.

Format: safetensors (https://github.com/huggingface/safetensors, "Format": 8-byte little-endian
header length, JSON header with ``dtype``, ``shape``, ``data_offsets`` relative to the data).
"""

from __future__ import annotations

import json
import os
import struct
import time
from pathlib import Path
from typing import Any

__all__ = ["BdnWorkerExtension", "closure", "module_key", "parse_request", "read_headers"]

MAX_NAMES = 1_000_000
MAX_HEADER = 100 << 20
PREAD_PIECE = 64 << 20
_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I64": "int64",
           "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
           "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def parse_request(raw: Any) -> tuple[Path, list[str]]:
    """``(snapshot_dir, names)`` of a request (a JSON string or a dict, see the module doc).

    Raises ValueError (one line) when it is not JSON, lacks a field, names no directory or has
    more than ``MAX_NAMES`` names; TypeError when it is not a JSON object.
    """
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except ValueError as exc:
            raise ValueError(f"bdn_load_tensors: request is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise TypeError("bdn_load_tensors: request must be a JSON object")
    d, names = raw.get("snapshot_dir"), raw.get("names")
    if not isinstance(d, str) or not Path(d).is_dir():
        raise ValueError(f"bdn_load_tensors: snapshot_dir {str(d)[:200]!r} is not a directory")
    if not isinstance(names, list) or len(names) > MAX_NAMES or not all(isinstance(n, str) for n in names):
        raise ValueError("bdn_load_tensors: names must be a list of tensor names")
    return Path(d), names


def read_headers(snapshot_dir: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """``{tensor name: (file, dtype, shape, absolute start, absolute end)}`` over the directory's
    ``*.safetensors`` files (headers only). Raises ValueError for a malformed header or a name
    in two files."""
    out: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for f in sorted(snapshot_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{f.name}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER:
                raise ValueError(f"{f.name}: header of {n} bytes")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise ValueError(f"{f.name}: header is not JSON: {exc}") from None
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise ValueError(f"tensor {name[:80]!r} is in {out[name][0].name} and {f.name}")
            try:
                start, end = (int(x) for x in e["data_offsets"])
                out[name] = (f, str(e["dtype"]), [int(x) for x in e["shape"]], base + start, base + end)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{f.name}: bad header entry for {name[:80]!r}") from None
    return out


def module_key(name: str, packed: dict[str, list[str]]) -> str:
    """The vLLM module a checkpoint tensor loads into: ``a.b.q_proj.weight`` -> ``a.b.qkv_proj``
    when ``packed`` (the model's ``packed_modules_mapping``) stacks ``q_proj`` into ``qkv_proj``;
    else the name without its last part."""
    mod = name.rpartition(".")[0]
    parent, _, leaf = mod.rpartition(".")
    for stacked, parts in packed.items():
        if leaf in parts:
            return f"{parent}.{stacked}" if parent else stacked
    return mod


def closure(changed: list[str], all_names: list[str], packed: dict[str, list[str]]) -> tuple[list[str], list[str]]:
    """``(modules, names to read)``: the modules holding a changed tensor, and every checkpoint
    tensor of those modules (in the checkpoint's order), since a module is rebuilt whole."""
    mods = sorted({module_key(n, packed) for n in changed})
    want = set(mods)
    return mods, [n for n in all_names if module_key(n, packed) in want]


def _pread_tensor(torch: Any, path: Path, dtype: str, shape: list[int], start: int, end: int) -> Any:
    tdt = getattr(torch, _DTYPES.get(dtype, ""), None)
    if tdt is None:
        raise ValueError(f"{path.name}: dtype {dtype} not supported")
    buf = torch.empty(end - start, dtype=torch.uint8)
    view = memoryview(buf.numpy())
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:done + PREAD_PIECE]], start + done)
            if got <= 0:
                raise ValueError(f"{path.name}: ends before byte {end}")
            done += got
    finally:
        os.close(fd)
        view.release()
    return buf.view(tdt).reshape(shape)


class BdnWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension``)."""

    def bdn_ping(self) -> dict[str, Any]:
        """``{"ok": true, "extension": "bdn"}``: lets the adapter see that the extension is installed."""
        return {"ok": True, "extension": "bdn"}

    def bdn_load_tensors(self, request: Any) -> dict[str, Any]:
        """Load ``request``'s changed tensors from its snapshot directory (see the module doc)."""
        import torch
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]
        from vllm.model_executor.model_loader.reload.layerwise import (  # type: ignore[import-not-found]
            _place_kernel_tensors,
            finalize_layerwise_reload,
            get_layerwise_info,
            initialize_online_processing,
        )
        from vllm.model_executor.model_loader.reload.meta import (  # type: ignore[import-not-found]
            restore_layer_on_meta,
        )
        from vllm.model_executor.model_loader.reload.utils import (  # type: ignore[import-not-found]
            get_layer_params_buffers,
        )

        t0 = time.perf_counter()
        snapshot_dir, names = parse_request(request)
        runner: Any = self.model_runner  # type: ignore[attr-defined]  # the worker's, once mixed in
        model = runner.get_model()
        vllm_config: Any = self.vllm_config  # type: ignore[attr-defined]
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        infos = read_headers(snapshot_dir)
        unknown = [n for n in names if n not in infos]
        if unknown:
            raise ValueError(f"bdn_load_tensors: {len(unknown)} name(s) not in {snapshot_dir}, e.g. {unknown[0][:80]!r}")
        hf = vllm_config.model_config.hf_config
        if getattr(hf, "tie_word_embeddings", False) and any("embed" in n or "lm_head" in n for n in names):
            raise ValueError("bdn_load_tensors: a tied embedding changed (reload fully)")
        mods, read = closure(names, list(infos), packed)
        layers = []
        for key in mods:
            try:
                layers.append((key, model.get_submodule(key)))
            except AttributeError:
                raise ValueError(f"bdn_load_tensors: no module {key!r} in the served model") from None
        tensors = []
        nbytes = 0
        want: dict[str, int] = {}  # module -> checkpoint elements it is given
        for n in read:
            f, dtype, shape, start, end = infos[n]
            t = _pread_tensor(torch, f, dtype, shape, start, end)
            tensors.append((n, t))
            nbytes += end - start
            key = module_key(n, packed)
            want[key] = want.get(key, 0) + t.numel()
        t1 = time.perf_counter()
        with set_current_vllm_config(vllm_config), torch.no_grad():
            for _key, layer in layers:
                info = get_layerwise_info(layer)
                info.kernel_tensors = get_layer_params_buffers(layer)
                info.kernel_non_persistent_buffers = set(layer._non_persistent_buffers_set)
                restore_layer_on_meta(layer, info)
                initialize_online_processing(layer)
            try:
                model.load_weights(iter(tensors))
            finally:
                # A module still waiting got fewer elements than its parameters hold. That is
                # padding (a vocab padded to a multiple of 64: vLLM's own reload then processes
                # it as it is) when it got every element of its checkpoint tensors (1/tp of them
                # per worker); anything less means a tensor missed it: put it back.
                tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
                incomplete = [key for key, layer in layers if get_layerwise_info(layer).can_load()
                              and get_layerwise_info(layer).load_numel * tp < want.get(key, 1)]
                for key, layer in layers:
                    info = get_layerwise_info(layer)
                    if key in incomplete:
                        _place_kernel_tensors(layer, info)  # as it was: never serve a half-built module
                        info.reset()
                finalize_layerwise_reload(model, vllm_config.model_config)
        if incomplete:
            raise RuntimeError(f"bdn_load_tensors: module(s) {', '.join(incomplete[:3])} got only part of their weights")
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if callable(fn):
                fn()
        changed_bytes = sum(infos[n][4] - infos[n][3] for n in names)
        return {"ok": True, "tensors_changed": len(names), "tensors_read": len(read), "bytes_read": nbytes,
                "bytes_changed": changed_bytes, "modules": len(mods),
                "read_ms": round((t1 - t0) * 1000.0, 3), "load_ms": round((time.perf_counter() - t1) * 1000.0, 3)}
