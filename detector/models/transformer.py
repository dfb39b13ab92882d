"""The transformer layers the ViT backbone and DINO's encoder and decoder share.

`Projection` (a matmul over any number of contracted and output dims, with
LoRA), `layer_norm`, `Mlp` (GELU, ReLU or SwiGLU, optionally normed hidden
units), `attention` (one implementation: `ops.attention`'s, whose backward
pass keeps no `[B, H, Tq, Tk]` array) and the logical axis names of their
activations. Parameters are float32 and computed in the module's `dtype`.

Logical axis names (mapped to mesh axes by `config.sharding.rules`):
  parameters  'embed' (model width of the matmul kernels: FSDP), 'heads' and
              'mlp' (tensor parallel), 'kv' (head width), 'norm' (vectors
              of model width);
  activations TOKEN_AXES for a `[B, T, E]` token sequence, HEAD_AXES inside
              attention, MLP_AXES for the MLP's hidden units.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from detector.models.layers import LayerNorm, normalize, relu
from detector.ops.attention import dot_product_attention

TOKEN_AXES = ("batch", "tokens", "act_embed")
HEAD_AXES = ("batch", "tokens", "act_heads", "kv")
MLP_AXES = ("batch", "tokens", "act_mlp")
MLP_KINDS = ("gelu", "relu", "swiglu")


def layer_norm(dtype: Any, name: str, epsilon: float = 1e-6) -> LayerNorm:
    """LayerNorm over the last axis with float32 parameters named ('norm',), computing in `dtype`."""
    return LayerNorm(epsilon=epsilon, dtype=dtype, name=name)


class HiddenNorm(nn.Module):
    """LayerNorm over the MLP's hidden units (EVA-02's `mlp.norm`): parameters named ('mlp',), like the units."""

    epsilon: float = 1e-6
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        features = (x.shape[-1],)
        scale = self.param("scale", nn.with_logical_partitioning(nn.initializers.ones, ("mlp",)), features)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("mlp",)), features)
        return normalize(x, scale, bias, self.epsilon).astype(self.dtype)


class Projection(nn.Module):
    """`x @ kernel + bias` contracting the last `contract` dims of x, for kernels of any rank, with optional LoRA.

    (`nn.DenseGeneral` initialises a flattened 2-D kernel, which cannot carry
    one logical name per dimension of the multi-dimensional kernel.)
    With `lora_rank` r > 0 it adds `(x @ lora_a) @ lora_b * (lora_alpha / r)`:
    `lora_a` `[in..., r]` (Kaiming-uniform, as the LoRA paper's code), `lora_b`
    `[r, out...]` (zeros, so training starts from the plain projection),
    named like the kernel's input and output axes so they shard with it.
    `bias_mask`, if given, scales the bias along its first axis by constants
    (EVA-02's qkv has no k bias: (1, 0, 1)).
    """

    features: tuple[int, ...]
    kernel_axes: tuple[str | None, ...]  # input dims, then feature dims
    bias_axes: tuple[str | None, ...]
    contract: int = 1
    dtype: Any = jnp.float32
    kernel_init: Any = None  # None: Glorot-uniform over the whole fan-in and fan-out, as for a 2-D kernel
    bias_init: Any = nn.initializers.zeros
    use_bias: bool = True
    bias_mask: tuple[float, ...] | None = None
    lora_rank: int = 0
    lora_alpha: float = 1.0

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
        x_dims = tuple(range(x.ndim - self.contract, x.ndim))
        x = x.astype(self.dtype)
        y = jax.lax.dot_general(x, kernel.astype(self.dtype), ((x_dims, in_dims), ((), ())))
        if self.lora_rank:
            a_init = nn.initializers.variance_scaling(
                1.0 / 3.0, "fan_in", "uniform", in_axis=in_dims, out_axis=(self.contract,)
            )
            lora_a = self.param(
                "lora_a",
                nn.with_logical_partitioning(a_init, (*self.kernel_axes[: self.contract], None)),
                (*in_shape, self.lora_rank),
                jnp.float32,
            )
            lora_b = self.param(
                "lora_b",
                nn.with_logical_partitioning(nn.initializers.zeros, (None, *self.kernel_axes[self.contract :])),
                (self.lora_rank, *self.features),
                jnp.float32,
            )
            low = jax.lax.dot_general(x, lora_a.astype(self.dtype), ((x_dims, in_dims), ((), ())))
            update = jax.lax.dot_general(low, lora_b.astype(self.dtype), (((low.ndim - 1,), (0,)), ((), ())))
            y = y + update * jnp.asarray(self.lora_alpha / self.lora_rank, self.dtype)
        if not self.use_bias:
            return y
        bias = self.param(
            "bias", nn.with_logical_partitioning(self.bias_init, self.bias_axes), self.features, jnp.float32
        )
        if self.bias_mask is not None:
            mask = np.asarray(self.bias_mask, np.float32).reshape(-1, *([1] * (len(self.features) - 1)))
            bias = bias * mask
        return y + bias.astype(self.dtype)


def merge_lora(backbone_params: Mapping, alpha_over_rank: float) -> dict:
    """`backbone_params` with every LoRA adapter folded into its kernel and the `lora_*` leaves removed.

    `kernel [stack..., in..., out...] + lora_a [stack..., in..., r] . lora_b
    [stack..., r, out...] * alpha_over_rank` (the contraction over r, per
    scanned slice), so a ViT with `lora_rank=0` computes with the result what
    the adapted ViT computes, e.g. for export. Leaves may be arrays or boxed
    (logically partitioned); they keep their form.
    """
    merged = {}
    for name, value in backbone_params.items():
        if isinstance(value, Mapping) and "lora_a" in value and "lora_b" in value and "kernel" in value:
            boxed = value["kernel"]
            kernel, a, b = (
                leaf.unbox() if isinstance(leaf, nn.meta.AxisMetadata) else leaf
                for leaf in (boxed, value["lora_a"], value["lora_b"])
            )
            stack = a.ndim + b.ndim - 2 - kernel.ndim
            a_flat = a.reshape(*a.shape[:stack], -1, a.shape[-1])
            b_flat = b.reshape(*b.shape[: stack + 1], -1)
            update = jnp.matmul(a_flat.astype(jnp.float32), b_flat.astype(jnp.float32)).reshape(kernel.shape)
            new_kernel = (kernel + update * alpha_over_rank).astype(kernel.dtype)
            rest = {k: v for k, v in value.items() if k not in ("lora_a", "lora_b", "kernel")}
            kernel_leaf = boxed.replace_boxed(new_kernel) if isinstance(boxed, nn.meta.AxisMetadata) else new_kernel
            merged[name] = {**rest, "kernel": kernel_leaf}
        elif isinstance(value, Mapping):
            merged[name] = merge_lora(value, alpha_over_rank)
        else:
            merged[name] = value
    return merged


class Mlp(nn.Module):
    """`[B, ..., E] -> [B, ..., E]`: fc1, GELU, ReLU or SwiGLU, optional LayerNorm over the hidden units, fc2.

    GELU (the ViT's) or ReLU (DETR's FFN): fc1 kernel `[E, hidden]`. SwiGLU: fc1 kernel `[E, 2, hidden]`, bias
    `[2, hidden]`, index 0 the gate: `silu(x @ W0 + b0) * (x @ W1 + b1)`.
    fc2 kernel `[hidden, E]`.
    """

    hidden: int
    dtype: Any = jnp.float32
    kind: str = "gelu"
    norm: bool = False
    norm_epsilon: float = 1e-6
    lora_rank: int = 0
    lora_alpha: float = 1.0

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        shape = x.shape
        tokens = x.reshape(shape[0], -1, shape[-1])
        lora = dict(lora_rank=self.lora_rank, lora_alpha=self.lora_alpha, dtype=self.dtype)
        if self.kind == "swiglu":
            y = Projection((2, self.hidden), ("embed", None, "mlp"), (None, "mlp"), **lora, name="fc1")(tokens)
            y = nn.silu(y[:, :, 0]) * y[:, :, 1]
        else:
            y = Projection((self.hidden,), ("embed", "mlp"), ("mlp",), **lora, name="fc1")(tokens)
            y = relu(y) if self.kind == "relu" else nn.gelu(y, approximate=False)
        y = nn.with_logical_constraint(y, MLP_AXES)
        if self.norm:
            y = HiddenNorm(self.norm_epsilon, self.dtype, name="norm")(y)
        y = Projection((shape[-1],), ("mlp", "embed"), ("norm",), **lora, name="fc2")(y)
        return y.reshape(shape)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Multi-head dot-product attention `[B, Tq, H, Dh]` x `[B, Tk, H, Dh]` -> `[B, Tq, H, Dh]` (see `ops.attention`).

    Logits and softmax in float32: bf16 loses the small differences that
    decide attention over thousands of tokens. `mask`: bool `[B, Tq, Tk]`,
    True where a query may see a key.
    """
    q, k, v = (nn.with_logical_constraint(x, HEAD_AXES) for x in (q, k, v))
    return nn.with_logical_constraint(dot_product_attention(q, k, v, mask), HEAD_AXES)
