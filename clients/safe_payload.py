"""Reading a job payload out of a request-stream entry without trusting it.

Sizes are checked before parsing and the number of decoded values is bounded, so huge
or hostile input is rejected without building large object graphs. When a payload is
rejected, its top-level `job_id` is still read when possible (best effort).
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgpack

from conveyor.clients.errors import ProtocolError
from conveyor.clients.limits import (
    JOB_ID_PATTERN,
    MAX_DECODED_ELEMENTS,
    MAX_JSON_BYTES,
    MAX_MSGPACK_BYTES,
    MAX_PROMPT_TOKENS,
)


def read_payload(fields: dict) -> dict:
    """The job map of an entry's `data` (msgpack) or `json` field; raises ProtocolError."""
    data = _field(fields, "data")
    if data is not None:
        return _unpack_msgpack(_as_bytes(data))
    text = _field(fields, "json")
    if text is not None:
        return _parse_json(_as_bytes(text))
    names = sorted(_as_text(k) for k in fields)[:8]
    raise ProtocolError(f"entry has neither a 'data' (msgpack) nor a 'json' field (fields: {names})")


def _field(fields: dict, name: str) -> Any:
    value = fields.get(name.encode())
    return fields.get(name) if value is None else value


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode("utf-8", "surrogatepass")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    raise ProtocolError(f"field value must be bytes, got {type(value).__name__}")


def _as_text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _unpack_msgpack(raw: bytes) -> dict:
    if len(raw) > MAX_MSGPACK_BYTES:
        raise _too_large("data", len(raw), MAX_MSGPACK_BYTES, _salvage_msgpack_job_id(raw))
    budget = _ElementBudget(MAX_DECODED_ELEMENTS)
    try:
        payload = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_MSGPACK_BYTES,
            max_bin_len=MAX_MSGPACK_BYTES,
            max_array_len=MAX_PROMPT_TOKENS,
            max_map_len=65_536,
            max_ext_len=64,
            list_hook=budget.count,
            object_hook=budget.count,
        )
    except _BudgetExceeded as exc:
        raise ProtocolError(str(exc), code="too_large", job_id=_salvage_msgpack_job_id(raw)) from None
    except Exception as exc:
        raise ProtocolError(
            f"'data' is not valid msgpack: {type(exc).__name__}: {exc}", job_id=_salvage_msgpack_job_id(raw)
        ) from None
    return _require_map(payload, "data")


def _parse_json(raw: bytes) -> dict:
    if len(raw) > MAX_JSON_BYTES:
        raise _too_large("json", len(raw), MAX_JSON_BYTES, _salvage_json_job_id(raw))
    if _json_element_bound(raw) > MAX_DECODED_ELEMENTS:
        raise ProtocolError("'json' has too many elements", code="too_large", job_id=_salvage_json_job_id(raw))
    try:
        payload = json.loads(raw.decode("utf-8"), parse_constant=_reject_constant)
    except Exception as exc:
        raise ProtocolError(
            f"'json' is not valid UTF-8 JSON: {type(exc).__name__}: {exc}", job_id=_salvage_json_job_id(raw)
        ) from None
    return _require_map(payload, "json")


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def _json_element_bound(raw: bytes) -> int:
    """Upper bound of the values json.loads would build, without building them."""
    bound = _separators(raw) + 1
    if bound <= MAX_DECODED_ELEMENTS:
        return bound
    for match in _JSON_STRING.finditer(raw):  # separators inside strings are not elements
        bound -= _separators(match.group())
    return bound


def _separators(raw: bytes) -> int:
    return raw.count(b",") + raw.count(b"[") + raw.count(b"{")


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not allowed")


def _require_map(payload: Any, field: str) -> dict:
    if not isinstance(payload, dict):
        raise ProtocolError(f"'{field}' must hold a map/object, got {type(payload).__name__}")
    return payload


def _too_large(field: str, size: int, limit: int, job_id: str | None) -> ProtocolError:
    return ProtocolError(f"'{field}' is {size} bytes, limit {limit}", code="too_large", job_id=job_id)


class _BudgetExceeded(Exception):
    pass


class _ElementBudget:
    """msgpack hook counting decoded containers and their elements."""

    def __init__(self, limit: int) -> None:
        self.left = limit

    def count(self, container: Any) -> Any:
        self.left -= 1 + len(container)
        if self.left < 0:
            raise _BudgetExceeded("payload decodes to too many elements")
        return container


# ---------------------------------------------------------------- best-effort job_id

_SHORT_STR_TYPES = frozenset(range(0xA0, 0xC0)) | {0xD9}  # fixstr, str8: keys we may read
_JSON_JOB_ID = re.compile(rb'"job_id"\s*:\s*"([A-Za-z0-9_.:-]{1,128})"')


def readable_job_id(payload: Any) -> str | None:
    """The payload's job_id when it is present and well formed, else None."""
    job_id = payload.get("job_id") if isinstance(payload, dict) else None
    if isinstance(job_id, str) and re.fullmatch(JOB_ID_PATTERN, job_id):
        return job_id
    return None


def _salvage_msgpack_job_id(raw: bytes) -> str | None:
    """Read only the top-level `job_id` of a broken or oversized msgpack map."""
    unpacker = msgpack.Unpacker(
        raw=False,
        max_buffer_size=len(raw) + 1,
        max_str_len=len(raw),
        max_bin_len=len(raw),
        max_array_len=len(raw),
        max_map_len=len(raw),
    )
    try:
        unpacker.feed(raw)
        for _ in range(unpacker.read_map_header()):
            key = unpacker.unpack() if raw[unpacker.tell()] in _SHORT_STR_TYPES else unpacker.skip()
            if key == "job_id":
                return readable_job_id({"job_id": unpacker.unpack()})
            unpacker.skip()
    except Exception:
        return None
    return None


def _salvage_json_job_id(raw: bytes) -> str | None:
    match = _JSON_JOB_ID.search(raw)
    return match.group(1).decode() if match else None
