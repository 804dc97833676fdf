"""Bounded error texts (messages.quote, the ERROR bound), the nesting bound (payloads.too_deep)
and the wrong-port hint: pure functions, no sockets."""

from __future__ import annotations

import pytest

from jobmesh.errors import PayloadError, ProtocolError
from jobmesh.protocol import messages as m
from jobmesh.protocol.framing import MAX_FRAME, encode_frame
from jobmesh.protocol.payloads import MAX_NESTING, too_deep, validate_payload

ODD_STRINGS = [
    "\x7f" * 300_000,
    "\x00\x01\x1b[31m" * 50_000,
    "\ud800" * 100_000,  # lone surrogates, as a "\ud800" escape would decode to
    "\U0001f600" * 250_000,  # 4-byte UTF-8
    "x" * 1_000_000,
]


def nested(depth: int, leaf=1, kind=dict):
    value = leaf
    for _ in range(depth):
        value = {"a": value} if kind is dict else [value]
    return value


@pytest.mark.parametrize("value", ODD_STRINGS, ids=["del", "control", "surrogate", "emoji", "plain"])
def test_quote_shows_at_most_200_characters_and_the_length(value):
    text = m.quote(value)
    assert len(text) <= 10 * m.QUOTE_CHARS + 40
    assert text.endswith("… (%d characters)" % len(value))
    text.encode("utf-8")  # printable, encodable: surrogates and controls come out escaped
    assert all(c.isprintable() for c in text)


def test_quote_of_short_values_is_their_repr_or_json():
    assert m.quote("abc") == "'abc'"
    assert m.quote(5) == "5"
    assert m.quote(None) == "None"
    assert m.quote({"a": [1, 2]}) == '{"a":[1,2]}'
    assert m.quote(10 ** 1000) == "an integer of about 1001 digits"
    deep = m.quote(nested(1000))
    assert len(deep) < 300 and deep.endswith("characters)")


@pytest.mark.parametrize("value", ODD_STRINGS, ids=["del", "control", "surrogate", "emoji", "plain"])
def test_an_error_built_from_anything_fits_a_frame(value):
    error = m.Error("bad value %s; raw: %s" % (m.quote(value), value))
    assert len(error.message) <= m.MAX_ERROR_CHARS + 40
    assert len(encode_frame(error.to_wire())) < MAX_FRAME
    assert error.message.startswith("bad value ")


@pytest.mark.parametrize("allowed", [m.WORKER_PORT_REQUESTS, m.CLIENT_PORT_REQUESTS, None])
def test_a_huge_unknown_type_is_quoted_not_copied(allowed):
    with pytest.raises(ProtocolError) as info:
        m.decode({"type": "\x7f" * 300_000}, allowed)
    assert "unknown or unexpected message type" in str(info.value)
    assert len(str(info.value)) < 3000


def test_a_request_on_the_wrong_port_names_the_right_one():
    with pytest.raises(ProtocolError, match=r"this is the worker port; SUBMIT_JOB belongs on the client port "
                                             r"\(7071 by default\)"):
        m.decode({"type": "SUBMIT_JOB", "taskType": "SLEEP", "payload": {}}, m.WORKER_PORT_REQUESTS)
    with pytest.raises(ProtocolError, match=r"this is the client port; WORKER_REGISTER belongs on the worker port "
                                             r"\(7070 by default\)"):
        m.decode({"type": "WORKER_REGISTER", "workerId": "w", "capacity": 1}, m.CLIENT_PORT_REQUESTS)
    with pytest.raises(ProtocolError, match="unknown or unexpected message type 'JOB_LIST'"):
        m.decode({"type": "JOB_LIST"}, m.CLIENT_PORT_REQUESTS)


@pytest.mark.parametrize("kind", [dict, list])
def test_too_deep_counts_levels_of_objects_and_arrays(kind):
    assert not too_deep(nested(MAX_NESTING, kind=kind))
    assert too_deep(nested(MAX_NESTING + 1, kind=kind))
    assert too_deep(nested(100_000, kind=kind))  # iterative: no RecursionError
    assert not too_deep({"a": 1, "b": "x"}) and not too_deep({}) and not too_deep(5)
    assert not too_deep([{"a": [1]}] * 1000, 3) and too_deep([{"a": [[1]]}], 3)


def test_a_payload_nested_too_deep_is_refused():
    payload = {"durationMillis": 1, "extra": nested(MAX_NESTING)}  # MAX_NESTING + 1 levels
    with pytest.raises(PayloadError, match="nested deeper than %d levels" % MAX_NESTING):
        validate_payload("SLEEP", payload)
    validate_payload("SLEEP", {"durationMillis": 1, "extra": nested(MAX_NESTING - 1)})


def test_payload_errors_quote_huge_values_briefly():
    with pytest.raises(PayloadError) as info:
        validate_payload("SLEEP", {"durationMillis": "\x7f" * 300_000})
    assert len(str(info.value)) < 3000 and "300000 characters" in str(info.value)
    with pytest.raises(PayloadError) as info:
        validate_payload("\x01" * 300_000, {})
    assert len(str(info.value)) < 3000
