"""Dot-product attention whose backward pass keeps no `[B, H, Tq, Tk]` array between the passes.

Written plainly, attention's gradient keeps its softmax for the backward pass,
and XLA keeps more than that: the logits and the broadcast normaliser too,
three `Tq x Tk` float32 arrays per head and layer. For DINO's decoder (900
matching plus the denoising queries, six layers) those were the largest
buffers at the train step's memory peak. Here a custom VJP keeps the inputs,
the output and each row's maximum and normaliser (`[B, H, Tq]`) and recomputes the
logits in the backward pass, as FlashAttention does: one more `q k^T` per
layer, no quadratic buffer that lives from the forward to the backward pass.
The recomputation waits for the output's gradient (an optimisation barrier
ties the two), so the scheduler cannot hoist it back into the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = jnp.finfo(jnp.float32).min


def _accumulation_dtype(x):
    """float32 at least (float64 stays float64, for gradient checks)."""
    return jnp.promote_types(jnp.float32, x.dtype)


def _logits(q, k, mask):
    """float32 `[B, H, Tq, Tk]` scaled logits, masked entries at the float32 minimum."""
    scale = q.shape[-1] ** -0.5
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=_accumulation_dtype(q)) * scale
    return logits if mask is None else jnp.where(mask[:, None], logits, _MASKED)


def _softmax(logits, row_max, row_sum):
    return jnp.exp(logits - row_max) / row_sum


def _forward(q, k, v, mask):
    logits = _logits(q, k, mask)
    row_max = jnp.max(logits, axis=-1, keepdims=True)
    row_sum = jnp.sum(jnp.exp(logits - row_max), axis=-1, keepdims=True)
    weights = _softmax(logits, row_max, row_sum).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", weights, v), (row_max, row_sum)


@jax.custom_vjp
def _attention(q, k, v, mask):
    return _forward(q, k, v, mask)[0]


def _attention_forward(q, k, v, mask):
    out, (row_max, row_sum) = _forward(q, k, v, mask)
    return out, (q, k, v, mask, out, row_max, row_sum)


def _attention_backward(residuals, out_grad):
    q, k, v, mask, out, row_max, row_sum = residuals
    # Recompute only once the gradient has arrived, never during the forward pass.
    q, k, v, row_max, row_sum, out_grad = jax.lax.optimization_barrier((q, k, v, row_max, row_sum, out_grad))
    # The forward pass's softmax bit for bit (masked entries exp(-huge) = 0, unless a whole row is masked).
    weights = _softmax(_logits(q, k, mask), row_max, row_sum)
    dtype = weights.dtype
    v_grad = jnp.einsum("bhqk,bqhd->bkhd", weights.astype(v.dtype), out_grad, preferred_element_type=dtype)
    weights_grad = jnp.einsum("bqhd,bkhd->bhqk", out_grad, v, preferred_element_type=dtype)
    # Softmax's gradient: w * (dw - sum_k w dw), the sum being the output's gradient against the output.
    row_dot = jnp.einsum("bqhd,bqhd->bhq", out_grad.astype(dtype), out.astype(dtype))
    logits_grad = weights * (weights_grad - row_dot[..., None]) * q.shape[-1] ** -0.5
    q_grad = jnp.einsum("bhqk,bkhd->bqhd", logits_grad, k.astype(dtype))
    k_grad = jnp.einsum("bhqk,bqhd->bkhd", logits_grad, q.astype(dtype))
    return q_grad.astype(q.dtype), k_grad.astype(k.dtype), v_grad.astype(v.dtype), None


_attention.defvjp(_attention_forward, _attention_backward)


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """softmax(q k^T / sqrt(Dh), masked) v per head, with a backward pass that recomputes the softmax.

    Args:
      q: `[B, Tq, H, Dh]` queries (float32 or bf16).
      k: `[B, Tk, H, Dh]` keys.
      v: `[B, Tk, H, Dh]` values (float64 throughout computes in float64).
      mask: optional bool `[B, Tq, Tk]`, True where a query may see a key; a row
        with no True entry attends uniformly (as a plain softmax over equal logits).

    Returns `[B, Tq, H, Dh]` in `v`'s dtype. Logits, softmax and every
    gradient are accumulated in float32 whatever the inputs' dtype. Plain
    XLA ops, batched over heads, so a `heads` sharding needs no
    communication; a fused kernel with the same signature can replace it.
    """
    if mask is None:
        mask = jnp.ones((q.shape[0], q.shape[1], k.shape[1]), bool)
    return _attention(q, k, v, mask)
