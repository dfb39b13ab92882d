"""The README and docs/ hold together: links and pictures resolve, and the commands they name exist.

Links: every relative `[text](path)` and `![alt](path)` outside code, with
an optional `#anchor`, names an existing file (or folder) relative to its
page, and the anchor a heading of the target page as GitHub slugs it. A
picture that has not been generated yet fails here until it is.

Commands: every `python -m MODULE ...` in a code block or in inline code
names a module that exists, and every `--flag` or `--flag=value` it passes
is an absl flag MODULE defines; a `--config.KEY=value` override names a key
of the config its `--config=` file builds (configs/common.py's base config
when the file is a placeholder). Commands of other modules (pytest, venv)
are only checked to exist.

Flags are read from the source, not by importing the entry points: absl
keeps one global flag registry per process, and evaluate, predict and export
each call `cli.define_trained_run_flags()` and `distributed.define_flags()`
at import, so importing a second of them raises DuplicateFlagError, and
importing them loads JAX, Flax and TensorFlow, seconds a module. The source
says the same: what `python -m MODULE` defines is the
`*.DEFINE_*("name", ...)` calls run by its module-level statements
(`if __name__ == "__main__":` included), by the module-level statements of
every first-party module imported at module level (transitively), and by the
first-party functions those statements call (transitively). Flags that
absl itself defines are allowed too; those of other libraries the entry
points import (TensorFlow's, Orbax's) are not: the docs pass none.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib.util
import re

import ml_collections
import pytest

from tests.helpers import REPO_ROOT

PAGES = ("README.md", *sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "docs").glob("*.md")))
FIRST_PARTY = ("detector", "sharding", "input_pipeline", "configs", "benchmarks", "docs")
# Flags absl itself defines in every program run through absl.app (help, flag files, logging, debugging).
ABSL_FLAGS = frozenset(
    "help helpfull helpshort helpxml flagfile undefok only_check_args pdb pdb_post_mortem run_with_pdb "
    "run_with_profiling profile_file use_cprofile_for_profiling logtostderr alsologtostderr log_dir verbosity v "
    "stderrthreshold showprefixforinfo logger_levels".split()
)

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$")
INLINE_CODE = re.compile(r"(`+)(.+?)\1", re.DOTALL)
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
COMMAND = re.compile(r"\bpython3?\s+-m\s+([A-Za-z_][\w.]*)")
# A command ends at a shell separator or a comment.
COMMAND_END = re.compile(r"&&|\|\||\||;|(?:^|\s)#")
FLAG = re.compile(r"(?<![\w-])--([A-Za-z][\w.-]*)(?:=(\S*))?")
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*$")  # benchmarks.NAME


@dataclasses.dataclass(frozen=True)
class Page:
    """A markdown page split into prose (outside fenced code) and its code blocks."""

    prose: str
    code_blocks: tuple[str, ...]


def split_markdown(text: str) -> Page:
    prose, blocks, block, fence = [], [], [], None
    for line in text.splitlines():
        opening = FENCE.match(line)
        if fence is None and opening:
            fence, block = opening.group(1), []
        elif fence is not None and line.strip().startswith(fence):
            blocks.append("\n".join(block))
            fence = None
        elif fence is not None:
            block.append(line)
        else:
            prose.append(line)
    assert fence is None, "a code block is not closed"
    return Page("\n".join(prose), tuple(blocks))


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link text kept, lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading's anchor on a page; repeated headings get -1, -2, ... as on GitHub."""
    found, seen = set(), {}
    for line in split_markdown(text).prose.splitlines():
        match = HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page_path, text: str) -> list[str]:
    """Relative links of the page at `page_path` (with `text`) whose file or heading does not exist."""
    prose = INLINE_CODE.sub("code", split_markdown(text).prose)
    broken = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        if not path:  # an anchor on this page
            if anchor not in anchors(text):
                broken.append(f"{target}: no heading #{anchor} on this page")
            continue
        resolved = (page_path.parent / path).resolve()
        if not resolved.exists():
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved.read_text()):
            broken.append(f"{target}: no heading #{anchor} in {resolved.name}")
    return broken


def commands(text: str) -> list[tuple[str, str]]:
    """(module, rest of the command) of every `python -m` in the page's code blocks and inline code."""
    page = split_markdown(text)
    lines = []
    for block in page.code_blocks:
        lines += block.replace("\\\n", " ").splitlines()
    lines += [" ".join(code.split()) for _, code in INLINE_CODE.findall(page.prose)]
    found = []
    for line in lines:
        starts = list(COMMAND.finditer(line))
        for match, following in zip(starts, [*starts[1:], None]):
            rest = line[match.end() : following.start() if following else None]
            found.append((match.group(1), COMMAND_END.split(rest)[0]))
    return found


# --- flags, read from the source -------------------------------------------------------------------------


