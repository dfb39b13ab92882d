"""Training curves as PNG files under `WORKDIR/plots/`, from the workdir's metric JSON lines.

Reads what :mod:`detector.loop.metric_writers` writes: `train_metrics.jsonl`
(`{"step": N, "loss": ..., "cls_loss": ..., "box_loss": ..., ...}`) and
`eval_metrics.jsonl` (`{"step": N, "AP": ..., "AP50": ..., ...}`, COCO
metrics in [0, 1]). Figures are rendered by matplotlib's Agg canvas directly,
without pyplot: nothing changes the process-wide backend or keeps figures
alive, so this is safe to call from a training process at any time.
"""

from __future__ import annotations

import io
import json
import logging
import math
from collections.abc import Sequence

from etils import epath
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from detector.loop.metric_writers import EVAL_METRICS_FILE, TRAIN_METRICS_FILE

PLOTS_DIR = "plots"
LOSS_PLOT_FILE = "loss.png"
MAP_PLOT_FILE = "map.png"

LOSS_KEYS = ("loss", "cls_loss", "box_loss")
AP_KEYS = ("AP", "AP50", "AP75")
# Losses spanning more than this ratio (two decades) get a log y axis, where
# the late, slow part of training would otherwise be a flat line at the bottom.
_LOG_SCALE_SPAN = 100.0
_FIGURE_SIZE_INCHES = (8.0, 4.5)
_DPI = 100  # with the size above: 800 x 450 pixel PNGs
# Markers show single evaluations, but would hide the curve of a long run.
_MAX_POINTS_WITH_MARKERS = 50

Series = dict[str, tuple[list[int], list[float]]]


def _read_records(path: epath.Path) -> list[dict]:
    """The JSON objects of a JSON-lines file that have an integer `step`; [] when it does not exist.

    Lines that do not parse (a write cut short by a kill leaves one at the
    end) are skipped.
    """
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            record["step"] = int(record["step"])
        except (ValueError, KeyError, TypeError, OverflowError):
            logging.info("%s: skipping a line that is not a metrics record: %.80r", path, line)
            continue
        records.append(record)
    return records


def _series(records: Sequence[dict], keys: Sequence[str], *, min_value: float) -> Series:
    """Per key, the `(steps, values)` with a finite value >= `min_value`, sorted by step.

    When a step appears twice (a resumed run), the later line wins.
    """
    series = {}
    for key in keys:
        by_step = {}
        for record in records:
            value = record.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue  # null (non-finite when logged) or absent
            if math.isfinite(value) and value >= min_value:
                by_step[record["step"]] = float(value)
        if by_step:
            steps = sorted(by_step)
            series[key] = (steps, [by_step[step] for step in steps])
    return series


def _spans_decades(series: Series) -> bool:
    values = [value for _, series_values in series.values() for value in series_values]
    if min(values) <= 0:
        return False  # a log axis cannot show these points
    return max(values) / min(values) > _LOG_SCALE_SPAN


def _write_figure(
    series: Series, path: epath.Path, *, title: str, ylabel: str, log_y: bool = False, ylim_bottom: float | None = None
) -> None:
    figure = Figure(figsize=_FIGURE_SIZE_INCHES, dpi=_DPI)
    canvas = FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    for name, (steps, values) in series.items():
        marker = "o" if len(steps) <= _MAX_POINTS_WITH_MARKERS else None
        axes.plot(steps, values, label=name, marker=marker, markersize=3, linewidth=1.5)
    if log_y:
        axes.set_yscale("log")
    if ylim_bottom is not None:
        axes.set_ylim(bottom=ylim_bottom)
    axes.set_title(title)
    axes.set_xlabel("step")
    axes.set_ylabel(ylabel)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    buffer = io.BytesIO()
    # Rendering to memory and writing the bytes through epath works for
    # workdirs on any filesystem epath supports (e.g. gs://).
    canvas.print_png(buffer)
    path.write_bytes(buffer.getvalue())


def write_training_plots(workdir) -> list[epath.Path]:
    """Writes `WORKDIR/plots/loss.png` and `WORKDIR/plots/map.png` from the workdir's metric files.

    `loss.png`: loss, cls_loss and box_loss against step (log y axis when
    they span more than two decades). `map.png`: COCO AP, AP50 and AP75
    against step; pycocotools' -1 ("no ground truth") points are left out.
    Null values and unreadable lines are skipped. A plot whose file is
    missing or holds no plottable point is not written; this never raises
    for missing or malformed metric files.

    Args:
        workdir: the training workdir (local path or any epath location).

    Returns:
        The paths written, in the order loss, mAP; [] when there was nothing to plot.
    """
    workdir = epath.Path(workdir)
    plots_dir = workdir / PLOTS_DIR
    written = []

    losses = _series(_read_records(workdir / TRAIN_METRICS_FILE), LOSS_KEYS, min_value=-math.inf)
    if losses:
        plots_dir.mkdir(parents=True, exist_ok=True)
        path = plots_dir / LOSS_PLOT_FILE
        _write_figure(losses, path, title="Training loss", ylabel="loss", log_y=_spans_decades(losses))
        written.append(path)

    average_precisions = _series(_read_records(workdir / EVAL_METRICS_FILE), AP_KEYS, min_value=0.0)
    if average_precisions:
        plots_dir.mkdir(parents=True, exist_ok=True)
        path = plots_dir / MAP_PLOT_FILE
        _write_figure(average_precisions, path, title="COCO box AP (evaluation)", ylabel="AP (0-1)", ylim_bottom=0.0)
        written.append(path)
    return written
