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

    {"snapshot_dir": "/dev/shm/bdn/<swarm>/step000003", "names": ["model.layers.0.self_attn.q_proj.weight"],
     "ranges": {"model.layers.0.self_attn.q_proj.weight": [[0, 4096], [1052672, 1060864]]}}

``ranges`` (optional) gives, per changed tensor, the byte ranges ``[start, end)`` counted from the
tensor's first byte outside which its bytes are those the engine serves (the offer's
``changed_ranges``, made relative by ``bdn.engines.changed``); a tensor without an entry is read
whole. Only the in-place path uses them (a rebuilt module needs its tensors whole).
``"inplace": false`` (optional, default true) rebuilds every module, for comparison.

How it loads (vLLM 0.32). Two ways, chosen per vLLM module:

**In place** (only the changed bytes are read): when the module's parameter holds the checkpoint's
values as they are (unquantized, one worker: ``tensor_parallel_size`` 1, a model whose
``load_weights`` copies checkpoint tensors into parameter rows unchanged: Llama, Mistral, Qwen2,
Qwen3), a changed checkpoint tensor is a run of rows of that parameter: the whole parameter for
``o_proj``, a norm or the embedding (whose vocabulary vLLM pads: extra rows), and for a stacked one
the shard's rows (``q`` of ``qkv_proj`` at ``QKVParallelLinear._get_shard_offset_mapping("q")``,
``up`` of ``gate_up_proj`` after ``output_sizes[0]`` rows; the shard id from the model's
``hf_to_vllm_mapper``, as its ``load_weights`` maps names). The extension ``os.preadv``'s the
changed byte ranges (the request's ``ranges``, else the whole tensor) from the snapshot straight
into those bytes of the parameter, then runs the module's ``quant_method.process_weights_after_
loading`` again, as vLLM does after any load (on CPU that repacks the module's weight for oneDNN
from the parameter; on a GPU it does nothing for unquantized weights). A sibling that did not
change (``k_proj`` when only ``q_proj`` did) is neither read nor touched.

On CPU vLLM empties a linear layer's parameter once it has repacked it
(``dispatch_cpu_unquantized_gemm(layer, remove_weight=True)`` in ``layers/utils.py``), so there
is nothing to write a slice into: start vLLM with ``BDN_VLLM_KEEP_UNPACKED=1`` and this module,
imported by vLLM's worker before it loads the model, makes that call keep the weight
(``remove_weight=False``, what vLLM already does for embeddings): linear weights then take their
bytes twice in RAM (the checkpoint layout and oneDNN's), the price of in-place loads on CPU.

**Rebuilt** (every other module: a repacked weight without ``BDN_VLLM_KEEP_UNPACKED``, quantized,
tensor parallel, another architecture; vLLM's own ``reload_weights`` does this for every module,
``vllm/model_executor/model_loader/reload/layerwise.py``): the module is rebuilt from checkpoint
tensors and processed again, so its *closure*, every checkpoint tensor of it, is read (q, k and v
of a layer whose q changed: ``bytes_read`` >= the changed bytes):

1. each changed checkpoint name is mapped to its module (``a.b.q_proj.weight`` ->
   ``a.b.qkv_proj`` through the model's ``packed_modules_mapping``);
2. only those modules are set up for a layerwise reload; the closure's tensors are read from the
   snapshot's safetensors files (``os.preadv`` of each tensor's byte range into a torch buffer:
   exactly the tensor's bytes) and given to ``model.load_weights`` (the model's own name mapping);
3. a module that did not receive every element of the checkpoint tensors given for it is put
   back as it was and the call fails (the adapter then reloads fully): a partial module never
   serves. (A module may hold more elements than its checkpoint tensors: a vocabulary padded to a
   multiple of 64; vLLM's own reload processes such a module once loading ends, and so does this.)

The first module of a call that has to be rebuilt is named in one log line of vLLM's log with the
reason (``fallback`` in the answer). A read that fails half-way through an in-place write raises
``RuntimeError``: the adapter then reloads fully in the same pause.

Returns (per worker) ``{"ok": true, "tensors_changed", "tensors_read", "bytes_read",
"bytes_changed", "modules", "inplace_tensors", "rebuilt_modules", "fallback", "read_ms",
"load_ms"}`` (``read_ms``: reading, in place or into buffers; ``load_ms``: repacking in-place
modules and rebuilding the others). Raises ``ValueError`` (one line) for a bad request (not JSON,
unknown tensor, a range outside its tensor, a tensor in two files, a header entry that breaks the
format, a module to rebuild that the model lacks, a dtype it does not read, a tied embedding
changed), all found before any parameter is written, and
``RuntimeError`` for a load that left a module incomplete or an in-place read that failed; vLLM
answers the route with 500.

Format: safetensors (https://github.com/huggingface/safetensors, "Format": 8-byte little-endian
header length, JSON header with ``dtype``, ``shape``, ``data_offsets`` relative to the data).
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

from bdn.engines.dtypes import ITEMSIZE as _ITEMSIZE
from bdn.engines.dtypes import TORCH_DTYPES as _DTYPES
from bdn.engines.preads import pread_spans

__all__ = [
    "BdnWorkerExtension",
    "INPLACE_ARCHS",
    "KEEP_UNPACKED_ENV",
    "check_ranges",
    "check_rebuild",
    "closure",
    "keep_unpacked_weights",
    "module_key",
    "parse_request",
    "read_headers",
]

log = logging.getLogger("vllm.bdn_worker")  # under vLLM's logger: its handler writes vLLM's log

KEEP_UNPACKED_ENV = "BDN_VLLM_KEEP_UNPACKED"
# Models whose load_weights copies a checkpoint tensor into its parameter's rows unchanged (read in
# vllm/model_executor/models/llama.py, qwen2.py, qwen3.py: AutoWeightsLoader / stacked_params_mapping).
INPLACE_ARCHS = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"})
MAX_NAMES = 1_000_000
MAX_RANGES = 1_000_000
MAX_HEADER = 100 << 20


def parse_request(raw: Any) -> tuple[Path, list[str], dict[str, list[tuple[int, int]]], bool]:
    """``(snapshot_dir, names, ranges, inplace)`` of a request (a JSON string or a dict, see the module doc).

    ``ranges`` is ``{name: [(start, end), ...]}`` (bytes from the tensor's first byte), empty when
    the request has none; their bounds are checked against the files by :func:`check_ranges`.
    Raises ValueError (one line) when it is not JSON, lacks a field, names no directory, has more
    than ``MAX_NAMES`` names or ``MAX_RANGES`` ranges, or a range is not two integers for a named
    tensor, sorted and apart; TypeError when it is not a JSON object.
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
    raw_ranges = raw.get("ranges")
    raw_ranges = {} if raw_ranges is None else raw_ranges
    if not isinstance(raw_ranges, dict):
        raise ValueError("bdn_load_tensors: ranges must map tensor names to lists of [start, end]")
    wanted, ranges, count = set(names), {}, 0
    for name, spans in raw_ranges.items():
        if name not in wanted or not isinstance(spans, list):
            raise ValueError(f"bdn_load_tensors: ranges of {str(name)[:80]!r}: not a changed tensor's list")
        count += len(spans)
        if count > MAX_RANGES:
            raise ValueError(f"bdn_load_tensors: more than {MAX_RANGES} ranges")
        out: list[tuple[int, int]] = []
        for span in spans:
            if (
                not isinstance(span, list)
                or len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            ):
                raise ValueError(f"bdn_load_tensors: ranges of {name[:80]!r}: {str(span)[:40]} is not [start, end]")
            start, end = span
            if start < (out[-1][1] if out else 0) or end <= start:
                raise ValueError(
                    f"bdn_load_tensors: ranges of {name[:80]!r}: [{start}, {end}) is empty, unsorted or overlapping"
                )
            out.append((start, end))
        ranges[name] = out
    inplace = raw.get("inplace", True)
    if not isinstance(inplace, bool):
        raise ValueError("bdn_load_tensors: inplace must be true or false")
    return Path(d), names, ranges, inplace


def check_ranges(ranges: dict[str, list[tuple[int, int]]], sizes: dict[str, int]) -> None:
    """Raise ValueError (one line) when a range of ``ranges`` ends after its tensor's ``sizes[name]`` bytes."""
    for name, spans in ranges.items():
        if spans and spans[-1][1] > sizes[name]:
            raise ValueError(
                f"bdn_load_tensors: ranges of {name[:80]!r} end at byte {spans[-1][1]}, "
                f"after the tensor's {sizes[name]}"
            )


def read_headers(snapshot_dir: Path) -> dict[str, tuple[Path, str, list[int], int, int]]:
    """``{tensor name: (file, dtype, shape, absolute start, absolute end)}`` over the directory's
    ``*.safetensors`` files (headers only). Every entry is held to the format before anything is
    read or written with it: ``0 <= begin <= end`` inside the file, and, for a dtype of
    :data:`_ITEMSIZE`, ``end - begin`` = the shape's elements times the dtype's size (else an
    in-place write of the tensor would run into the parameter rows after it, another tensor's).
    Raises ValueError (one line) for a malformed header or entry, or a name in two files."""
    out: dict[str, tuple[Path, str, list[int], int, int]] = {}
    for f in sorted(snapshot_dir.glob("*.safetensors")):
        with open(f, "rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            head = fh.read(8)
            if len(head) != 8:
                raise ValueError(f"{f.name}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise ValueError(f"{f.name}: header of {n} bytes in a file of {size}")
            try:
                header = json.loads(fh.read(n))
            except ValueError as exc:
                raise ValueError(f"{f.name}: header is not JSON: {exc}") from None
        if not isinstance(header, dict):
            raise ValueError(f"{f.name}: header is not a JSON object")
        base = 8 + n
        for name, e in header.items():
            if name == "__metadata__":
                continue
            if name in out:
                raise ValueError(f"tensor {name[:80]!r} is in {out[name][0].name} and {f.name}")
            out[name] = (f, *_entry(f.name, name, e, base, size))
    return out


def _entry(fname: str, name: str, e: Any, base: int, size: int) -> tuple[str, list[int], int, int]:
    """``(dtype, shape, absolute start, absolute end)`` of one header entry (see :func:`read_headers`)."""
    try:
        dtype, shape, offsets = e["dtype"], e["shape"], e["data_offsets"]
    except (KeyError, TypeError):
        raise ValueError(f"{fname}: bad header entry for {name[:80]!r}") from None
    ints = [*shape, *offsets] if isinstance(shape, list) and isinstance(offsets, list) else None
    if (
        not isinstance(dtype, str)
        or ints is None
        or len(offsets) != 2
        or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in ints)
    ):
        raise ValueError(f"{fname}: bad header entry for {name[:80]!r}")
    start, end = offsets
    if start > end or base + end > size:
        raise ValueError(f"{fname}: tensor {name[:80]!r} at [{start}, {end}) of a data area of {size - base} bytes")
    item = _ITEMSIZE.get(dtype)
    if item is not None and end - start != math.prod(shape) * item:
        raise ValueError(
            f"{fname}: tensor {name[:80]!r} is {end - start} bytes, its shape {shape} of {dtype} needs "
            f"{math.prod(shape) * item}"
        )
    return dtype, list(shape), base + start, base + end


def check_rebuild(
    model: Any, infos: dict[str, tuple[Path, str, list[int], int, int]], mods: list[str], read: list[str]
) -> None:
    """Raise ValueError (one line) unless every module of ``mods`` is in ``model`` (a
    ``torch.nn.Module``) and every tensor of ``read`` has a dtype the extension reads: checked
    before the in-place writes, so that a request failing there leaves every parameter as it was."""
    import torch

    for key in mods:
        try:
            model.get_submodule(key)
        except AttributeError:
            raise ValueError(f"bdn_load_tensors: no module {key[:80]!r} in the served model") from None
    for n in read:
        f, dtype = infos[n][0], infos[n][1]
        if getattr(torch, _DTYPES.get(dtype, ""), None) is None:
            raise ValueError(f"bdn_load_tensors: {f.name}: tensor {n[:80]!r} has dtype {dtype}, not one read here")


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
    try:
        _pread_into(path, start, view, [(0, end - start)])
    finally:
        view.release()
    return buf.view(tdt).reshape(shape)


def _pread_into(path: Path, offset: int, view: memoryview, spans: list[tuple[int, int]]) -> int:
    """``view[start:end]`` = ``path``'s bytes from ``offset + start`` for each span; the bytes read
    (:func:`bdn.engines.preads.pread_spans`; a short file raises ValueError)."""
    return pread_spans(path, offset, view, spans)


def keep_unpacked_weights() -> None:
    """Make vLLM's CPU backend keep each linear layer's weight in the checkpoint layout after it
    repacks it (``dispatch_cpu_unquantized_gemm(layer, remove_weight=False)``), so that a changed
    tensor can be written into its rows (see the module doc). Called at import when the vLLM
    process has ``BDN_VLLM_KEEP_UNPACKED=1``; must run before vLLM loads the model."""
    from vllm.model_executor.layers import utils  # type: ignore[import-not-found]  # vLLM lives in the engine's venv, not where bdn is type-checked

    orig = utils.dispatch_cpu_unquantized_gemm
    if getattr(orig, "_bdn_keeps_weight", False):
        return

    def dispatch_keeping_weight(layer: Any, remove_weight: bool) -> None:
        orig(layer, remove_weight=False)

    dispatch_keeping_weight._bdn_keeps_weight = True  # type: ignore[attr-defined]  # a marker attribute on our own function
    utils.dispatch_cpu_unquantized_gemm = dispatch_keeping_weight  # linear.py imports it at each call
    log.info("bdn: vLLM keeps linear weights unpacked (%s=1): changed tensors are written in place", KEEP_UNPACKED_ENV)


if os.environ.get(KEEP_UNPACKED_ENV) == "1":
    keep_unpacked_weights()


def _inplace_target(
    model: Any, name: str, shape: list[int], dtype: str, packed: dict[str, list[str]], tp: int
) -> tuple[Any, Any, int] | str:
    """``(layer, parameter, byte offset of the tensor's first byte in it)`` when checkpoint tensor
    ``name`` is a run of rows of a parameter that holds the checkpoint's values (see the module
    doc); otherwise why not (one phrase)."""
    import torch

    if tp != 1:
        return "tensor parallel"
    if type(model).__name__ not in INPLACE_ARCHS:
        return f"{type(model).__name__} not known to copy tensors unchanged"
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None and hasattr(mapper, "_map_name_with_shard"):
        res = mapper._map_name_with_shard(name)  # what the model's load_weights does with the name
        if res is None:
            return "the model ignores it"
        mapped, shard = res
        mod_name, _, pname = mapped.rpartition(".")
    else:  # the packed mapping's order is the shard order (q, k, v; gate, up)
        mod_name, pname, shard = module_key(name, packed), name.rpartition(".")[2], None
        leaf = name.rpartition(".")[0].rpartition(".")[2]
        for parts in packed.values():
            if leaf in parts:
                shard = "qkv"[parts.index(leaf)] if parts == ["q_proj", "k_proj", "v_proj"] else parts.index(leaf)
    try:
        layer = model.get_submodule(mod_name)
    except AttributeError:
        return f"no module {mod_name}"
    param = getattr(layer, pname, None)
    qm = getattr(layer, "quant_method", None)
    if qm is not None and type(qm).__name__ not in ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod"):
        return f"quantized ({type(qm).__name__})"
    if not isinstance(param, torch.Tensor) or param.is_meta or param.numel() == 0:
        return f"weight repacked (start vLLM with {KEEP_UNPACKED_ENV}=1)"
    tdt = getattr(torch, _DTYPES.get(dtype, ""), None)
    if param.dtype != tdt or not param.is_contiguous() or param.dim() != len(shape) or param.dim() == 0:
        return "parameter's dtype or layout differs"
    row0, rows = 0, shape[0]
    if shard is not None:
        if isinstance(shard, str) and hasattr(layer, "_get_shard_offset_mapping"):
            row0, size = layer._get_shard_offset_mapping(shard), layer._get_shard_size_mapping(shard)
        elif isinstance(shard, int) and isinstance(getattr(layer, "output_sizes", None), list):
            row0, size = sum(layer.output_sizes[:shard]), layer.output_sizes[shard]
        else:
            return f"shard {shard!r} of {type(layer).__name__}"
        if row0 is None or size != rows:
            return f"shard {shard!r} of {type(layer).__name__}"
    if list(param.shape[1:]) != list(shape[1:]) or row0 + rows > param.shape[0]:
        return "parameter's shape differs"
    return layer, param, row0 * param[0].numel() * param.element_size()


class BdnWorkerExtension:
    """Mixed into vLLM's worker (``--worker-extension-cls bdn.engines.vllm_worker.BdnWorkerExtension``)."""

    def bdn_ping(self) -> dict[str, Any]:
        """``{"ok": true, "extension": "bdn"}``: lets the adapter see that the extension is installed."""
        return {"ok": True, "extension": "bdn"}

    def bdn_load_tensors(self, request: Any) -> dict[str, Any]:
        """Load ``request``'s changed tensors from its snapshot directory (see the module doc)."""
        import torch
        from vllm.config import set_current_vllm_config  # type: ignore[import-not-found]  # vLLM lives in the engine's venv, not where bdn is type-checked

        t0 = time.perf_counter()
        snapshot_dir, names, ranges, inplace = parse_request(request)
        runner: Any = self.model_runner  # type: ignore[attr-defined]  # the worker's, once mixed in
        model = runner.get_model()
        vllm_config: Any = self.vllm_config  # type: ignore[attr-defined]  # the worker's, once mixed in
        packed = dict(getattr(model, "packed_modules_mapping", {}) or {})
        infos = read_headers(snapshot_dir)
        unknown = [n for n in names if n not in infos]
        if unknown:
            raise ValueError(
                f"bdn_load_tensors: {len(unknown)} name(s) not in {snapshot_dir}, e.g. {unknown[0][:80]!r}"
            )
        check_ranges(ranges, {n: infos[n][4] - infos[n][3] for n in ranges})
        hf = vllm_config.model_config.hf_config
        if getattr(hf, "tie_word_embeddings", False) and any("embed" in n or "lm_head" in n for n in names):
            raise ValueError("bdn_load_tensors: a tied embedding changed (reload fully)")
        tp = int(getattr(vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
        # Per module: in place when every changed tensor of it can be, else rebuilt.
        targets: dict[str, list[tuple[str, Any, Any, int]]] = {}
        rebuild: list[str] = []
        fallback = None
        by_module: dict[str, list[str]] = {}
        for n in names:
            by_module.setdefault(module_key(n, packed), []).append(n)
        for key, group in by_module.items():
            found = []
            for n in group:
                t = (
                    _inplace_target(model, n, infos[n][2], infos[n][1], packed, tp)
                    if inplace
                    else "in-place loads are off"
                )
                if isinstance(t, str):
                    if fallback is None:
                        fallback = f"{key}: {t}"
                        log.warning(
                            "bdn: module %s cannot take a slice (%s): rebuilt from all its checkpoint tensors", key, t
                        )
                    break
                found.append((n, *t))
            else:
                targets[key] = found
                continue
            rebuild.extend(group)
        mods, read = closure(rebuild, list(infos), packed)
        check_rebuild(model, infos, mods, read)  # a bad module or dtype fails before any write
        nbytes = 0
        with torch.no_grad():
            for found in targets.values():
                for n, _layer, param, off in found:
                    f, _dtype, _shape, start, end = infos[n]
                    spans = ranges.get(n, [(0, end - start)])
                    if param.device.type == "cpu":
                        view = memoryview(param.data.view(-1).view(torch.uint8).numpy())
                        try:
                            nbytes += _pread_into(f, start - off, view, [(a + off, b + off) for a, b in spans])
                        except ValueError as exc:
                            raise RuntimeError(f"bdn_load_tensors: {exc} (parameter half written)") from None
                        finally:
                            view.release()
                    else:
                        flat = param.data.view(-1).view(torch.uint8)
                        for a, b in spans:
                            buf = _pread_tensor(torch, f, "U8", [b - a], start + a, start + b)
                            flat[off + a : off + b].copy_(buf)
                            nbytes += b - a
        t1 = time.perf_counter()
        with set_current_vllm_config(vllm_config), torch.no_grad():
            for found in targets.values():
                layer = found[0][1]
                qm = getattr(layer, "quant_method", None)
                if qm is not None:
                    qm.process_weights_after_loading(layer)  # on CPU: repack from the parameter
        t2 = time.perf_counter()
        rebuilt_bytes, read_s = self._bdn_rebuild(model, vllm_config, infos, mods, read, packed) if mods else (0, 0.0)
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            fn = getattr(runner, reset, None)
            if callable(fn):
                fn()
        changed_bytes = sum(infos[n][4] - infos[n][3] for n in names)
        written = sum(len(v) for v in targets.values())
        return {
            "ok": True,
            "tensors_changed": len(names),
            "tensors_read": written + len(read),
            "bytes_read": nbytes + rebuilt_bytes,
            "bytes_changed": changed_bytes,
            "modules": len(targets) + len(mods),
            "inplace_tensors": written,
            "rebuilt_modules": len(mods),
            "fallback": fallback,
            "read_ms": round((t1 - t0 + read_s) * 1000.0, 3),
            "load_ms": round((time.perf_counter() - t1 - read_s) * 1000.0, 3),
            "repack_ms": round((t2 - t1) * 1000.0, 3),
        }

    def _bdn_rebuild(
        self,
        model: Any,
        vllm_config: Any,
        infos: dict[str, tuple[Path, str, list[int], int, int]],
        mods: list[str],
        read: list[str],
        packed: dict[str, list[str]],
    ) -> tuple[int, float]:
        """Rebuild ``mods`` from the checkpoint tensors ``read`` (see the module doc); ``(bytes read, seconds reading)``."""
        import torch
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import (  # type: ignore[import-not-found]  # vLLM lives in the engine's venv, not where bdn is type-checked
            _place_kernel_tensors,
            finalize_layerwise_reload,
            get_layerwise_info,
            initialize_online_processing,
        )
        from vllm.model_executor.model_loader.reload.meta import (  # type: ignore[import-not-found]  # vLLM lives in the engine's venv, not where bdn is type-checked
            restore_layer_on_meta,
        )
        from vllm.model_executor.model_loader.reload.utils import (  # type: ignore[import-not-found]  # vLLM lives in the engine's venv, not where bdn is type-checked
            get_layer_params_buffers,
        )

        t0 = time.perf_counter()
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
        read_s = time.perf_counter() - t0
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
                incomplete = [
                    key
                    for key, layer in layers
                    if get_layerwise_info(layer).can_load()
                    and get_layerwise_info(layer).load_numel * tp < want.get(key, 1)
                ]
                for key, layer in layers:
                    info = get_layerwise_info(layer)
                    if key in incomplete:
                        _place_kernel_tensors(layer, info)  # as it was: never serve a half-built module
                        info.reset()
                finalize_layerwise_reload(model, vllm_config.model_config)
        if incomplete:
            raise RuntimeError(
                f"bdn_load_tensors: module(s) {', '.join(incomplete[:3])} got only part of their weights"
            )
        return nbytes, read_s
