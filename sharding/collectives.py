"""Collectives of a compiled XLA program and the bytes they move, read from its optimized HLO.

Input is the text of `jax.jit(f).lower(...).compile().as_text()`: the module after
SPMD partitioning and XLA's optimization passes, so it holds the collectives that
actually run (per device), not the ones the user wrote.

Bytes are "the size of the full logical buffer involved, per device", per execution:

* all-reduce: its result (same size as its operand).
* all-gather: its result, the gathered buffer.
* reduce-scatter: its operand, the buffer before scattering.
* all-to-all, collective-permute: their result.

A combined (tuple-shaped) collective counts the sum over its elements. These are
buffer sizes, not wire traffic: a ring all-reduce of B bytes over n devices sends
about 2 * B * (n - 1) / n bytes per device; a caller wanting wire traffic can derive
it from `bytes` and `group_size`.

Executions multiply along the call graph from ENTRY: a while body runs its known
trip count (taken from XLA's `"known_trip_count"` backend config), a computation
reached along several paths sums the paths. Where XLA gives no trip count the loop
is counted once and the collective's `executions_exact` is False (and a warning is
logged); every branch of a conditional is counted as if it ran on every execution,
an upper bound, also marked `executions_exact=False`.

Format assumptions (checked on XLA:CPU output, reasoned for GPU's async ops):

* One instruction per line, computations as `[ENTRY] %name (params) -> type {` ... `}`
  with the closing brace in column 0 (how `as_text()` prints). A header without the
  signature (`ENTRY main {`, as in hand-written HLO) is accepted too.
* Async collectives are counted at their `-start` op only; `-update` and `-done` ops
  are skipped. Result shapes of the start ops:
    - `all-reduce-start`: the reduced buffer(s) themselves (same as a sync all-reduce),
      so every tuple element counts.
    - `all-gather-start`: `(operand(s), result(s))`; only element 1 counts.
    - `collective-permute-start`: `(operand, result[, u32[] context...])`; only element 1.
    - `reduce-scatter-start`, `all-to-all-start` (XLA's printed form of an `async-start`
      wrapping that collective): `((operands...), result[, context])`; element 0 for
      reduce-scatter (the unscattered operand), element 1 for all-to-all.
  An unsugared `async-start(...), calls=%wrapped` is followed into `%wrapped`, where the
  plain collective is counted once; `async-update`/`async-done` are not followed even
  when they also print `calls=`, so the pair is not counted twice.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Iterable

log = logging.getLogger(__name__)

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# Opcodes counted, and their kind: the sync ops and the `-start` half of async pairs.
# `-done`/`-update` halves are deliberately absent so a pair counts once.
_OPCODE_KIND = {kind: kind for kind in COLLECTIVE_KINDS}
_OPCODE_KIND.update({f"{kind}-start": kind for kind in COLLECTIVE_KINDS})

# Bits per element. Sub-byte types are stored one element per byte unless the layout
# says otherwise (`E(4)`, handled in `_parse_type`), which is XLA's default.
_DTYPE_BITS = {
    "pred": 8,
    "s8": 8,
    "u8": 8,
    "s4": 8,
    "u4": 8,
    "s2": 8,
    "u2": 8,
    "s1": 8,
    "u1": 8,
    "bf16": 16,
    "f16": 16,
    "s16": 16,
    "u16": 16,
    "f32": 32,
    "s32": 32,
    "u32": 32,
    "f64": 64,
    "s64": 64,
    "u64": 64,
    "c64": 64,
    "c128": 128,
    "token": 0,  # ordering tokens carry no data
}


def _dtype_bits(dtype: str) -> int:
    if dtype in _DTYPE_BITS:
        return _DTYPE_BITS[dtype]
    # All f8 variants (f8e4m3fn, f8e5m2, f8e4m3fnuz, f8e8m0fnu, ...) and f4e2m1fn/f6*
    # occupy one byte per element in XLA's default layout.
    if re.fullmatch(r"f[468]e\d+m\d+\w*", dtype):
        return 8
    raise ValueError(f"unknown HLO element type {dtype!r}: cannot size a collective buffer of it")


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective instruction of the optimized HLO module.

    `bytes` is per device and per execution (definition in the module docstring);
    the program moves `bytes * executions` bytes through it per call.
    """

    kind: str  # one of COLLECTIVE_KINDS
    computation: str  # name of the HLO computation holding the instruction (no '%')
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of each buffer counted in `bytes`
    bytes: int  # bytes per device per execution
    executions: int  # runs per call of the program, while-loop trip counts multiplied in
    group_size: int  # devices per replica group; 1 if unparseable
    # False when a path from ENTRY crosses a while loop with no known trip count (counted
    # as one trip) or a conditional branch (counted as always taken: an upper bound).
    executions_exact: bool = True

    @property
    def total_bytes(self) -> int:
        """Bytes per device over all executions in one call of the program."""
        return self.bytes * self.executions


