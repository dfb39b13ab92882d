"""Dot-product attention whose backward pass keeps no `[B, H, Tq, Tk]` array between the passes.

Written plainly, attention's gradient keeps its softmax for the backward pass,
and XLA keeps more than that: the logits and the broadcast normaliser too,
three `Tq x Tk` float32 arrays per head and layer. For DINO's decoder (900
matching plus the denoising queries, six layers) those were the largest
buffers at the train step's memory peak. Here a custom VJP keeps the inputs,
the output and each row's log-sum-exp (`[B, H, Tq]`) and recomputes the
logits in the backward pass, as FlashAttention does: one more `q k^T` per
layer, no quadratic buffer that lives from the forward to the backward pass.
The recomputation depends on the output's gradient, so XLA can neither
merge it with the forward pass's logits nor hoist it into the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def accumulation_dtype(*arrays):
    """What the attention ops accumulate in: float32 at least (float64 stays float64, for gradient checks)."""
    return jnp.promote_types(jnp.float32, jnp.result_type(*arrays))


def _scaled(q):
    """`q / sqrt(Dh)`: the logits' scale applied to `[B, Tq, H, Dh]`, not to `[B, H, Tq, Tk]`."""
    return q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype)


def _logits(q_scaled, k, mask):
    """`[B, H, Tq, Tk]` logits of scaled queries in the accumulation dtype, masked entries -inf."""
    logits = jnp.einsum("bqhd,bkhd->bhqk", q_scaled, k, preferred_element_type=accumulation_dtype(q_scaled))
    return jnp.where(mask[:, None], logits, -jnp.inf)


def _forward(q, k, v, mask):
    logits = _logits(_scaled(q), k, mask)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)  # a fully masked row: all -inf
    unnormalised = jnp.exp(logits - row_max)
    row_sum = jnp.sum(unnormalised, axis=-1, keepdims=True)
    # Normalised after the product, on [B, Tq, H, Dh] rather than [B, H, Tq, Tk]: one pass fewer over the weights.
    out = jnp.einsum("bhqk,bkhd->bqhd", unnormalised.astype(v.dtype), v, preferred_element_type=row_sum.dtype)
    out = (out / jnp.transpose(jnp.where(row_sum > 0, row_sum, 1.0), (0, 2, 1, 3))).astype(v.dtype)
    # What the backward pass subtracts: one number per row (+inf for a fully masked one, whose weights are 0).
    log_sum_exp = jnp.where(row_sum > 0, row_max + jnp.log(row_sum), jnp.inf)[..., 0]
    return out, log_sum_exp


@jax.custom_vjp
def _attention(q, k, v, mask):
    return _forward(q, k, v, mask)[0]


def _attention_forward(q, k, v, mask):
    out, log_sum_exp = _forward(q, k, v, mask)
    return out, (q, k, v, mask, out, log_sum_exp)


def _attention_backward(residuals, out_grad):
    q, k, v, mask, out, log_sum_exp = residuals
    # The softmax again, from one number per row. Recomputed from `q_again`,
    # which depends on the gradient: from `q` itself, XLA would merge the
    # recomputed logits with the forward pass's (common subexpressions) and
    # keep every layer's until the backward pass; XLA:CPU drops optimisation
    # barriers. Float rules keep XLA from folding x * 0 (x may be NaN). Each
    # query and head takes its own gradient's element: no communication
    # under a heads or tokens sharding.
    q_scaled = _scaled(q + (out_grad[..., :1] * 0).astype(q.dtype))
    weights = jnp.exp(_logits(q_scaled, k, mask) - log_sum_exp[..., None])
    dtype = weights.dtype
    v_grad = jnp.einsum("bhqk,bqhd->bkhd", weights.astype(v.dtype), out_grad, preferred_element_type=dtype)
    weights_grad = jnp.einsum("bqhd,bkhd->bhqk", out_grad, v, preferred_element_type=dtype)
    # Softmax's gradient: w * (dw - sum_k w dw), the sum being the output's gradient against the output.
    row_dot = jnp.einsum("bqhd,bqhd->bhq", out_grad.astype(dtype), out.astype(dtype))
    logits_grad = weights * (weights_grad - row_dot[..., None])
    q_grad = _scaled(jnp.einsum("bhqk,bkhd->bqhd", logits_grad, k.astype(dtype)))
    k_grad = jnp.einsum("bhqk,bqhd->bkhd", logits_grad, q_scaled.astype(dtype))
    return q_grad.astype(q.dtype), k_grad.astype(k.dtype), v_grad.astype(v.dtype), None


_attention.defvjp(_attention_forward, _attention_backward)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(Dh), masked) v per head, with a backward pass that recomputes the softmax.

    Args:
      q: `[B, Tq, H, Dh]` queries (float32 or bf16).
      k: `[B, Tk, H, Dh]` keys.
      v: `[B, Tk, H, Dh]` values (float64 throughout computes in float64).
      mask: optional bool `[B, Tq, Tk]`, True where a query may see a key; a row
        with no True entry attends to nothing (output 0, no gradient), as in FlashAttention.

    Returns `[B, Tq, H, Dh]` in `v`'s dtype. Logits, softmax and every
    gradient are accumulated in float32 whatever the inputs' dtype. Plain
    XLA ops, batched over heads, so a `heads` sharding needs no
    communication; a fused kernel with the same signature can replace it.
    """
    if mask is None:
        mask = jnp.ones((q.shape[0], q.shape[1], k.shape[1]), bool)
    return _attention(q, k, v, mask)
