"""Compiles a request's structured-output constraint with xgrammar when the engine accepts
the request (off the step's critical path), once per distinct constraint: a bounded LRU
keeps the compiled grammars, which requests share (each sequence gets its own matcher).

xgrammar reads the vocabulary from the Hugging Face tokenizer, sized to the MODEL's
vocabulary (the logits may be wider than the tokenizer: ids past it are never allowed),
with the model's EOS ids as its stop tokens: a complete grammar allows only those.

A producer's constraint is compiled in a worker process under a memory, time and size
bound (engine/grammar_worker.py): a grammar crafted to blow up fails its own request,
naming the limit, and costs this process nothing. This process only rebuilds the compiled
grammar from its JSON (milliseconds), or, where it crosses to the engine core anyway
(``serialize``: ingest's), keeps just the JSON.
"""

import json
import threading
from collections import OrderedDict

import xgrammar as xgr

from conveyor.engine.errors import InvalidRequest
from conveyor.engine.grammar_worker import CompileLimits, CompileRefused, GrammarWorker
from conveyor.engine.json_schema_support import too_many_repeats, unenforced
from conveyor.engine.structured_outputs import StructuredOutputsParams, schema_text

MAX_CACHED = 256  # compiled grammars kept ...
MAX_CACHED_BYTES = 256 << 20  # ... and their size, as xgrammar counts it (plus the JSON kept) ...
# ... and the size of their JSON, kept or not: xgrammar's count leaves out most of what a
# grammar of large automata holds (rebuilt, up to about 5 times its JSON)
MAX_CACHED_JSON_BYTES = 128 << 20
JSON_OBJECT_SCHEMA = '{"type":"object"}'  # json_object: as vLLM, an object (the builtin grammar also allows arrays)
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
    JSON; the receiving side's GrammarCompiler.adopt rebuilds it on its own tokenizer info.
    Ingest's compiler keeps only that JSON (``compiled`` None: nothing in its process runs it)."""

    def __init__(
        self, compiled: "xgr.CompiledGrammar | None", key: tuple, serialized: str | None = None, json_bytes: int = 0
    ):
        self.compiled = compiled  # None: only its JSON (unpickled, not yet adopted; or ingest's)
        self.key = key
        self.serialized = serialized
        self.json_bytes = json_bytes or len(serialized or "")  # its JSON's size, kept or not

    @property
    def cached_bytes(self) -> int:
        return (self.compiled.memory_size_bytes if self.compiled is not None else 0) + len(self.serialized or "")

    def __getstate__(self) -> dict:
        # ingest's compiler serializes once, when it compiles (GrammarCompiler(serialize=True));
        # not kept otherwise, so what a cache counted of this grammar never changes
        return {"key": self.key, "serialized": self.serialized or self.compiled.serialize_json()}

    def __setstate__(self, state: dict) -> None:
        self.__init__(None, state["key"], state["serialized"])


class GrammarCompiler:
    """One per input processor, built from its own tokenizer (tokenizers are not shared
    across threads); thread-safe all the same."""

    def __init__(
        self, tokenizer, vocab_size: int, stop_token_ids, serialize: bool = False, limits: CompileLimits | None = None
    ):
        """``serialize``: each grammar is kept as its JSON (its requests cross to the engine
        core); ``limits``: the compile worker's bounds (default: from the environment)."""
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        self.serialize = serialize
        self.limits = limits
        self.worker: GrammarWorker | None = None  # started on the first compile (an adopting core needs none)
        self.cache: OrderedDict[tuple, Grammar] = OrderedDict()
        self.cached_bytes = 0
        self.json_bytes = 0
        self.lock = threading.Lock()

    def compile(self, params: StructuredOutputsParams) -> Grammar:
        """The grammar of validated ``params``; InvalidRequest naming the field if it cannot
        be built, or not within the compile limits."""
        key = constraint_key(params)
        with self.lock:
            grammar = self.cache.get(key)
            if grammar is None:
                grammar = self._cache(self._compile(params.kind, key))
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
                # its JSON is not needed here
                cached = self._cache(Grammar(compiled, grammar.key, json_bytes=len(grammar.serialized)))
            self.cache.move_to_end(grammar.key)
            return cached

    def close(self) -> None:
        """Ends the compile worker (it also ends with this object, or this process)."""
        if self.worker is not None:
            self.worker.close()

    def _compile(self, kind: str, key: tuple) -> Grammar:
        if self.worker is None:
            self.worker = GrammarWorker(self.info.serialize_json(), self.limits)
        try:
            serialized, _ = self.worker.compile(*key)
        except CompileRefused as exc:
            field = f"structured_outputs.{kind}"
            if exc.invalid:
                raise InvalidRequest(field, f"cannot compile {WHAT[kind]}: {exc.message}") from None
            raise InvalidRequest(field, f"{WHAT[kind]} was not compiled: {exc.message}") from None
        if self.serialize:
            return Grammar(None, key, serialized)
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self.info)
        return Grammar(compiled, key, json_bytes=len(serialized))

    def _cache(self, grammar: Grammar) -> Grammar:
        self.cache[grammar.key] = grammar
        self.cached_bytes += grammar.cached_bytes
        self.json_bytes += grammar.json_bytes
        while len(self.cache) > 1 and (
            len(self.cache) > MAX_CACHED
            or self.cached_bytes > MAX_CACHED_BYTES
            or self.json_bytes > MAX_CACHED_JSON_BYTES
        ):
            _, oldest = self.cache.popitem(last=False)
            self.cached_bytes -= oldest.cached_bytes
            self.json_bytes -= oldest.json_bytes
        return grammar


def constraint_key(params: StructuredOutputsParams) -> tuple:
    """(what xgrammar compiles: json | regex | grammar, its text, any whitespace); refuses
    what xgrammar would not enforce or would take too long to build."""
    kind, any_whitespace = params.kind, params.any_whitespace
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


def _schema_problem(schema: dict) -> str | None:
    try:
        return unenforced(schema)
    except RecursionError:
        return "nested too deeply"


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's too)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
