"""Exporting a trained detector: the serialized program, in a fresh process, detects what the predictor does.

Uses test_train's reference run (4 steps of the tiny config) and its
compilation cache. A score threshold of 0 fills every detection slot, so the
comparison covers max_detections boxes per image, not just the few that four
steps of training would score highly.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest
from PIL import Image

from detector.errors import ConfigError
from detector.serving import artifact
from detector.serving import predictor as predictor_lib
from detector.serving.predictor import load_predictor
from input_pipeline import batch as batch_layout
from input_pipeline import transforms
from tests.helpers import REPO_ROOT
from tests.helpers.tiny_config import as_flags, make_config

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("compilation_cache_dir")]

EXPORT_OVERRIDES = {"postprocess.score_threshold": 0.0, "postprocess.max_detections": 10}
MAX_DETECTIONS = EXPORT_OVERRIDES["postprocess.max_detections"]
IMAGE_SIZES = ((120, 90), (48, 160), (64, 64))  # (h, w): taller, wider and the same as the network input

# What a user of the artifact runs: no config, no workdir, only the exported directory.
LOAD_AND_PREDICT = """
import sys
import numpy as np
from PIL import Image
from detector.serving import artifact
directory, output, *paths = sys.argv[1:]
detector = artifact.load_artifact(directory)
results = detector.predict([np.asarray(Image.open(path).convert("RGB")) for path in paths])
np.savez(output, **{f"{key}_{i}": value for i, result in enumerate(results) for key, value in result.items()})
"""


def subprocess_env():
    return {
        **os.environ,
        "PYTHONPATH": str(REPO_ROOT),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": os.environ.get("XLA_FLAGS", ""),
        # The commands share the module's compilation cache (`compilation_cache_dir`, once per
        # test run) instead of each compiling the same programs again; none: off.
        "JAX_COMPILATION_CACHE_DIR": jax.config.jax_compilation_cache_dir or "",
    }


def run_in_fresh_process(script: str, directory, output, paths) -> None:
    """`python -c script DIRECTORY OUTPUT PATH...` in a new process, as a user of the artifact runs it."""
    result = subprocess.run(
        [sys.executable, "-c", script, str(directory), str(output), *map(str, paths)],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]


def expected_detections(predictor, images):
    """The in-process predictor's detections per image, mapped to original pixels independently of artifact."""
    opts = transforms.TransformOptions.from_config(predictor.config)
    rows = [predictor_lib.network_input(image, i, opts) for i, image in enumerate(images)]
    blank = batch_layout.empty_example(predictor.config.input.image_size, predictor.config.input.max_boxes)
    rows += [blank] * (predictor.batch_size - len(rows))
    local_batch = {key: np.stack([row[key] for row in rows]) for key in blank}
    outputs = jax.device_get(predictor(predictor.global_batch(local_batch)))
    expected = []
    for i, image in enumerate(images):
        height, width = image.shape[:2]
        network_height, network_width = predictor.config.input.image_size
        scale = min(network_height / height, network_width / width)
        keep = outputs["valid"][i]
        expected.append(
            {
                "boxes_yxyx": np.clip(outputs["boxes"][i][keep] / scale, 0.0, [height, width, height, width]),
                "scores": outputs["scores"][i][keep],
                "labels": outputs["classes"][i][keep],
            }
        )
    return expected


def assert_fresh_process_detects_what_the_predictor_does(directory, predictor, tmp_path, max_detections: int):
    """The artifact in `directory`, loaded and run in a new Python process on three images of other sizes,
    gives the in-process predictor's detections, all `max_detections` of them (score threshold 0)."""
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (height, width, 3), np.uint8) for height, width in IMAGE_SIZES]
    paths = []
    for i, image in enumerate(images):
        paths.append(tmp_path / f"image_{i}.png")
        Image.fromarray(image).save(paths[-1])
    output = tmp_path / "exported_detections.npz"
    run_in_fresh_process(LOAD_AND_PREDICT, directory, output, paths)
    got = np.load(output)
    for i, want in enumerate(expected_detections(predictor, images)):
        assert len(want["scores"]) == max_detections  # threshold 0: every slot holds a detection
        exported = {key: got[f"{key}_{i}"] for key in ("boxes_yxyx", "scores", "labels")}
        assert_same_detections(exported, want)
        height, width = IMAGE_SIZES[i]
        assert np.all(got[f"boxes_yxyx_{i}"] <= [height, width, height, width])


def assert_same_detections(got, want, score_rtol=1e-5, score_atol=1e-6, box_atol=1e-3):
    """Two programs' detections of one image agree up to the order of near-tied scores.

    The programs differ (batch size, device count, constants folded), so
    scores differ by rounding, and where two are tied to within it, top-k and
    NMS may keep either: each detection must have its twin (label, score,
    box) in the other set, or else a partner without a twin whose score is
    tied with its own, a choice that rounding decided.
    """
    assert len(got["scores"]) == len(want["scores"])

    def close(a, b):
        return abs(a - b) <= score_atol + score_rtol * abs(b)

    unpaired_got = set(range(len(got["scores"])))
    unpaired_want = []
    for k in np.argsort(-want["scores"], kind="stable"):
        twin = next(
            (
                j
                for j in sorted(unpaired_got)
                if got["labels"][j] == want["labels"][k]
                and close(got["scores"][j], want["scores"][k])
                and np.allclose(got["boxes_yxyx"][j], want["boxes_yxyx"][k], atol=box_atol)
            ),
            None,
        )
        if twin is None:
            unpaired_want.append(k)
        else:
            unpaired_got.remove(twin)
    for k in unpaired_want:
        tied = [j for j in unpaired_got if close(got["scores"][j], want["scores"][k])]
        assert tied, (
            f"no detection like {k} ({want['labels'][k]}, {want['scores'][k]}, {want['boxes_yxyx'][k]}) in {got}"
        )


