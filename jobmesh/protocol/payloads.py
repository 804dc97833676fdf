"""Task types, their payload bounds, and the one validator both coordinator and worker use.

| task        | payload                      | bounds                     |
|-------------|------------------------------|----------------------------|
| SLEEP       | {"durationMillis": n}        | 0 .. 600 000               |
| WORD_COUNT  | {"text": "..."}              | at most 200 000 characters |
| SHA256      | {"text": "..."}              | at most 200 000 characters |
| PRIME_COUNT | {"limit": n}                 | 2 .. 50 000 000            |
| FAIL        | {"failUntilAttempt": n}      | 0 .. 1000                  |

Unknown fields inside a payload are ignored, like unknown fields in messages.

Payloads and results nest objects and arrays at most ``MAX_NESTING`` levels deep
(``too_deep``): deeper values are refused before they are stored, since every later
encode of them (snapshots, lists, assignments) would pay for them, or fail.

A result is at most ``MAX_RESULT_BYTES`` (64 KiB) as compact JSON with non-ASCII
characters written as ``\\u`` escapes (``result_too_large``); the task process, the
worker and the coordinator measure it the same way and fail a larger one with the same
words.
"""

from __future__ import annotations

import re
from typing import Any

import ujson

from jobmesh.errors import PayloadError
from jobmesh.protocol.messages import quote

MAX_TEXT_CHARS = 200_000
MAX_NESTING = 64  # levels of objects and arrays in a payload or a result (the value itself is level 1)
MAX_RESULT_BYTES = 64 * 1024  # a task's result as JSON (see result_too_large)
MAX_PROGRESS_MESSAGE_CHARS = 1000  # a progress report's message (ctx.progress, TASK_PROGRESS)


def result_too_large(result: Any, stored: str | None = None) -> str | None:
    """Why ``result`` is over the result limit, or None (also for a value JSON cannot hold:
    encoding it fails later, with its own words). ``stored`` is the result already encoded
    as the coordinator stores it (compact, non-ASCII characters and "/" unescaped): when it
    is ASCII it gives the size without a second encode, each "/" counting as its ``\\/``."""
    try:
        if stored is not None and stored.isascii():
            size = len(stored) + stored.count("/")
        else:
            size = len(ujson.dumps(result))
    except (ValueError, OverflowError, TypeError, RecursionError):
        return None
    if size <= MAX_RESULT_BYTES:
        return None
    return "result is %d bytes as JSON; a result may be at most %d bytes (64 KiB)" % (size, MAX_RESULT_BYTES)


