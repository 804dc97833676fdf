"""Task types, their payload bounds, and the one validator both coordinator and worker use.

| task        | payload                      | bounds                     |
|-------------|------------------------------|----------------------------|
| SLEEP       | {"durationMillis": n}        | 0 .. 600 000               |
| WORD_COUNT  | {"text": "..."}              | at most 200 000 characters |
| SHA256      | {"text": "..."}              | at most 200 000 characters |
| PRIME_COUNT | {"limit": n}                 | 2 .. 50 000 000            |
| FAIL        | {"failUntilAttempt": n}      | 0 .. 1000                  |

Unknown fields inside a payload are ignored, like unknown fields in messages.
"""

from __future__ import annotations

import re
from typing import Any

from jobmesh.errors import PayloadError

MAX_TEXT_CHARS = 200_000

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


def validate_payload(task_type: Any, payload: Any) -> dict[str, Any]:
    """Return ``payload`` if it is valid for ``task_type``; raise ``PayloadError`` otherwise."""
    if not isinstance(task_type, str) or task_type not in TASK_SPECS:
        raise PayloadError(
            "unknown task type %r (known: %s)" % (task_type, ", ".join(TASK_TYPES))
        )
    if not isinstance(payload, dict):
        raise PayloadError("%s payload must be a JSON object" % task_type)
    if not is_finite_json(payload):
        raise PayloadError("%s payload holds NaN or Infinity, which JSON does not allow" % task_type)
    field, kind, low, high = TASK_SPECS[task_type]
    if field not in payload:
        raise PayloadError("%s payload needs field %r" % (task_type, field))
    value = payload[field]
    if kind is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PayloadError("%s field %r must be an integer, got %r" % (task_type, field, value))
        if not low <= value <= high:
            raise PayloadError("%s field %r must be in %d..%d, got %d" % (task_type, field, low, high, value))
    else:
        if not isinstance(value, str):
            raise PayloadError("%s field %r must be a string" % (task_type, field))
        if len(value) > high:
            raise PayloadError(
                "%s field %r is %d characters, the limit is %d" % (task_type, field, len(value), high)
            )
    return payload
