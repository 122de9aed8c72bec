"""The part of JSON Schema that xgrammar enforces. xgrammar compiles schemas with other
assertions too but ignores them (``multipleOf``, ``uniqueItems``, ``not``, a length next to
a ``pattern``...), so its output could fail the schema: such a schema is refused instead,
and every output under an accepted schema validates against it.

Unknown keywords are annotations in JSON Schema (a validator ignores them too): allowed.
"""

import re

# assertions xgrammar 0.2 drops (vLLM refuses the same ones for xgrammar)
UNENFORCED = (
    "multipleOf",
    "uniqueItems",
    "contains",
    "minContains",
    "maxContains",
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
    "additionalItems",
    "patternProperties",
    "propertyNames",
)
# string formats xgrammar turns into a grammar (cpp/json_schema_converter.cc)
FORMATS = (
    "email",
    "date",
    "time",
    "date-time",
    "duration",
    "ipv4",
    "ipv6",
    "hostname",
    "uuid",
    "uri",
    "uri-reference",
    "uri-template",
    "json-pointer",
    "relative-json-pointer",
)
LENGTHS = ("minLength", "maxLength")
# where subschemas sit: maps of them, lists of them, and single ones
SCHEMA_MAPS = ("properties", "$defs", "definitions")
SCHEMA_LISTS = ("prefixItems", "anyOf", "allOf")
SCHEMA_VALUES = ("items", "additionalProperties")
MAX_DEPTH = 32  # subschemas in subschemas: xgrammar's time and memory grow very fast with nesting
MAX_REPEAT = 1000  # largest {m,n} of a pattern: xgrammar's pattern conversion grows faster than linearly with it
REPEAT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")


def unenforced(schema, path: str = "#", depth: int = 0) -> str | None:
    """What in ``schema`` xgrammar would not enforce (the first thing, with its path), or None."""
    if not isinstance(schema, dict):
        return None  # true / false (or an error xgrammar reports)
    if depth > MAX_DEPTH:
        return f"{path}: subschemas nested more than {MAX_DEPTH} deep"
    found = _own_keywords(schema, path)
    for sub, sub_path in _subschemas(schema, path):
        found = found or unenforced(sub, sub_path, depth + 1)
    return found


def _subschemas(schema: dict, path: str):
    for key in SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            yield from ((sub, f"{path}/{key}/{name}") for name, sub in schema[key].items())
    for key in SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            yield from ((sub, f"{path}/{key}/{index}") for index, sub in enumerate(schema[key]))
    for key in SCHEMA_VALUES:
        yield schema.get(key), f"{path}/{key}"


def _own_keywords(schema: dict, path: str) -> str | None:
    keyword = next((k for k in UNENFORCED if k in schema), None)
    if keyword:
        return f"{path}: '{keyword}' is not supported (the grammar could not enforce it)"
    if "oneOf" in schema:
        return f"{path}: 'oneOf' is not supported (it would be enforced as 'anyOf'); use 'anyOf'"
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return f"{path}: 'allOf' with more than one schema is not supported"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{path}: '$ref' must point into this schema ('#/...'), got {ref[:80]!r}"
    fmt = schema.get("format")
    if isinstance(fmt, str) and fmt not in FORMATS:
        return f"{path}: format {fmt[:40]!r} is not supported (supported: {', '.join(FORMATS)})"
    if ("pattern" in schema or "format" in schema) and any(k in schema for k in LENGTHS):
        return f"{path}: minLength/maxLength next to pattern/format is not supported"
    problem = too_many_repeats(schema["pattern"]) if isinstance(schema.get("pattern"), str) else None
    return f"{path}/pattern: {problem}" if problem else None


def too_many_repeats(regex: str) -> str | None:
    """A ``{m,n}`` bound over MAX_REPEAT in ``regex``, described, or None."""
    for match in REPEAT.finditer(regex):
        bound = max(int(number) for number in match.groups() if number)
        if bound > MAX_REPEAT:
            return f"repetition bound {bound} is over the limit of {MAX_REPEAT}"
    return None
