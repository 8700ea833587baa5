"""safetensors dtype names (the format's header ``dtype`` strings, huggingface/safetensors) mapped
to torch: ``TORCH_DTYPES`` gives the name of the ``torch`` attribute, ``ITEMSIZE`` the bytes per
element. Standard library only: vLLM's worker extension imports it in vLLM's own venv."""

from __future__ import annotations

#: safetensors dtype name -> ``torch`` dtype attribute name (``getattr(torch, ...)``).
TORCH_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
}

#: safetensors dtype name -> bytes per element.
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
ITEMSIZE |= {"F8_E4M3": 1, "F8_E5M2": 1}

__all__ = ["ITEMSIZE", "TORCH_DTYPES"]