def progress_problem(fraction: Any, message: Any) -> str | None:
    """Why ``(fraction, message)`` is not a progress report, or None: the fraction is a
    number from 0 to 1 (not a bool, not NaN), the message null or a string of at most
    ``MAX_PROGRESS_MESSAGE_CHARS`` characters. The task process refuses a bad report with
    these words, the coordinator drops one (TASK_PROGRESS)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        return "the progress fraction must be a number from 0 to 1, not %s" % type(fraction).__name__
    if not 0 <= fraction <= 1:  # NaN too: every comparison with it is false
        return "the progress fraction must be from 0 to 1, got %r" % fraction
    if message is not None and not isinstance(message, str):
        return "the progress message must be a string or None, not %s" % type(message).__name__
    if message is not None and len(message) > MAX_PROGRESS_MESSAGE_CHARS:
        return "the progress message may be at most %d characters, got %d" % (MAX_PROGRESS_MESSAGE_CHARS,
                                                                              len(message))
    return None

# task type -> (field, python type, minimum, maximum); for text, the bounds are on length.
TASK_SPECS: dict[str, tuple[str, type, int, int]] = {
    "SLEEP": ("durationMillis", int, 0, 600_000),
    "WORD_COUNT": ("text", str, 0, MAX_TEXT_CHARS),
    "SHA256": ("text", str, 0, MAX_TEXT_CHARS),
    "PRIME_COUNT": ("limit", int, 2, 50_000_000),
    "FAIL": ("failUntilAttempt", int, 0, 1000),
}

TASK_TYPES: tuple[str, ...] = tuple(TASK_SPECS)

# Names of task types, built-in or declared by workers: 1-128 letters, digits and _ . : -
TASK_NAME_RULE = "1-128 characters of letters, digits and _ . : -"
_TASK_NAME = re.compile(r"[A-Za-z0-9_.:\-]{1,128}\Z")


def is_task_type_name(name: Any) -> bool:
    """Whether ``name`` is a legal task-type name (``TASK_NAME_RULE``)."""
    return isinstance(name, str) and _TASK_NAME.match(name) is not None


def is_finite_json(value: Any) -> bool:
    """False if ``value`` holds NaN or an infinity anywhere (the JSON parser lets them in,
    but they are not JSON and peers in other languages cannot read them back)."""
    if type(value) is dict:  # the usual payload: a flat object of ints and strings
        for v in value.values():
            t = type(v)
            if t is not int and t is not str:
                break
        else:
            return True
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                return False
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return True


def too_deep(value: Any, limit: int = MAX_NESTING) -> bool:
    """True if objects and arrays nest more than ``limit`` levels in ``value`` (an object
    or array is level 1, one inside it level 2, ...). Iterative, so no recursion limit
    bites whatever the depth; a flat object costs one pass over its values."""
    if type(value) is dict:  # the usual payload: nothing nested at all
        for v in value.values():
            t = type(v)
            if t is dict or t is list:
                break
        else:
            return limit < 1
    elif type(value) is not list:
        return False
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, level = stack.pop()
        if level > limit:
            return True
        for child in (v.values() if type(v) is dict else v):
            t = type(child)
            if t is dict or t is list:
                stack.append((child, level + 1))
    return False


def validate_payload(task_type: Any, payload: Any) -> dict[str, Any]:
    """Return ``payload`` if it is valid for ``task_type``; raise ``PayloadError`` otherwise."""
    if not isinstance(task_type, str) or task_type not in TASK_SPECS:
        raise PayloadError(
            "unknown task type %s (known: %s)" % (quote(task_type), ", ".join(TASK_TYPES))
        )
    if not isinstance(payload, dict):
        raise PayloadError("%s payload must be a JSON object" % task_type)
    if too_deep(payload):
        raise PayloadError("%s payload nested deeper than %d levels" % (task_type, MAX_NESTING))
    if not is_finite_json(payload):
        raise PayloadError("%s payload holds NaN or Infinity, which JSON does not allow" % task_type)
    field, kind, low, high = TASK_SPECS[task_type]
    if field not in payload:
        raise PayloadError("%s payload needs field %r" % (task_type, field))
    value = payload[field]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PayloadError("%s field %r must be an integer, got %s" % (task_type, field, quote(value)))
        if not low <= value <= high:
            raise PayloadError("%s field %r must be in %d..%d, got %s" % (task_type, field, low, high, quote(value)))
    else:
        if not isinstance(value, str):
            raise PayloadError("%s field %r must be a string" % (task_type, field))
        if len(value) > high:
            raise PayloadError(
                "%s field %r is %d characters, the limit is %d" % (task_type, field, len(value), high)
            )
    return payload


# ---- what a task type or a job may ask for (docs/PROTOCOL.md) -------------------------

MAX_ATTEMPTS_LIMIT = 1_000_000  # a job's attempt budget at most
MAX_TIMEOUT_MILLIS = 7 * 24 * 3600 * 1000  # a per-attempt deadline: 1 ms .. 7 days
# Ten years (as the coordinator's millisecond settings): a result's time to live and a
# retry backoff at most; beyond it an instant no longer fits the store's integers.
MAX_TTL_MILLIS = 315_360_000_000
# WORKER_REGISTER taskDefaults: field -> (least, most); each field may be absent or null.
TASK_DEFAULT_BOUNDS: dict[str, tuple[int, int]] = {
    "timeoutMillis": (1, MAX_TIMEOUT_MILLIS),
    "maxAttempts": (1, MAX_ATTEMPTS_LIMIT),
    "retryBaseMillis": (0, MAX_TTL_MILLIS),
    "retryCapMillis": (0, MAX_TTL_MILLIS),
}


def task_defaults_problem(task_type: str, defaults: Any) -> str | None:
    """Why ``defaults`` (one type's entry of WORKER_REGISTER ``taskDefaults``) cannot be
    kept, or None if it can. Unknown fields are ignored, as in messages."""
    if not isinstance(defaults, dict):
        return "taskDefaults of %s must be an object, got %s" % (quote(task_type), quote(defaults))
    for field, (low, high) in TASK_DEFAULT_BOUNDS.items():
        value = defaults.get(field)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high):
            return "taskDefaults of %s: %s must be an integer %d..%d or null, got %s" % (
                quote(task_type), field, low, high, quote(value))
    base, cap = defaults.get("retryBaseMillis"), defaults.get("retryCapMillis")
    if base is not None and cap is not None and base > cap:
        return "taskDefaults of %s: retryBaseMillis %d is above retryCapMillis %d" % (quote(task_type), base, cap)
    return None
