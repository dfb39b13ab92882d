"""Weights files: every tensor of a `.npz`, `.safetensors` or `.pth`/`.pt` file by name; this project's flat `.npz`.

A file holds either a torch state dict, torchvision's, timm's or
transformers' names with '.' between modules (`layer1.0.conv1.weight`,
`blocks.0.attn.qkv.weight`), converted when it is loaded, or this project's
layout, '/'-separated backbone parameter paths (`stem_conv/kernel`), as
`save_backbone_params` and, for ResNets, `python -m detector.convert_pretrained`
write it. `.pth`/`.pt` needs torch, `.safetensors` the safetensors package,
`.npz` nothing. Nothing is downloaded.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

import numpy as np
from flax import traverse_util

from detector.errors import WeightsFileError

SUFFIXES = (".npz", ".safetensors", ".pth", ".pt")
_SHOWN_NAMES = 5


def describe_names(names: Iterable[str]) -> str:
    """'a, b, c, d, e and 7 more': tensor names as the error messages list them, sorted, the first five shown."""
    names = sorted(names)
    shown = ", ".join(names[:_SHOWN_NAMES])
    return f"{shown} and {len(names) - _SHOWN_NAMES} more" if len(names) > _SHOWN_NAMES else shown


def _torch_tensors_as_numpy(path: str) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError:
        raise WeightsFileError(
            f"{path}: reading a PyTorch checkpoint needs torch (pip install torch), or "
            "convert it elsewhere to .npz or .safetensors"
        ) from None
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    # Training checkpoints wrap the weights: {"model": ...} or {"state_dict": ...}.
    for wrapper in ("state_dict", "model"):
        if isinstance(loaded, Mapping) and isinstance(loaded.get(wrapper), Mapping):
            loaded = loaded[wrapper]
    if not isinstance(loaded, Mapping) or not all(isinstance(v, torch.Tensor) for v in loaded.values()):
        raise WeightsFileError(f"{path}: not a state dict (a mapping of names to tensors)")
    return {
        name: (t.detach().float() if t.is_floating_point() else t.detach()).cpu().numpy() for name, t in loaded.items()
    }


def read_state_dict(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Every tensor in a weights file, by name, as host numpy arrays.

    Reads `.npz`, `.safetensors` (with the `safetensors` package) and
    `.pth`/`.pt` PyTorch state dicts (with `torch`, tensors only: no pickled
    code runs). Floating-point torch tensors come back as float32. A
    `module.` prefix on every name (DistributedDataParallel) is dropped.
    Raises FileNotFoundError for a missing file and WeightsFileError for an
    unknown suffix, a missing reader package or a damaged (e.g. truncated) file.
    """
    path = os.fspath(path)
    suffix = os.path.splitext(path)[1].lower()
    if suffix not in SUFFIXES:
        raise WeightsFileError(
            f"{path}: unknown weights file type {suffix or '(no suffix)'!r}; use one of {', '.join(SUFFIXES)}"
        )
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained weights file not found: {path}")
    try:
        tensors = _read_tensors(path, suffix)
    except WeightsFileError:
        raise
    except Exception as e:  # each reader has its own error types for a damaged file
        cause = " ".join(str(e).split()) or type(e).__name__
        raise WeightsFileError(
            f"{path}: cannot read it as {suffix} ({cause}); the file is damaged or truncated, copy or convert it again"
        ) from e
    if tensors and all(name.startswith("module.") for name in tensors):
        tensors = {name[len("module.") :]: value for name, value in tensors.items()}
    return tensors


def _read_tensors(path: str, suffix: str) -> dict[str, np.ndarray]:
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as npz:
            return {name: npz[name] for name in npz.files}
    if suffix == ".safetensors":
        try:
            from safetensors.numpy import load_file
        except ImportError:
            raise WeightsFileError(
                f"{path}: reading .safetensors needs the safetensors package "
                "(pip install safetensors, or pip install '.[pretrained]')"
            ) from None
        return load_file(path)
    return _torch_tensors_as_numpy(path)


def flatten_backbone_params(backbone_params) -> dict[str, np.ndarray]:
    """Nested params -> {'stage1_block1/Conv_0/kernel': array, ...}, the flat `.npz` layout."""
    return {path: np.asarray(value) for path, value in traverse_util.flatten_dict(backbone_params, sep="/").items()}


def save_backbone_params(backbone_params, path: str | os.PathLike) -> None:
    """Writes backbone params as a flat `.npz` that `load_backbone_params` reads."""
    np.savez(path, **flatten_backbone_params(backbone_params))


def has_torch_names(tensors: Mapping[str, object]) -> bool:
    """Whether a file's names are a torch state dict's ('module.param'), not this project's ('module/param')."""
    with_slash = sum("/" in name for name in tensors)
    if with_slash and with_slash != len(tensors):
        raise WeightsFileError(
            "the file mixes 'module/param' names (this project's layout) with "
            "'module.param' names (torchvision's or timm's); convert it again"
        )
    return not with_slash
