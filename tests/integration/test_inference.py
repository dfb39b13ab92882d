"""After training: evaluate a workdir (COCO and per-class tables) and predict on a folder of images.

Both use test_train's reference run (4 steps of the tiny config) and its
compilation cache. Four steps detect little above the default score
threshold, so these runs lower it: what is checked is the plumbing (which
parameters, what is scored, where boxes are drawn), not detection quality.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval

import input_pipeline
from detector.serving import bulk_prediction, coco_evaluation, drawing, image_sources, prediction_shards
from detector.serving import predictor as predictor_lib
from detector.serving.predictor import load_predictor
from tests.helpers import REPO_ROOT
from tests.helpers.tiny_config import as_flags, make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]


def low_threshold_config(data_dir, threshold=0.001):
    return make_config(data_dir, **{"postprocess.score_threshold": threshold})


def test_evaluate_prints_both_tables_and_scores_what_it_writes(reference_run, data_dir, tmp_path, capsys):
    config = low_threshold_config(data_dir)
    report = predictor_lib.evaluate_workdir(config, str(reference_run.workdir), "last", str(tmp_path))
    printed = capsys.readouterr().out
    assert report["step"] == 4 and report["images"] == config.dataset.num_eval_examples
    assert "AP50" in printed and "AR100" in printed
    names = input_pipeline.get_dataset_info(config).class_names
    assert [c["name"] for c in report["per_class"]] == list(names)
    for name in names:
        assert any(line.startswith(name) for line in printed.splitlines()), printed

    # pycocotools itself, on the written detections, gives the reported numbers.
    detections = json.loads((tmp_path / predictor_lib.DETECTIONS_FILE).read_text())
    assert detections and json.loads((tmp_path / predictor_lib.METRICS_FILE).read_text()) == report
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = input_pipeline.coco_ground_truth(config)
        gt.createIndex()
        coco_eval = COCOeval(gt, gt.loadRes(detections), iouType="bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    for name, value in zip(coco_evaluation.COCO_METRIC_NAMES, coco_eval.stats):
        assert report["metrics"][name] == pytest.approx(value, abs=1e-12), name
    # Per class: pycocotools restricted to one category gives that class's AP.
    first = report["per_class"][0]
    coco_eval.params.catIds = [first["category_id"]]
    with contextlib.redirect_stdout(io.StringIO()):
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    assert first["AP"] == pytest.approx(max(coco_eval.stats[0], -1.0), abs=1e-12)
    assert sum(c["instances"] for c in report["per_class"]) == sum(
        not a.get("iscrowd", 0) for a in gt.dataset["annotations"]
    )


def test_checkpoint_choice(reference_run, data_dir):
    config = make_config(data_dir)
    assert load_predictor(config, str(reference_run.workdir), "2").step == 2
    assert load_predictor(config, str(reference_run.workdir), "best").step == 4
    with pytest.raises(FileNotFoundError, match=r"--checkpoint=3: no such checkpoint .* \(steps there: 2, 4\)"):
        load_predictor(config, str(reference_run.workdir), "3")
    with pytest.raises(FileNotFoundError, match="does not exist: train first"):
        load_predictor(config, str(reference_run.workdir / "nowhere"), "last")


@pytest.fixture(scope="module")
def photo_folder(tmp_path_factory):
    """Mixed sizes and formats, a grayscale image, a nested folder, and a file that is not an image."""
    folder = tmp_path_factory.mktemp("photos")
    rng = np.random.default_rng(0)
    (folder / "nested").mkdir()
    Image.fromarray(rng.integers(0, 255, (120, 90, 3), np.uint8)).save(folder / "tall.jpg", quality=90)
    Image.fromarray(rng.integers(0, 255, (48, 160, 3), np.uint8)).save(folder / "wide.png")
    Image.fromarray(rng.integers(0, 255, (64, 64), np.uint8)).save(folder / "nested" / "gray.png")
    (folder / "broken.jpg").write_bytes(b"\xff\xd8 not really a jpeg")
    return folder


def test_predict_writes_coco_results_and_draws_the_boxes(reference_run, data_dir, photo_folder, tmp_path):
    config = low_threshold_config(data_dir, threshold=0.0)
    config.postprocess.max_detections = 5
    predictor = load_predictor(config, str(reference_run.workdir), "last")
    summary = bulk_prediction.predict(
        predictor,
        str(tmp_path),
        inputs=[str(photo_folder)],
        workdir=str(reference_run.workdir),
        checkpoint="last",
        coco_results=True,
    )
    assert (summary.images, summary.unreadable, summary.detections) == (4, 1, 15)
    images = json.loads((tmp_path / "images.json").read_text())
    assert [(pathlib.Path(e["file_name"]).name, e["height"], e["width"]) for e in images] == [
        ("gray.png", 64, 64),
        ("tall.jpg", 120, 90),
        ("wide.png", 48, 160),
    ]  # broken.jpg is listed in the shards with its error, not among the COCO images
    rows = prediction_shards.read_merged(str(tmp_path)).to_pylist()
    assert [pathlib.Path(r["file"]).name for r in rows] == ["broken.jpg", "gray.png", "tall.jpg", "wide.png"]
    assert rows[0]["error"] and rows[0]["scores"] == [] and all(r["error"] is None for r in rows[1:])
    results = json.loads((tmp_path / "detections.json").read_text())
    assert {d["image_id"] for d in results} == {e["id"] for e in images}
    assert all(sum(d["image_id"] == e["id"] for d in results) == 5 for e in images)  # max_detections

    # The picture of the wide image: its best box outlined in its class's colour, at original size.
    wide = next(e for e in images if e["file_name"].endswith("wide.png"))
    picture = np.asarray(Image.open(tmp_path / "pictures" / "wide.png").convert("RGB"))
    assert picture.shape == (48, 160, 3)
    assert sorted(os.listdir(tmp_path / "pictures")) == ["gray.png", "tall.png", "wide.png"]
    best = max((d for d in results if d["image_id"] == wide["id"]), key=lambda d: d["score"])
    label = predictor.dataset_info.label_to_category_id.index(best["category_id"])
    x, y, w, h = best["bbox"]
    left, top, right, bottom = (int(np.floor(x)), int(np.floor(y)), int(np.ceil(x + w)) - 1, int(np.ceil(y + h)) - 1)
    # The left and bottom edges (label tags sit at the top and may cover other boxes' edges).
    edges = np.concatenate([picture[top : bottom + 1, left], picture[bottom, left : right + 1]])
    assert edges.shape[0] > 2
    matches = np.all(edges == drawing.class_color(label), axis=-1)
    assert matches.mean() > 0.5, (best, edges)


def test_predicting_the_eval_split_gives_the_evaluations_detections(reference_run, data_dir, tmp_path):
    """The split's rows carry the dataset's ids, so its COCO results are what evaluation scored."""
    config = low_threshold_config(data_dir)
    evaluation = tmp_path / "evaluation"
    predictor_lib.evaluate_workdir(config, str(reference_run.workdir), "last", str(evaluation))
    predictor = load_predictor(config, str(reference_run.workdir), "last")
    output = tmp_path / "predicted"
    bulk_prediction.predict(
        predictor,
        str(output),
        split_source=lambda: image_sources.SplitImages(input_pipeline.prepare_split(config, "eval"), "eval"),
        workdir=str(reference_run.workdir),
        checkpoint="last",
        coco_results=True,
        pictures=0,
    )

    def key(d):
        return (d["image_id"], d["category_id"], d["score"], tuple(d["bbox"]))

    predicted = sorted(json.loads((output / "detections.json").read_text()), key=key)
    evaluated = sorted(json.loads((evaluation / predictor_lib.DETECTIONS_FILE).read_text()), key=key)
    assert len(predicted) == len(evaluated) > 0
    for a, b in zip(predicted, evaluated, strict=True):
        assert (a["image_id"], a["category_id"]) == (b["image_id"], b["category_id"])
        np.testing.assert_allclose(a["bbox"], b["bbox"], atol=2e-3)
        assert a["score"] == pytest.approx(b["score"], abs=1e-5)
    assert not os.path.exists(output / "pictures")


def test_a_stopped_run_resumes_where_its_commits_end(reference_run, data_dir, photo_folder, tmp_path):
    """A run that stops after its first committed batch (its later rows never committed) and the same command
    again: each image once, as one uninterrupted run writes them."""
    config = low_threshold_config(data_dir, threshold=0.0)
    predictor = load_predictor(config, str(reference_run.workdir), "last", batch_size=8)
    many = tmp_path / "many"
    many.mkdir()
    for i in range(20):  # 20 images in batches of 8: 3 batches
        (many / f"{i:02d}.png").symlink_to(photo_folder / "wide.png")
    common = dict(inputs=[str(many)], workdir=str(reference_run.workdir), checkpoint="last", pictures=0)
    whole = bulk_prediction.predict(predictor, str(tmp_path / "whole"), **common)

    class Stop(Exception):
        pass

    real_add = prediction_shards.ShardWriter.add

    def add_then_stop(writer, table, batch_index):
        real_add(writer, table, batch_index)
        if batch_index == 0:
            writer.commit()
        elif batch_index == 1:
            raise Stop  # batch 1 added, never committed

    prediction_shards.ShardWriter.add = add_then_stop
    try:
        with pytest.raises(Stop):
            bulk_prediction.predict(predictor, str(tmp_path / "resumed"), **common)
    finally:
        prediction_shards.ShardWriter.add = real_add
    manifest = json.loads(next((tmp_path / "resumed" / "manifests").glob("*.json")).read_text())
    assert manifest["next_batch"] == 1
    resumed = bulk_prediction.predict(predictor, str(tmp_path / "resumed"), **common)
    assert resumed.images == whole.images == 20 and len(resumed.parts) == 2
    assert (
        prediction_shards.read_merged(str(tmp_path / "resumed")).to_pylist()
        == prediction_shards.read_merged(str(tmp_path / "whole")).to_pylist()
    )


def test_evaluate_command_prints_the_tables(reference_run, data_dir, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "detector.evaluate",
            "--config=configs/default.py",
            f"--workdir={reference_run.workdir}",
            "--checkpoint=best",
            f"--output={tmp_path}",
            *as_flags(data_dir),
        ],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "COCO bbox metrics of step 4 (best)" in result.stdout
    assert "per class" in result.stdout and "rectangle" in result.stdout
