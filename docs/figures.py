"""The pictures in the docs, each made alone with --only (default: all three).

  python -m docs.figures --only=mesh         # docs/images/mesh_axes.png: draws only, seconds
  python -m docs.figures --only=ap_vs_time   # docs/images/ap_vs_time.png: runs benchmarks.ap_vs_time (minutes)
  python -m docs.figures --only=ap_vs_time --ap_json=benchmark_results/ap_vs_time.json   # plots a finished run
  python -m docs.figures --only=predicted    # docs/images/predicted.png: detector.predict on validation images

mesh        the ('data', 'fsdp', 'model') mesh of 8 devices and what each form
            of parallelism splits, as configs/common.py's rules and
            sharding/partitioning.py's spatial rules say.
ap_vs_time  COCO AP against wall-clock seconds per config, from the JSON that
            `python -m benchmarks.ap_vs_time` writes; without --ap_json the
            benchmark runs first (it trains every config, one after the other).
predicted   `python -m detector.predict`'s pictures of the first validation
            images of the embedded dataset, side by side, from --workdir; a
            workdir without a checkpoint is trained first with --config (the
            default run: minutes on a CPU).

Run from the repository root: the commands it starts read configs/ there.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

from absl import app, flags
from matplotlib import patches
from matplotlib.figure import Figure

REPO_ROOT = pathlib.Path(__file__).resolve().parents[1]
FIGURES = ("mesh", "ap_vs_time", "predicted")

_ONLY = flags.DEFINE_list("only", list(FIGURES), f"Which pictures to make, of {', '.join(FIGURES)}.")
_IMAGES_DIR = flags.DEFINE_string("images_dir", "docs/images", "Where the pictures are written.")
_AP_JSON = flags.DEFINE_string(
    "ap_json", None, "A JSON that benchmarks.ap_vs_time wrote; without it the benchmark runs first."
)
_AP_CONFIGS = flags.DEFINE_list(
    "ap_configs", ["default", "dino_tiny"], "Configs the benchmark trains (configs/NAME.py)."
)
_AP_EVAL_EVERY = flags.DEFINE_integer(
    "ap_eval_every_steps",
    0,
    "Evaluation interval of the benchmark's runs (0: each config's own, as in docs/performance.md).",
)
_AP_OUTPUT_DIR = flags.DEFINE_string(
    "ap_output_dir", "benchmark_results", "Where the benchmark run started here writes its JSON."
)
_CONFIG = flags.DEFINE_string("config", "configs/default.py", "Config of the run whose predictions are drawn.")
_WORKDIR = flags.DEFINE_string(
    "workdir", "runs/default", "The trained run to predict with (trained first when it has no checkpoint)."
)
_IMAGES = flags.DEFINE_list(
    "images", [], "Image files or folders to predict on (default: the first validation images of the dataset)."
)
_NUM_IMAGES = flags.DEFINE_integer("num_images", 4, "Validation images drawn when --images is not given.")
# 0.5: on 128 px images the labels of more, weaker detections cover the shapes.
_SCORE_THRESHOLD = flags.DEFINE_float("score_threshold", 0.5, "Detections scoring less are not drawn.")

# 1400 x 800 pixels: legible on a laptop screen and in GitHub's page width.
FIGSIZE, DPI = (14, 8), 100
# Two shades per mesh axis: index 0 dark, index 1 light.
COLORS = {"data": ("#3b6fb6", "#a9c6ee"), "fsdp": ("#d9742b", "#f6c9a4"), "model": ("#3f9a57", "#b3dfbd")}
GREY, INK = "#d9d9d9", "#222222"


def device_index(data: int, fsdp: int, model: int) -> int:
    """The number drawn at mesh coordinates (data, fsdp, model), row-major; which physical device sits there
    is sharding/mesh.py's choice, by the interconnect's topology."""
    return data * 4 + fsdp * 2 + model


# Axes are laid out in units of this many pixels on both axes, so squares stay square.
UNIT_PX = 34.0


def _axes(fig, rect):
    """Axes at figure fraction `rect`, without ticks, in square units of UNIT_PX pixels from (0, 0)."""
    ax = fig.add_axes(rect)
    width_px, height_px = rect[2] * FIGSIZE[0] * DPI, rect[3] * FIGSIZE[1] * DPI
    ax.set_xlim(0, width_px / UNIT_PX)
    ax.set_ylim(0, height_px / UNIT_PX)
    ax.axis("off")
    return ax


def _device_grid(ax, x0, y0, size, gap, color_of=None, labels=False, fontsize=11):
    """8 device squares from (x0, y0) up: rows are `data` (0 on top), pairs `fsdp`, a pair's two squares `model`.

    `color_of(data, fsdp, model)` fills each square (grey without it). Returns
    the grid's (width, height).
    """
    pair_gap = 3 * gap
    pair_width = 2 * size + gap
    for d in range(2):
        for f in range(2):
            px = x0 + f * (pair_width + pair_gap)
            py = y0 + (1 - d) * (size + pair_gap)
            ax.add_patch(
                patches.FancyBboxPatch(
                    (px - gap, py - gap),
                    pair_width + 2 * gap,
                    size + 2 * gap,
                    boxstyle="round,pad=0,rounding_size=0.15",
                    facecolor="none",
                    edgecolor="#888888",
                    linewidth=1.2,
                    linestyle="--",
                )
            )
            for m in range(2):
                x = px + m * (size + gap)
                color = color_of(d, f, m) if color_of else GREY
                ax.add_patch(patches.Rectangle((x, py), size, size, facecolor=color, edgecolor=INK, linewidth=1.2))
                if labels:
                    ax.text(
                        x + size / 2,
                        py + size * 0.62,
                        str(device_index(d, f, m)),
                        ha="center",
                        va="center",
                        fontsize=fontsize + 5,
                        fontweight="bold",
                        color=INK,
                    )
                    ax.text(
                        x + size / 2,
                        py + size * 0.25,
                        f"({d}, {f}, {m})",
                        ha="center",
                        va="center",
                        fontsize=fontsize - 1,
                        color="#444444",
                    )
    return 2 * pair_width + pair_gap, 2 * size + pair_gap


def _arrow(ax, start, end):
    ax.annotate("", xy=end, xytext=start, arrowprops=dict(arrowstyle="->", lw=1.8, color=INK))


def _text(ax, x, y, text, size=11.5, **kw):
    kw = {"va": "center", "color": INK, "linespacing": 1.35, **kw}
    ax.text(x, y, text, fontsize=size, **kw)


# Panels: 14 x 10 units; the mesh on the left, what is split from CONTENT_X on.
CONTENT_X = 5.3


def _panel(fig, rect, title, axis, caption):
    """A panel: a title, the 8 devices coloured by their index on `axis`, and a caption at the bottom."""
    ax = _axes(fig, rect)
    width, height = ax.get_xlim()[1], ax.get_ylim()[1]
    ax.add_patch(
        patches.FancyBboxPatch(
            (0.1, 0.1),
            width - 0.2,
            height - 0.2,
            boxstyle="round,pad=0,rounding_size=0.3",
            facecolor="#fafafa",
            edgecolor="#bbbbbb",
            linewidth=1.0,
        )
    )
    _text(ax, 0.5, height - 0.85, title, size=14, fontweight="bold")
    position = {"data": 0, "fsdp": 1, "model": 2}[axis]
    _device_grid(ax, 0.6, 4.3, 0.9, 0.12, color_of=lambda *c: COLORS[axis][c[position]])
    _text(ax, 0.5, 3.55, f"colour: index\non '{axis}'", size=10.5, color="#444444")
    _text(ax, 0.5, 1.2, caption)
    return ax


def _images_row(ax, x0, y0, colors, label, size=0.8, gap=0.15):
    """A batch of len(colors) images as numbered squares, `label` above them."""
    for i, color in enumerate(colors):
        x = x0 + i * (size + gap)
        ax.add_patch(patches.Rectangle((x, y0), size, size, facecolor=color, edgecolor=INK))
        _text(ax, x + size / 2, y0 + size / 2, str(i), size=10, ha="center")
    _text(ax, x0, y0 + size + 0.45, label)


def _bar(ax, x0, y0, width, colors, texts, label, height=0.8):
    """A tensor as a bar cut into len(colors) equal pieces along its width, `label` above it."""
    piece = width / len(colors)
    for i, (color, text) in enumerate(zip(colors, texts)):
        ax.add_patch(patches.Rectangle((x0 + i * piece, y0), piece, height, facecolor=color, edgecolor=INK))
        _text(ax, x0 + (i + 0.5) * piece, y0 + height / 2, text, size=10.5, ha="center")
    _text(ax, x0, y0 + height + 0.45, label)


def draw_mesh(path: pathlib.Path) -> pathlib.Path:
    """The 2 x 2 x 2 mesh and what data, FSDP, tensor and spatial parallelism split, as a PNG at `path`."""
    fig = Figure(figsize=FIGSIZE, dpi=DPI, facecolor="white")
    fig.text(
        0.5,
        0.962,
        "One mesh, ('data', 'fsdp', 'model') = (2, 2, 2) on 8 devices: what each form of parallelism splits",
        ha="center",
        va="center",
        fontsize=17,
        fontweight="bold",
        color=INK,
    )

    # Left: the mesh itself, every device with its coordinates.
    ax = _axes(fig, (0.005, 0.02, 0.295, 0.89))
    x0, y0 = 1.6, 12.6
    grid_width, grid_height = _device_grid(ax, x0, y0, 2.2, 0.15, labels=True, fontsize=12)
    _arrow(ax, (x0 - 0.2, y0 + grid_height + 0.6), (x0 + grid_width + 0.2, y0 + grid_height + 0.6))
    _text(ax, x0 + grid_width / 2, y0 + grid_height + 1.15, "fsdp", size=14, ha="center", fontweight="bold")
    _arrow(ax, (x0 - 0.6, y0 + grid_height + 0.2), (x0 - 0.6, y0 - 0.2))
    _text(ax, x0 - 1.05, y0 + grid_height / 2, "data", size=14, ha="center", rotation=90, fontweight="bold")
    _text(ax, x0 + grid_width / 2, y0 - 0.85, "model: the two devices of a pair", size=13, ha="center")
    _text(
        ax,
        x0 + grid_width / 2,
        y0 - 1.7,
        "number: the device; (data, fsdp, model):\nits coordinates in the mesh",
        size=11.5,
        ha="center",
        color="#444444",
    )
    _text(
        ax,
        0.4,
        5.6,
        "What is split where (the rules in\nconfigs/common.py):\n"
        "\N{BULLET} the global batch: over data x fsdp\n"
        "\N{BULLET} parameters and optimizer state: over\n"
        "   fsdp, and over model where rules say\n"
        "\N{BULLET} inside a layer, over model: channels,\n"
        "   attention heads, MLP hidden units,\n"
        "   or image rows (spatial partitioning)",
        size=12.5,
    )

    # Right: one panel per form, its devices coloured by their index on that form's axis.
    width, height = 0.343, 0.435
    left, right = 0.305, 0.305 + width + 0.006
    upper, lower = 0.475, 0.025

    ax = _panel(
        fig,
        (left, upper, width, height),
        "data: the batch's images",
        "data",
        "Each data slice trains on its own images with\nthe same parameters; gradients are all-reduced.",
    )
    d0, d1 = COLORS["data"]
    _images_row(ax, CONTENT_X, 6.6, [d0] * 4 + [d1] * 4, "a global batch of 8 images")
    _bar(ax, CONTENT_X, 3.7, 7.45, [GREY], ["all parameters"], "parameters: whole in every data slice")

    ax = _panel(
        fig,
        (right, upper, width, height),
        "fsdp: the batch AND the parameters",
        "fsdp",
        "ZeRO-3: a device keeps a slice of each parameter and\nits optimizer state, gathered layer by layer for use.",
    )
    f0, f1 = COLORS["fsdp"]
    _images_row(ax, CONTENT_X, 6.6, [f0, f0, f1, f1, f0, f0, f1, f1], "the batch, split 4 ways: data x fsdp")
    _bar(ax, CONTENT_X, 3.7, 7.45, [f0, f1], ["fsdp 0", "fsdp 1"], "parameters + optimizer state")

    ax = _panel(
        fig,
        (left, lower, width, height),
        "model: tensor parallelism",
        "model",
        "Both devices of a pair see the same images; a ViT\nor DINO block needs two all-reduces per forward pass.",
    )
    m0, m1 = COLORS["model"]
    _bar(ax, CONTENT_X, 6.6, 7.45, [m0, m1], ["model 0", "model 1"], "a layer's outputs, split in two:")
    _text(ax, CONTENT_X, 4.65, "conv: output channels\nattention: heads\nMLP: hidden units", va="center")

    ax = _panel(
        fig,
        (right, lower, width, height),
        "spatial: image rows over 'model'",
        "model",
        "sharding.spatial_partitioning=True: channels and conv\nkernels stay whole on 'model' (kernels on fsdp only).",
    )
    image_x, image_y, image_w, image_h = CONTENT_X, 2.6, 2.8, 5.6
    half = image_h / 2
    ax.add_patch(patches.Rectangle((image_x, image_y + half), image_w, half, facecolor=m0, edgecolor=INK))
    ax.add_patch(patches.Rectangle((image_x, image_y), image_w, half, facecolor=m1, edgecolor=INK))
    halo = 0.3
    ax.add_patch(
        patches.Rectangle(
            (image_x, image_y + half - halo),
            image_w,
            2 * halo,
            facecolor="none",
            edgecolor=INK,
            hatch="///",
            linewidth=0.8,
        )
    )
    _text(ax, image_x + image_w / 2, image_y + half * 1.5, "rows of\nmodel 0", size=10.5, ha="center")
    _text(ax, image_x + image_w / 2, image_y + half * 0.5, "rows of\nmodel 1", size=10.5, ha="center")
    _text(
        ax, image_x + image_w + 0.3, image_y + image_h - 0.9, "an image, and every\nconv activation after it", size=11
    )
    _text(ax, image_x + image_w + 0.3, image_y + half, "halo rows (hatched):\nexchanged for\neach convolution", size=11)

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def run_ap_vs_time(output_dir: str, configs: list[str], eval_every_steps: int) -> pathlib.Path:
    """Runs `python -m benchmarks.ap_vs_time` (it trains every config, one after the other); returns its JSON."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.ap_vs_time",
        f"--configs={','.join(configs)}",
        f"--eval_every_steps={eval_every_steps}",
        f"--output_dir={output_dir}",
    ]
    print(" ".join(command), flush=True)
    subprocess.run(command, cwd=REPO_ROOT, check=True)
    return REPO_ROOT / output_dir / "ap_vs_time.json"


