"""Plain ViT backbone for detection (ViTDet, Li et al. 2022); its simple feature pyramid is in `necks`.

The backbone is a non-hierarchical ViT at patch 16: most blocks attend
within non-overlapping windows, every `global_attention_every`-th block
attends globally. Blocks of equal shape are stacked with `nn.scan`, so the
compiled program holds one block body however deep the model is.

Logical axis names (mapped to mesh axes by `config.sharding.rules`):
  parameters  'embed' (model width of the matmul kernels: FSDP), 'heads' and
              'mlp' (tensor parallel), 'kv' (head width), 'norm' (vectors
              of model width), 'stages'/'layers' (scanned stacks);
  activations ('batch', 'height', 'width', 'act_embed') for the token grid,
              ('batch', 'tokens', 'act_heads', 'kv') inside attention and
              ('batch', 'tokens', 'act_mlp') inside the MLP.
With heads and mlp on `model`, each block is the Megatron layout: the qkv and
fc1 kernels are split by output, the out-projection and fc2 kernels by input,
so the forward pass of a block needs exactly two all-reduces.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from detector.errors import ConfigError
from detector.models.layers import LayerNorm, conv, rematerialized

TOKEN_GRID_AXES = ("batch", "height", "width", "act_embed")
HEAD_AXES = ("batch", "tokens", "act_heads", "kv")
MLP_AXES = ("batch", "tokens", "act_mlp")


def layer_norm(dtype: Any, name: str, epsilon: float = 1e-6) -> LayerNorm:
    """LayerNorm over the last axis with float32 parameters named ('norm',), computing in `dtype`."""
    return LayerNorm(epsilon=epsilon, dtype=dtype, name=name)


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


class Projection(nn.Module):
    """`x @ kernel + bias` contracting the last `contract` dims of x, for kernels of any rank.

    (`nn.DenseGeneral` initialises a flattened 2-D kernel, which cannot carry
    one logical name per dimension of the multi-dimensional kernel.)
    """

    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]  # input dims, then feature dims
    bias_axes: tuple[str | None, ...]
    contract: int = 1
    dtype: Any = jnp.float32
    kernel_init: Any = None  # None: Glorot-uniform over the whole fan-in and fan-out, as for a 2-D kernel
    bias_init: Any = nn.initializers.zeros

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        in_shape = x.shape[x.ndim - self.contract :]
        in_dims = tuple(range(self.contract))
        out_dims = tuple(range(self.contract, self.contract + len(self.features)))
        init = self.kernel_init or nn.initializers.variance_scaling(
            1.0, "fan_avg", "uniform", in_axis=in_dims, out_axis=out_dims
        )
        kernel = self.param(
            "kernel", nn.with_logical_partitioning(init, self.kernel_axes), (*in_shape, *self.features), jnp.float32
        )
        bias = self.param(
            "bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes), self.features, jnp.float32
        )
        x_dims = tuple(range(x.ndim - self.contract, x.ndim))
        y = jax.lax.dot_general(x.astype(self.dtype), kernel.astype(self.dtype), ((x_dims, in_dims), ((), ())))
        return y + bias.astype(self.dtype)


class Attention(nn.Module):
    """Multi-head self-attention over a `[B, H, W, E]` token grid, global or windowed."""

    num_heads: int
    window_size: int  # 0: global attention
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, embed = x.shape
        head_dim = embed // self.num_heads
        if self.window_size:
            x, padded_hw = _window_partition(x, self.window_size)
        groups, gh, gw, _ = x.shape
        tokens = x.reshape(groups, gh * gw, embed)
        qkv = Projection(
            (3, self.num_heads, head_dim),
            ("embed", None, "heads", "kv"),
            (None, "heads", "kv"),
            dtype=self.dtype,
            name="qkv",
        )(tokens)
        q, k, v = (nn.with_logical_constraint(qkv[:, :, i], HEAD_AXES) for i in range(3))
        # Logits and softmax in float32: bf16 loses the small differences that
        # decide attention over thousands of tokens.
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32) * head_dim**-0.5
        weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
        out = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", weights, v), HEAD_AXES)
        out = Projection((embed,), ("heads", "kv", "embed"), ("norm",), contract=2, dtype=self.dtype, name="out")(out)
        out = out.reshape(groups, gh, gw, embed)
        if self.window_size:
            out = _window_unpartition(out, self.window_size, padded_hw, (h, w))
        return out


class Mlp(nn.Module):
    hidden: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        b, h, w, embed = x.shape
        tokens = x.reshape(b, h * w, embed)
        y = nn.Dense(
            self.hidden,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "mlp")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)),
            name="fc1",
        )(tokens)
        y = nn.with_logical_constraint(nn.gelu(y, approximate=False), MLP_AXES)
        y = nn.Dense(
            embed,
            dtype=self.dtype,
            param_dtype=jnp.float32,
            kernel_init=nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("mlp", "embed")),
            bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("norm",)),
            name="fc2",
        )(y)
        return y.reshape(b, h, w, embed)


class Block(nn.Module):
    """Pre-norm transformer block on a `[B, H, W, E]` grid; `(x, _) -> (x, None)` so it can be scanned."""

    num_heads: int
    mlp_hidden: int
    window_size: int
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        # Pin the incoming residual stream too: inside a scan it is the loop
        # carry, whose sharding XLA would otherwise infer from its first use.
        x = nn.with_logical_constraint(x, TOKEN_GRID_AXES)
        y = Attention(self.num_heads, self.window_size, self.dtype, name="attn")(layer_norm(self.dtype, "norm1")(x))
        x = nn.with_logical_constraint(x + y, TOKEN_GRID_AXES)
        y = Mlp(self.mlp_hidden, self.dtype, name="mlp")(layer_norm(self.dtype, "norm2")(x))
        return nn.with_logical_constraint(x + y, TOKEN_GRID_AXES), None


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

    @nn.compact
    def __call__(self, x: jax.Array, _: Any = None) -> tuple[jax.Array, None]:
        block_cls = _block_class(self.remat, self.scan)
        if self.windowed_blocks and self.scan:
            x, _ = _stack(block_cls, self.windowed_blocks, "layers")(
                self.num_heads, self.mlp_hidden, self.window_size, self.dtype, name="windowed"
            )(x, None)
        else:
            for i in range(self.windowed_blocks):
                x, _ = block_cls(self.num_heads, self.mlp_hidden, self.window_size, self.dtype, name=f"windowed{i}")(
                    x, None
                )
        x, _ = block_cls(self.num_heads, self.mlp_hidden, 0, self.dtype, name="global")(x, None)
        return x, None


class ViT(nn.Module):
    """ViT trunk. `__call__(images [B, H, W, 3]) -> {4: [B, H/16, W/16, embed_dim]}` (level 4 = stride 16).

    Attributes:
      patch_size: 16 gives the stride-16 map the simple feature pyramid expects.
      depth: number of blocks; a multiple of `global_attention_every`.
      global_attention_every: blocks per stage; the last block of each stage
        attends globally (ViTDet-B: 3, i.e. blocks 2, 5, 8, 11).
      window_size: side of the attention windows, in tokens.
      pretrain_image_size: the position embedding is learnt on this square
        size's grid and resized to the input's grid.
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
    remat: str = "none"
    scan: bool = True
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, images: jax.Array) -> dict[int, jax.Array]:
        if self.depth % self.global_attention_every:
            raise ConfigError(
                f"model.backbone.depth={self.depth} is not a multiple of "
                f"global_attention_every={self.global_attention_every}"
            )
        if self.embed_dim % self.num_heads:
            raise ConfigError(
                f"model.backbone.embed_dim={self.embed_dim} is not divisible by num_heads={self.num_heads}"
            )
        if self.patch_size != 16:
            raise ConfigError(f"model.backbone.patch_size={self.patch_size}; the pyramid expects 16")
        x = conv(
            self.embed_dim,
            self.patch_size,
            self.patch_size,
            dtype=self.dtype,
            kernel_init=nn.initializers.lecun_normal(),
            name="patch_embed",
        )(images.astype(self.dtype))
        grid = self.pretrain_image_size // self.patch_size
        pos = self.param(
            "pos_embed",
            nn.with_logical_partitioning(nn.initializers.truncated_normal(0.02), (None, None, None, "norm")),
            (1, grid, grid, self.embed_dim),
        )
        if (grid, grid) != x.shape[1:3]:
            pos = jax.image.resize(pos, (1, *x.shape[1:3], self.embed_dim), method="bicubic")
        x = nn.with_logical_constraint(x + pos.astype(self.dtype), TOKEN_GRID_AXES)

        stage_kwargs = dict(
            windowed_blocks=self.global_attention_every - 1,
            num_heads=self.num_heads,
            mlp_hidden=int(self.embed_dim * self.mlp_ratio),
            window_size=self.window_size,
            remat=self.remat,
            scan=self.scan,
            dtype=self.dtype,
        )
        num_stages = self.depth // self.global_attention_every
        if self.scan:
            x, _ = _stack(Stage, num_stages, "stages")(**stage_kwargs, name="stages")(x, None)
        else:
            for i in range(num_stages):
                x, _ = Stage(**stage_kwargs, name=f"stage{i}")(x, None)
        return {4: layer_norm(self.dtype, "norm")(x)}
