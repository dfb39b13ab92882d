"""The registry of ViT checkpoint sources: which layout a state dict is in, and its tensors in the canonical names.

A file's source is the one that recognises its names (`Source.recognises`,
told by the patch embedding's name), one with an `also_has` pattern chosen
over one without, so the order below is only that of the messages. Adding a
source: a module defining its `SOURCE` and a line here (contributing.md,
"Adding a checkpoint source").
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from detector.models.weights import (
    dinov3_release,
    timm_vit,
    transformers_dinov2,
    transformers_dinov3,
    transformers_vit,
)
from detector.models.weights.canonical import Source, rename_to_canonical

SOURCES: tuple[Source, ...] = (
    timm_vit.SOURCE,
    dinov3_release.SOURCE,
    transformers_dinov2.SOURCE,
    transformers_dinov3.SOURCE,
    transformers_vit.SOURCE,
)


def source_of(state_dict: Mapping[str, Any]) -> Source | None:
    """The source whose layout the state dict's names are in, or None when no source recognises them."""
    recognising = [source for source in SOURCES if source.recognises(state_dict.keys())]
    return min(recognising, key=lambda source: source.also_has is None, default=None)


def vit_layout(state_dict: Mapping[str, Any]) -> str | None:
    """The name of the state dict's source ('timm', 'transformers Dinov2', ...), else None."""
    source = source_of(state_dict)
    return source.name if source else None


def is_vit_state_dict(state_dict: Mapping[str, Any]) -> bool:
    """Whether a state dict (torch names) is a ViT's in one of the sources' layouts."""
    return source_of(state_dict) is not None


def patch_embedding_names() -> str:
    """'patch_embed.proj.weight, embeddings.patch_embeddings.projection.weight or ...': what tells a ViT file."""
    names = list(dict.fromkeys(source.patch_embedding for source in SOURCES))
    return f"{', '.join(names[:-1])} or {names[-1]}" if len(names) > 1 else names[0]


def source_checkpoints() -> str:
    """The files of every source, for the message when a file is in none of their layouts."""
    kinds = [source.checkpoints for source in SOURCES]
    return f"{', '.join(kinds[:-1])} or {kinds[-1]}" if len(kinds) > 1 else kinds[0]


def canonical_vit_state_dict(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Any source's ViT state dict -> the canonical names (`canonical`'s docstring), float32 numpy.

    Unchanged names pass through, so a canonical dict (the converter's output)
    maps onto itself; a state dict no source recognises is read as timm's.
    The source's ignored tensors are left out; see `rename_to_canonical` for
    what is merged and split.
    """
    return rename_to_canonical(state_dict, source_of(state_dict) or timm_vit.SOURCE)


def ignored_vit_keys(state_dict: Mapping[str, Any]) -> list[str]:
    """The names the converter always skips (those its source ignores), sorted."""
    source = source_of(state_dict) or timm_vit.SOURCE
    return sorted(name for name in state_dict if source.is_ignored(name))
