"""The canonical ViT names every checkpoint source is renamed to, and `Source`, what a source declares.

The canonical names are timm's `VisionTransformer` names, extended (D =
width, h = MLP hidden units, R = register tokens, G = the position grid's
side, p = patch side):

  patch_embed.proj.{weight [D, 3, p, p], bias [D]}
  pos_embed [1, G*G, D]; class_pos_embed [1, 1, D] (the class token's entry, split off pos_embed)
  cls_token [1, 1, D]; reg_token [1, R, D]; rope.periods [head width / 4] (RoPE's, DINOv3's)
  blocks.i.norm{1,2}.{weight,bias}; blocks.i.ls{1,2}.gamma (LayerScale)
  blocks.i.attn.qkv.{weight [3D, D], bias [3D]} or attn.q_bias, attn.v_bias [D] (no k bias)
  blocks.i.attn.proj.{weight [D, D], bias}
  blocks.i.mlp.fc1.{weight [h, D], bias} (GELU) or mlp.fc1_g, mlp.fc1_x (SwiGLU: gate, value)
  blocks.i.mlp.norm.{weight,bias} [h] (EVA-02's norm over the hidden units)
  blocks.i.mlp.fc2.{weight [D, h], bias}; norm.{weight,bias} (the final norm)

A source's renames may also produce these intermediate forms, which
`rename_to_canonical` resolves after renaming: blocks.i.attn.{q,k,v}.{weight,bias}
(separate projections: concatenated into attn.qkv, the biases into
attn.qkv.bias when all three exist, else kept as q_bias/v_bias),
blocks.i.mlp.fc1_packed.{weight,bias} ([2h, D], gate first: split into
fc1_g/fc1_x), blocks.i.mlp.fc1_up.* (fc1_x in a file with gates, else fc1)
and rope.inv_freq (1 / rope.periods). timm's packed SwiGLU, an fc1 twice as
wide as fc2's input, is split as fc1_packed is.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from detector.errors import WeightsFileError

PATCH_EMBEDDING = "patch_embed.proj.weight"
BLOCK_KEY = re.compile(r"^blocks\.(\d+)\.")
# The buffer of RoPE's periods; the model recomputes them, so they are checked, not loaded.
ROPE_PERIODS = "rope.periods"

Renames = tuple[tuple[str, str], ...]


@dataclasses.dataclass(frozen=True)
class Source:
    """A layout of ViT checkpoints: how its files are told apart and how their names become canonical ones.

    Each name of a file goes through `trunk_renames`, then `block_renames`:
    (regex, replacement) pairs applied with `re.sub` in order, so a rule sees
    what the ones before it made. A name no rule changes is taken as
    canonical already; one that is neither ends up in the converter's
    "unexpected" list.
    """

    name: str  # in messages: "a ViT ({name} layout)", the converter's "{name} ViT, depth ..."
    checkpoints: str  # the files that come in this layout, for the message when no source recognises a file
    patch_embedding: str  # the patch projection's weight: every file of this layout has it
    # A pattern (re.search) one of the file's names must match as well, to tell this layout from another
    # with the same patch embedding: a source with one is chosen over those without.
    also_has: str | None = None
    trunk_renames: Renames = ()
    block_renames: Renames = ()
    # What a checkpoint holds beyond a detection backbone (classifiers, mask tokens, decoders): dropped
    # whatever the config.
    ignored: tuple[str, ...] = ()
    ignored_prefixes: tuple[str, ...] = ()

    def recognises(self, names: Collection[str]) -> bool:
        """Whether a state dict with these tensor names is in this layout."""
        if self.patch_embedding not in names:
            return False
        return self.also_has is None or any(re.search(self.also_has, name) for name in names)

    def is_ignored(self, name: str) -> bool:
        return name in self.ignored or name.startswith(self.ignored_prefixes)

    def renamed(self, name: str) -> str:
        """The canonical name of one of the file's names (or an intermediate form; see the module docstring)."""
        for pattern, replacement in (*self.trunk_renames, *self.block_renames):
            name = re.sub(pattern, replacement, name)
        return name


