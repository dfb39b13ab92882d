"""Large JSON in bounded memory: the outline and the streamed lists read what json.loads reads; records."""

import dataclasses
import json
import math
import random

import numpy as np
import pytest

from input_pipeline import records
from input_pipeline.datasets import json_stream

# Strings made of what confuses a scanner: quotes, backslash runs, brackets, the literals' names
# (no NUL: json_stream's markers for the literals begin with one).
_PIECES = ['"', "\\", "\\\\", "[", "]", "{", "}", "NaN", "-Infinity", "a", ",", ":", " ", "é", "\n"]


def _string(rng):
    return "".join(rng.choice(_PIECES) for _ in range(rng.randint(0, 6)))


def _value(rng, depth=0):
    if depth > 2 or rng.random() < 0.4:
        return rng.choice([7, -2.5, math.nan, math.inf, -math.inf, True, None, _string(rng), 10**30, 1e300, 10**400])
    if rng.random() < 0.6:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {_string(rng): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _same(a, b):
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_outline_and_items_read_what_json_loads_reads(tmp_path, monkeypatch):
    """Random documents, with chunks so small that every token and escape run crosses a chunk boundary."""
    rng = random.Random(0)
    path = tmp_path / "doc.json"
    for trial in range(300):
        monkeypatch.setattr(json_stream, "_CHUNK_BYTES", rng.choice([9, 10, 11, 16, 4096]))
        doc = {_string(rng): _value(rng) for _ in range(rng.randint(0, 4))}
        doc["list"] = [_value(rng, 1) for _ in range(rng.randint(0, 6))]
        text = json.dumps(doc, indent=rng.choice([None, 1]), ensure_ascii=rng.random() < 0.5)
        path.write_text(("\ufeff" if trial % 50 == 0 else "") + text, encoding="utf-8")
        expected = json.loads(path.read_text(encoding="utf-8-sig"))
        outline = json_stream.outline(str(path))
        assert outline.values.keys() == expected.keys(), text
        for key, value in outline.values.items():
            if isinstance(value, json_stream.Span):
                outline.check(key)
                if value.kind == "list":
                    assert _same(list(outline.items(key)), expected[key]), (text, key)
            else:
                assert _same(value, expected[key]), (text, key)


@pytest.mark.parametrize(
    "text, error, message",
    [
        ('{"a": [1, 2}', json_stream.JsonError, "premature end"),
        ('{"a" [1]}', json_stream.JsonError, "Expecting ':' delimiter"),
        ('{"a": [1]} x', json_stream.JsonError, "Extra data"),
        ('{"a": [1]]}', json_stream.JsonError, "unbalanced"),
        ('{"a": "open}', json_stream.JsonError, "premature end"),
        ("", json_stream.JsonError, "Expecting value"),
        ("[1, 2]", TypeError, "list"),
        ('"text"', TypeError, "str"),
    ],
)
def test_outline_errors(tmp_path, text, error, message):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(error, match=message):
        json_stream.outline(str(path))


def test_an_error_inside_a_list_raises_when_reached(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"a": [1, 2, {"x": tru}], "b": {"c": [1,]}}')
    outline = json_stream.outline(str(path))
    with pytest.raises(json_stream.JsonError):
        list(outline.items("a"))
    with pytest.raises(json_stream.JsonError):
        outline.check("b")


def test_serialized_records_parse_back_with_tensorflow():
    rng = np.random.default_rng(0)
    for n, image_id in [(0, 5), (3, -7), (7, 2**63 - 1)]:
        example = records.SourceExample(
            image_bytes=rng.integers(0, 256, 300, np.uint8).tobytes(),
            image_id=image_id,
            height=480,
            width=640,
            boxes_yxyx=rng.uniform(0, 400, (n, 4)).astype(np.float32),
            labels=rng.integers(0, 300, n).astype(np.int32),
            is_crowd=rng.random(n) < 0.5,
        )
        back = records.parse_numpy(records.serialize(example))
        assert (back.image_bytes, back.image_id, back.height, back.width) == (example.image_bytes, image_id, 480, 640)
        np.testing.assert_array_equal(back.boxes_yxyx, example.boxes_yxyx)
        np.testing.assert_array_equal(back.labels, example.labels)
        np.testing.assert_array_equal(back.is_crowd, example.is_crowd)
        parsed = records.parse(records.serialize(example))
        np.testing.assert_array_equal(parsed["boxes"].numpy(), example.boxes_yxyx)
        np.testing.assert_array_equal(parsed["is_crowd"].numpy(), example.is_crowd)
    with pytest.raises(ValueError, match="int64"):
        records.serialize(dataclasses.replace(example, image_id=2**63))
