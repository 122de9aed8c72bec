"""Exact token counts for light clients: the model's tokenizer.json through the `tokenizers`
package and its chat template rendered with jinja2 the way transformers renders it.

The template comes from Redis (model info), so its rendering is bounded: in time
(RENDER_TIMEOUT_S, checked on every line the compiled template runs), in output (what the
messages could fill, plus MAX_TEMPLATE_OUTPUT_CHARS) and in what one `*` or `**` may build.
A template over a bound raises RenderRefused for that count alone."""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime
from functools import lru_cache
from typing import Any, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

RENDER_TIMEOUT_S = 2.0
MAX_TEMPLATE_OUTPUT_CHARS = 256 * 1024  # what a template may add to the messages' own text
MAX_BINOP_ITEMS = 1 << 20  # characters or items one `*` in a template may build
MAX_EXPONENT = 64
# checked_count_chat trusts a rendering only with at least this many tokens per message on
# top of the messages' own text: every served template marks each message (ChatML, Llama 3
# and Gemma about five tokens of role markers; Mistral's assistant turns, the least, an EOS)
# and the tokens that merge at a message's edges are fewer than its markup.
MIN_MARKUP_TOKENS = 1


class RenderRefused(ValueError):
    """A chat template over a bound of time, output or size (the message says which)."""


class TokenCounter:
    """Counts tokens as the serving replica will (same tokenizer.json, same chat template)."""

    def __init__(
        self, tokenizer: Tokenizer, chat_template: str | None = None, special_tokens: Mapping[str, Any] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template = chat_template or None
        self.special_tokens = dict(special_tokens or {})

    @classmethod
    def from_json(
        cls,
        tokenizer_json: bytes | str,
        chat_template: str | None = None,
        special_tokens: Mapping[str, Any] | None = None,
    ) -> TokenCounter:
        text = tokenizer_json.decode() if isinstance(tokenizer_json, bytes) else tokenizer_json
        return cls(Tokenizer.from_str(text), chat_template, special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.encode(text, add_special_tokens))

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character span of every token of `text` (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).offsets

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    def render_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The prompt text, as `tokenizer.apply_chat_template(messages, tokenize=False)` returns it."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        plain = [{k: v for k, v in m.items() if v is not None} for m in messages]  # as transformers does
        context = {
            **self.special_tokens,
            "messages": plain,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        budget = 2 * len(json.dumps(plain, default=str)) + MAX_TEMPLATE_OUTPUT_CHARS
        return render_bounded(compile_template(self.chat_template), context, budget, RENDER_TIMEOUT_S)

    def encode_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Prompt token ids of a chat (the template already holds the special tokens)."""
        return self.encode(self.render_chat(messages, add_generation_prompt), add_special_tokens=False)

    def count_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True) -> int:
        return len(self.encode_chat(messages, add_generation_prompt))

    def checked_count_chat(self, messages: list[Mapping[str, Any]]) -> int:
        """count_chat for sizing a job (the gateway's default max_tokens: the context the
        prompt leaves), refused (RenderRefused) unless the rendering holds more than the
        messages' own text: at least MIN_MARKUP_TOKENS per message on top of it.

        The template is input (model info in Redis), and a count below the replica's makes
        the context left look larger than the replica, rendering its own template, finds it:
        the job is refused (prompt + max_tokens over max_model_len). A template that drops
        the conversation, or renders only its text (no role markup, no generation prompt:
        no served template does), is such a count; refused, the caller leaves the job's own
        default. Real templates add several tokens per message (role markers, separators)
        and the generation prompt, far more than the tokens merging at a message's edges."""
        used = self.count_chat(messages)
        own = sum(self.count(message_text(m.get("content")), add_special_tokens=False) for m in messages)
        least = own + MIN_MARKUP_TOKENS * len(messages)
        if used < least:
            raise RenderRefused(
                f"the chat template renders {used} tokens of {len(messages)} message(s) whose text holds {own}: "
                f"under the {least} any served template renders (its own markup): not trusted for counting"
            )
        return used


def message_text(content: Any) -> str:
    """The text a message contributes to a prompt: its content, or the text of its parts
    (``[{"type": "text", "text": ...}, ...]``; other parts carry no text)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"] for part in content if isinstance(part, Mapping) and isinstance(part.get("text"), str)
        )
    return str(content)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks it; we need not)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() refusing underscore attributes, like transformers' sandbox."""

    def __setitem__(self, name: str, value: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")
        super().__setitem__(name, value)


class _Dict:
    """`dict(...)` for templates without handing them the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any) -> dict:
        return dict.fromkeys(*args)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # jinja's own tojson escapes HTML characters; transformers' does not
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render_bounded(template: jinja2.Template, context: dict, max_chars: int, timeout_s: float) -> str:
    """template.render(**context), refused past `max_chars` of output or `timeout_s` of work."""
    deadline = time.monotonic() + timeout_s

    def on_line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise RenderRefused(f"the chat template took over {timeout_s:g} s to render")
        return on_line

    def on_call(frame: Any, event: str, arg: Any) -> Any:  # only the template's own code is timed
        return on_line if frame.f_code.co_filename == "<template>" else None

    parts, size, previous = [], 0, sys.gettrace()
    sys.settrace(on_call)
    try:
        for part in template.generate(**context):
            size += len(part)
            if size > max_chars:
                raise RenderRefused(f"the chat template rendered over {max_chars} characters")
            parts.append(part)
    finally:
        sys.settrace(previous)
    return "".join(parts)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """transformers' sandbox, where `'x' * 10**9` or `2 ** 10**9` is refused before it is built."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**" and isinstance(right, int) and abs(right) > MAX_EXPONENT:
            raise RenderRefused(f"a chat template's exponent is over {MAX_EXPONENT}")
        if operator == "*":
            sized, count = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if (
                isinstance(sized, (str, list, tuple))
                and isinstance(count, int)
                and len(sized) * count > MAX_BINOP_ITEMS
            ):
                raise RenderRefused(f"a chat template's `*` builds over {MAX_BINOP_ITEMS} items")
        return super().call_binop(context, operator, left, right)


@lru_cache(maxsize=16)
def compile_template(chat_template: str) -> jinja2.Template:
    """The template in the environment transformers uses for chat templates."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception,
        namespace=_Namespace,
        dict=_Dict(),
        strftime_now=lambda fmt: datetime.now().strftime(fmt),
    )
    return env.from_string(chat_template)
