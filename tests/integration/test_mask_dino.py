"""Mask DINO end to end: four steps on the embedded shapes with their masks, an evaluation whose background
scoring gives mask AP beside box AP; a run stopped mid-way and restarted ends bit-identical;
`detector.predict`'s masks (RLE in the results, filled in the pictures) and the exported program's, in a fresh
process, equal to the predictor's."""

from __future__ import annotations

import json
import types

import hotcoco
import jax
import numpy as np
import pytest
from PIL import Image

import input_pipeline
from detector.loop import trainer
from detector.serving import artifact, bulk_prediction, coco_evaluation, prediction_shards
from detector.serving import predictor as predictor_lib
from detector.serving.coco_ap import RleMasks
from detector.training import checkpointing
from input_pipeline import batch as batch_layout
from input_pipeline import transforms
from tests.helpers.runs import checkpoint_steps, once_per_run, read_jsonl
from tests.helpers.tiny_config import make_dino_config
from tests.integration.test_export import run_in_fresh_process
from tests.integration.test_fault_tolerance import saved_state
from tests.integration.test_train import Preempted, WrappedTrainIterator

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

MASKS = {
    "model.dino.mask_dim": 8,
    "input.mask_stride": 4,
    "loss.set_prediction.mask_points": 64,
    "postprocess.score_threshold": 0.0,  # every detection kept: after 2 steps all scores are low
}
STEPS = {"total_steps": 4, "checkpoint_every_steps": 2, "eval_every_steps": 4, "log_every_steps": 1}


@pytest.fixture(scope="module")
def mask_run(tmp_path_factory, data_dir):
    """Four steps with masks, checkpoints at 2 and 4, an evaluation at 4; the best checkpoint chosen by mask AP."""
    config = make_dino_config(data_dir, **MASKS, **STEPS, best_metric="mask_AP")

    def produce(workdir):
        metrics = trainer.train_and_evaluate(config, str(workdir))
        (workdir / "returned_metrics.json").write_text(json.dumps(metrics))

    workdir = once_per_run(tmp_path_factory, "mask_run", produce)
    metrics = json.loads((workdir / "returned_metrics.json").read_text())
    return types.SimpleNamespace(workdir=workdir, config=config, metrics=metrics)


def test_mask_dino_trains_and_scores_mask_ap_in_the_loop(mask_run):
    metrics, workdir = mask_run.metrics, mask_run.workdir
    for key in ("AP", "mask_AP", "mask_AP50", "mask_AR100"):
        assert 0.0 <= metrics[key] <= 1.0, (key, metrics)
    train_rows = [row for row in read_jsonl(workdir / "train_metrics.jsonl") if "loss" in row]
    assert [row["step"] for row in train_rows] == [1, 2, 3, 4]
    assert all(row["mask_loss"] > 0 and row["dice_loss"] > 0 for row in train_rows)
    [evaluation] = read_jsonl(workdir / "eval_metrics.jsonl")
    assert evaluation["step"] == 4 and evaluation["mask_AP"] == pytest.approx(metrics["mask_AP"])
    assert json.dumps(evaluation)  # plain numbers, as every other metric
    assert checkpointing.restore_best(str(workdir))[0] == 4


