"""Compiles a request's structured-output constraint with xgrammar when the engine accepts
the request (off the step's critical path), once per distinct constraint: a bounded LRU
keeps the compiled grammars, which requests share (each sequence gets its own matcher).

xgrammar reads the vocabulary from the Hugging Face tokenizer, sized to the MODEL's
vocabulary (the logits may be wider than the tokenizer: ids past it are never allowed),
with the model's EOS ids as its stop tokens: a complete grammar allows only those.
"""

import json
import re
import threading
from collections import OrderedDict

import xgrammar as xgr

from conveyor.engine.errors import InvalidRequest
from conveyor.engine.json_schema_support import too_many_repeats, unenforced
from conveyor.engine.structured_outputs import StructuredOutputsParams, schema_text

MAX_CACHED = 256  # compiled grammars kept ...
MAX_CACHED_BYTES = 256 << 20  # ... and their size, as xgrammar counts it
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # json_object: as vLLM, an object (the builtin grammar also allows arrays)
XGRAMMAR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # "[15:49:50] /project/cpp/x.cc:123: "
# xgrammar 0.2.9 writes the characters of a string with minLength/maxLength as [^"\\\r\n]
# (no escapes): that lets raw control characters through, which JSON forbids. Such rules get
# JSON's class of characters that need no escape instead.
LENGTH_BOUNDED_CHARS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\]")
WHAT = {
    "json": "the JSON schema",
    "regex": "the regex",
    "choice": "the choices",
    "grammar": "the grammar",
    "json_object": "the JSON object grammar",
}


class Grammar:
    """A compiled constraint (immutable, shared): what a sequence's matcher runs on.

    Pickled (to the engine core, engine/engine_core.py) it travels as xgrammar's
    JSON; the receiving side's GrammarCompiler.adopt rebuilds it on its own tokenizer info."""

    def __init__(self, compiled: "xgr.CompiledGrammar | None", key: tuple, serialized: str | None = None):
        self.compiled = compiled  # None: unpickled, not yet adopted
        self.key = key
        self.serialized = serialized

    @property
    def cached_bytes(self) -> int:
        return self.compiled.memory_size_bytes + len(self.serialized or "")

    def __getstate__(self) -> dict:
        # ingest's compiler serializes once, when it compiles (GrammarCompiler(serialize=True));
        # not kept otherwise, so what a cache counted of this grammar never changes
        return {"key": self.key, "serialized": self.serialized or self.compiled.serialize_json()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(None, state["key"], state["serialized"])


class GrammarCompiler:
    """One per input processor, built from its own tokenizer (tokenizers are not shared
    across threads); thread-safe all the same."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, serialize: bool = False):
        """``serialize``: each grammar is also serialized once, here (its requests cross to the engine core)."""
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)  # the LRU below is the one cache
        self.serialize = serialize
        self.cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self.cached_bytes = 0
        self.lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar of validated ``params``; InvalidRequest naming the field if it cannot be built."""
        key = constraint_key(params)
        with self.lock:
            grammar = self.cache.get(key)
            if grammar is None:
                compiled = self._compile(params.kind, key)
                grammar = self._cache(Grammar(compiled, key, compiled.serialize_json() if self.serialize else None))
            self.cache.move_to_end(key)
            return grammar

    def adopt(self, grammar: Grammar) -> Grammar:
        """The grammar another process compiled (unpickled): the cached one of its key, else
        rebuilt from its JSON (milliseconds; compiling again could take seconds)."""
        if grammar.compiled is not None:
            return grammar
        with self.lock:
            cached = self.cache.get(grammar.key)
            if cached is None:
                compiled = xgr.CompiledGrammar.deserialize_json(grammar.serialized, self.info)
                cached = self._cache(Grammar(compiled, grammar.key))  # its JSON is not needed here
            self.cache.move_to_end(grammar.key)
            return cached

    def _compile(self, kind: str, key: tuple) -> "xgr.CompiledGrammar":
        source, text, any_whitespace = key
        try:
            if source == "json":
                grammar = xgr.Grammar.from_json_schema(text, any_whitespace=any_whitespace)
                return self.compiler.compile_grammar(_json_strings_fixed(grammar))
            if source == "regex":
                return self.compiler.compile_regex(text)
            return self.compiler.compile_grammar(text)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its own text
            raise InvalidRequest(f"structured_outputs.{kind}", f"cannot compile {WHAT[kind]}: {_reason(exc)}") from None

    def _cache(self, grammar: Grammar) -> Grammar:
        self.cache[grammar.key] = grammar
        self.cached_bytes += grammar.cached_bytes
        while len(self.cache) > MAX_CACHED or (self.cached_bytes > MAX_CACHED_BYTES and len(self.cache) > 1):
            _, oldest = self.cache.popitem(last=False)
            self.cached_bytes -= oldest.cached_bytes
        return grammar


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """(what xgrammar compiles: json | regex | grammar, its text, any whitespace); refuses
    what xgrammar would not enforce or would take too long to build."""
    kind, any_whitespace = params.kind, not params.disable_any_whitespace
    if kind == "json":
        schema = params.schema()
        problem = _schema_problem(schema)
        if problem:
            raise InvalidRequest("structured_outputs.json", problem)
        return ("json", schema_text(schema), any_whitespace)
    if kind == "json_object":
        return ("json", JSON_OBJECT_SCHEMA, any_whitespace)
    if kind == "regex":
        problem = "must not contain NUL characters" if "\x00" in params.regex else too_many_repeats(params.regex)
        if problem:
            raise InvalidRequest("structured_outputs.regex", problem)
        return ("regex", params.regex, False)
    if kind == "choice":
        return ("grammar", choice_grammar(params.choice), False)
    return ("grammar", params.grammar, False)


def _json_strings_fixed(grammar: "xgr.Grammar"):
    """The grammar (or its EBNF text, fixed) with no raw control characters in its strings."""
    text = str(grammar)
    return text.replace(*LENGTH_BOUNDED_CHARS) if LENGTH_BOUNDED_CHARS[0] in text else grammar


def _reason(exc: Exception) -> str:
    """xgrammar's message: its first line, without the "[time] file:line: " prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return XGRAMMAR_PREFIX.sub("", lines[0])[:500]


def _schema_problem(schema: dict) -> str | None:
    try:
        return unenforced(schema)
    except RecursionError:
        return "nested too deeply"


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
