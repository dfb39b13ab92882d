"""A backbone option is named where it is defaulted, checked and used, and nowhere in between.

The ViT's options are its dataclass fields: `configs/common.py` gives their
defaults, `detector/models/vit.py` checks and uses them and
`detector/models/weights/` maps checkpoints onto them. Everything that builds,
trains or serves a model passes the config block through
`detector.models.backbones` whole, so adding an option touches none of it.
Options are found as identifiers (names, attributes, keywords, arguments) and
as strings that are exactly an option's name (`block.get("qkv_bias")`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import pathlib
import pkgutil

import flax.linen as nn

from detector import models
from detector.models.vit import ViT
from tests.helpers import REPO_ROOT

# Where the ViT's options must not be named: the code between the config and the ViT.
BETWEEN = (
    "detector/models/retinanet.py",
    "detector/models/backbones.py",
    "detector/models/families",
    "detector/training",
    "detector/loop",
    "detector/serving",
)


def shared_field_names() -> set[str]:
    """Fields other networks of `detector.models` declare too (the compute dtype, `remat`, DINO's `num_heads`,
    the transformer layers' LoRA rank): shared words, not the ViT's own."""
    names = set()
    for info in pkgutil.walk_packages(models.__path__, f"{models.__name__}."):
        if info.name == ViT.__module__:
            continue
        for _, cls in inspect.getmembers(importlib.import_module(info.name), inspect.isclass):
            if issubclass(cls, nn.Module) and cls.__module__ == info.name:
                names |= {field.name for field in dataclasses.fields(cls)}
    return names


def vit_option_names() -> set[str]:
    return {field.name for field in dataclasses.fields(ViT)} - shared_field_names()


def named_options(path: pathlib.Path, options: set[str]) -> list[str]:
    """'path:line: name' for each identifier or exact string of `path` that is one of `options`.

    Attributes of an imported module (`jax.lax.scan`, `nn.scan`) are that
    module's names, not options, and are skipped.
    """
    tree = ast.parse(path.read_text(), filename=str(path))
    modules = {
        (alias.asname or alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }

    def root(node: ast.AST) -> str | None:
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            words = [node.id]
        elif isinstance(node, ast.Attribute):
            words = [] if root(node.value) in modules else [node.attr]
        elif isinstance(node, (ast.keyword, ast.arg)):
            words = [node.arg]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            words = [node.value]
        else:
            words = []
        found += [f"{path.relative_to(REPO_ROOT)}:{node.lineno}: {word}" for word in words if word in options]
    return found


def between_files(root: pathlib.Path = REPO_ROOT) -> list[pathlib.Path]:
    paths = []
    for entry in BETWEEN:
        path = root / entry
        paths += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    return paths


def test_vit_options_are_named_only_where_defaulted_checked_and_used():
    options = vit_option_names()
    found = [line for path in between_files() for line in named_options(path, options)]
    assert found == []


def test_the_scan_sees_the_options_and_their_uses():
    """The options include the foundation-backbone switches, and a use of one is reported: not an empty check."""
    options = vit_option_names()
    assert {"qkv_bias", "layer_scale", "register_tokens", "mlp_norm", "rope_temperature", "final_norm"} <= options
    assert {"dtype", "remat"}.isdisjoint(options)
    assert all(path.exists() for path in between_files())
    source = REPO_ROOT / "detector/models/vit.py"
    uses = named_options(source, options)
    assert any(line.endswith(": qkv_bias") for line in uses) and any(line.endswith(": final_norm") for line in uses)
