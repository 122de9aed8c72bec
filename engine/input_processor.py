"""Turns a user's prompt + parameters into a validated request for the engine core (or an InvalidRequest)."""

import time

from jinja2.exceptions import TemplateError

from conveyor.engine import chat_tools
from conveyor.engine.core_request import EngineCoreRequest
from conveyor.engine.errors import InvalidRequest
from conveyor.engine.grammar_compiler import GrammarCompiler
from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import PRIORITY_CLASSES, Sequence

MAX_PROMPT_CHARS = 4_000_000  # refuse to tokenize absurd inputs (the token limit is checked after)


class InputProcessor:
    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        max_model_len: int,
        max_pool_tokens: int,
        eos_token_ids: frozenset[int] = frozenset(),
        serialize_grammars: bool = False,
    ):
        """``serialize_grammars``: its sequences go to another process (the engine core), so
        each grammar is serialized once where it is compiled."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.max_pool_tokens = max_pool_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self._grammars: GrammarCompiler | None = None  # built from this tokenizer on first use
        self.serialize_grammars = serialize_grammars

    def tokenize(self, prompt, add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt", "must not be empty")
            if len(prompt) > MAX_PROMPT_CHARS:
                raise InvalidRequest("prompt", f"has {len(prompt)} characters; the limit is {MAX_PROMPT_CHARS}")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens) or self._empty()
        if isinstance(prompt, (list, tuple)):
            if not prompt:
                raise InvalidRequest("prompt_token_ids", "must not be empty")
            for token_id in prompt:
                if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                    raise InvalidRequest(
                        "prompt_token_ids", f"entries must be ints in [0, {self.vocab_size}), got {token_id!r}"
                    )
            return list(prompt)
        raise InvalidRequest("prompt", f"must be a string or a list of token ids, got {type(prompt).__name__}")

    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Token ids of a chat; `tools` (OpenAI's function tools) as engine/chat_tools.py renders them."""
        if not messages:
            raise InvalidRequest("messages", "must not be empty")
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequest("messages", "this model's tokenizer has no chat template")
        for index, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not _has_content(message):
                raise InvalidRequest(f"messages[{index}]", "must be {'role': str, 'content': str}")
        try:
            if chat_tools.uses_tools(messages, tools):
                text = chat_tools.chat_text(self.tokenizer, messages, tools)
            else:
                text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as exc:  # the template needs what these messages lack (e.g. a content)
            raise InvalidRequest("messages", f"this model's chat template cannot render them: {exc}") from None
        return self.tokenize(text, add_special_tokens=False)  # the template has them

    def tool_parser(self) -> str:
        """The tool-call parser this model's output needs (engine/chat_tools.py)."""
        return chat_tools.default_tool_parser(self.tokenizer)

    def request_for(
        self,
        request_id: str,
        prompt=None,
        params: SamplingParams | None = None,
        priority_class: str = "interactive",
        priority: int = 0,
        arrival_time: float | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
    ) -> EngineCoreRequest:
        """Tokenize (or apply the chat template) and validate: a request or InvalidRequest."""
        params = params or SamplingParams()
        token_ids = self.apply_chat_template(messages, tools) if messages is not None else self.tokenize(prompt)
        return self.make_request(request_id, token_ids, params, priority_class, priority, arrival_time)

    def sequence_for(self, *args, **kwargs) -> Sequence:
        return self.request_for(*args, **kwargs).to_sequence()

    def with_tokenizer(self, tokenizer) -> "InputProcessor":
        """The same limits over another tokenizer instance (one per thread: a fast tokenizer
        used from two threads at once fails with "Already borrowed")."""
        return InputProcessor(tokenizer, self.vocab_size, self.max_model_len, self.max_pool_tokens, self.eos_token_ids)

    def make_request(
        self,
        request_id: str,
        token_ids: list[int],
        params: SamplingParams,
        priority_class: str = "interactive",
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> EngineCoreRequest:
        params.validate(self.vocab_size)
        if priority_class not in PRIORITY_CLASSES:
            raise InvalidRequest("priority_class", f"must be one of {PRIORITY_CLASSES}, got {priority_class!r}")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequest("priority", f"must be an integer, got {type(priority).__name__}")
        limit = min(self.max_model_len, self.max_pool_tokens)
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(token_ids)
        if len(token_ids) + max(max_tokens, 1) > limit:
            which = "max_model_len" if limit == self.max_model_len else "the KV cache pool"
            raise InvalidRequest(
                "prompt",
                f"{len(token_ids)} prompt tokens + max_tokens {params.max_tokens} exceed {which} ({limit} tokens)",
            )
        return EngineCoreRequest(
            request_id,
            tuple(token_ids),
            params,
            max_tokens,
            priority_class,
            priority,
            arrival_time or time.time(),
            self.compile_grammar(params),
        )

    def make_sequence(self, *args, **kwargs) -> Sequence:
        return self.make_request(*args, **kwargs).to_sequence()

    def compile_grammar(self, params: SamplingParams):
        """The compiled grammar of a structured request (None for others); InvalidRequest."""
        if params.structured_outputs is None:
            return None
        return self._grammar_compiler().compile(params.structured_outputs)

    def adopt_grammar(self, seq: Sequence) -> None:
        """A sequence made in another process (the replica's front door): its grammar rebuilt here."""
        if seq.grammar is not None:
            seq.grammar = self._grammar_compiler().adopt(seq.grammar)

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            self._grammars = GrammarCompiler(
                self.tokenizer, self.vocab_size, self.eos_token_ids, self.serialize_grammars
            )
        return self._grammars

    def _empty(self):
        raise InvalidRequest("prompt", "tokenizes to zero tokens")


def _has_content(message: dict) -> bool:
    """A string content; only an assistant's message of tool calls may go without one."""
    content = message.get("content")
    if content is None:
        return message.get("role") == "assistant" and bool(message.get("tool_calls"))
    return isinstance(content, str)
