"""What a request's output must match (vLLM's ``StructuredOutputsParams``): a JSON schema,
a regex, one of some strings, an EBNF grammar, or any JSON object.

JSON (``json``, ``json_object``) is compact unless ``whitespace="any"``: no whitespace outside
strings but one space after each ``,`` and ``:`` (xgrammar's compact form, as vLLM's
``disable_any_whitespace``), so a model unsure of itself cannot spend its max_tokens on blank
lines. ``whitespace="any"`` allows any whitespace between tokens (xgrammar's default, and
this engine's before compact became the default). ``disable_any_whitespace`` (vLLM's name) is
accepted: true asks for the default, and cannot be given with ``whitespace="any"``.

Plain data, checked here for shape and size (``validate``, when the engine accepts the
request); engine/grammar_compiler.py then compiles it, so a constraint that cannot be
compiled fails that request alone.
"""

import json
from dataclasses import dataclass

from conveyor.engine import sampling_limits as limits
from conveyor.engine.errors import InvalidRequest

CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object")
WHITESPACE = ("compact", "any")  # json, json_object: compact (None, the default) or any whitespace


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None  # a JSON schema: text, or the parsed object
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF (GBNF) as xgrammar reads it, start rule `root`
    json_object: bool | None = None  # True: any JSON object
    disable_any_whitespace: bool = False  # vLLM's name; compact is the default (true: the same)
    whitespace: str | None = None  # json, json_object: "compact" (None: the default) or "any"

    @property
    def kind(self) -> str:
        """The one constraint given (valid params only)."""
        return next(name for name in CONSTRAINTS if getattr(self, name) is not None)

    @property
    def any_whitespace(self) -> bool:
        """JSON with any whitespace between tokens (else compact)."""
        return self.whitespace == "any"

    def validate(self) -> None:
        given = [name for name in CONSTRAINTS if getattr(self, name) is not None]
        if len(given) != 1:
            raise InvalidRequest(
                "structured_outputs",
                f"exactly one of {', '.join(CONSTRAINTS)} is required (got {', '.join(given) or 'none'})",
            )
        if not isinstance(self.disable_any_whitespace, bool):
            raise InvalidRequest("structured_outputs.disable_any_whitespace", "must be a boolean")
        if self.whitespace is not None and self.whitespace not in WHITESPACE:
            raise InvalidRequest("structured_outputs.whitespace", f"must be compact or any, got {self.whitespace!r}")
        if self.disable_any_whitespace and self.any_whitespace:
            raise InvalidRequest("structured_outputs.whitespace", "any contradicts disable_any_whitespace: true")
        if self.json_object is not None and self.json_object is not True:
            raise InvalidRequest("structured_outputs.json_object", f"must be true when given, got {self.json_object!r}")
        if self.json is not None:
            self.schema()
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None:
                _text(f"structured_outputs.{name}", getattr(self, name))
        if self.choice is not None:
            _choices(self.choice)

    def schema(self) -> dict:
        """The JSON schema as an object (``json`` may be its text)."""
        where = "structured_outputs.json"
        if isinstance(self.json, str):
            _text(where, self.json)
            try:
                schema = json.loads(self.json)
            except (ValueError, RecursionError) as exc:
                raise InvalidRequest(where, f"is not valid JSON: {exc}") from None
        elif isinstance(self.json, dict):
            schema = self.json
            _text(where, schema_text(schema))
        else:
            raise InvalidRequest(
                where, f"must be a JSON schema (an object or its text), got {type(self.json).__name__}"
            )
        if not isinstance(schema, dict):
            raise InvalidRequest(where, f"must be a JSON object, got {type(schema).__name__}")
        return schema


def schema_text(schema: dict) -> str:
    """Compact JSON text of a schema, its key order kept (the order of the output's properties)."""
    try:
        return json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidRequest("structured_outputs.json", f"must be plain JSON: {exc}") from None


def _text(where: str, text) -> None:
    if not isinstance(text, str):
        raise InvalidRequest(where, f"must be a string, got {type(text).__name__}")
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.MAX_STRUCTURED_BYTES:
        raise InvalidRequest(where, f"is {size} bytes; the limit is {limits.MAX_STRUCTURED_BYTES}")


def _choices(choices) -> None:
    where = "structured_outputs.choice"
    if not isinstance(choices, (list, tuple)) or not choices:
        raise InvalidRequest(where, "must be a non-empty list of strings")
    if len(choices) > limits.MAX_CHOICES:
        raise InvalidRequest(where, f"at most {limits.MAX_CHOICES} choices, got {len(choices)}")
    for choice in choices:
        if not isinstance(choice, str):
            raise InvalidRequest(where, f"must be strings, got {type(choice).__name__}")
        if len(choice) > limits.MAX_CHOICE_CHARS:
            raise InvalidRequest(where, f"each choice at most {limits.MAX_CHOICE_CHARS} characters, got {len(choice)}")
    total = sum(len(choice.encode("utf-8", "surrogatepass")) for choice in choices)
    if total > limits.MAX_STRUCTURED_BYTES:
        raise InvalidRequest(where, f"the choices are {total} bytes in all; the limit is {limits.MAX_STRUCTURED_BYTES}")
