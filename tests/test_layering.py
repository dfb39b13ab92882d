"""Dependencies point one way: every first-party import of every module is checked against a rule table.

Layers, lowest first: `sharding` (model-agnostic mesh and accounting) and
`input_pipeline` (host data; may use `sharding`); in `detector/`, `errors`,
then `ops` (pure array math) and `models` (networks), then `training` (state,
steps, optimizer, checkpoints) and `serving` (predictor, evaluation, export,
drawing), then the training loop, which evaluates and draws, then the entry
points. Within `models`, a detector family's files (network and objective)
reach their backbone through `detector.models.backbones` and import nothing
of another family's files. Imports inside functions count too: a lazy
import is still a dependency.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

from tests.helpers import REPO_ROOT

FIRST_PARTY = ("detector", "sharding", "input_pipeline", "configs", "benchmarks", "tests")
SCANNED = ("detector", "sharding", "input_pipeline", "configs", "benchmarks")

MODELS_MAY_IMPORT = ("detector.models", "detector.ops", "detector.errors", "sharding", "input_pipeline")
# A family's network and objective build their backbone through `detector.models.backbones`
# alone and take nothing from another family's files.
BACKBONE_MODULES = ("detector.models.resnet", "detector.models.vit")
RETINANET_FILES = ("detector.models.retinanet", "detector.models.families.retinanet")
DINO_FILES = ("detector.models.dino", "detector.models.families.dino")

# Module prefix -> (first-party prefixes it may import, prefixes it may not import even so).
# The longest matching prefix applies.
RULES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "sharding": (("sharding",), ()),
    "input_pipeline": (("input_pipeline", "sharding"), ()),
    "configs": (("configs",), ()),
    "detector": (("detector", "sharding", "input_pipeline"), ()),  # entry points and cli
    "detector.errors": ((), ()),
    "detector.ops": (("detector.ops", "detector.errors", "sharding", "input_pipeline"), ()),
    "detector.models": (MODELS_MAY_IMPORT, ()),
    **{module: (MODELS_MAY_IMPORT, (*BACKBONE_MODULES, *DINO_FILES)) for module in RETINANET_FILES},
    **{module: (MODELS_MAY_IMPORT, (*BACKBONE_MODULES, *RETINANET_FILES)) for module in DINO_FILES},
    "detector.training": (("detector.training", *MODELS_MAY_IMPORT), ()),
    "detector.serving": (("detector.serving", "detector.training", *MODELS_MAY_IMPORT), ()),
    # The loop: trains, and evaluates with serving's COCO evaluation and draws its pictures.
    "detector.loop": (("detector.loop", "detector.serving", "detector.training", *MODELS_MAY_IMPORT), ()),
    "benchmarks": (FIRST_PARTY[:-1], ()),
}


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every first-party module `path` imports, at any depth of the file.

    `from package import name` counts as `package.name` when that is a module,
    else as `package`.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path, root).rsplit(".", 1)[0] if path.name != "__init__.py" else module_name(path, root)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                candidate = f"{base}.{alias.name}"
                as_path = root / pathlib.Path(*candidate.split("."))
                is_module = as_path.with_suffix(".py").exists() or (as_path / "__init__.py").exists()
                found.append((node.lineno, candidate if is_module else base))
    return [(line, name) for line, name in found if name.split(".")[0] in FIRST_PARTY]


def _matches(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def violations(root: pathlib.Path, packages=SCANNED, rules=RULES) -> list[str]:
    """One line per import that breaks `rules`: 'file:line: module imports other (rule for prefix)'."""
    found = []
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            module = module_name(path, root)
            rule = max((p for p in rules if _matches(module, p)), key=len, default=None)
            if rule is None:
                found.append(f"{path.relative_to(root)}: no rule covers {module}")
                continue
            allowed, forbidden = rules[rule]
            for line, imported in imported_modules(path, root):
                ok = any(_matches(imported, a) for a in allowed) and not any(_matches(imported, f) for f in forbidden)
                if not ok and imported != module:
                    found.append(f"{path.relative_to(root)}:{line}: {module} imports {imported} (rule {rule!r})")
    return found


def test_imports_point_one_way():
    assert violations(REPO_ROOT) == []


def package_imports(root: pathlib.Path) -> dict[str, set[str]]:
    """`detector` package (`detector.training`, ...) -> the other `detector` packages its modules import."""
    graph: dict[str, set[str]] = {}
    for path in sorted((root / "detector").rglob("*.py")):
        module = module_name(path, root).split(".")
        if len(module) < 3:  # the entry points and cli: the top, importing everything
            continue
        package = ".".join(module[:2])
        for _, imported in imported_modules(path, root):
            other = ".".join(imported.split(".")[:2])
            if other != package and (root / pathlib.Path(*other.split("."))).is_dir():
                graph.setdefault(package, set()).add(other)
    return graph


def test_no_two_packages_import_each_other():
    """Whatever the table allows, the packages' own imports form no cycle (serving <-> training was one)."""
    graph = package_imports(REPO_ROOT)
    assert {"detector.serving", "detector.training", "detector.loop"} <= set(graph)  # the scan sees them
    seen, stack = set(), []

    def visit(package):
        assert package not in stack, " -> ".join([*stack[stack.index(package) :], package])
        if package in seen:
            return
        stack.append(package)
        for other in sorted(graph.get(package, ())):
            visit(other)
        stack.pop()
        seen.add(package)

    for package in sorted(graph):
        visit(package)


