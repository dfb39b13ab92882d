"""A small input-pipeline config (no model): the synthetic dataset at 64 px, 48x56 network input."""

import ml_collections

SIZE = 64  # generated image side
NET = (48, 56)  # network input (H, W), deliberately not the image size
N_TRAIN, N_EVAL = 64, 20
MAX_BOXES = 8


def make_config(data_dir, **overrides):
    config = ml_collections.ConfigDict(
        {
            "seed": 0,
            "global_batch_size": 8,
            "total_steps": 8,
            "dataset": {
                "name": "synthetic_shapes",
                "data_dir": str(data_dir),
                "train_split": "train",
                "eval_split": "validation",
                "num_train_examples": N_TRAIN,
                "num_eval_examples": N_EVAL,
                "image_size": SIZE,
                "cache_dir": None,
                "prepare_workers": 0,
                "train_json": None,
                "train_images": None,
                "eval_json": None,
                "eval_images": None,
                "include_negatives": True,
            },
            "input": {
                "image_size": NET,
                "max_boxes": MAX_BOXES,
                "scale_jitter": (0.8, 1.25),
                "horizontal_flip": True,
                "mean_rgb": (123.675, 116.28, 103.53),
                "std_rgb": (58.395, 57.12, 57.375),
                "prefetch": 2,
                "min_box_size": 2.0,
                "min_visible_fraction": 0.0,
                "color_jitter": 0.0,
                "resize_on_device": False,
                "source_size": None,
                "max_bad_fraction": 0.5,
                "num_threads": None,
                "mosaic_probability": 0.0,
                "mosaic_until": 0.5,
                "mask_stride": 0,
            },
        }
    )
    config.update_from_flattened_dict(overrides)
    return config
