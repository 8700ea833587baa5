"""Which file each tensor of a sharded publish goes to, and tensors as numpy arrays.

The layout of a step must not depend on how its tensors were spread over the trainer's ranks
(a step from 4 ranks and from 1 rank must rebuild the same files), so a tensor's file is a pure
function of its name (:func:`layer_file` unless the caller gives another), and a file's bytes are
what :func:`bdn.fileops.save` writes for its tensors with ``__metadata__ {"format": "pt"}``
(the reference safetensors layout: ``bdn.proto.safetensors_fmt.serialize_header``).
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from bdn.proto.errors import PathError
from bdn.proto.identity import validate_relpath
from bdn.proto.manifest import MANIFEST_NAME
from bdn.proto.reserved import reserved_path
from bdn.publish.errors import PublishError

#: The Hugging Face index of a checkpoint sharded over several files (written by the commit).
INDEX_NAME = "model.safetensors.index.json"
#: The file of every tensor outside a numbered layer (embeddings, final norm, LM head).
REST_FILE = "model-rest.safetensors"

_LAYER = re.compile(r"^((?:[^.]+\.)*?(?:layers|layer|h|blocks|block)\.\d+)\.")


def layer_file(name: str) -> str:
    """The default ``file_of``: one file per numbered layer, the rest in ``model-rest.safetensors``.

    ``model.layers.12.mlp.up_proj.weight`` -> ``model.layers.12.safetensors`` (the name up to the
    first ``layers|layer|h|blocks|block`` segment followed by a number); any other name ->
    :data:`REST_FILE`. A rank must own whole layers (and the rest as a whole).
    """
    m = _LAYER.match(name)
    return f"{m.group(1)}.safetensors" if m else REST_FILE


def single_file(name: str) -> str:
    """A ``file_of`` putting every tensor in ``model.safetensors`` (one rank owns them all)."""
    return "model.safetensors"


def check_file_path(path: Any, tensor: str) -> str:
    """Return ``path`` if a ``file_of`` may give it; PublishError/PathError naming ``tensor`` if not."""
    if not isinstance(path, str) or not path.endswith(".safetensors"):
        raise PublishError(f"file_of({tensor!r}) gave {path!r}, not a relative path ending in .safetensors")
    validate_relpath(path)
    if path in (MANIFEST_NAME, INDEX_NAME) or reserved_path(path):
        raise PathError(f"file_of({tensor!r}) gave {path!r}, a name bdn writes itself")
    return path


def group(tensors: Mapping[str, np.ndarray], file_of: Callable[[str], str]) -> dict[str, dict[str, np.ndarray]]:
    """``{file path: {name: array}}``, files and names sorted."""
    out: dict[str, dict[str, np.ndarray]] = {}
    for name in sorted(tensors):
        out.setdefault(check_file_path(file_of(name), name), {})[name] = tensors[name]
    return dict(sorted(out.items()))


# torch dtypes numpy has no type for: viewed as same-size integers, then as the ml_dtypes type.
_TORCH_VIEWS = {
    "torch.bfloat16": ("int16", "bfloat16"),
    "torch.float8_e4m3fn": ("uint8", "float8_e4m3fn"),
    "torch.float8_e5m2": ("uint8", "float8_e5m2"),
}


def as_numpy(name: str, value: Any) -> np.ndarray:
    """A tensor as a C-contiguous numpy array: numpy as is, torch copied to host memory if needed.

    torch bf16/float8 become ml_dtypes arrays over the same bytes (no conversion). Raises
    PublishError naming the tensor for any other type.
    """
    if isinstance(value, np.ndarray):
        return np.ascontiguousarray(value)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        view = _TORCH_VIEWS.get(str(t.dtype))
        if view is None:
            return t.numpy()
        import ml_dtypes

        return t.view(getattr(torch, view[0])).numpy().view(getattr(ml_dtypes, view[1]))
    raise PublishError(f"tensor {name!r} is a {type(value).__name__}, not a numpy array or a torch tensor")
