"""The default recipe shrunk to 64 px synthetic images and a tiny RetinaNet, for tests that train.

One set of overrides serves both ways of running: `make_config` for the
trainer called in-process, `as_flags` for `python -m detector.train`.
"""

from __future__ import annotations

from configs import default

OVERRIDES = {
    "dataset.num_train_examples": 64,
    "dataset.num_eval_examples": 16,
    "dataset.image_size": 64,
    "input.image_size": (64, 64),
    "input.max_boxes": 8,
    "global_batch_size": 8,
    "eval_batch_size": 8,
    "model.fpn_features": 16,
    "model.head_features": 16,
    "model.head_convs": 1,
    "model.backbone.width": 8,
    "log_every_steps": 2,
    "total_steps": 4,
    "checkpoint_every_steps": 2,
    "eval_every_steps": 4,
}


def make_config(data_dir, **overrides):
    """The tiny config reading synthetic data in `data_dir`; `overrides` use dotted keys."""
    config = default.get_config()
    config.dataset.data_dir = str(data_dir)
    config.lock()  # A misspelt override fails instead of adding a key nobody reads.
    config.update_from_flattened_dict({**OVERRIDES, **overrides})
    return config


def as_flags(data_dir, **overrides) -> list[str]:
    """The same config as command-line flags for `python -m detector.train --config=configs/default.py`."""
    values = {"dataset.data_dir": str(data_dir), **OVERRIDES, **overrides}
    # No spaces inside tuples, so the flags survive a shell's word splitting too.
    return [f"--config.{key}={str(value).replace(' ', '')}" for key, value in values.items()]


# The tiny DINO at the same 64 px: 85 pyramid positions, so 32 queries.
DINO_OVERRIDES = {
    "model.name": "dino",
    "model.dino.hidden_dim": 16,
    "model.dino.num_heads": 2,
    "model.dino.ffn_dim": 32,
    "model.dino.encoder_layers": 1,
    "model.dino.decoder_layers": 2,
    "model.dino.num_queries": 32,
    "model.dino.denoising_pairs": 16,  # 32 query slots for the 8 box slots
    # Every training option on: the hybrid branch (32 + 48 of the 85
    # proposals; 6 copies of the 8 box slots), a quality-aware class loss,
    # mosaics (every example of the run: a restart reads mosaics too),
    # distinct query selection and NMS on the predictions.
    "model.dino.one_to_many_queries": 48,
    "model.dino.one_to_many_repeats": 6,
    "model.dino.distinct_query_iou": 0.8,
    "loss.set_prediction.class_loss": "mal",
    "input.mosaic_probability": 1.0,
    "input.mosaic_until": 1.0,
    "postprocess.query_nms_iou_threshold": 0.7,
}


def make_dino_config(data_dir, **overrides):
    """`make_config` with the DINO family instead of the RetinaNet."""
    return make_config(data_dir, **{**DINO_OVERRIDES, **overrides})