@dataclasses.dataclass(frozen=True)
class CollectiveSummary:
    """All collectives of one kind in a program, per device and per call of the program."""

    count: int  # executions summed
    bytes: int  # bytes * executions summed


def summarize(collectives: Iterable[Collective]) -> dict[str, CollectiveSummary]:
    """Per-kind totals; every kind in COLLECTIVE_KINDS is present (zeros when absent)."""
    count = dict.fromkeys(COLLECTIVE_KINDS, 0)
    nbytes = dict.fromkeys(COLLECTIVE_KINDS, 0)
    for c in collectives:
        count[c.kind] += c.executions
        nbytes[c.kind] += c.bytes * c.executions
    return {kind: CollectiveSummary(count=count[kind], bytes=nbytes[kind]) for kind in COLLECTIVE_KINDS}


# ----------------------------------------------------------------------------- shapes


@dataclasses.dataclass(frozen=True)
class _Array:
    dtype: str
    dims: tuple[int, ...]
    bits: int | None = None  # element size from the layout's E(n), if any

    @property
    def nbytes(self) -> int:
        bits = self.bits if self.bits is not None else _dtype_bits(self.dtype)
        return -(-math.prod(self.dims) * bits // 8)  # round partial bytes up


_ARRAY_RE = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\]")
_FLAT_BRACES_RE = re.compile(r'\{[^{}"]*\}')  # a layout without nested braces or quotes: most of them


def _skip_blank(text: str, pos: int) -> int:
    """Skips whitespace and `/*index=5*/` comments, which the printer puts inside long tuples."""
    while pos < len(text):
        if text[pos].isspace():
            pos += 1
        elif text.startswith("/*", pos):
            end = text.find("*/", pos + 2)
            pos = len(text) if end < 0 else end + 2
        else:
            break
    return pos


# A quoted string (backend configs hold brackets and commas; an unterminated one runs to the end of the
# text) or one bracket or comma: the only characters the bracket matching and splitting below look at.
# Scanning by regex instead of character by character: an 11 MB module parses in a fraction of the time.
_SIGNIFICANT_RE = re.compile(r'"(?:[^"\\]|\\.)*(?:"|\Z)|[()\[\]{},]')


def _matching(text: str, pos: int, open_: str, close: str) -> int:
    """Index of the bracket closing the one at `pos`, ignoring brackets inside quoted strings."""
    depth = 0
    for m in _SIGNIFICANT_RE.finditer(text, pos):
        ch = m.group()
        if ch == open_:
            depth += 1
        elif ch == close:
            depth -= 1
            if depth == 0:
                return m.start()
    raise ValueError(f"unbalanced {open_!r} in HLO text: {text[pos : pos + 80]!r}")


def _dim(text: str) -> int:
    # Bounded dynamic dims print as `<=8`: the buffer is allocated at the bound.
    # Unbounded ones (`?`) have no static size; they count as 0.
    digits = re.findall(r"\d+", text)
    return int(digits[-1]) if digits else 0


def _parse_type(text: str, pos: int = 0):
    """Parses one HLO shape starting at `pos`; returns (shape, position after it)."""
    pos = _skip_blank(text, pos)
    if pos < len(text) and text[pos] == "(":
        elements = []
        pos += 1
        while True:
            pos = _skip_blank(text, pos)
            if pos >= len(text):
                raise ValueError("unterminated tuple shape")
            if text[pos] == ")":
                return tuple(elements), pos + 1
            element, pos = _parse_type(text, pos)
            elements.append(element)
            pos = _skip_blank(text, pos)
            if pos < len(text) and text[pos] == ",":
                pos += 1
    m = _ARRAY_RE.match(text, pos)
    if not m:
        raise ValueError(f"not an HLO shape: {text[pos : pos + 40]!r}")
    dims = tuple(_dim(d) for d in m.group(2).split(",") if d.strip())
    pos, bits = m.end(), None
    if pos < len(text) and text[pos] == "{":  # layout, e.g. {1,0} or {1,0:T(8,128)E(4)}
        flat = _FLAT_BRACES_RE.match(text, pos)
        end = flat.end() - 1 if flat else _matching(text, pos, "{", "}")
        packed = re.search(r"E\((\d+)\)", text[pos:end])
        if packed:
            bits = int(packed.group(1))
        pos = end + 1
    return _Array(m.group(1), dims, bits), pos