def draw_ap_vs_time(json_path: pathlib.Path, path: pathlib.Path) -> pathlib.Path:
    """AP against wall seconds, one line per config, from benchmarks.ap_vs_time's JSON at `json_path`."""
    record = json.loads(pathlib.Path(json_path).read_text())
    series: dict[str, list[tuple[float, float, int]]] = {}
    for row in record["rows"]:
        series.setdefault(row["config"], []).append((float(row["wall s"]), float(row["AP"]), int(row["step"])))
    if not series:
        raise SystemExit(f"error: {json_path} holds no evaluations; run the benchmark longer")
    fig = Figure(figsize=FIGSIZE, dpi=DPI, facecolor="white")
    ax = fig.add_axes((0.08, 0.1, 0.88, 0.78))
    for points in series.values():
        points.sort()
    # End labels stacked by final AP, the best above its point and the rest below theirs, so
    # runs that end close together keep their labels apart.
    by_final_ap = sorted(series, key=lambda config: -series[config][-1][1])
    for i, (config, points) in enumerate(series.items()):
        seconds, ap, steps = zip(*points)
        color = f"C{i}"
        ax.plot(seconds, ap, marker="o", markersize=7, linewidth=2.2, color=color, label=f"configs/{config}.py")
        rank = by_final_ap.index(config)
        ax.annotate(
            f"AP {ap[-1]:.3f} (step {steps[-1]})",
            xy=(seconds[-1], ap[-1]),
            xytext=(8, 8 if rank == 0 else -8 - 18 * (rank - 1)),
            textcoords="offset points",
            fontsize=12,
            va="bottom" if rank == 0 else "top",
            color=color,
        )
    machine = record.get("machine", {})
    where = f"{machine.get('cpu', 'unknown CPU')}, {machine.get('cpu_cores', '?')} cores; {machine.get('devices', '')}"
    ax.set_title(f"COCO AP against wall-clock time, one run after the other\n{where}", fontsize=15)
    ax.set_xlabel("seconds from the command's start (compiling and evaluations included)", fontsize=13)
    ax.set_ylabel("COCO AP@[.5:.95], validation split", fontsize=13)
    ax.tick_params(labelsize=12)
    # Room above and on the right for the last points' labels.
    ax.set_ylim(0, 1.12 * max(ap for points in series.values() for _, ap, _ in points))
    ax.set_xlim(0, 1.3 * max(seconds for points in series.values() for seconds, _, _ in points))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=13, loc="lower right")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def _load_config(config_path: str):
    """The config at `config_path`, loaded as `--config=` does: by file path, then get_config()."""
    spec = importlib.util.spec_from_file_location("_figures_config", REPO_ROOT / config_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def has_checkpoint(workdir: pathlib.Path) -> bool:
    """Whether `workdir` holds a complete checkpoint (Orbax names them by step; partial ones are renamed later)."""
    checkpoints = workdir / "checkpoints"
    return checkpoints.is_dir() and any(p.name.isdigit() for p in checkpoints.iterdir())


def write_validation_images(directory: pathlib.Path, count: int, image_size: int) -> list[pathlib.Path]:
    """The first `count` validation images of the embedded dataset as PNG files (what its eval split holds)."""
    from PIL import Image

    from input_pipeline.datasets import synthetic_shapes

    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        example = synthetic_shapes.generate_example("validation", index, image_size)
        paths.append(directory / f"validation_{index:03d}.png")
        Image.fromarray(example.image).save(paths[-1])
    return paths


def make_predicted(path: pathlib.Path) -> pathlib.Path:
    """Trains --workdir if it has no checkpoint, runs detector.predict and puts its pictures side by side at `path`."""
    from PIL import Image

    workdir = REPO_ROOT / _WORKDIR.value
    base = [f"--config={_CONFIG.value}", f"--workdir={workdir}"]
    if not has_checkpoint(workdir):
        command = [sys.executable, "-m", "detector.train", *base]
        print(" ".join(command), flush=True)
        subprocess.run(command, cwd=REPO_ROOT, check=True)
    with tempfile.TemporaryDirectory(prefix="docs_figures_") as tmp:
        inputs = list(_IMAGES.value)
        if not inputs:
            image_size = int(_load_config(_CONFIG.value).dataset.image_size)
            inputs = [
                str(p) for p in write_validation_images(pathlib.Path(tmp, "inputs"), _NUM_IMAGES.value, image_size)
            ]
        output = pathlib.Path(tmp, "predictions")
        command = [
            sys.executable,
            "-m",
            "detector.predict",
            *base,
            f"--output={output}",
            f"--score_threshold={_SCORE_THRESHOLD.value}",
            *inputs,
        ]
        print(" ".join(command), flush=True)
        subprocess.run(command, cwd=REPO_ROOT, check=True)
        pictures = sorted((output / "pictures").glob("*.png"))
        if not pictures:
            raise SystemExit(f"error: detector.predict wrote no pictures to {output}")
        fig = Figure(figsize=(14, 14 / len(pictures) + 0.9), dpi=DPI, facecolor="white")
        for i, picture in enumerate(pictures):
            ax = fig.add_subplot(1, len(pictures), i + 1)
            ax.imshow(Image.open(picture).convert("RGB"), interpolation="nearest")
            ax.set_title(picture.stem, fontsize=12)
            ax.axis("off")
        fig.suptitle(f"python -m detector.predict, {_CONFIG.value}, score >= {_SCORE_THRESHOLD.value}", fontsize=14)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=DPI, facecolor="white")
    return path


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments {argv[1:]}; use flags, e.g. --only=mesh")
    unknown = sorted(set(_ONLY.value) - set(FIGURES))
    if unknown:
        raise app.UsageError(f"--only names {', '.join(unknown)}; use some of {', '.join(FIGURES)}")
    images = REPO_ROOT / _IMAGES_DIR.value
    if "mesh" in _ONLY.value:
        print("wrote", draw_mesh(images / "mesh_axes.png"))
    if "ap_vs_time" in _ONLY.value:
        json_path = _AP_JSON.value or run_ap_vs_time(_AP_OUTPUT_DIR.value, _AP_CONFIGS.value, _AP_EVAL_EVERY.value)
        print("wrote", draw_ap_vs_time(pathlib.Path(json_path), images / "ap_vs_time.png"))
    if "predicted" in _ONLY.value:
        print("wrote", make_predicted(images / "predicted.png"))


if __name__ == "__main__":
    app.run(main)
