"""The GPU and compile-time benchmarks, end to end on the CPU with tiny configs."""

import json
import math
import os
import re
import statistics
import subprocess
import sys

import pytest

from benchmarks import gpu, profile_step
from tests.helpers import REPO_ROOT, quick_xla_flags

pytestmark = pytest.mark.slow


def _cpu_env() -> dict[str, str]:
    """The test process's environment on one CPU device (conftest's 8 fake devices would split batch 2)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    # Quick XLA:CPU compiles, as for the suite: these runs compile far more than they compute.
    env["XLA_FLAGS"] = quick_xla_flags()
    return env


def _run(module: str, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        env={**_cpu_env(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize(
    "device_kind, expected",
    [
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H200", 989e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("TPU v5 lite", 197e12),
        ("TPU v5", 459e12),
        ("cpu", None),
        ("Some Future Accelerator", None),
    ],
)
def test_peak_flops_lookup(device_kind, expected):
    assert gpu.peak_flops(device_kind) == expected


def test_batch_search_doubles_until_a_batch_does_not_fit(monkeypatch):
    tried = []

    def fake_measure(config, batch_size, device, memory_limit, steps, num_classes):
        tried.append(batch_size)
        return {"batch": batch_size, "seconds_per_step": 1.0, "per_device_bytes": 0} if batch_size <= 8 else None

    monkeypatch.setattr(gpu, "measure", fake_measure)
    fitting = gpu.largest_fitting_batch("m", None, None, None, start_batch=1, max_batch=64, steps=1, num_classes=1)
    assert tried == [1, 2, 4, 8, 16] and fitting[-1]["batch"] == 8
    tried.clear()
    fitting = gpu.largest_fitting_batch("m", None, None, None, start_batch=2, max_batch=4, steps=1, num_classes=1)
    assert tried == [2, 4] and fitting[-1]["batch"] == 4  # capped at max_batch


def test_gpu_measures_every_family_and_selects_by_name():
    names = [name.split(" (")[0] for name, _ in gpu._model_configs(smoke=True)]
    assert names == ["RetinaNet tiny ResNet", "ViTDet tiny", "DINO tiny", "DINO tiny DINOv3-style LoRA"]
    assert [name for name, _ in gpu._model_configs(smoke=False, only=["DINO", "vitdet"])] == [
        "ViTDet-B",
        "DINO-4scale R50",
        "DINO DINOv3-L/16 full",
        "DINO DINOv3-7B/16 frozen",
        "DINO DINOv3-7B/16 LoRA",
    ]
    for _, config in gpu._model_configs(smoke=False):
        assert config.model.dtype == "bfloat16" and dict(config.mesh) == dict(data=1, fsdp=1, model=1)
    with pytest.raises(
        ValueError, match="--models=yolo matches none of: RetinaNet R50-FPN; ViTDet-B; DINO-4scale R50;"
    ):
        gpu._model_configs(smoke=False, only=["yolo"])


def test_gpu_smoke(tmp_path):
    # One model (the three share every line past their config, checked
    # above; DINO's bfloat16 step is tested in tests/detector/models) and
    # --max_batch=1: one compile (the search itself is tested above), which
    # is most of the run.
    result = _run("benchmarks.gpu", "--smoke", "--models=retinanet", "--max_batch=1", "--output_dir", str(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "gpu.json") as f:
        rows = json.load(f)["rows"]
    assert [row["model"].split(" (")[0] for row in rows] == ["RetinaNet tiny ResNet"]
    for row in rows:
        assert row["per-device batch"] >= 1
        assert row["images/s"] > 0
        assert math.isfinite(row["TFLOP/step"]) and row["TFLOP/step"] > 0
        assert math.isfinite(row["MFU"]) and row["MFU"] > 0


def test_compile_time_warm_cache_skips_compiling(tmp_path):
    result = _run(
        "benchmarks.compile_time",
        "--configs=default",
        "--image_size=64",
        f"--cache_root={tmp_path / 'cache'}",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "compile_time.json") as f:
        cold, warm = json.load(f)["rows"]
    assert (cold["cache"], warm["cache"]) == ("cold", "warm")
    assert os.listdir(tmp_path / "cache" / "default")
    # Every program the warm run compiles is found in the cache, so it writes nothing.
    assert cold["cache entries written"] > 0 and warm["cache entries written"] == 0
    # Times are the table's to report, not a test's to judge (a busy machine
    # can slow either run): each row has them, measured.
    for row in (cold, warm):
        assert row["compile s"] > 0 and row["start→first step s"] > 0, row


@pytest.mark.parametrize(
    "module, peers",
    [("vs_torchvision", ("torch", "torchvision")), ("vs_transformers", ("torch", "timm", "transformers"))],
)
def test_peer_comparison_says_how_to_install_the_peer_when_missing(module, peers):
    hide_peers = (
        "import importlib.util, runpy, sys\n"
        "find_spec = importlib.util.find_spec\n"
        f"importlib.util.find_spec = lambda name, *a: None if name in {peers!r} else find_spec(name, *a)\n"
        f"sys.argv = [{module!r}]\n"
        f"runpy.run_module('benchmarks.{module}', run_name='__main__', alter_sys=True)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", hide_peers], cwd=REPO_ROOT, env=_cpu_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: ") and 'pip install -e ".[bench]"' in last_line


def test_transformers_comparison_refuses_an_image_too_small_for_the_queries():
    # 128 px: 16^2 + 8^2 + 4^2 + 2^2 = 340 positions for 900 queries; refused before any worker starts.
    result = _run("benchmarks.vs_transformers", "--image_size=128")
    assert result.returncode != 0
    last_line = result.stderr.strip().splitlines()[-1]
    assert last_line.startswith("error: --image_size=128") and "340 positions" in last_line, result.stderr[-2000:]


# torchvision's parameter counts, from its own process (torchvision can crash
# on import next to TensorFlow, which this process has loaded).
_TORCHVISION_PARAMETERS = r"""
import json
from benchmarks.vs_torchvision import torchvision_model
model = torchvision_model(80, 512)
print(json.dumps({"total": sum(p.numel() for p in model.parameters()),
                  "trainable": sum(p.numel() for p in model.parameters() if p.requires_grad)}))
