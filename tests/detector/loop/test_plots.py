"""Training-curve PNGs from the workdir's metric files, tolerant of gaps, -1 APs and cut-off lines."""

import json

from PIL import Image

from detector.loop.metric_writers import EVAL_METRICS_FILE, TRAIN_METRICS_FILE
from detector.loop.plots import write_training_plots


def _write_lines(path, records, cut_off_tail=None):
    text = "".join(json.dumps(record) + "\n" for record in records)
    if cut_off_tail is not None:
        text += cut_off_tail  # a kill in the middle of a write
    path.write_text(text)


def _train_records():
    records = [
        {
            "step": step,
            "loss": 10.0 / step**2,
            "cls_loss": 6.0 / step**2,
            "box_loss": 4.0 / step**2,
            "learning_rate": 0.01,
        }
        for step in range(1, 30)
    ]
    records[3]["loss"] = None  # a non-finite value is logged as null
    return records


def _assert_png(path):
    assert path.exists()
    with Image.open(str(path)) as png:
        assert png.format == "PNG"
        width, height = png.size
        assert 200 <= width <= 4000 and 150 <= height <= 4000


def test_writes_loss_and_map_plots(tmp_path):
    _write_lines(tmp_path / TRAIN_METRICS_FILE, _train_records(), cut_off_tail='{"step": 30, "lo')
    _write_lines(
        tmp_path / EVAL_METRICS_FILE,
        [
            {"step": 10, "AP": 0.1, "AP50": 0.2, "AP75": 0.05, "APs": -1.0, "APm": 0.1, "APl": 0.2, "AR100": 0.3},
            {"step": 20, "AP": 0.2, "AP50": -1.0, "AP75": 0.1, "APs": -1.0, "APm": 0.2, "APl": 0.3, "AR100": 0.4},
        ],
        cut_off_tail='{"step": 30, "AP": 0.',
    )

    written = write_training_plots(str(tmp_path))

    assert written == [tmp_path / "plots" / "loss.png", tmp_path / "plots" / "map.png"]
    for path in written:
        _assert_png(path)


def test_missing_eval_file_writes_only_the_loss_plot(tmp_path):
    _write_lines(tmp_path / TRAIN_METRICS_FILE, _train_records())
    assert write_training_plots(tmp_path) == [tmp_path / "plots" / "loss.png"]
    assert not (tmp_path / "plots" / "map.png").exists()


def test_nothing_to_plot_writes_nothing(tmp_path):
    assert write_training_plots(tmp_path) == []
    assert not (tmp_path / "plots").exists()
    # Files without a single plottable point: nulls, -1 APs, garbage.
    _write_lines(tmp_path / TRAIN_METRICS_FILE, [{"step": 1, "loss": None}], cut_off_tail="not json\n")
    _write_lines(tmp_path / EVAL_METRICS_FILE, [{"step": 1, "AP": -1.0, "AP50": -1.0, "AP75": -1.0}])
    assert write_training_plots(tmp_path) == []