def test_a_mask_run_stopped_after_step_2_resumes_to_the_uninterrupted_state(mask_run, data_dir, tmp_path, monkeypatch):
    """Stopped at step 3 (checkpoint 2 saved) and started again, the run ends bit for bit where the
    uninterrupted one did: parameters, optimizer state and every step's losses. Every DINO option is on
    (denoising noise, the hybrid branch and its matching, the quality-aware loss, mosaics, distinct query
    selection) beside the masks and the mask points of each (step, image): all functions of the checkpoint and
    the step. A real SIGKILL and restart of `detector.train`: tests/integration/test_fault_tolerance.py."""
    config = make_dino_config(data_dir, **MASKS, **STEPS, best_metric="mask_AP")
    real_create_train_iterator = input_pipeline.create_train_iterator
    starts = []

    def dies_at_step_3(batch, step):
        if step == 3:
            raise Preempted
        return batch

    def create_train_iterator(config, *, start_position=0, first_row=None):
        starts.append(start_position)
        batches = real_create_train_iterator(config, start_position=start_position, first_row=first_row)
        return batches if len(starts) > 1 else WrappedTrainIterator(batches, config.global_batch_size, dies_at_step_3)

    monkeypatch.setattr(input_pipeline, "create_train_iterator", create_train_iterator)
    with pytest.raises(Preempted):
        trainer.train_and_evaluate(config, str(tmp_path))
    assert checkpoint_steps(tmp_path) == [2]
    trainer.train_and_evaluate(config, str(tmp_path))
    assert starts == [0, 2 * config.global_batch_size]

    final, expected = saved_state(tmp_path, 4), saved_state(mask_run.workdir, 4)
    leaves = jax.tree_util.tree_leaves_with_path(expected)
    assert any("pixel_embedding" in jax.tree_util.keystr(path) for path, _ in leaves)
    assert any("one_to_many_content" in jax.tree_util.keystr(path) for path, _ in leaves)
    for (path, wanted), actual in zip(leaves, jax.tree.leaves(final), strict=True):
        np.testing.assert_array_equal(actual, wanted, err_msg=jax.tree_util.keystr(path))

    def losses(workdir):
        rows = [row for row in read_jsonl(workdir / "train_metrics.jsonl") if "loss" in row]
        return {row["step"]: (row["loss"], row["mask_loss"], row["dice_loss"]) for row in rows}

    assert losses(tmp_path) == losses(mask_run.workdir)


IMAGE_SIZES = ((120, 90), (48, 160), (64, 64))  # (h, w): taller, wider and the network input's own
PREDICT = {"postprocess.max_detections": 5}


def write_images(folder):
    rng = np.random.default_rng(0)
    folder.mkdir()
    paths = []
    for i, (height, width) in enumerate(IMAGE_SIZES):
        paths.append(folder / f"image_{i}.png")
        Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(paths[-1])
    return paths


def decode(segmentations) -> np.ndarray:
    """COCO RLE dicts -> bool [N, H, W]."""
    masks = np.asarray(hotcoco.mask.decode(list(segmentations)), bool)
    return np.moveaxis(masks.reshape(*masks.shape[:2], -1), -1, 0)


def test_predict_writes_each_mask_as_rle_and_draws_it(mask_run, data_dir, tmp_path):
    config = make_dino_config(data_dir, **MASKS, **PREDICT)
    predictor = predictor_lib.load_predictor(config, str(mask_run.workdir), "last")
    paths = write_images(tmp_path / "photos")
    out = tmp_path / "out"
    bulk_prediction.predict(
        predictor,
        str(out),
        inputs=[str(tmp_path / "photos")],
        workdir=str(mask_run.workdir),
        checkpoint="last",
        coco_results=True,
    )
    results = json.loads((out / "detections.json").read_text())
    rows = prediction_shards.read_merged(str(out)).to_pylist()
    assert len(results) == 5 * len(paths) and [len(r["masks_rle"]) for r in rows] == [5] * len(paths)
    for image_id, (height, width) in enumerate(IMAGE_SIZES):
        mine = [d for d in results if d["image_id"] == image_id]
        assert all(d["segmentation"]["size"] == [height, width] for d in mine)
        # The shard's RLE strings are the results file's.
        assert [d["segmentation"]["counts"] for d in mine] == rows[image_id]["masks_rle"]
        masks = decode(d["segmentation"] for d in mine)
        picture = np.asarray(Image.open(out / "pictures" / f"image_{image_id}.png").convert("RGB"))
        original = np.asarray(Image.open(paths[image_id]).convert("RGB"))
        # Every mask pixel is tinted (a fill changes every pixel it covers, the 0.45 blend of two different
        # colours), outside all masks and boxes' outlines and tags the photo is untouched.
        covered = masks.any(axis=0)
        if covered.any():
            changed = np.any(picture != original, axis=-1)
            assert changed[covered].mean() > 0.9
        # The score is Mask DINO's: at most the class score that ranked the detection.
        assert all(0.0 <= d["score"] <= 1.0 for d in mine)