def module_file(name: str):
    """The source file of first-party module `name`, or None."""
    if name.split(".")[0] not in FIRST_PARTY:
        return None
    base = REPO_ROOT.joinpath(*name.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@dataclasses.dataclass(frozen=True)
class Source:
    tree: ast.Module
    functions: dict[str, ast.FunctionDef]
    names: dict[str, str]  # local name -> dotted first-party name it stands for (module, or module.attribute)


def import_base(node: ast.ImportFrom, name: str) -> str:
    """The absolute module of `from BASE import ...` in module `name` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = name if module_file(name).name == "__init__.py" else name.rpartition(".")[0]
    parts = package.split(".")
    return ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))


@functools.cache
def parse(name: str) -> Source:
    path = module_file(name)
    tree = ast.parse(path.read_text(), filename=str(path))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                names[alias.asname or alias.name] = f"{import_base(node, name)}.{alias.name}"
    return Source(tree, functions, names)


def top_level_statements(tree: ast.Module, as_main: bool) -> list[ast.stmt]:
    """The simple statements that run when the module runs (`as_main`: under `python -m`) or is imported.

    Compound statements (if, try, with) count by their bodies; `if __name__ == "__main__":` only as main.
    """
    found, pending = [], list(tree.body)
    while pending:
        node = pending.pop(0)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            continue
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test) and not as_main:
            continue
        if not hasattr(node, "body"):
            found.append(node)
            continue
        for field in ("body", "orelse", "finalbody", "handlers"):
            pending[:0] = [n for n in getattr(node, field, []) if isinstance(n, ast.stmt | ast.excepthandler)]
    return found


def dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = dotted(node.value)
        return f"{base}.{node.attr}" if base else None
    return None


def resolve_function(name: str, full: str, depth: int = 0):
    """(module, function) that dotted `full`, as written in module `name`, calls; None if not first-party."""
    first, _, rest = full.partition(".")
    source = parse(name)
    if not rest and first in source.functions:
        return name, first
    target = source.names.get(first)
    if target is None or depth > 3:
        return None
    target = f"{target}.{rest}" if rest else target
    parts = target.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:cut])
        if module_file(module) and cut == len(parts) - 1:
            return resolve_function(module, parts[-1], depth + 1)
    return None


def flag_definitions(nodes, name: str, visited: set) -> tuple[set[str], set[str]]:
    """(flags, config-file flags) defined by running `nodes` of module `name`, following first-party calls."""
    defined, config_files = set(), set()
    for node in nodes:
        for call in (n for n in ast.walk(node) if isinstance(n, ast.Call)):
            callee = dotted(call.func) or ""
            if callee.rpartition(".")[2].startswith("DEFINE"):
                args = [a.value for a in call.args[:1] if isinstance(a, ast.Constant)]
                args += [k.value.value for k in call.keywords if k.arg == "name" and isinstance(k.value, ast.Constant)]
                defined.update(args)
                if callee.endswith("DEFINE_config_file"):
                    config_files.update(args)
                continue
            function = resolve_function(name, callee) if callee else None
            if function and function not in visited:
                visited.add(function)
                more, files = flag_definitions(parse(function[0]).functions[function[1]].body, function[0], visited)
                defined |= more
                config_files |= files
    return defined, config_files


def with_packages(module: str) -> list[str]:
    """The first-party modules importing `module` runs: a.b.c runs a, a.b and a.b.c."""
    parts = module.split(".")
    return [m for m in (".".join(parts[:cut]) for cut in range(1, len(parts) + 1)) if module_file(m)]


@functools.cache
def module_flags(name: str, as_main: bool = True) -> tuple[frozenset[str], frozenset[str]]:
    """(flags, config-file flags) that `python -m name` (as_main) or `import name` defines."""
    run = {name: as_main}
    pending = [name, *with_packages(name)]
    for package in pending[1:]:
        run.setdefault(package, False)
    while pending:
        module = pending.pop()
        for node in top_level_statements(parse(module).tree, run[module]):
            if isinstance(node, ast.Import):
                imported = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = import_base(node, module)
                imported = [base] + [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for new in (m for i in imported for m in with_packages(i) if m not in run):
                run[new] = False
                pending.append(new)
    defined, config_files, visited = set(), set(), set()
    for module, main in run.items():
        more, files = flag_definitions(top_level_statements(parse(module).tree, main), module, visited)
        defined |= more
        config_files |= files
    return frozenset(defined), frozenset(config_files)


# --- config keys ------------------------------------------------------------------------------------------


@functools.cache
def load_config(path: str) -> ml_collections.ConfigDict:
    """The config `--config=path` builds; the common base for a placeholder (`--config=...`)."""
    file = REPO_ROOT / path
    if not (path.endswith(".py") and file.is_file()):
        from configs import common

        return common.base_config()
    spec = importlib.util.spec_from_file_location(f"_docs_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def has_key(config: ml_collections.ConfigDict, key: str) -> bool:
    node = config
    for part in key.split("."):
        if not isinstance(node, ml_collections.ConfigDict) or part not in node:
            return False
        node = node[part]
    return True


def command_errors(module: str, rest: str) -> list[str]:
    """What is wrong with `python -m module rest`: a module that does not exist, or flags it does not take."""
    parts = module.split(".")
    if PLACEHOLDER.match(parts[-1]):  # `python -m benchmarks.NAME`: the package must exist
        parts = parts[:-1]
    module = ".".join(parts)
    if importlib.util.find_spec(module) is None:
        return [f"python -m {module}: no such module"]
    if module_file(module) is None:  # pytest, venv: not ours, their flags are not checked
        return []
    defined, config_files = module_flags(module)
    flags = FLAG.findall(rest)
    config_path = next((value for flag, value in flags if flag in config_files), "")
    errors = []
    for flag, _ in flags:
        root, _, key = flag.partition(".")
        if key and root in config_files:
            if not has_key(load_config(config_path), key):
                errors.append(f"python -m {module} --{flag}: {config_path or 'the config'} has no key {key}")
        elif not (flag in defined or flag in ABSL_FLAGS or (flag.startswith("no") and flag[2:] in defined)):
            errors.append(f"python -m {module} --{flag}: not a flag of {module}")
    return errors


# --- tests ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_and_pictures_resolve(page):
    path = REPO_ROOT / page
    broken = broken_links(path, path.read_text())
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES)
def test_commands_name_existing_modules_and_their_flags(page):
    errors = [e for module, rest in commands((REPO_ROOT / page).read_text()) for e in command_errors(module, rest)]
    assert not errors, "\n".join(errors)


def test_the_docs_index_links_every_page():
    index = split_markdown((REPO_ROOT / "docs" / "README.md").read_text()).prose
    linked = {target.partition("#")[0] for target in LINK.findall(index)}
    assert {p.removeprefix("docs/") for p in PAGES if p.startswith("docs/") and p != "docs/README.md"} <= linked


def test_the_readme_keeps_the_quickstart_and_test_commands():
    """CI runs the README's test command (.ci/run); the quickstart trains the default config."""
    found = commands((REPO_ROOT / "README.md").read_text())
    assert ("detector.train", " --config=configs/default.py --workdir=runs/default") in found
    assert ("pytest", " -n 2 --dist loadfile tests") in found
    assert "python -m pytest -n 2 --dist loadfile tests" in (REPO_ROOT / ".ci" / "run").read_text()


def test_github_slugs():
    assert github_slug("The planner: `detector.plan`") == "the-planner-detectorplan"
    assert github_slug("Learning-rate multipliers, gradient accumulation, EMA") == (
        "learning-rate-multipliers-gradient-accumulation-ema"
    )
    assert anchors("# A\n\n```bash\n# not a heading\n```\n\n## A\n") == {"a", "a-1"}


def test_a_missing_file_picture_or_heading_is_reported(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Some part\n")
    text = (
        "[ok](other.md#some-part) ![ok](other.md) [external](https://example.com/x.md) [here](#title)\n"
        "[gone](missing.md) ![gone](images/missing.png) [bad anchor](other.md#no-part) [bad](#nothing)\n"
        "`[not a link](nowhere.md)`\n\n# Title\n"
    )
    assert broken_links(tmp_path / "page.md", text) == [
        f"missing.md: no file {tmp_path / 'missing.md'}",
        f"images/missing.png: no file {tmp_path / 'images' / 'missing.png'}",
        "other.md#no-part: no heading #no-part in other.md",
        "#nothing: no heading #nothing on this page",
    ]


def test_flags_are_read_through_helpers_imports_and_the_main_block():
    predict, predict_config = module_flags("detector.predict")
    # its own, cli.define_trained_run_flags(), distributed.define_flags(), and detector.cli's module level
    assert {"output", "score_threshold", "config", "workdir", "checkpoint", "raw_params"} <= predict
    assert {"coordinator_address", "heartbeat_timeout_s", "verbose", "compilation_cache_dir"} <= predict
    assert predict_config == {"config"}
    assert "output_dir" in module_flags("benchmarks.ap_vs_time")[0]  # from benchmarks.report
    assert "process_id" in module_flags("sharding.distributed")[0]  # defined in its __main__ block only
    assert "process_id" not in module_flags("sharding.distributed", as_main=False)[0]
    assert "config" not in module_flags("benchmarks.host_memory")[1]  # a plain string flag there


def test_unknown_modules_flags_and_config_keys_are_reported():
    text = (
        "```bash\n"
        "python -m detector.train --config=configs/default.py --workdir=w \\\n"
        "    --config.model.no_such_key=1 --no_such_flag=2  # --ignored in a comment\n"
        "python -m detector.no_such_module --x\n"
        "```\n"
        "Inline: `python -m detector.plan --config=... --config.mesh.model=8 --nosearch --devices=8`.\n"
    )
    errors = [e for module, rest in commands(text) for e in command_errors(module, rest)]
    assert errors == [
        "python -m detector.train --config.model.no_such_key: configs/default.py has no key model.no_such_key",
        "python -m detector.train --no_such_flag: not a flag of detector.train",
        "python -m detector.no_such_module: no such module",
    ]
