"""JSON from untrusted hands, bounded: an object no deeper than MAX_JSON_DEPTH (a 400 naming
what was parsed, never a RecursionError's 500). The gateway's bodies and the Batch API's
input lines both go through here."""

from __future__ import annotations

import json
from typing import Any

from conveyor.apps.openai_api.errors import OpenAIError, invalid

MAX_JSON_DEPTH = 64  # objects and arrays nested in one body; OpenAI's own schemas stay far below


def parse_object(raw: bytes, what: str = "the request body") -> dict:
    """A JSON object from `raw`; OpenAIError(400) naming `what` when it is not one or nests too deep."""
    try:
        body = json.loads(raw)
    except RecursionError:  # deeper than the parser goes: surely deeper than MAX_JSON_DEPTH
        raise too_deep(what) from None
    except ValueError:
        raise invalid(f"{what} is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(f"{what} must be a JSON object", code="invalid_json")
    if depth_over(body, MAX_JSON_DEPTH):
        raise too_deep(what)
    return body


def too_deep(what: str) -> OpenAIError:
    return invalid(f"{what} nests objects and arrays more than {MAX_JSON_DEPTH} levels deep", code="json_too_deep")


def depth_over(value: Any, limit: int) -> bool:
    """Whether `value` nests containers more than `limit` deep (iterative: no recursion to exhaust)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False