def rename_to_canonical(state_dict: Mapping[str, Any], source: Source) -> dict[str, np.ndarray]:
    """A state dict in `source`'s layout -> the canonical names, float32 numpy, ignored tensors left out.

    Renamed (`Source.renamed`), then the intermediate forms resolved: q/k/v
    concatenated, packed fc1 split, `rope.inv_freq` inverted, and
    `pos_embed` `[1, 1 + G*G, D]` split into `pos_embed [1, G*G, D]` and
    `class_pos_embed [1, 1, D]`. Raises WeightsFileError when two of the
    file's tensors get the same name.
    """
    renamed = {name: source.renamed(name) for name in state_dict if not source.is_ignored(name)}
    # transformers' up_proj is the value half of a gated MLP, the whole fc1 of a GELU one.
    up = ".mlp.fc1_x." if any(".mlp.fc1_g." in canonical for canonical in renamed.values()) else ".mlp.fc1."
    tensors: dict[str, np.ndarray] = {}
    for name, canonical in renamed.items():
        canonical = canonical.replace(".mlp.fc1_up.", up)
        if canonical in tensors:
            raise WeightsFileError(f"two tensors of the file map to {canonical} (one is {name}); it mixes layouts")
        tensors[canonical] = np.asarray(state_dict[name], np.float32)
    if "rope.inv_freq" in tensors:
        tensors[ROPE_PERIODS] = 1.0 / tensors.pop("rope.inv_freq")
    if "pos_embed" in tensors:
        side, class_entry = timm_position_grid(tensors)
        if class_entry:
            tensors["class_pos_embed"] = tensors["pos_embed"][:, :1]
            tensors["pos_embed"] = tensors["pos_embed"][:, 1:]
    blocks = sorted({int(m[1]) for name in tensors if (m := BLOCK_KEY.match(name))})
    for i in blocks:
        _canonical_block(tensors, f"blocks.{i}.")
    return tensors


def _canonical_block(tensors: dict[str, np.ndarray], block: str) -> None:
    """Merges one block's q/k/v and splits its packed fc1 tensors, in place (see `rename_to_canonical`)."""
    weights = [f"{block}attn.{p}.weight" for p in "qkv"]
    if all(name in tensors for name in weights):
        tensors[f"{block}attn.qkv.weight"] = np.concatenate([tensors.pop(name) for name in weights])
    biases = {p: tensors.pop(f"{block}attn.{p}.bias", tensors.pop(f"{block}attn.{p}_bias", None)) for p in "qkv"}
    if all(b is not None for b in biases.values()):
        tensors[f"{block}attn.qkv.bias"] = np.concatenate(list(biases.values()))
    else:
        for p, bias in biases.items():
            if bias is not None:
                tensors[f"{block}attn.{p}_bias"] = bias
    packed = tensors.pop(f"{block}mlp.fc1_packed.weight", None)
    packed_bias = tensors.pop(f"{block}mlp.fc1_packed.bias", None)
    fc1, fc2 = tensors.get(f"{block}mlp.fc1.weight"), tensors.get(f"{block}mlp.fc2.weight")
    if packed is None and fc1 is not None and fc2 is not None and fc1.shape[0] == 2 * fc2.shape[-1] != fc2.shape[0]:
        # timm's SwiGLUPacked (DINOv2 ViT-g): fc1 twice as wide as fc2's input.
        packed, packed_bias = tensors.pop(f"{block}mlp.fc1.weight"), tensors.pop(f"{block}mlp.fc1.bias", None)
    if packed is not None:
        tensors[f"{block}mlp.fc1_g.weight"], tensors[f"{block}mlp.fc1_x.weight"] = np.split(packed, 2)
        if packed_bias is not None:
            tensors[f"{block}mlp.fc1_g.bias"], tensors[f"{block}mlp.fc1_x.bias"] = np.split(packed_bias, 2)


def timm_position_grid(state_dict: Mapping[str, Any]) -> tuple[int, bool]:
    """(G, class token) of timm's `pos_embed` `[1, (1 +) G*G, width]`: the grid's side and whether the class token's
    entry comes first."""
    shape = tuple(np.shape(state_dict["pos_embed"]))
    if len(shape) == 3 and shape[0] == 1:
        for class_token in (False, True):
            tokens = shape[1] - class_token
            if tokens > 0 and math.isqrt(tokens) ** 2 == tokens:
                return math.isqrt(tokens), class_token
    raise WeightsFileError(
        f"pos_embed has shape {shape}; timm's is [1, G*G, width] or [1, 1 + G*G, width] "
        "(class token first) for a G x G grid of patches"
    )