def test_every_module_is_covered_and_scanned():
    """The table covers each package, and the scan sees the modules that matter (not an empty tree)."""
    modules = {module_name(p, REPO_ROOT) for package in SCANNED for p in (REPO_ROOT / package).rglob("*.py")}
    for expected in (
        "detector.ops.box_ops",
        "detector.models.retinanet",
        "detector.loop.trainer",
        "detector.serving.predictor",
        "sharding.mesh",
        "input_pipeline.pipeline",
    ):
        assert expected in modules


@pytest.mark.parametrize(
    "module_path, line, rule",
    [
        ("sharding/extra.py", "from detector.models import retinanet", "sharding"),
        ("sharding/extra.py", "import input_pipeline", "sharding"),
        ("input_pipeline/extra.py", "from detector.training import steps", "input_pipeline"),
        ("detector/ops/extra.py", "from detector.models.resnet import ResNet", "detector.ops"),
        ("detector/models/extra.py", "from detector.training import optim", "detector.models"),
        ("detector/models/extra.py", "from ..serving import drawing", "detector.models"),
        ("detector/models/families/dino.py", "from detector.models import retinanet", "detector.models.families.dino"),
        ("detector/models/dino.py", "from detector.models.vit import ViT", "detector.models.dino"),
        (
            "detector/models/families/dino.py",
            "from .retinanet import anchors_for_config",
            "detector.models.families.dino",
        ),
        ("detector/models/retinanet.py", "from detector.models.resnet import ResNet", "detector.models.retinanet"),
        ("detector/training/extra.py", "from detector.serving import coco_evaluation", "detector.training"),
        ("detector/serving/extra.py", "from detector.loop.trainer import train_and_evaluate", "detector.serving"),
        ("detector/training/extra.py", "from detector.loop import evaluator", "detector.training"),
        ("configs/extra.py", "import detector", "configs"),
    ],
)
def test_a_forbidden_import_is_reported(tmp_path, module_path, line, rule):
    """Copies the real packages, adds (or replaces) one module with a forbidden import inside a function, expects
    one report."""
    for package in ("detector", "sharding", "input_pipeline", "configs"):
        for path in (REPO_ROOT / package).rglob("*.py"):
            target = tmp_path / path.relative_to(REPO_ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text())
    extra = tmp_path / module_path
    extra.write_text(f"def lazy():\n    {line}\n")
    found = violations(tmp_path, packages=("detector", "sharding", "input_pipeline", "configs"))
    assert len(found) == 1, found
    assert found[0].startswith(f"{module_path}:2:") and f"(rule {rule!r})" in found[0]


def test_no_two_sibling_modules_differ_only_by_a_suffix():
    """Within a package, no pair like export.py / exporting.py that a reader must open both of to tell apart."""
    pairs = []
    for package in SCANNED:
        for directory in [REPO_ROOT / package, *(p for p in (REPO_ROOT / package).rglob("*") if p.is_dir())]:
            names = sorted(p.stem for p in directory.glob("*.py") if p.stem != "__init__")
            pairs += [
                f"{directory.relative_to(REPO_ROOT)}: {a}.py / {b}.py"
                for a in names
                for b in names
                if a != b and b.startswith(a) and not b[len(a)].startswith("_")
            ]
    assert pairs == []