# What a user of the artifact runs: no config, no workdir, only the exported directory; masks as COCO RLE.
LOAD_AND_PREDICT_MASKS = """
import json, sys
import numpy as np
from PIL import Image
from detector.serving import artifact
directory, output, *paths = sys.argv[1:]
detector = artifact.load_artifact(directory)
results = detector.predict([np.asarray(Image.open(path).convert("RGB")) for path in paths])
with open(output, "w") as f:
    json.dump([{"boxes_yxyx": r["boxes_yxyx"].tolist(), "scores": r["scores"].tolist(),
                "labels": r["labels"].tolist(), "masks": r["masks"].to_coco()} for r in results], f)
"""


def test_exported_program_in_a_fresh_process_gives_the_predictors_masks(mask_run, data_dir, tmp_path):
    config = make_dino_config(data_dir, **MASKS, **PREDICT)
    predictor = predictor_lib.load_predictor(config, str(mask_run.workdir), "last")
    exported = artifact.export_predictor(predictor, batch_size=2)
    directory = artifact.write_artifact(exported, predictor, tmp_path / "artifact")
    metadata = json.loads((directory / artifact.METADATA_FILE).read_text())
    assert metadata["mask_stride"] == 4
    assert metadata["outputs"]["masks"] == {"shape": [2, 5, 16, 16], "dtype": "float32"}  # 64 px input
    assert "instance_masks" in metadata["output_meaning"]["masks"]

    paths = write_images(tmp_path / "photos")
    output = tmp_path / "exported.json"
    run_in_fresh_process(LOAD_AND_PREDICT_MASKS, directory, output, paths)
    got = json.loads(output.read_text())

    # The predictor's own path to masks (`batch_predictions`, as detector.predict and evaluation take it).
    images = [np.asarray(Image.open(path).convert("RGB")) for path in paths]
    opts = transforms.TransformOptions.from_config(predictor.config)
    rows = [predictor_lib.network_input(image, i, opts) for i, image in enumerate(images)]
    blank = batch_layout.empty_example(predictor.config.input.image_size, predictor.config.input.max_boxes)
    rows += [blank] * (predictor.batch_size - len(rows))
    outputs = jax.device_get(predictor(predictor.global_batch({k: np.stack([r[k] for r in rows]) for k in blank})))
    want = coco_evaluation.batch_predictions(outputs, predictor.dataset_info.label_to_category_id).detections
    for image_id, exported_image in enumerate(got):
        mine = np.flatnonzero(want.image_ids == image_id)
        assert len(exported_image["scores"]) == len(mine) == 5
        want_masks = decode(want.masks.select(mine).to_coco())
        got_masks = decode(exported_image["masks"])
        labels = [predictor.dataset_info.label_to_category_id[v] for v in exported_image["labels"]]
        # Two programs (batch 2 against the predictor's), the same detections: a detection's twin has its
        # class, its box, its mask to a few pixels at most where a logit is within rounding of 0, its score.
        for k in range(len(mine)):
            twins = [
                j
                for j in range(len(labels))
                if labels[j] == want.category_ids[mine[k]]
                and abs(exported_image["scores"][j] - want.scores[mine[k]]) <= 2e-5
            ]
            assert twins, (image_id, k)
            differing = min(np.sum(got_masks[j] != want_masks[k]) for j in twins)
            assert differing <= 2, (image_id, k, differing)
        assert RleMasks.from_coco(exported_image["masks"]).heights.tolist() == [IMAGE_SIZES[image_id][0]] * 5


def test_the_best_checkpoint_metric_is_checked_before_training(data_dir, tmp_path):
    from detector.errors import ConfigError
    from detector.loop.evaluator import best_metric

    assert best_metric(make_dino_config(data_dir, **MASKS, best_metric="mask_AP")) == "mask_AP"
    with pytest.raises(ConfigError, match=r"best_metric='mask_AP' needs a model that predicts masks"):
        best_metric(make_dino_config(data_dir, best_metric="mask_AP"))
    with pytest.raises(ConfigError, match=r"best_metric='segm_AP'; use a COCO stat name"):
        best_metric(make_dino_config(data_dir, best_metric="segm_AP"))
