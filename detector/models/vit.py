"""Plain ViT backbone for detection (ViTDet, Li et al. 2022); its simple feature pyramid is in `necks`.

The backbone is a non-hierarchical ViT: most blocks attend within
non-overlapping windows, every `global_attention_every`-th block attends
globally. Blocks of equal shape are stacked with `nn.scan`, so the compiled
program holds one block body however deep the model is.

One module covers the plain ViT (MAE, DeiT) and the foundation backbones
through options (see `ViT`): DINOv2 (patch 14, class token with its own
position, optional registers, LayerScale, SwiGLU for ViT-g), DINOv3 (patch
16, no absolute position but 2-D RoPE, registers, LayerScale, SwiGLU for
H+/7B, no or q/v-only qkv bias, LayerNorm eps 1e-5) and EVA-02 (patch 14,
absolute position plus 'cat' RoPE on a reference grid, q/v-only bias,
SwiGLU with a LayerNorm over the hidden units). `detector.models.weights` maps
their timm and transformers checkpoints onto it.

Logical axis names (mapped to mesh axes by `config.sharding.rules`):
  parameters  'embed' (model width of the matmul kernels: FSDP), 'heads' and
              'mlp' (tensor parallel), 'kv' (head width), 'norm' (vectors
              of model width), 'stages'/'layers' (scanned stacks);
  activations ('batch', 'height', 'width', 'act_embed') for the token grid,
              ('batch', None, 'act_embed') for the prefix (class, register) tokens,
              ('batch', 'tokens', 'act_heads', 'kv') inside attention and
              ('batch', 'tokens', 'act_mlp') inside the MLP.
With heads and mlp on `model`, each block is the Megatron layout: the qkv and
fc1 kernels are split by output, the out-projection and fc2 kernels by input,
so the forward pass of a block needs exactly two all-reduces, LoRA adapters
included (the adapters of the out-projection and fc2 contract the split axis
too, but XLA sums their partial products into the kernels' before the one
all-reduce; tests/integration/test_model_parallel.py counts them).
`mlp_norm` adds reductions over `model`: the mean and variance over the
sharded hidden units, two more all-reduces of one value per token.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from detector.errors import ConfigError
from detector.models.layers import conv, rematerialized
from detector.models.transformer import HEAD_AXES, Mlp, Projection, attention, layer_norm

TOKEN_GRID_AXES = ("batch", "height", "width", "act_embed")
PREFIX_AXES = ("batch", None, "act_embed")
PATCH_SIZES = (14, 16)
ROPES = ("", "dinov3", "eva02")
MLPS = ("gelu", "swiglu")
QKV_BIASES = ("all", "qv", "none")
# The stride of the map the simple feature pyramid and DINO read as level 4.
FEATURE_STRIDE = 16


def _window_partition(x: jax.Array, window: int) -> tuple[jax.Array, tuple[int, int]]:
    """`[B, H, W, C]` -> `[B * nH * nW, window, window, C]`, zero-padding H and W up to multiples."""
    b, h, w, c = x.shape
    pad_h, pad_w = -h % window, -w % window
    x = jnp.pad(x, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)))
    hp, wp = h + pad_h, w + pad_w
    x = x.reshape(b, hp // window, window, wp // window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window, window, c), (hp, wp)


def _window_unpartition(windows: jax.Array, window: int, padded_hw: tuple[int, int], hw: tuple[int, int]) -> jax.Array:
    """Inverse of `_window_partition`, cropping the padding."""
    hp, wp = padded_hw
    c = windows.shape[-1]
    x = windows.reshape(-1, hp // window, wp // window, window, window, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, hp, wp, c)[:, : hw[0], : hw[1], :]


def rope_angles(
    kind: str, grid: tuple[int, int], head_dim: int, temperature: float, reference_grid: int = 0
) -> np.ndarray:
    """Rotation angles in radians of a `grid` of patch tokens: `[h * w, head_dim // 2]` float32, tokens row by row.

    Channel pair j of a head turns by `position[axis] * temperature ** -(i / n)`
    with n = head_dim // 4 frequencies, axis = j // n (0: row, 1: column) and
    i = j % n. The position is, for 'dinov3' (timm's RotaryEmbeddingDinoV3,
    transformers' DINOv3ViTRopePositionEmbedding), 2 pi times the patch
    centre normalised to [-1, 1] along each axis separately; for 'eva02'
    (timm's RotaryEmbeddingCat, index grid) the patch index, rescaled to a
    `reference_grid`-long axis when that is not 0 (EVA's `ref_feat_shape`).
    Computed in float64 on the host from static shapes: no parameters.
    """
    if kind not in ROPES[1:]:
        raise ConfigError(f"model.backbone.rope={kind!r}; use one of {', '.join(repr(r) for r in ROPES)}")
    bands = head_dim // 4
    inverse_periods = float(temperature) ** (-np.arange(bands, dtype=np.float64) / bands)
    if kind == "dinov3":
        coords = [2.0 * math.pi * (2.0 * (np.arange(s, dtype=np.float64) + 0.5) / s - 1.0) for s in grid]
    else:
        coords = [np.arange(s, dtype=np.float64) * (reference_grid / s if reference_grid else 1.0) for s in grid]
    rows, cols = np.meshgrid(*coords, indexing="ij")
    angles = np.concatenate([rows.reshape(-1, 1) * inverse_periods, cols.reshape(-1, 1) * inverse_periods], axis=1)
    return angles.astype(np.float32)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """RoPE on `x [..., head_dim]` with `cos`, `sin` `[..., head_dim // 2]` (broadcast against x's leading dims).

    Pairs (j, j + head_dim/2) turn together (timm's rotate_half=True, DINOv3),
    or (2j, 2j + 1) when `interleaved` (EVA's 'cat' layout).
    """
    if interleaved:
        pairs = x.reshape(*x.shape[:-1], -1, 2)
        first, second = pairs[..., 0], pairs[..., 1]
    else:
        first, second = jnp.split(x, 2, axis=-1)
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    turned = (first * cos - second * sin, second * cos + first * sin)
    if interleaved:
        return jnp.stack(turned, axis=-1).reshape(x.shape)
    return jnp.concatenate(turned, axis=-1)


@dataclasses.dataclass(frozen=True)
class BlockOptions:
    """What shapes a block beyond its heads, MLP width and window: each field is the `ViT` field of its name."""

    mlp: str = "gelu"
    mlp_norm: bool = False
    qkv_bias: str = "all"
    layer_scale: float = 0.0
    norm_epsilon: float = 1e-6
    rope: str = ""
    rope_temperature: float = 10000.0
    rope_reference_grid: int = 0
    lora_rank: int = 0
    lora_alpha: float = 1.0


def _rope_tables(
    options: BlockOptions, grid: tuple[int, int], head_dim: int, prefix: int, window: int
) -> tuple[np.ndarray, np.ndarray]:
    """(cos, sin) `[groups or 1, tokens, 1, head_dim // 2]` for attention over the token order `Attention` builds.

    The angles are those of the full grid (`rope_angles`), cut into windows like
    the tokens when `window` (padding tokens turn by 0: cos 1, sin 0), after
    `prefix` unturned tokens otherwise.
    """
    angles = rope_angles(options.rope, grid, head_dim, options.rope_temperature, options.rope_reference_grid)
    cos, sin = np.cos(angles.astype(np.float64)), np.sin(angles.astype(np.float64))
    if window:
        h, w = grid
        pad = ((0, -h % window), (0, -w % window), (0, 0))
        tables = []
        for table, fill in ((cos, 1.0), (sin, 0.0)):
            padded = np.pad(table.reshape(h, w, -1), pad, constant_values=fill)
            hp, wp, d = padded.shape
            windows = padded.reshape(hp // window, window, wp // window, window, d).transpose(0, 2, 1, 3, 4)
            tables.append(windows.reshape(-1, window * window, 1, d))
        cos, sin = tables
    else:
        d = cos.shape[-1]
        cos = np.concatenate([np.ones((prefix, d)), cos])[None, :, None]
        sin = np.concatenate([np.zeros((prefix, d)), sin])[None, :, None]
    return cos.astype(np.float32), sin.astype(np.float32)


class Attention(nn.Module):
    """Multi-head self-attention over a `[B, H, W, E]` token grid (and `[B, P, E]` prefix tokens), global or windowed.

    `__call__(x, prefix=None) -> (x', prefix')`; prefix tokens (class,
    registers) attend and are attended to only in global attention, and are
    never rotated by RoPE.
    """

    num_heads: int
    window_size: int  # 0: global attention
    dtype: Any = jnp.float32
    options: BlockOptions = BlockOptions()

    @nn.compact
    def __call__(self, x: jax.Array, prefix: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
        b, h, w, embed = x.shape
        head_dim = embed // self.num_heads
        options = self.options
        num_prefix = 0 if prefix is None else prefix.shape[1]
        if self.window_size:
            if num_prefix:
                raise ConfigError("prefix tokens need global attention in every block (global_attention_every=1)")
            x, padded_hw = _window_partition(x, self.window_size)
            groups, gh, gw, _ = x.shape
            tokens = x.reshape(groups, gh * gw, embed)
        else:
            tokens = x.reshape(b, h * w, embed)
            if num_prefix:
                tokens = jnp.concatenate([prefix.astype(tokens.dtype), tokens], axis=1)
        lora = dict(lora_rank=options.lora_rank, lora_alpha=options.lora_alpha)
        qkv = Projection(
            (3, self.num_heads, head_dim),
            ("embed", None, "heads", "kv"),
            (None, "heads", "kv"),
            dtype=self.dtype,
            use_bias=options.qkv_bias != "none",
            # EVA-02 and DINOv3-qkvb learn q and v biases only: k's stays 0.
            bias_mask=(1.0, 0.0, 1.0) if options.qkv_bias == "qv" else None,
            **lora,
            name="qkv",
        )(tokens)
        q, k, v = (nn.with_logical_constraint(qkv[:, :, i], HEAD_AXES) for i in range(3))
        if options.rope:
            # Constants of the static grid shape, folded into the program.
            cos, sin = _rope_tables(options, (h, w), head_dim, num_prefix, self.window_size)
            interleaved = options.rope == "eva02"
            q, k = (rotate(t, jnp.asarray(cos), jnp.asarray(sin), interleaved) for t in (q, k))
        out = attention(q, k, v)
        out = Projection(
            (embed,), ("heads", "kv", "embed"), ("norm",), contract=2, dtype=self.dtype, **lora, name="out"
        )(out)
        if self.window_size:
            out = out.reshape(groups, gh, gw, embed)
            return _window_unpartition(out, self.window_size, padded_hw, (h, w)), None
        prefix_out = out[:, :num_prefix] if num_prefix else None
        return out[:, num_prefix:].reshape(b, h, w, embed), prefix_out


class Block(nn.Module):
    """Pre-norm transformer block; `(x, _) -> (x, None)` so it can be scanned.

    `x` is the `[B, H, W, E]` grid, or `(grid, prefix [B, P, E])` with prefix
    tokens (then the block must attend globally). With `layer_scale` each
    branch is scaled by a learnt `[E]` vector (`ls1`, `ls2`) before the residual sum.
    """

    num_heads: int
    mlp_hidden: int
    window_size: int
    dtype: Any = jnp.float32
    options: BlockOptions = BlockOptions()

    @nn.compact
    def __call__(self, carry: Any, _: Any = None) -> tuple[Any, None]:
        x, prefix = carry if isinstance(carry, tuple) else (carry, None)
        options = self.options
        # Pin the incoming residual stream too: inside a scan it is the loop
        # carry, whose sharding XLA would otherwise infer from its first use.
        x = nn.with_logical_constraint(x, TOKEN_GRID_AXES)
        if prefix is not None:
            prefix = nn.with_logical_constraint(prefix, PREFIX_AXES)

        def scale(name):
            if not options.layer_scale:
                return lambda y: y
            gamma = self.param(
                name,
                nn.with_logical_partitioning(nn.initializers.constant(options.layer_scale), ("norm",)),
                (x.shape[-1],),
                jnp.float32,
            )
            return lambda y: y * gamma.astype(y.dtype)

        def both(fn, grid, tokens):
            return fn(grid), None if tokens is None else fn(tokens)

        norm1 = layer_norm(self.dtype, "norm1", options.norm_epsilon)
        y, y_prefix = Attention(self.num_heads, self.window_size, self.dtype, options, name="attn")(
            *both(norm1, x, prefix)
        )
        ls1 = scale("ls1")
        x = nn.with_logical_constraint(x + ls1(y), TOKEN_GRID_AXES)
        if prefix is not None:
            prefix = prefix + ls1(y_prefix)
        norm2 = layer_norm(self.dtype, "norm2", options.norm_epsilon)
        mlp = Mlp(
            self.mlp_hidden,
            self.dtype,
            options.mlp,
            options.mlp_norm,
            options.norm_epsilon,
            options.lora_rank,
            options.lora_alpha,
            name="mlp",
        )
        ls2 = scale("ls2")
        x = nn.with_logical_constraint(x + ls2(mlp(norm2(x))), TOKEN_GRID_AXES)
        if prefix is None:
            return (x if not isinstance(carry, tuple) else (x, None)), None
        return (x, nn.with_logical_constraint(prefix + ls2(mlp(norm2(prefix))), PREFIX_AXES)), None


def _block_class(remat: str, scanned: bool):
    # Inside a scan there is no common subexpression for XLA to merge, and
    # prevent_cse would only block optimisations.
    return rematerialized(Block, remat, prevent_cse=not scanned)


def _stack(block_cls, length: int, axis_name: str):
    return nn.scan(
        block_cls,
        variable_axes={"params": 0},
        split_rngs={"params": True},
        length=length,
        metadata_params={nn.PARTITION_NAME: axis_name},
    )


class Stage(nn.Module):
    """`windowed_blocks` windowed blocks followed by one global block."""

    windowed_blocks: int
    num_heads: int
    mlp_hidden: int
    window_size: int
    remat: str = "none"
    scan: bool = True
    dtype: Any = jnp.float32
    options: BlockOptions = BlockOptions()

    @nn.compact
    def __call__(self, x: Any, _: Any = None) -> tuple[Any, None]:
        block_cls = _block_class(self.remat, self.scan)
        block_args = (self.num_heads, self.mlp_hidden, self.window_size, self.dtype, self.options)
        if self.windowed_blocks and self.scan:
            x, _ = _stack(block_cls, self.windowed_blocks, "layers")(*block_args, name="windowed")(x, None)
        else:
            for i in range(self.windowed_blocks):
                x, _ = block_cls(*block_args, name=f"windowed{i}")(x, None)
        x, _ = block_cls(self.num_heads, self.mlp_hidden, 0, self.dtype, self.options, name="global")(x, None)
        return x, None


class ViT(nn.Module):
    """ViT trunk. `__call__(images [B, H, W, 3]) -> {4: [B, ceil(H/16), ceil(W/16), embed_dim]}` (level 4 = stride 16).

    Attributes:
      patch_size: 16, or 14 (DINOv2, EVA-02): then the `[H/14, W/14]` token
        grid is resized bilinearly (`jax.image.resize`, antialiased) to
        `[ceil(H/16), ceil(W/16)]` before it is returned as level 4, so the
        simple feature pyramid and DINO see stride 16 whatever the patch.
        `patch_tokens` returns the grid before that resize.
      depth: number of blocks; a multiple of `global_attention_every`.
      global_attention_every: blocks per stage; the last block of each stage
        attends globally (ViTDet-B: 3, i.e. blocks 2, 5, 8, 11).
      window_size: side of the attention windows, in tokens.
      pretrain_image_size: the position embedding is learnt on this square
        size's grid and resized (bicubic) to the input's grid.
      absolute_position: a learnt position embedding `pos_embed [1, g, g, E]`
        added after the patch embedding (False for DINOv3).
      rope: '' (none), 'dinov3' or 'eva02': 2-D rotary position embedding
        of q and k of the patch tokens (`rope_angles`, `rotate`), recomputed
        for every input grid; with windows, the full grid's rotation is cut
        into the windows, so relative positions are as without them.
      rope_temperature: the frequencies' base (DINOv3 100, EVA-02 10000).
      rope_reference_grid: EVA-02's `ref_feat_shape` side (16): positions
        are rescaled so the grid spans that many patches; 0: none.
      class_token, register_tokens: learnt prefix tokens `cls_token [1, 1, E]`
        and `reg_token [1, R, E]` carried through the blocks and dropped
        from the output. With `absolute_position` the class token gets its
        own `class_pos_embed [1, 1, E]` (DINOv2's pos_embed entry); registers
        get none. Prefix tokens need `global_attention_every == 1`.
      layer_scale: 0 for none, else the initial value of LayerScale's
        `ls1`, `ls2` `[E]` (DINOv2/v3: 1e-5).
      mlp: 'gelu' or 'swiglu'; mlp_hidden: its hidden units (0: embed_dim *
        mlp_ratio); mlp_norm: LayerNorm over the hidden units before fc2
        (EVA-02's `scale_mlp`; costs two all-reduces over `model` per block).
      qkv_bias: 'all', 'qv' (a `[3, H, Dh]` bias whose k part the forward
        pass multiplies by 0: EVA-02, DINOv3-qkvb) or 'none' (DINOv3).
      norm_epsilon: every LayerNorm's epsilon (DINOv3: 1e-5).
      final_norm: a LayerNorm `norm` over the last block's tokens. timm's
        average-pooling ViTs (EVA-02 as registered) have none there: their
        `fc_norm` normalises the pooled vector only, so their features are
        the last block's tokens as they are.
      lora_rank, lora_alpha: LoRA adapters (`Projection`) on qkv, out, fc1
        and fc2 when the rank is not 0; `merge_lora` folds them in for export.
      remat: 'none', 'full' or 'dots' (see REMAT_POLICIES).
      scan: stack equal blocks with `nn.scan` (compile time independent of depth).
    """

    patch_size: int = 16
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_ratio: float = 4.0
    window_size: int = 14
    global_attention_every: int = 3
    pretrain_image_size: int = 224
    absolute_position: bool = True
    rope: str = ""
    rope_temperature: float = 10000.0
    rope_reference_grid: int = 0
    class_token: bool = False
    register_tokens: int = 0
    layer_scale: float = 0.0
    mlp: str = "gelu"
    mlp_hidden: int = 0
    mlp_norm: bool = False
    qkv_bias: str = "all"
    norm_epsilon: float = 1e-6
    final_norm: bool = True
    lora_rank: int = 0
    lora_alpha: float = 1.0
    remat: str = "none"
    scan: bool = True
    dtype: Any = jnp.float32

    def _check(self) -> None:
        def choice(key, value, allowed):
            if value not in allowed:
                raise ConfigError(f"model.backbone.{key}={value!r}; use one of {', '.join(repr(a) for a in allowed)}")

        if self.depth % self.global_attention_every:
            raise ConfigError(
                f"model.backbone.depth={self.depth} is not a multiple of "
                f"global_attention_every={self.global_attention_every}"
            )
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"model.backbone.embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}"
            )
        if self.patch_size not in PATCH_SIZES:
            raise ConfigError(
                f"model.backbone.patch_size={self.patch_size}; use 16, or 14 (resized to the pyramid's stride 16)"
            )
        choice("rope", self.rope, ROPES)
        choice("mlp", self.mlp, MLPS)
        choice("qkv_bias", self.qkv_bias, QKV_BIASES)
        head_dim = self.embed_dim // self.num_heads
        if self.rope and head_dim % 4:
            raise ConfigError(
                f"model.backbone.rope={self.rope!r} needs a head width (embed_dim / num_heads = {head_dim}) "
                "divisible by 4"
            )
        if (self.class_token or self.register_tokens) and self.global_attention_every != 1:
            raise ConfigError(
                f"model.backbone.class_token={self.class_token}, register_tokens={self.register_tokens}: prefix "
                f"tokens need global attention in every block, not global_attention_every="
                f"{self.global_attention_every}; set global_attention_every=1, or class_token=False and "
                "register_tokens=0 (pretrained class and register tokens are then dropped on loading)"
            )
        if self.lora_rank < 0 or self.register_tokens < 0 or self.mlp_hidden < 0:
            raise ConfigError("model.backbone.lora_rank, register_tokens and mlp_hidden must not be negative")

    def block_options(self) -> BlockOptions:
        # Each block option is the ViT field of its name: a new one is a field of both, set nowhere else.
        return BlockOptions(**{field.name: getattr(self, field.name) for field in dataclasses.fields(BlockOptions)})

    @nn.compact
    def patch_tokens(self, images: jax.Array) -> jax.Array:
        """`images [B, H, W, 3]` -> the last block's patch tokens `[B, H/p, W/p, E]` (final-normed unless
        `final_norm` is False; prefix tokens dropped)."""
        self._check()
        height, width = images.shape[1:3]
        x = conv(
            self.embed_dim,
            self.patch_size,
            self.patch_size,
            dtype=self.dtype,
            kernel_init=nn.initializers.lecun_normal(),
            # An image short of whole patches (patch 14 at 1024 px) gets zeros below and right, as timm's
            # dynamic_img_pad pads it: 'SAME' would split them between both sides and shift every patch.
            padding=((0, -height % self.patch_size), (0, -width % self.patch_size)),
            name="patch_embed",
        )(images.astype(self.dtype))
        b = x.shape[0]
        embed_init = nn.initializers.truncated_normal(0.02)
        if self.absolute_position:
            grid = self.pretrain_image_size // self.patch_size
            pos = self.param(
                "pos_embed",
                nn.with_logical_partitioning(embed_init, (None, None, None, "norm")),
                (1, grid, grid, self.embed_dim),
            )
            if (grid, grid) != x.shape[1:3]:
                pos = jax.image.resize(pos, (1, *x.shape[1:3], self.embed_dim), method="bicubic")
            x = x + pos.astype(self.dtype)
        x = nn.with_logical_constraint(x, TOKEN_GRID_AXES)

        prefix = []
        prefix_axes = nn.with_logical_partitioning(embed_init, (None, None, "norm"))
        if self.class_token:
            cls = self.param("cls_token", prefix_axes, (1, 1, self.embed_dim))
            if self.absolute_position:
                cls = cls + self.param("class_pos_embed", prefix_axes, (1, 1, self.embed_dim))
            prefix.append(cls)
        if self.register_tokens:
            prefix.append(self.param("reg_token", prefix_axes, (1, self.register_tokens, self.embed_dim)))
        carry: Any = x
        if prefix:
            tokens = jnp.concatenate(prefix, axis=1).astype(self.dtype)
            carry = (x, jnp.broadcast_to(tokens, (b, *tokens.shape[1:])))

        stage_kwargs = dict(
            windowed_blocks=self.global_attention_every - 1,
            num_heads=self.num_heads,
            mlp_hidden=self.mlp_hidden or int(self.embed_dim * self.mlp_ratio),
            window_size=self.window_size,
            remat=self.remat,
            scan=self.scan,
            dtype=self.dtype,
            options=self.block_options(),
        )
        num_stages = self.depth // self.global_attention_every
        if self.scan:
            carry, _ = _stack(Stage, num_stages, "stages")(**stage_kwargs, name="stages")(carry, None)
        else:
            for i in range(num_stages):
                carry, _ = Stage(**stage_kwargs, name=f"stage{i}")(carry, None)
        x = carry[0] if prefix else carry
        return layer_norm(self.dtype, "norm", self.norm_epsilon)(x) if self.final_norm else x

    def __call__(self, images: jax.Array) -> dict[int, jax.Array]:
        x = self.patch_tokens(images)
        if self.patch_size != FEATURE_STRIDE:
            size = tuple(-(-s // FEATURE_STRIDE) for s in images.shape[1:3])
            x = jax.image.resize(x, (x.shape[0], *size, x.shape[-1]), method="bilinear").astype(x.dtype)
            x = nn.with_logical_constraint(x, TOKEN_GRID_AXES)
        return {4: x}


# Parameters of the ViT below its blocks: ViTDet's layer decay counts them as block -1.
EMBEDDING_PARAMS = ("patch_embed", "pos_embed", "class_pos_embed", "cls_token", "reg_token")


def block_ids(path: tuple[str, ...], shape: tuple[int, ...], depth: int, global_every: int) -> np.ndarray | int | None:
    """Block index (0-based) of the ViT parameter at `path` (names below the ViT), broadcastable against `shape`;
    -1: embeddings; None: above the blocks (the final norm).

    Scanned stacks hold several blocks in one array: `stages/windowed/...` is
    `[stages, windowed per stage, ...]` and `stages/global/...` is
    `[stages, ...]`; unrolled ones are `stage{s}/windowed{j}/...` and
    `stage{s}/global/...`. Stage s holds blocks s*g .. s*g + g - 1 (g =
    global_every), its global block last.
    """
    if path[0] in EMBEDDING_PARAMS:
        return -1
    g = global_every
    if path[0] == "stages":  # scanned stages
        stages = depth // g
        if path[1] == "windowed":
            ids = np.arange(stages)[:, None] * g + np.arange(g - 1)[None, :]
        else:
            ids = np.arange(stages) * g + g - 1
        return ids.reshape(ids.shape + (1,) * (len(shape) - ids.ndim))
    match = re.fullmatch(r"stage(\d+)", path[0])
    if match:
        stage = int(match.group(1))
        if path[1] == "windowed":  # windowed blocks scanned inside an unrolled stage
            ids = stage * g + np.arange(g - 1)
            return ids.reshape(ids.shape + (1,) * (len(shape) - 1))
        block = re.fullmatch(r"windowed(\d+)", path[1])
        return stage * g + (int(block.group(1)) if block else g - 1)
    return None


def layer_decay_exponents(backbone_config):
    """`(path below the ViT, shape) -> exponent or None` for the ViT of `config.model.backbone`.

    ViTDet's layer-wise decay: block i of a depth-D ViT learns at decay ** (D - i),
    the embeddings at decay ** (D + 1); None (x1) for the final norm.
    """
    depth, global_every = backbone_config.depth, backbone_config.global_attention_every

    def exponents(path: tuple[str, ...], shape: tuple[int, ...]) -> np.ndarray | None:
        block = block_ids(path, shape, depth, global_every)
        return None if block is None else depth - np.asarray(block)

    return exponents
