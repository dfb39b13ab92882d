"""Large JSON files read in bounded memory: the top-level object's outline, then its big values streamed.

A COCO instances JSON is one object whose `images` and `annotations` lists
hold millions of entries. `json.loads` turns the whole file into Python
objects (about 5 bytes of memory per byte of JSON); this module never holds
more than a read buffer of the file:

  outline(path)           one vectorized pass (numpy) over the bytes that
                          finds the top-level object's keys, the byte span of
                          every list or object value, and where Python-only
                          literals (NaN, Infinity, -Infinity) stand outside
                          strings. What lies outside those spans (keys,
                          scalar values, punctuation) is parsed by `json`.
  Outline.items(key)      the elements of one top-level list, parsed one at a
                          time by ijson's C backend (yajl) from that span.
  Outline.check(key)      parses a value's span without keeping it, so a
                          syntax error anywhere still stops the read.

Why this split: ijson alone can only follow one path per pass over the whole
file, and its per-event Python interface is slower than json.loads; yajl
tokenizes about 60 MB/s, so the three COCO lists as three ijson passes would
tokenize a 200 MB file three times (measured 3.3 s per pass) before any
structure check. msgspec decodes fastest but needs the whole file in memory
(the file's size in RSS, 400 MB to 630 MB at 200,000 images, measured).
With the outline each byte is tokenized by yajl once, only inside the values
that are read, and a file's categories are found without parsing its
annotations. Python's `json` accepts NaN and +-Infinity (json.dumps writes
them) where yajl does not, and yajl's native numbers reject what overflows a
double where Python gives inf; both are kept as `json` reads them: the
literals are handed to yajl as marker strings and turned back into floats,
and a list that overflows is read again from its start with exact decimal
numbers.
"""

from __future__ import annotations

import codecs
import dataclasses
import decimal
import io
import json
import re
from collections.abc import Iterator
from typing import Any

import ijson
import numpy as np

_CHUNK_BYTES = 2 << 20
# The longest Python-only literal: a token cut by a chunk boundary is found
# in the next chunk, so each chunk keeps this many bytes for the next.
_LOOKAHEAD = len(b"-Infinity")
_NON_FINITE = re.compile(rb"-?Infinity|NaN")  # matches at a known offset only
# Marker strings that yajl reads in place of the literals; a JSON string
# cannot hold a raw NUL, so a file would have to spell these out as \u0000.
_MARKERS = {b"NaN": "\x00NaN", b"Infinity": "\x00Infinity", b"-Infinity": "\x00-Infinity"}
_MARKER_VALUES = {"\x00NaN": float("nan"), "\x00Infinity": float("inf"), "\x00-Infinity": float("-inf")}
_JSON_WHITESPACE = b" \t\r\n"
# +1 for an opening bracket, -1 for a closing one, 0 for any other byte.
_BRACKET_DEPTH = np.zeros(256, np.int8)
_BRACKET_DEPTH[[ord("["), ord("{")]] = 1
_BRACKET_DEPTH[[ord("]"), ord("}")]] = -1


class JsonError(ValueError):
    """The file is not valid JSON; the message is the parser's cause, without a traceback's detail."""


@dataclasses.dataclass(frozen=True)
class Span:
    """Where a top-level list or object value lies in the file.

    Attributes:
      start, end: byte offsets of its opening and one past its closing bracket.
      kind: 'list' or 'dict'.
    """

    start: int
    end: int
    kind: str


@dataclasses.dataclass(frozen=True)
class Outline:
    """The top-level object of a JSON file without its big values (see outline()).

    Attributes:
      path: the file.
      values: top-level key -> a Span for a list or object value, else the
        (small) value itself as json.loads gives it.
      non_finite: int64 [T] byte offsets of NaN / Infinity / -Infinity literals
        outside strings, ascending.
    """

    path: str
    values: dict[str, Any]
    non_finite: np.ndarray

    def kind(self, key: str) -> str:
        """'list', 'dict', 'absent', or the Python type name of a scalar value."""
        if key not in self.values:
            return "absent"
        value = self.values[key]
        return value.kind if isinstance(value, Span) else type(value).__name__

    def items(self, key: str) -> Iterator[Any]:
        """The elements of the top-level list `key`, one at a time, as json.loads gives them.

        Raises:
          JsonError: the list's bytes are not valid JSON (raised when reached).
        """
        span = self.values[key]
        use_float, done = True, 0
        while True:
            try:
                with _SpanReader(self, span) as reader:
                    elements = ijson.items(reader, "item", use_float=use_float, buf_size=1 << 20)
                    exact = not use_float or reader.has_markers
                    for index, element in enumerate(elements):
                        if index >= done:  # a second read skips what the first one gave
                            yield _as_json_loads_gives(element) if exact else element
                            done += 1
                return
            except ijson.common.JSONError as e:
                # yajl's native numbers overflow where Python's give inf or
                # an int of any size: read the list again with exact decimals.
                if use_float and "overflow" in str(e):
                    use_float = False
                    continue
                raise JsonError(_cause(e)) from None

    def check(self, key: str) -> None:
        """Parses the value of `key` (a Span) without keeping it: JsonError if its bytes are not valid JSON."""
        span = self.values[key]
        try:
            with _SpanReader(self, span) as reader:
                # Exact decimals: a number that overflows a double is valid JSON (inf).
                for _ in ijson.basic_parse(reader, use_float=False, buf_size=1 << 20):
                    pass
        except ijson.common.JSONError as e:
            raise JsonError(_cause(e)) from None

    def check_all(self, read: tuple[str, ...]) -> None:
        """check() every list or object value but those in `read` (which the caller parses itself)."""
        for key, value in self.values.items():
            if isinstance(value, Span) and key not in read:
                self.check(key)