def _leaves(shape) -> list[_Array]:
    if isinstance(shape, _Array):
        return [shape]
    return [leaf for element in shape for leaf in _leaves(element)]


# ------------------------------------------------------------------------ instructions


class _Instruction:
    """One instruction line, parsed as far as a caller asks: most of a module's instructions are neither
    collectives nor calls, and only their name and opcode are ever read."""

    __slots__ = ("name", "opcode", "_line", "_shape_span", "_open_paren", "_shape", "_close_paren")

    def __init__(self, name: str, opcode: str, line: str, shape_span: tuple[int, int], open_paren: int):
        self.name, self.opcode, self._line = name, opcode, line
        self._shape_span, self._open_paren = shape_span, open_paren
        self._shape = self._close_paren = None

    @property
    def shape(self):
        """_Array, or a (possibly nested) tuple of them."""
        if self._shape is None:
            self._shape = _parse_type(self._line[: self._shape_span[1]], self._shape_span[0])[0]
        return self._shape

    def _close(self) -> int:
        if self._close_paren is None:
            try:
                self._close_paren = _matching(self._line, self._open_paren, "(", ")")
            except ValueError:  # an operand list this parser cannot close: all operands, no attributes
                self._close_paren = len(self._line)
        return self._close_paren

    @property
    def operands(self) -> str:
        """Raw text between the opcode's parentheses."""
        return self._line[self._open_paren + 1 : self._close()]

    @property
    def attrs(self) -> str:
        """Raw text after them: `, key=value, ...`."""
        return self._line[self._close() + 1 :]


