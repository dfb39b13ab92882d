"""Box geometry written once: numpy, jax.numpy and TensorFlow give the same numbers."""

import jax.numpy as jnp
import numpy as np
import pytest
import tensorflow as tf

from input_pipeline import box_geometry

BOXES = np.array([[0, 0, 10, 20], [5, -5, 15, 8], [4, 4, 2, 9], [-3, 30, 40, 50]], np.float32)
OTHER = np.array([[5, 10, 10, 30], [0, 0, 10, 10], [0, 0, 9, 9], [0, 0, 1, 1]], np.float32)

BACKENDS = {"numpy": (np, np.asarray), "jax": (jnp, jnp.asarray), "tf": (tf, tf.constant)}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_values_on_every_backend(backend):
    xp, to_array = BACKENDS[backend]
    boxes, other = to_array(BOXES), to_array(OTHER)
    np.testing.assert_array_equal(np.asarray(box_geometry.area(boxes, xp=xp)), [200, 130, 0, 860])
    np.testing.assert_array_equal(np.asarray(box_geometry.intersection_area(boxes, other, xp=xp)), [50, 40, 0, 0])
    height, width = to_array(np.float32(12)), to_array(np.float32(25))
    np.testing.assert_array_equal(
        np.asarray(box_geometry.clip(boxes, height, width, xp=xp)),
        [[0, 0, 10, 20], [5, 0, 12, 8], [4, 4, 2, 9], [0, 25, 12, 25]],
    )
    xywh = box_geometry.yxyx_to_xywh(boxes, xp=xp)
    np.testing.assert_array_equal(np.asarray(xywh)[1], [-5, 5, 13, 10])
    np.testing.assert_array_equal(np.asarray(box_geometry.xywh_to_yxyx(xywh, xp=xp)), BOXES)


def test_clip_takes_one_size_per_image():
    boxes = np.array([[[-1, -1, 50, 50]], [[-1, -1, 50, 50]]], np.float32)  # [2 images, 1 box, 4]
    heights, widths = np.array([[10], [20]], np.float32), np.array([[30], [40]], np.float32)
    clipped = box_geometry.clip(boxes, heights, widths)
    np.testing.assert_array_equal(clipped, [[[0, 0, 10, 30]], [[0, 0, 20, 40]]])
