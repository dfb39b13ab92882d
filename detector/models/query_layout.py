"""DINO's decoder queries along their axis, as one value: [denoising | one_to_one | one_to_many].

The decoder runs three kinds of queries side by side, each a segment of the
query axis, in this order:
  * denoising: the contrastive denoising groups (training with
    `model.dino.denoising_pairs` > 0; see `detector.ops.denoising`);
  * one_to_one: the N matching queries, the only ones prediction runs;
  * one_to_many: H-DETR's hybrid branch (training with
    `model.dino.one_to_many_queries` M > 0).
`QueryLayout` holds the three sizes and is the one place that knows the
order: where each segment sits, how to cut the decoder's outputs into
segments and put per-segment inputs together, and which query may attend to
which.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from detector.ops import denoising

SEGMENTS = ("denoising", "one_to_one", "one_to_many")

# Which segments a segment's queries may attend to. The one-to-one queries
# must not see the denoising ones (they carry the answers), and no query sees
# the one-to-many ones, so the one-to-one queries compute exactly what they
# would without either. Within the denoising segment each query sees only its
# own group (`denoising.group_attention_mask`).
_SEES = {
    "denoising": ("denoising", "one_to_one"),
    "one_to_one": ("one_to_one",),
    "one_to_many": ("one_to_many",),
}


@dataclasses.dataclass(frozen=True)
class QueryLayout:
    """The sizes of the decoder's query segments, in `SEGMENTS` order; T = their sum.

    A segment of size 0 is absent: it is not in `segments`, `split` gives no
    part for it and `concatenate` takes none.
    """

    num_one_to_one: int
    num_denoising: int = 0
    num_one_to_many: int = 0

    def __post_init__(self):
        for segment in SEGMENTS:
            size = self.size(segment)
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise ValueError(f"QueryLayout: {segment} size {size!r}; use a whole number >= 0")
        if not self.num_one_to_one:
            raise ValueError("QueryLayout: no one-to-one queries; the decoder needs at least one")

    def size(self, segment: str) -> int:
        """The number of queries of `segment` (one of `SEGMENTS`)."""
        if segment not in SEGMENTS:
            raise KeyError(f"{segment!r} is not a query segment; use one of {', '.join(SEGMENTS)}")
        return getattr(self, f"num_{segment}")

    @property
    def segments(self) -> tuple[str, ...]:
        """The names of the segments present (size > 0), in query order."""
        return tuple(segment for segment in SEGMENTS if self.size(segment))

    @property
    def total(self) -> int:
        """T: the number of queries the decoder runs."""
        return sum(self.size(segment) for segment in SEGMENTS)

    def slice(self, segment: str) -> slice:
        """Where `segment`'s queries sit on the query axis (an empty slice for an absent segment)."""
        start = sum(self.size(s) for s in SEGMENTS[: SEGMENTS.index(segment)])
        return slice(start, start + self.size(segment))

    def without(self, segment: str) -> QueryLayout:
        """This layout less `segment`: the others keep their order."""
        self.size(segment)  # a KeyError for a name that is no segment
        return dataclasses.replace(self, **{f"num_{segment}": 0})

    def split(self, x: jax.Array, axis: int) -> dict[str, jax.Array]:
        """`x` with T entries along `axis` -> {segment: its part}, one entry per present segment, in query order."""
        if x.shape[axis] != self.total:
            raise ValueError(f"split: axis {axis} of shape {x.shape} has {x.shape[axis]} queries, not {self.total}")
        parts = {}
        for segment in self.segments:
            where = self.slice(segment)
            parts[segment] = jax.lax.slice_in_dim(x, where.start, where.stop, axis=axis)
        return parts

    def concatenate(self, parts: Mapping[str, jax.Array], axis: int) -> jax.Array:
        """{segment: part} for exactly the present segments -> one array with T entries along `axis`."""
        if set(parts) != set(self.segments):
            raise ValueError(f"concatenate: parts for {sorted(parts)}, but the layout has {list(self.segments)}")
        for segment in self.segments:
            if parts[segment].shape[axis] != self.size(segment):
                raise ValueError(
                    f"concatenate: {segment} has {parts[segment].shape[axis]} queries on axis {axis}, "
                    f"not {self.size(segment)}"
                )
        return jnp.concatenate([parts[segment] for segment in self.segments], axis=axis)

    def attention_mask(self, batch: int, denoising_group: jax.Array | None = None) -> jax.Array | None:
        """The decoder self-attention's mask: bool `[B, T, T]`, True where a query (row) may see another (column).

        None when every query may see every other (the one-to-one queries
        alone). `denoising_group`: int32 `[B, D]`, each denoising slot's group
        (-1: an invalid slot), from `denoising.contrastive_denoising_queries`;
        needed with D > 0.
        """
        if self.segments == ("one_to_one",):
            return None
        segment_of = np.repeat(np.arange(len(SEGMENTS)), [self.size(segment) for segment in SEGMENTS])  # [T]
        sees = np.array([[column in _SEES[row] for column in SEGMENTS] for row in SEGMENTS])
        mask = jnp.broadcast_to(
            jnp.asarray(sees[segment_of[:, None], segment_of[None, :]]), (batch, self.total, self.total)
        )
        if self.num_denoising:
            if denoising_group is None or denoising_group.shape != (batch, self.num_denoising):
                shape = None if denoising_group is None else denoising_group.shape
                raise ValueError(f"attention_mask: denoising_group of shape {shape}, not {(batch, self.num_denoising)}")
            within = self.slice("denoising")
            mask = mask.at[:, within, within].set(denoising.group_attention_mask(denoising_group))
        return mask
