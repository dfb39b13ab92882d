"""Builds small COCO-format folders (instances JSON + JPEG/PNG files) for tests."""

import json

import numpy as np
from PIL import Image

from input_pipeline.datasets import synthetic_shapes as ss

# Synthetic-shapes label -> a COCO-style category id: gapped and not in label order
# of appearance, so a missing remap shows up as wrong classes.
CATEGORY_IDS = (3, 7, 12, 90)
CATEGORIES = [{"id": c, "name": n} for c, n in zip(CATEGORY_IDS, ss.CLASS_NAMES)]


def write_folder(root, split, num_images, *, size=64, crowd_every=3, negative_ids=(2,), first_id=100):
    """Writes `root/split/` images and `root/split.json`; returns (json_path, image_dir, data).

    Image ids start at `first_id` and step by 7 (ids are not 1..N). Even ids are
    JPEG, odd ids PNG. Every `crowd_every`-th image also gets a crowd box
    (iscrowd=1) over its first object. Images whose index is in `negative_ids`
    keep their pixels but list no annotations.
    """
    image_dir = root / split
    image_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for index in range(num_images):
        image_id = first_id + 7 * index
        ex = ss.generate_example(split, index, size)
        name = f"{image_id:06d}." + ("jpg" if image_id % 2 == 0 else "png")
        Image.fromarray(ex.image).save(image_dir / name, quality=95)
        images.append({"id": image_id, "file_name": name, "width": size, "height": size})
        if index in negative_ids:
            continue
        for (y0, x0, y1, x1), label in zip(ex.boxes.tolist(), ex.labels.tolist()):
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": CATEGORY_IDS[label],
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": (x1 - x0) * (y1 - y0),
                    "iscrowd": 0,
                }
            )
        if crowd_every and index % crowd_every == 0:
            y0, x0, y1, x1 = ex.boxes[0].tolist()
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": CATEGORY_IDS[int(ex.labels[0])],
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": (x1 - x0) * (y1 - y0),
                    "iscrowd": 1,
                }
            )
    data = {"images": images, "annotations": annotations, "categories": CATEGORIES}
    json_path = root / f"{split}.json"
    json_path.write_text(json.dumps(data))
    return str(json_path), str(image_dir), data


def coco_json_overrides(root, num_train=16, num_eval=8):
    """Dotted config overrides that point the trainer at a fresh COCO folder under `root`."""
    train_json, train_images, _ = write_folder(root, "train", num_train)
    eval_json, eval_images, _ = write_folder(root, "validation", num_eval)
    return {
        "dataset.name": "coco_json",
        "dataset.train_json": train_json,
        "dataset.train_images": train_images,
        "dataset.eval_json": eval_json,
        "dataset.eval_images": eval_images,
    }


def first_box_yxyx(data, image_id):
    boxes = [a["bbox"] for a in data["annotations"] if a["image_id"] == image_id and not a["iscrowd"]]
    x, y, w, h = boxes[0]
    return np.array([y, x, y + h, x + w], np.float32)