def _cause(error: Exception) -> str:
    text = error.args[0] if error.args else ""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    return (str(text).splitlines() or [type(error).__name__])[0].strip()


def _as_json_loads_gives(value: Any) -> Any:
    """`value` with decimals as floats and the literal markers as NaN / +-inf, as json.loads would give it."""
    if isinstance(value, dict):
        return {k: _as_json_loads_gives(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_as_json_loads_gives(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, str) and value in _MARKER_VALUES:
        return _MARKER_VALUES[value]
    return value


class _SpanReader(io.RawIOBase):
    """A file-like view of bytes [span.start, span.end) with the Python-only literals as marker strings."""

    def __init__(self, outline: Outline, span: Span):
        super().__init__()
        self._file = open(outline.path, "rb")  # noqa: SIM115  closed by close()
        self._position, self._end = span.start, span.end
        lo, hi = np.searchsorted(outline.non_finite, [span.start, span.end])
        self._literals = outline.non_finite[lo:hi].tolist()
        self.has_markers = bool(self._literals)

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._file.close()
        super().close()

    def read(self, size: int = -1) -> bytes:
        if self._position >= self._end:
            return b""
        stop = self._end if size is None or size < 0 else min(self._end, self._position + size)
        for literal in self._literals:  # ascending; one that starts inside this read is read whole
            if literal >= stop:
                break
            stop = max(stop, min(self._end, literal + _LOOKAHEAD))
        self._file.seek(self._position)
        data = self._file.read(stop - self._position)
        if self._literals and self._literals[0] < stop:
            data = self._replace_literals(data)
        self._position = stop
        return data

    def _replace_literals(self, data: bytes) -> bytes:
        pieces, copied = [], 0
        while self._literals and self._literals[0] < self._position + len(data):
            offset = self._literals.pop(0) - self._position
            token = _NON_FINITE.match(data, offset).group()
            pieces += [data[copied:offset], json.dumps(_MARKERS[token]).encode()]
            copied = offset + len(token)
        pieces.append(data[copied:])
        return b"".join(pieces)

    def readinto(self, buffer) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


@dataclasses.dataclass
class _ScanState:
    """What the scan carries from one chunk to the next."""

    in_string: bool = False
    backslash_run: int = 0  # backslashes ending the previous chunk (an odd run escapes the next byte)
    depth: int = 0
    span_start: int | None = None  # offset of the open top-level value's bracket
    literals_to: int = 0  # the end of the last literal found (its tail must not count again)
    copied_to: int = 0  # the skeleton holds the file's bytes up to here (outside spans)


def outline(path: str) -> Outline:
    """Reads the outline of the JSON object in `path` (see module doc), holding one chunk at a time.

    Raises:
      JsonError: the top level is not valid JSON (or the file ends inside a value).
      TypeError: the top level is valid JSON but no object; the message is the
        Python type name json.loads would give ('list', 'str', ...).
      OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        head = f.read(_CHUNK_BYTES)
        start = len(codecs.BOM_UTF8) if head.startswith(codecs.BOM_UTF8) else 0  # json.loads skips a BOM too
        first = head[start:].lstrip(_JSON_WHITESPACE)[:1]
        if first != b"{":
            if first == b"[":
                raise TypeError("list")  # without parsing what may be a very long list
            f.seek(0)
            try:
                raise TypeError(type(json.loads(f.read())).__name__)
            except ValueError as e:
                raise JsonError(_cause(e)) from None
        f.seek(start)
        state, skeleton, spans, literals = _ScanState(copied_to=start), [], [], []
        base, carry = start, b""
        while True:
            data = carry + f.read(_CHUNK_BYTES)
            at_end = len(data) <= len(carry)
            owned = len(data) if at_end else len(data) - _LOOKAHEAD
            _scan(data, owned, base, state, skeleton, spans, literals)
            if at_end:
                break
            carry = data[owned:]
            base += owned
    if state.in_string or state.depth != 0:
        raise JsonError("premature end of file")
    try:
        values = json.loads(b"".join(skeleton))
    except ValueError as e:
        raise JsonError(e.msg if isinstance(e, json.JSONDecodeError) else _cause(e)) from None
    if not isinstance(values, dict):
        raise TypeError(type(values).__name__)
    for key, value in values.items():
        if isinstance(value, list):  # the placeholder [index] of a list value
            values[key] = spans[value[0]]
        elif isinstance(value, dict):  # the placeholder {"": index} of an object value
            values[key] = spans[value[""]]
    return Outline(path, values, np.asarray(literals, np.int64))


def _scan(data: bytes, owned: int, base: int, state: _ScanState, skeleton: list, spans: list, literals: list) -> None:
    """Scans data[:owned] (file offset `base`); data[owned:] is only looked into for literals."""
    chunk = np.frombuffer(data, np.uint8, count=owned)
    quotes = np.flatnonzero(chunk == ord('"'))
    if state.backslash_run or data.find(b"\\", 0, owned) >= 0:
        quotes = _unescaped(chunk, quotes, state)
    # Bytes inside strings are no structure: a byte is inside one when an odd
    # number of string quotes precede it (counting from an open string).
    # `| 32` folds '[' onto '{' and ']' onto '}': two compares find all four.
    folded = chunk | 32
    opening = folded == ord("{")
    brackets = np.flatnonzero(opening | (folded == ord("}")))
    outside = (np.searchsorted(quotes, brackets) + state.in_string) % 2 == 0
    brackets = brackets[outside]
    steps = np.where(opening[brackets], 1, -1)
    depth_after = state.depth + np.cumsum(steps)
    # Only brackets that open or close a top-level value (or unbalance the
    # file) are visited one by one: a handful per file.
    opens_value = (steps > 0) & (depth_after == 2)
    closes_value = (steps < 0) & (depth_after == 1)
    for i in np.flatnonzero(opens_value | closes_value | (depth_after < 0)):
        offset = base + int(brackets[i])
        if depth_after[i] < 0:
            raise JsonError(f"unbalanced '{chr(chunk[brackets[i]])}' at byte {offset}")
        if opens_value[i]:
            skeleton.append(data[state.copied_to - base : offset - base])
            kind = "list" if chunk[brackets[i]] == ord("[") else "dict"
            skeleton.append(f"[{len(spans)}]".encode() if kind == "list" else f'{{"": {len(spans)}}}'.encode())
            spans.append(Span(offset, -1, kind))
            state.span_start = offset
        else:
            spans[-1] = dataclasses.replace(spans[-1], end=offset + 1)
            state.span_start = None
            state.copied_to = offset + 1
    if len(depth_after):
        state.depth = int(depth_after[-1])
    if state.span_start is None:
        skeleton.append(data[state.copied_to - base : owned])
        state.copied_to = base + owned
    for start, end in _literal_spans(data, owned):
        if base + start < state.literals_to:
            continue  # the tail of a literal found in the previous chunk
        if (np.searchsorted(quotes, start) + state.in_string) % 2 == 0:
            literals.append(base + start)
            state.literals_to = base + end
    state.in_string = bool((state.in_string + len(quotes)) % 2)


def _literal_spans(data: bytes, owned: int) -> list[tuple[int, int]]:
    """(start, end) of every NaN, Infinity and -Infinity that starts in data[:owned], ascending.

    bytes.find, not a regular expression: re's alternation ran at 55 MB/s,
    find at 20 GB/s, and nearly every chunk holds none.
    """
    found = []
    for token in (b"NaN", b"Infinity"):
        # Infinity may start one byte past `owned` when its '-' is the last owned byte.
        search_to = owned + len(token) + (token == b"Infinity")
        start = data.find(token, 0, search_to)
        while start >= 0:
            signed = token == b"Infinity" and start > 0 and data[start - 1] == ord("-")
            first = start - 1 if signed else start
            if first < owned:
                found.append((first, start + len(token)))
            start = data.find(token, start + 1, search_to)
    return sorted(found)


def _unescaped(chunk: np.ndarray, quotes: np.ndarray, state: _ScanState) -> np.ndarray:
    """The quotes of `quotes` not escaped by an odd run of backslashes; updates state.backslash_run."""
    backslashes = np.flatnonzero(chunk == ord("\\"))
    if not len(backslashes):
        escaped_first = state.backslash_run % 2 == 1 and len(quotes) and quotes[0] == 0
        state.backslash_run = 0
        return quotes[1:] if escaped_first else quotes
    breaks = np.flatnonzero(np.diff(backslashes) != 1) + 1
    run_starts = backslashes[np.r_[0, breaks]]
    run_ends = backslashes[np.r_[breaks - 1, len(backslashes) - 1]]  # inclusive
    run_lengths = run_ends - run_starts + 1
    if run_starts[0] == 0:
        run_lengths[0] += state.backslash_run
    # A run ending just before byte 0 (in the previous chunk) escapes a quote at 0.
    escaped = np.zeros(len(quotes), bool)
    if len(quotes) and quotes[0] == 0:
        escaped[0] = state.backslash_run % 2 == 1
    run = np.minimum(np.searchsorted(run_ends, quotes - 1), len(run_ends) - 1)
    escaped |= (run_ends[run] == quotes - 1) & (run_lengths[run] % 2 == 1)
    state.backslash_run = int(run_lengths[-1]) if run_ends[-1] == len(chunk) - 1 else 0
    return quotes[~escaped]