def test_exported_program_in_a_fresh_process_detects_what_the_predictor_does(reference_run, data_dir, tmp_path):
    config = make_config(data_dir, **EXPORT_OVERRIDES)
    predictor = load_predictor(config, str(reference_run.workdir), "last")
    exported = artifact.export_predictor(predictor, batch_size=2)
    assert set(exported.platforms) == {"cpu", "cuda"}
    directory = artifact.write_artifact(exported, predictor, tmp_path / "artifact")

    metadata = json.loads((directory / artifact.METADATA_FILE).read_text())
    assert metadata["batch_size"] == 2 and metadata["step"] == 4
    assert metadata["input"]["shape"] == [2, 64, 64, 3]
    assert metadata["input"]["mean_rgb"] == list(config.input.mean_rgb)
    assert metadata["outputs"] == {
        "boxes": {"shape": [2, MAX_DETECTIONS, 4], "dtype": "float32"},
        "scores": {"shape": [2, MAX_DETECTIONS], "dtype": "float32"},
        "classes": {"shape": [2, MAX_DETECTIONS], "dtype": "int32"},
        "valid": {"shape": [2, MAX_DETECTIONS], "dtype": "bool"},
    }
    assert metadata["class_names"] == list(predictor.dataset_info.class_names)
    assert metadata["label_to_category_id"] == list(predictor.dataset_info.label_to_category_id)

    # Three images on a program of two: the second call is padded with a blank image.
    assert_fresh_process_detects_what_the_predictor_does(directory, predictor, tmp_path, MAX_DETECTIONS)

    with pytest.raises(ConfigError, match="at least 1"):
        artifact.export_predictor(predictor, batch_size=0)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        artifact.load_artifact(tmp_path / "nowhere")


def run_export_command(reference_run, data_dir, *extra):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "detector.export",
            "--config=configs/default.py",
            f"--workdir={reference_run.workdir}",
            *extra,
            *as_flags(data_dir),
        ],
        cwd=REPO_ROOT,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_export_command_writes_the_artifact(reference_run, data_dir, tmp_path):
    result = run_export_command(reference_run, data_dir, "--checkpoint=best", f"--output={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported step 4 (best) for batches of 1 on cpu/cuda to {tmp_path}" in result.stdout
    assert (tmp_path / artifact.EXPORTED_FILE).stat().st_size > 0
    metadata = json.loads((tmp_path / artifact.METADATA_FILE).read_text())
    assert metadata["batch_size"] == 1 and metadata["step"] == 4


def test_export_command_reports_a_missing_checkpoint_in_one_line(reference_run, data_dir, tmp_path):
    result = run_export_command(reference_run, data_dir, "--checkpoint=99", f"--output={tmp_path}")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and "--checkpoint=99" in last_line, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / artifact.EXPORTED_FILE).exists()


def test_export_command_writes_an_onnx_model_that_detects_what_the_predictor_does(reference_run, data_dir, tmp_path):
    pytest.importorskip("jax2onnx")
    pytest.importorskip("onnxruntime")
    directory = tmp_path / "onnx"
    overrides = [f"--config.{key}={value}" for key, value in EXPORT_OVERRIDES.items()]
    result = run_export_command(reference_run, data_dir, "--format=onnx", f"--output={directory}", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"exported step 4 (last) as ONNX (opset 21, any batch size) to {directory}" in result.stdout
    metadata = json.loads((directory / artifact.METADATA_FILE).read_text())
    assert metadata["program_format"] == "onnx" and metadata["exported_file"] == "model.onnx"
    assert metadata["batch_size"] is None and metadata["input"]["shape"] == ["batch", 64, 64, 3]
    assert metadata["outputs"]["boxes"] == {"shape": ["batch", MAX_DETECTIONS, 4], "dtype": "float32"}
    config = make_config(data_dir, **EXPORT_OVERRIDES)
    predictor = load_predictor(config, str(reference_run.workdir), "last")
    # onnxruntime in a new process, through the artifact's loader: three images in one call.
    assert_fresh_process_detects_what_the_predictor_does(directory, predictor, tmp_path, MAX_DETECTIONS)


def test_export_command_refuses_an_onnx_opset_the_converter_lacks_in_one_line(reference_run, data_dir, tmp_path):
    pytest.importorskip("jax2onnx")
    result = run_export_command(reference_run, data_dir, "--format=onnx", "--opset=7", f"--output={tmp_path}")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: --opset=7: the ONNX converter writes opsets 18 to"), result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not any(tmp_path.iterdir())
