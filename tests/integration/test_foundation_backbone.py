"""A DINO on a DINOv3-style backbone trained through LoRA, end to end from the command line.

`python -m detector.train --config=configs/dino_dinov3_tiny.py:lora` (the
config argument picks the backbone's training mode) at 64 px for two steps:
it trains, evaluates in the loop, predicts from its checkpoint and exports
with the adapters merged into the ViT's kernels (that the merged program
detects what the adapted model does, and that an artifact runs in a fresh
process, are tested on smaller models: tests/detector/training/
test_backbone_training.py and tests/integration/test_export.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from configs import dino_dinov3_tiny
from detector.serving import artifact
from detector.serving.predictor import load_predictor
from tests.helpers import REPO_ROOT
from tests.helpers.runs import flat, read_jsonl
from tests.helpers.tiny_config import DINO_OVERRIDES, OVERRIDES
from tests.integration.test_export import expected_detections, subprocess_env

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

# The tiny DINO of the other end-to-end tests, on a 32-wide, 2-block DINOv3-style ViT with rank-2 adapters.
BACKBONE = {
    "model.backbone.embed_dim": 32,
    "model.backbone.depth": 2,
    "model.backbone.num_heads": 2,
    "model.backbone.mlp_hidden": 64,
    "model.backbone.lora_rank": 2,
    "model.backbone.lora_alpha": 4.0,
}
STEPS = {"total_steps": 2, "checkpoint_every_steps": 2, "eval_every_steps": 2, "log_every_steps": 1}
RETINANET_ONLY = ("model.backbone.width", "model.fpn_features", "model.head_features", "model.head_convs")


def overrides(data_dir) -> dict:
    values = {"dataset.data_dir": str(data_dir), **OVERRIDES, **DINO_OVERRIDES, **BACKBONE, **STEPS}
    values.update({"postprocess.score_threshold": 0.0, "postprocess.max_detections": 10})
    return {key: value for key, value in values.items() if key not in RETINANET_ONLY}


def test_dinov3_style_lora_dino_trains_evaluates_and_exports_from_the_command_line(data_dir, tmp_path):
    workdir = tmp_path / "run"
    values = overrides(data_dir)
    flags = [f"--config.{key}={str(value).replace(' ', '')}" for key, value in values.items()]
    result = subprocess.run(
        [sys.executable, "-m", "detector.train", "--config=configs/dino_dinov3_tiny.py:lora", f"--workdir={workdir}"]
        + flags,
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert [row["step"] for row in read_jsonl(workdir / "train_metrics.jsonl") if "loss" in row] == [1, 2]
    evaluations = read_jsonl(workdir / "eval_metrics.jsonl")
    assert evaluations and 0.0 <= evaluations[-1]["AP"] <= 1.0

    config = dino_dinov3_tiny.get_config("lora")
    config.lock()
    config.update_from_flattened_dict(values)
    predictor = load_predictor(config, str(workdir), "last")
    assert any(name.endswith("lora_b") for name in flat(predictor.params))
    images = [np.random.default_rng(0).integers(0, 256, (48, 80, 3), np.uint8)]
    (detections,) = expected_detections(predictor, images)
    assert len(detections["scores"]) == 10 and np.isfinite(detections["boxes_yxyx"]).all()
    directory = artifact.write_artifact(
        artifact.export_predictor(predictor, batch_size=2), predictor, tmp_path / "artifact"
    )
    metadata = json.loads((directory / artifact.METADATA_FILE).read_text())
    assert metadata["outputs"]["boxes"]["shape"] == [2, 10, 4]