"""


# What `_TORCHVISION_PARAMETERS` prints (torchvision 0.29.1): stored, so the comparison runs without torch.
TORCHVISION_PARAMETERS = {"total": 33786804, "trainable": 33564404}


# Ours as `benchmarks.vs_torchvision` builds it, counted as torchvision counts: frozen BatchNorm is buffers there.
# In a process of its own: the benchmark's module defines flags that another benchmark here defines too.
_OUR_PARAMETERS = """
import json
import jax
import numpy as np
from flax import traverse_util
from benchmarks.vs_torchvision import our_config
from detector.models import families
from detector.training import optim

config = our_config(2, 512, "float32")
model = families.create_model(config, 80)
params = jax.eval_shape(lambda: model.init(jax.random.key(0), jax.numpy.zeros((1, 512, 512, 3))))["params"]
params = jax.tree.map(lambda x: x.value if hasattr(x, "value") else x, params, is_leaf=lambda x: hasattr(x, "value"))
frozen = traverse_util.flatten_dict(optim.frozen_parameters(config.model)(params))
sizes = {path: int(np.prod(leaf.shape)) for path, leaf in traverse_util.flatten_dict(params).items()}
total = sum(n for path, n in sizes.items() if not any("FrozenBatchNorm" in p or p == "stem_norm" for p in path))
print(json.dumps({"total": total, "trainable": sum(n for path, n in sizes.items() if not frozen[path])}))
"""


def _counts(script: str) -> dict[str, int]:
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO_ROOT, env=_cpu_env(), capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_compared_models_have_the_same_parameters():
    """Ours as benchmarked and torchvision's RetinaNet R50-FPN hold the same weights, frozen and trained.

    torchvision's counts are stored; where torch and torchvision are installed
    they are counted again, so a torchvision release that builds the model
    otherwise shows here (then update `TORCHVISION_PARAMETERS`).
    """
    import importlib.util

    if importlib.util.find_spec("torch") is not None and importlib.util.find_spec("torchvision") is not None:
        assert _counts(_TORCHVISION_PARAMETERS) == TORCHVISION_PARAMETERS
    assert _counts(_OUR_PARAMETERS) == TORCHVISION_PARAMETERS


def test_ap_vs_time_stamps_every_evaluation_of_a_run(tmp_path, data_dir):
    """4 steps at 64 px, an evaluation every 2 steps as the config says: 2 points, in time order.

    One config: the benchmark's code is the same for every family, and each
    family's training and evaluation are tested end to end elsewhere.
    Without --eval_every_steps each run keeps its config's own interval. A
    persistent compilation cache that the environment names is not used: every
    run compiles from nothing.
    """
    from tests.helpers.tiny_config import OVERRIDES

    overrides = {**OVERRIDES, "dataset.data_dir": str(data_dir), "eval_every_steps": 2}
    flags = [f"--override={key}={str(value).replace(' ', '')}" for key, value in overrides.items()]
    result = _run(
        "benchmarks.ap_vs_time",
        "--configs=default",
        f"--workdir_root={tmp_path / 'runs'}",
        "--output_dir",
        str(tmp_path),
        *flags,
        env={"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "cache")},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "compilation cache off" in (tmp_path / "runs" / "default.log").read_text()
    assert not (tmp_path / "cache").exists()
    with open(tmp_path / "ap_vs_time.json") as f:
        rows = json.load(f)["rows"]
    assert [(row["config"], row["step"]) for row in rows] == [("default", 2), ("default", 4)]
    first, second = rows
    assert 0 < first["wall s"] < second["wall s"]
    assert 0.0 <= second["AP"] <= 1.0
    # A workdir that exists would be resumed, not measured: refused.
    again = _run("benchmarks.ap_vs_time", "--configs=default", f"--workdir_root={tmp_path / 'runs'}")
    assert again.returncode != 0 and "exists" in again.stderr


def test_host_memory_samples_a_run_and_measures_growth_from_after_the_first_evaluation(tmp_path, data_dir):
    from tests.helpers.tiny_config import OVERRIDES

    overrides = {**OVERRIDES, "dataset.data_dir": str(data_dir)}
    for key in ("total_steps", "eval_every_steps", "log_every_steps"):
        overrides.pop(key)  # the benchmark sets them
    flags = [f"--override={key}={str(value).replace(' ', '')}" for key, value in overrides.items()]
    result = _run(
        "benchmarks.host_memory",
        "--total_steps=8",
        "--eval_every_steps=4",
        "--log_every_steps=2",
        "--sample_s=0.2",
        "--rows=4",
        "--max_growth=1.0",
        f"--workdir={tmp_path / 'run'}",
        "--output_dir",
        str(tmp_path),
        *flags,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "host_memory.json") as f:
        record = json.load(f)
    samples = record["samples"]  # the figures sit beside the table in the JSON
    assert len(samples) >= 10
    # (wall s, step, evaluations, bytes): in time order, steps never go back, a real process's size.
    assert [s[0] for s in samples] == sorted(s[0] for s in samples)
    assert [s[1] for s in samples] == sorted(s[1] for s in samples) and samples[-1][1] == 8
    assert all(s[3] > 100 * 2**20 for s in samples if s[1] > 0)
    baseline, final = record["baseline_bytes"], record["final_bytes"]
    assert record["growth"] == pytest.approx((final - baseline) / baseline)
    after_first_eval = [s for s in samples if s[2] >= 1 and s[1] < 8]
    tenth = max(1, len(after_first_eval) // 10)
    assert baseline == statistics.median(s[3] for s in after_first_eval[:tenth])
    assert final == statistics.median(s[3] for s in after_first_eval[-tenth:])
    assert len(record["rows"]) == 4 and record["rows"][-1]["step"] == 8
    assert "eval step 8" in (tmp_path / "run.log").read_text()


def test_input_pipeline_reports_the_host_cores_a_host_of_accelerators_needs(tmp_path):
    result = _run(
        "benchmarks.input_pipeline",
        "--pipelines=default",
        "--pipelines=coco_lsj",
        "--coco_images=16",
        "--synthetic_images=64",
        "--batches=1",
        "--accelerators=4",
        "--images_per_second=250",
        f"--workdir={tmp_path}",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "input_pipeline.json") as f:
        record = json.load(f)
    default, coco_lsj = record["rows"]
    for row in (default, coco_lsj):
        per_thread = row["images/s per thread"]
        assert per_thread > 0
        assert row["host cores for 4 x 250 images/s"] == math.ceil(4 * 250 / per_thread)
    assert (record["accelerators"], record["images_per_second_per_accelerator"]) == (4, 250.0)
    # The default config resizes on the host; COCO's 640x480 JPEGs fit a 1024 px window's source canvas.
    assert (default["resized on the host"], coco_lsj["resized on the host"]) == ("all", "0%")


def test_profile_step_attributes_op_time_to_model_parts_and_passes(tmp_path):
    result = _run(
        "benchmarks.profile_step",
        "--config=configs/default.py",
        "--config.input.image_size=(64,64)",  # every part and pass still runs; a quarter of the pixels
        "--config.global_batch_size=8",
        "--top=200",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "profile_step.json") as f:
        record = json.load(f)
    rows = record["rows"]
    groups = {(row["part"], row["pass"]) for row in rows}
    for part in ("backbone", "neck", "head"):
        assert {(part, "forward"), (part, "backward")} <= groups, groups
    assert math.isclose(sum(row["op ms/step"] for row in rows), record["op_ms"], rel_tol=0.02)
    assert math.isclose(sum(record["by_part"].values()), record["op_ms"], rel_tol=1e-6)
    assert record["cores"] == os.cpu_count()
    untimed = re.search(r"not in any timed op: (\d+) ms/step of (\d+) cores' time", result.stdout)
    assert untimed and int(untimed.group(2)) == record["cores"], result.stdout[-2000:]
    expected = max(0.0, record["step_ms"] * record["cores"] - record["op_ms"])
    assert abs(int(untimed.group(1)) - expected) <= 1

    # The buffers at the memory peak: inputs and the model's activations, each with its part.
    with open(tmp_path / "profile_step_memory.json") as f:
        memory = json.load(f)
    assert memory["peak_bytes"] == sum(memory["by_part"].values())
    assert {"state", "batch", "backbone"} <= set(memory["by_part"]), memory["by_part"]
    sizes = [row["MiB"] for row in memory["rows"]]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] > 0


def test_profile_step_names_each_detector_part():
    # Op names as JAX writes them for DINO's step (forward, backward, remat, the loss's named stages).
    step = "jit(train_step)/"
    cases = {
        step + "jvp(Dino)/encoder3/self_attention/scatter-add": ("encoder", "forward", "scatter-add"),
        step + "transpose(jvp(Dino))/decoder0/cross_attention/dot_general": ("decoder", "backward", "dot_general"),
        step + "jvp(Dino)/backbone/stage1_block0/Conv_0/conv_general_dilated": ("backbone", "forward", None),
        step + "jvp(Dino)/encoder_class_head/dot_general": ("head", "forward", None),
        step + "transpose(jvp(Dino))/concatenate": ("model (other)", "backward", None),
        step + "jvp(vmap())/matching/while/body/min": ("matching", "forward", None),
        step + "transpose(jvp(vmap()))/loss/log": ("loss", "backward", None),
        step + "jvp()/denoising/add": ("denoising", "forward", None),
        step + "sqrt": ("optimizer+other", "forward", None),
    }
    for op_name, (part, direction, op) in cases.items():
        got = profile_step.attribute(op_name, "fusion.3")
        assert got[:2] == (part, direction), (op_name, got)
        assert op is None or got[2] == op
    names = {"fusion.7": step + "jvp(Dino)/neck/add"}
    assert profile_step.attribute_buffer("state_params__backbone__kernel.1", names)[0] == "state"
    assert profile_step.attribute_buffer("batch__image__.1", names)[0] == "batch"
    assert profile_step.attribute_buffer("fusion.7", names)[0] == "neck"
    assert profile_step.attribute_buffer("wrapped_broadcast.1", names)[0] == "unattributed"


def test_coco_scoring_matches_pycocotools_and_times_training_beside_it(tmp_path):
    result = _run(
        "benchmarks.coco_scoring",
        "--sizes=60:5,120:7",
        "--pycocotools_max_images=60",
        "--detections_per_image=20",
        "--overlap_config=configs/default.py",
        "--overlap_config.global_batch_size=2",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "coco_scoring.json") as f:
        rows = json.load(f)["rows"]
    scorers = [(row["images"], row["scorer"]) for row in rows]
    assert {(60, "coco_ap"), (60, "pycocotools"), (60, "hotcoco (columns)"), (120, "coco_ap")} <= set(scorers)
    assert (120, "hotcoco (dicts)") in scorers and (120, "pycocotools") not in scorers  # above --pycocotools_max_images
    for row in rows:
        assert row["detections"] == row["images"] * 20 and row["seconds"] > 0 and row["peak RSS GB"] > 0
        if row["images"] == 60:
            assert row["max |diff| vs pycocotools"] < 1e-12  # the same numbers, from its own input form
    with open(tmp_path / "coco_scoring_overlap.json") as f:
        train, scoring = json.load(f)["rows"]
    assert train["alone"] > 0 and train["together"] > 0 and scoring["alone"] > 0


def test_data_scale_prepares_a_tiny_folder_per_worker_count(tmp_path):
    # One folder: each row is a fresh process that loads TensorFlow and JAX, as training does.
    result = _run(
        "benchmarks.data_scale",
        "--images=200",
        "--workers=1,2",
        "--scoring_sizes=40:3",
        "--pycocotools_max_images=40",
        f"--workdir={tmp_path / 'work'}",
        "--output_dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "data_scale.json") as f:
        rows = json.load(f)["rows"]
    assert [(row["images"], row["workers"]) for row in rows] == [(200, 1), (200, 2)]
    for row in rows:
        assert row["images/s"] == pytest.approx(row["images"] / row["prepare s"])
        assert 0.1 < row["JSON MB"] < 1 and 0 < row["index MB"] < 1
        # Sampled from outside every 50 ms (the process tree) vs the preparing process's own exact peak.
        assert row["peak RSS GB"] > 0.05 and row["prepare RSS GB"] > 0.05
        assert 0 < row["open s"] < 1 and row["first batch s"] > 0
    # The folders stay for the next run; the prepared splits do not.
    assert sorted(os.listdir(tmp_path / "work")) == ["coco_200", "sources"]
    assert "| images | workers | JSON MB |" in result.stdout
    with open(tmp_path / "data_scale_scoring.json") as f:
        scoring = json.load(f)["rows"]
    assert {row["scorer"] for row in scoring} >= {"coco_ap", "pycocotools"}
    assert all(row["images"] == 40 and row["max |diff| vs pycocotools"] < 1e-12 for row in scoring)
