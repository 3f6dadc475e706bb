"""``to_json`` / ``from_json``: the document envelope and every way reading one fails."""

from __future__ import annotations

import json

import pytest

from piper_ir import Bucket, Edge, Graph, Node, NodeKind, SerializationError, Tags, from_json, to_json
from piper_ir.serialize import FORMAT, VERSION

NODE = Node("a", NodeKind.COMPUTE, tags=Tags.of(PP=1), devices=(0, 1))


def _doc(**changes: object) -> str:
    doc = json.loads(to_json(NODE))
    doc.update(changes)
    return json.dumps(doc)


def _with_value(**changes: object) -> str:
    doc = json.loads(to_json(NODE))
    doc["value"].update(changes)
    return json.dumps(doc)


def test_envelope() -> None:
    doc = json.loads(to_json(NODE))
    assert (
        (doc["format"], doc["version"], doc["type"]) == (FORMAT, VERSION, "Node") == ("piper-ir", 1, "Node")
    )
    assert doc["value"]["kind"] == "compute"
    assert doc["value"]["tags"] == {"items": [["PP", 1]]}
    assert from_json(to_json(NODE)) == NODE


def test_graph_round_trip_keeps_cached_lookups_out_of_the_document() -> None:
    graph = Graph((), (), (NODE, Node("b", NodeKind.MARKER)), (Edge("a", "b"),))
    assert graph.node_by_id["a"] == NODE  # fill a cached property first
    doc = json.loads(to_json(graph))
    assert set(doc["value"]) == {
        "segments",
        "values",
        "nodes",
        "edges",
        "inputs",
        "targets",
        "microbatches",
        "world_size",
        "replication",
        "buckets",
        "sharding",
        "ties",
        "precision",
        "grad_norm",
    }
    assert from_json(to_json(graph)) == graph


@pytest.mark.parametrize("text", ["", "{", "not json", "{'format': 'piper-ir'}"])
def test_not_json(text: str) -> None:
    with pytest.raises(SerializationError, match="not JSON"):
        from_json(text)


@pytest.mark.parametrize("text", ["[]", "3", "{}", _doc(format="piper"), _doc(format=None)])
def test_wrong_format(text: str) -> None:
    with pytest.raises(SerializationError, match="not a piper-ir document"):
        from_json(text)


@pytest.mark.parametrize("version", [2, 0, "1", None, True])
def test_wrong_version(version: object) -> None:
    with pytest.raises(SerializationError, match=f"version {version!r}; this code reads 1"):
        from_json(_doc(version=version))


@pytest.mark.parametrize("type_name", ["Nope", "", None, ["Node"], "Phase", "SerializationError"])
def test_unknown_type(type_name: object) -> None:
    with pytest.raises(SerializationError, match="unknown IR type"):
        from_json(_doc(type=type_name))


def test_unknown_field() -> None:
    with pytest.raises(SerializationError, match=r"unknown fields \['colour'\] for Node"):
        from_json(_with_value(colour="red"))


def test_unknown_field_in_nested_value() -> None:
    with pytest.raises(SerializationError, match=r"unknown fields \['extra'\] for Tags"):
        from_json(_with_value(tags={"items": [], "extra": 1}))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"devices": "01"}, "expected a list"),
        ({"devices": [0, True]}, "expected int, got True"),
        ({"devices": [0, 1.5]}, "expected int"),
        ({"microbatch": "0"}, "matches none of"),
        ({"tags": [["PP", 1]]}, "expected an object for Tags"),
        ({"tags": {"items": [["PP", 1, 2]]}}, "expected 2 items"),
        ({"kind": "bogus"}, "invalid Node document: 'bogus' is not a valid NodeKind"),
        ({"id": None}, "expected str, got None"),
    ],
)
def test_bad_field_values(changes: dict, message: str) -> None:
    with pytest.raises(SerializationError, match=message):
        from_json(_with_value(**changes))


def test_missing_required_field() -> None:
    doc = json.loads(to_json(NODE))
    del doc["value"]["id"]
    with pytest.raises(SerializationError, match="invalid Node document"):
        from_json(json.dumps(doc))


def test_missing_optional_field_takes_default() -> None:
    doc = json.loads(to_json(NODE))
    del doc["value"]["stream"]
    assert from_json(json.dumps(doc)).stream == "compute"


def test_mirrored_bucket_round_trip_and_documents_without_mirrors() -> None:
    """``Bucket.mirrors`` (DualPipe's per-direction ZeRO-2/3 buckets) travels; a document
    written before the field existed reads back with none."""
    bucket = Bucket("bucket:s0:d0:0", "s0", ("w",), 10, 2, "float64", (0, 2), ("bucket:s0:d1:0",))
    assert from_json(to_json(bucket)) == bucket
    doc = json.loads(to_json(bucket))
    del doc["value"]["mirrors"]
    assert from_json(json.dumps(doc)).mirrors == ()


def test_unencodable_value() -> None:
    with pytest.raises(SerializationError, match="cannot encode set"):
        to_json(Node("a", NodeKind.COMPUTE, value={"x"}))  # type: ignore[arg-type]


def test_each_class_is_inspected_once_however_many_values_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """A program of 16,384 devices holds 392k instructions: a document is read with the type
    hints of each class looked up once, not once per value (which made reading a 4,096-device
    program take 33 s)."""
    import typing

    from piper_ir import serialize

    graph = Graph((), (), tuple(Node(f"n{i}", NodeKind.COMPUTE, tags=Tags.of(PP=i)) for i in range(200)), ())
    text = to_json(graph)
    monkeypatch.setattr(serialize, "_HINTS", {}, raising=False)  # empty caches: a fresh process
    monkeypatch.setattr(serialize, "_DECODERS", {}, raising=False)
    looked_up: list[type] = []
    real = typing.get_type_hints
    monkeypatch.setattr(typing, "get_type_hints", lambda cls, *a, **k: looked_up.append(cls) or real(cls, *a, **k))
    assert from_json(text) == graph
    assert sorted(c.__name__ for c in looked_up) == ["Graph", "Node", "Tags"]


@pytest.mark.parametrize("depth", [100_000, 10**6])
def test_deep_nesting_is_a_serialization_error(depth: int) -> None:
    """A file of brackets used to end in a ``RecursionError`` (a traceback from ``piper show``)."""
    for text in ("[" * depth + "]" * depth, '{"a":' * depth + "1" + "}" * depth):
        with pytest.raises(SerializationError, match="nested too deeply"):
            from_json(text)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b'{"format": "piper-ir\xff\xfe"}', "not UTF-8 text: invalid start byte at byte 20"),
        (b"\xff\xfe\x00garbage\x80\x81", "not UTF-8 text|not JSON"),  # read as UTF-16 (its BOM), or not
        (bytes(range(256)), "not UTF-8 text|not JSON"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "not UTF-8 text|not JSON"),
        (b"{\"format\": \"piper-ir\"}", "version None"),
    ],
)
def test_bytes_that_are_not_a_document(data: bytes, message: str) -> None:
    with pytest.raises(SerializationError, match=message):
        from_json(data)
    assert from_json(to_json(NODE).encode()) == NODE


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"tags": {"items": [[["PP"], 1]]}}, "invalid Node document|matches none|expected"),
        ({"peers": {"a": 1}}, "expected a list"),
        ({"devices": [[0]]}, "expected int"),
        ({"kind": ["compute"]}, "invalid Node document"),
    ],
)
def test_values_of_the_wrong_shape_are_serialization_errors(changes: dict, message: str) -> None:
    with pytest.raises(SerializationError, match=message):
        from_json(_with_value(**changes))