_INSTRUCTION_RE = re.compile(r"\s+(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE_RE = re.compile(r"\s*([a-z][a-z0-9\-]*)\(")
# An array shape with a layout without nested braces: where most instructions' shapes end, found without
# parsing them.
_ARRAY_SPAN_RE = re.compile(f"{_ARRAY_RE.pattern}(?:{_FLAT_BRACES_RE.pattern})?")


def _split_top(text: str) -> list[str]:
    """Splits at commas outside brackets and quoted strings."""
    pieces, depth, start = [], 0, 0
    for m in _SIGNIFICANT_RE.finditer(text):
        ch = m.group()
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            pieces.append(text[start : m.start()])
            start = m.end()
    pieces.append(text[start:])
    return [p.strip() for p in pieces if p.strip()]


def _split_attrs(text: str) -> dict[str, str]:
    attrs = {}
    for piece in _split_top(text):
        key, sep, value = piece.partition("=")
        if sep:
            attrs[key.strip()] = value.strip()
    return attrs


def _parse_instruction(line: str) -> _Instruction | None:
    m = _INSTRUCTION_RE.match(line)
    if not m:
        return None
    span = _ARRAY_SPAN_RE.match(line, m.end())
    if span:
        shape_end = span.end()
    else:  # a tuple, or a layout with nested braces: parsed now, to find where it ends
        try:
            _, shape_end = _parse_type(line, m.end())
        except ValueError:
            return None  # not an instruction line (or a form this parser does not know)
    op = _OPCODE_RE.match(line, shape_end)
    if not op:
        return None
    return _Instruction(m.group(1), op.group(1), line, (m.end(), shape_end), op.end() - 1)


# ----------------------------------------------------------------------------- module


_HEADER_RE = re.compile(r"(ENTRY\s+)?%?([^\s(){}]+)\s*(?:\(.*\)\s*->\s*.*?)?\s*\{\s*$")


@dataclasses.dataclass
class _Module:
    computations: dict[str, list[_Instruction]]
    entry: str
    replicas: int  # replica_count from the module header (1 if absent)
    partitions: int  # num_partitions from the module header (1 if absent)


def _parse_module(hlo_text: str) -> _Module:
    computations: dict[str, list[_Instruction]] = {}
    entry, current = None, None
    replicas = partitions = 1
    for line in hlo_text.splitlines():
        if current is None:
            if line.startswith("HloModule"):
                r = re.search(r"replica_count=(\d+)", line)
                p = re.search(r"num_partitions=(\d+)", line)
                replicas = int(r.group(1)) if r else 1
                partitions = int(p.group(1)) if p else 1
                continue
            # Headers start in column 0; so do the FileNames/StackFrames tables, whose
            # lines end in '}' rather than '{'.
            m = _HEADER_RE.match(line) if line[:1] not in ("", " ", "\t") else None
            if m:
                current = m.group(2)
                computations[current] = []
                if m.group(1):
                    entry = current
        elif line.startswith("}"):
            current = None
        else:
            instruction = _parse_instruction(line)
            if instruction is not None:
                computations[current].append(instruction)
    if entry is None:
        raise ValueError(
            "HLO text has no ENTRY computation; pass the whole module "
            "(e.g. `jax.jit(f).lower(...).compile().as_text()`)"
        )
    return _Module(computations, entry, replicas, partitions)


# ------------------------------------------------------------------------- call graph


def _names(value: str | None) -> list[str]:
    """Computation names of `%f` or `{%f, %g}`."""
    if not value:
        return []
    return [n.lstrip("%") for n in re.findall(r"%?[\w.\-]+", value.strip("{}"))]


_TRIP_COUNT_RE = re.compile(r'known_trip_count[\\":{\s]*n[\\":\s]*(\d+)')


def _callees(instruction: _Instruction, computation: str) -> list[tuple[str, int, bool]]:
    """(callee, runs per run of the caller, exact?) for the computations an instruction runs."""
    op = instruction.opcode
    if op == "while":
        m = _TRIP_COUNT_RE.search(instruction.attrs)
        exact = m is not None
        if m:
            trips = int(m.group(1))
        else:
            trips = 1
            log.warning(
                "while loop %%%s in %%%s has no known trip count; its body is counted once",
                instruction.name,
                computation,
            )
        attrs = _split_attrs(instruction.attrs)
        # The condition is evaluated once more than the body runs.
        return [(n, trips, exact) for n in _names(attrs.get("body"))] + [
            (n, trips + 1, exact) for n in _names(attrs.get("condition"))
        ]
    if op == "conditional":
        attrs = _split_attrs(instruction.attrs)
        branches = (
            _names(attrs.get("branch_computations"))
            + _names(attrs.get("true_computation"))
            + _names(attrs.get("false_computation"))
        )
        return [(n, 1, False) for n in branches]  # one branch runs; counting all is an upper bound
    # `to_apply` only means "runs once" for a call; for reduce, all-reduce, scatter, sort,
    # map, ... it names a scalar reducer/comparator, which holds no collectives.
    if op == "call":
        attrs = _split_attrs(instruction.attrs)
        return [(n, 1, True) for n in _names(attrs.get("to_apply")) + _names(attrs.get("calls"))]
    # Fusions, custom calls, and async starts (`async-start` or XLA's printed
    # `<op>-start` form for a wrapped fusion/custom call). `-update`/`-done` also name
    # the wrapped computation but must not count it again.
    if op in ("fusion", "custom-call") or (op.endswith("-start") and op not in _OPCODE_KIND):
        attrs = _split_attrs(instruction.attrs)
        return [(n, 1, True) for n in _names(attrs.get("calls")) + _names(attrs.get("called_computations"))]
    return []


def _executions(module: _Module) -> dict[str, tuple[int, bool]]:
    """Runs per program call, and exactness, of each computation reachable from ENTRY."""
    edges = {
        name: [e for i in instructions for e in _callees(i, name) if e[0] in module.computations]
        for name, instructions in module.computations.items()
    }
    # Reverse post-order of an iterative DFS: every caller precedes its callees (HLO
    # call graphs are acyclic), so each computation's count is final when it is visited.
    postorder, seen = [], {module.entry}
    stack = [(module.entry, iter(edges[module.entry]))]
    while stack:
        node, pending = stack[-1]
        for callee, _, _ in pending:
            if callee not in seen:
                seen.add(callee)
                stack.append((callee, iter(edges[callee])))
                break
        else:
            stack.pop()
            postorder.append(node)
    runs, exact = {module.entry: 1}, {module.entry: True}
    for name in reversed(postorder):
        for callee, times, edge_exact in edges[name]:
            runs[callee] = runs.get(callee, 0) + runs[name] * times
            exact[callee] = exact.get(callee, True) and exact[name] and edge_exact
    return {name: (runs[name], exact[name]) for name in runs}


# ------------------------------------------------------------------------ collectives


_MESH_GROUP_AXES_RE = re.compile(r"(?:\s*,\s*device_ids=\((?:[^()]|\([^()]*\))*\))?\s*\{([^{}]*)\}")


def _group_size(instruction: _Instruction, module: _Module) -> int:
    attrs = instruction.attrs
    if instruction.opcode.startswith("collective-permute"):
        return 2  # source_target_pairs: each transfer is between two devices
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]", attrs)
    if m:
        # `mesh['a'=2,'b'=4][, device_ids=(...)] {'b'}`: the group spans the listed axes;
        # a sub-axis prints as 'a':(pre_size)size.
        axis_sizes = {name: int(size) for name, size in re.findall(r"'?([^'=,\s]+)'?\s*=\s*(\d+)", m.group(1))}
        axes = _MESH_GROUP_AXES_RE.match(attrs, m.end())
        if not axes:
            return 1
        size = 1
        for name, sub_size in re.findall(r"'?([^',:{}\s]+)'?(?::\(\d+\)(\d+))?", axes.group(1)):
            if sub_size:
                size *= int(sub_size)
            elif name in axis_sizes:
                size *= axis_sizes[name]
            else:
                return 1
        return size
    m = re.search(r"replica_groups=\[([\d,\s]+)\]<=", attrs)
    if m:  # iota form [groups,size]<=[n](T(...)): the last dim is the group size
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=\{\{([^}]*)\}", attrs)
    if m:
        return len(re.findall(r"\d+", m.group(1)))
    if re.search(r"replica_groups=\{\s*\}", attrs) or "replica_groups=" not in attrs:
        # Empty groups: one group. Without a channel id the op is cross-replica (all
        # replicas); with one it spans every replica and partition.
        return module.replicas * (module.partitions if "channel_id=" in attrs else 1)
    return 1


def _operand_buffers(instruction: _Instruction, symbols: dict[str, _Instruction]) -> list[_Array] | None:
    """Shapes of an instruction's operands, from inline types or the defining instructions."""
    buffers = []
    for piece in _split_top(instruction.operands):
        piece = re.sub(r"/\*.*?\*/", "", piece).strip()
        name = piece.split()[-1].lstrip("%") if piece else ""
        if " " in piece:  # printed with operand shapes: `f32[8]{0} %x`
            buffers += _leaves(_parse_type(piece)[0])
        elif name in symbols:
            buffers += _leaves(symbols[name].shape)
        else:
            return None
    return buffers


def _scattered_back(instruction: _Instruction, group_size: int) -> list[_Array]:
    """A reduce-scatter's operand rebuilt from its result: the scatter dim times the group."""
    dims = re.search(r"dimensions=\{(\d+)\}", instruction.attrs)
    out = []
    for leaf in _leaves(instruction.shape):
        d = list(leaf.dims)
        if dims and int(dims.group(1)) < len(d):
            d[int(dims.group(1))] *= group_size
        out.append(_Array(leaf.dtype, tuple(d), leaf.bits))
    return out


def _moved_buffers(
    instruction: _Instruction, kind: str, group_size: int, symbols: dict[str, _Instruction]
) -> list[_Array]:
    shape, op = instruction.shape, instruction.opcode
    if op.endswith("-start") and kind != "all-reduce":
        # (operand(s), result(s), context...): see the module docstring.
        if isinstance(shape, tuple) and len(shape) >= 2:
            return _leaves(shape[0] if kind == "reduce-scatter" else shape[1])
    if kind == "reduce-scatter":
        operands = _operand_buffers(instruction, symbols)
        return operands if operands is not None else _scattered_back(instruction, group_size)
    return _leaves(shape)


def parse_collectives(hlo_text: str) -> list[Collective]:
    """Collectives of an optimized HLO module, in print order, with per-device bytes.

    Collectives in computations that are not reachable from ENTRY (never run) are left out.
    """
    module = _parse_module(hlo_text)
    runs = _executions(module)
    found = []
    for computation, instructions in module.computations.items():
        if computation not in runs:
            continue
        executions, exact = runs[computation]
        symbols = {i.name: i for i in instructions}
        for instruction in instructions:
            kind = _OPCODE_KIND.get(instruction.opcode)
            if kind is None:
                continue
            group_size = _group_size(instruction, module)
            buffers = [b for b in _moved_buffers(instruction, kind, group_size, symbols) if b.dtype != "token"]
            found.append(
                Collective(
                    kind=kind,
                    computation=computation,
                    shapes=tuple((b.dtype, b.dims) for b in buffers),
                    bytes=sum(b.nbytes for b in buffers),
                    executions=executions,
                    group_size=group_size,
                    executions_exact=exact,
                )
            )
    return found
