"""Exports a trained detector as one self-contained program: a serialized jax.export (StableHLO) or ONNX.

  python -m detector.export --config=configs/default.py --workdir=runs/default
  python -m detector.export --config=... --workdir=DIR --checkpoint=best --batch_size=4 --output=exported
  python -m detector.export --config=... --workdir=DIR --format=onnx          # WORKDIR/export/onnx

Writes, under `--output` (default `WORKDIR/export/jax`):
  model.jax_exported  the detection program with its parameters as constants:
                      images uint8 [B, H, W, 3] (eval-transformed, not
                      normalised) and image_hw int32 [B, 2] -> boxes [B, D, 4]
                      yxyx network pixels, scores [B, D], classes [B, D] int32,
                      valid [B, D] bool; runs on CPU and CUDA GPUs
  model.json          preprocessing (image size, mean/std, resize rule), class
                      names, label -> category id, output shapes, step, JAX version
With --format=onnx, model.onnx instead of model.jax_exported: the same inputs
and outputs for any batch size (a dynamic batch dimension), for ONNX Runtime,
TensorRT, OpenVINO or Triton; weights over 2 GB in model.onnx.data beside it.
It needs the converter (`pip install -e ".[onnx]"` and jax2onnx, see
detector/serving/onnx_export.py).

Load either with `detector.serving.artifact.load_artifact(DIR).predict(images)`, or
anywhere with `jax.export.deserialize(bytes).call(images, image_hw)`. The detection
settings baked in are the config's `postprocess` ones; change them with
e.g. `--config.postprocess.score_threshold=0.3`.

No TensorFlow SavedModel is written: jax2tf's XlaCallModule in the TF
installed alongside this JAX reads an older StableHLO than this JAX writes.
"""

from __future__ import annotations

from absl import flags
from etils import epath

from detector import cli
from detector.errors import ConfigError
from detector.serving import artifact, onnx_export
from detector.serving.predictor import load_predictor
from sharding import distributed

_CONFIG, _WORKDIR, _CHECKPOINT, _RAW_PARAMS = cli.define_trained_run_flags()
_FORMAT = flags.DEFINE_enum("format", "jax", ["jax", "onnx"], "jax: StableHLO (jax.export); onnx: an ONNX model.")
_BATCH_SIZE = flags.DEFINE_integer(
    "batch_size", 1, "Images per call of the exported StableHLO program (fixed); an ONNX model takes any batch."
)
_OPSET = flags.DEFINE_integer("opset", onnx_export.DEFAULT_OPSET, "ONNX opset of --format=onnx.")
_OUTPUT = flags.DEFINE_string(
    "output", None, "Directory for the program and model.json (default WORKDIR/export/jax or WORKDIR/export/onnx)."
)
distributed.define_flags()


def main(argv: list[str]) -> None:
    cli.start(argv)
    if _BATCH_SIZE.value < 1:
        raise ConfigError(f"--batch_size={_BATCH_SIZE.value} must be at least 1")
    # The predictor's own (sharded, compiled) batch size is the config's; the
    # exported program has its own, fixed one.
    if _FORMAT.value == "onnx":
        onnx_export.check_opset(_OPSET.value)  # before loading anything: a missing converter or opset fails first
    predictor = load_predictor(_CONFIG.value, _WORKDIR.value, _CHECKPOINT.value, raw_params=_RAW_PARAMS.value)
    output = _OUTPUT.value or epath.Path(_WORKDIR.value) / "export" / _FORMAT.value
    if _FORMAT.value == "onnx":
        written = onnx_export.export_to_directory(
            predictor, str(output), checkpoint=_CHECKPOINT.value, opset=_OPSET.value
        )
    else:
        written = artifact.export_to_directory(predictor, _BATCH_SIZE.value, output, checkpoint=_CHECKPOINT.value)
    if written is not None:
        print(written, flush=True)


if __name__ == "__main__":
    cli.run(main)
