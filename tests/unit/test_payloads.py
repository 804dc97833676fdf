"""Task payload validation (PROTOCOL.md, "Task payloads"): bounds at and beyond each edge."""

from __future__ import annotations

import pytest
import ujson

from jobmesh.errors import JobmeshError, PayloadError
from jobmesh.protocol.payloads import (MAX_RESULT_BYTES, MAX_TEXT_CHARS, TASK_SPECS, TASK_TYPES, result_too_large,
                                       validate_payload)

# task -> (field, lowest legal, highest legal) straight from the protocol table
INT_BOUNDS = {
    "SLEEP": ("durationMillis", 0, 600_000),
    "PRIME_COUNT": ("limit", 2, 50_000_000),
    "FAIL": ("failUntilAttempt", 0, 1000),
}
TEXT_TASKS = ("WORD_COUNT", "SHA256")


def test_task_types_are_the_five_of_the_protocol():
    assert set(TASK_TYPES) == {"SLEEP", "WORD_COUNT", "SHA256", "PRIME_COUNT", "FAIL"}
    assert set(TASK_SPECS) == set(TASK_TYPES)
    assert MAX_TEXT_CHARS == 200_000


@pytest.mark.parametrize("task", sorted(INT_BOUNDS))
def test_int_bounds_at_the_edges_are_accepted(task):
    field, low, high = INT_BOUNDS[task]
    for value in (low, low + 1, high - 1, high):
        payload = {field: value}
        assert validate_payload(task, payload) == payload


@pytest.mark.parametrize("task", sorted(INT_BOUNDS))
def test_int_bounds_beyond_the_edges_are_refused(task):
    field, low, high = INT_BOUNDS[task]
    for value in (low - 1, high + 1, -(2 ** 63), 2 ** 63):
        with pytest.raises(PayloadError):
            validate_payload(task, {field: value})


@pytest.mark.parametrize("task", sorted(INT_BOUNDS))
@pytest.mark.parametrize("value", [True, False, 1.0, 5.5, "5", None, [5], {"n": 5}])
def test_int_fields_refuse_other_types_including_bool(task, value):
    field, _low, _high = INT_BOUNDS[task]
    with pytest.raises(PayloadError):
        validate_payload(task, {field: value})


@pytest.mark.parametrize("task", TEXT_TASKS)
def test_text_length_bounds(task):
    assert validate_payload(task, {"text": ""}) == {"text": ""}
    assert validate_payload(task, {"text": "x" * 200_000}) == {"text": "x" * 200_000}
    with pytest.raises(PayloadError):
        validate_payload(task, {"text": "x" * 200_001})


@pytest.mark.parametrize("task", TEXT_TASKS)
def test_text_bound_counts_characters_not_bytes(task):
    # 200 000 three-byte characters are 600 000 UTF-8 bytes but only 200 000 characters.
    assert validate_payload(task, {"text": "✓" * 200_000})
    with pytest.raises(PayloadError):
        validate_payload(task, {"text": "✓" * 200_001})


@pytest.mark.parametrize("task", TEXT_TASKS)
@pytest.mark.parametrize("value", [None, 5, True, ["a"], {"a": 1}])
def test_text_fields_refuse_other_types(task, value):
    with pytest.raises(PayloadError):
        validate_payload(task, {"text": value})


@pytest.mark.parametrize("task", sorted(TASK_SPECS))
def test_missing_field_is_refused(task):
    with pytest.raises(PayloadError):
        validate_payload(task, {})
    with pytest.raises(PayloadError):
        validate_payload(task, {"somethingElse": 1})


@pytest.mark.parametrize("task", sorted(TASK_SPECS))
@pytest.mark.parametrize("payload", [None, [], "{}", 5, True])
def test_payload_must_be_an_object(task, payload):
    with pytest.raises(PayloadError):
        validate_payload(task, payload)


@pytest.mark.parametrize("task_type", ["EXEC", "sleep", "", None, 5, "SHELL"])
def test_unknown_task_type_is_refused(task_type):
    with pytest.raises(PayloadError):
        validate_payload(task_type, {"durationMillis": 1})


def test_unknown_payload_fields_are_ignored():
    payload = {"durationMillis": 10, "note": "extra"}
    assert validate_payload("SLEEP", payload) == payload


def test_payload_error_is_a_jobmesh_error():
    assert issubclass(PayloadError, JobmeshError)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_infinity_are_not_json_and_are_refused(bad):
    # A lenient parser lets NaN/Infinity in; they are not JSON and peers could not read them back.
    with pytest.raises(PayloadError):
        validate_payload("SLEEP", {"durationMillis": 1, "extra": bad})
    with pytest.raises(PayloadError):
        validate_payload("SHA256", {"text": "x", "nested": {"deep": [1, bad]}})
    with pytest.raises(PayloadError):
        validate_payload("SLEEP", {"durationMillis": bad})


@pytest.mark.parametrize("text", ["/", "y", "\u00e9", "\U0001F600", "\n"])
@pytest.mark.parametrize("over", [0, 1])
def test_a_result_measures_the_same_from_its_stored_text(text, over):
    # Given results at and just over the limit as measured (non-ASCII as \u escapes, "/" as "\/")
    width = len(ujson.dumps(text)) - 2
    count = (MAX_RESULT_BYTES - 8) // width  # '{"x":""}' is 8 bytes
    result = {"x": text * count + "z" * (MAX_RESULT_BYTES - 8 - count * width + over)}
    stored = ujson.dumps(result, ensure_ascii=False, escape_forward_slashes=False)
    # Then the size taken from the stored form is the measured one, so the same results fail
    assert (result_too_large(result) is None) == (over == 0)
    assert result_too_large(result, stored) == result_too_large(result)
