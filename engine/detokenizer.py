"""Incremental detokenization with stop strings.

Text is decoded from a sliding window of token ids (so the work per token stays small and
multi-byte characters are only emitted once complete). A suffix that could be the start of
a stop string is held back until it is either completed (and cut) or ruled out.
"""

from conveyor.engine.stop_strings import StopMatcher

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output, for correct leading spaces


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str: bool = False,
        spaces_between_special_tokens: bool = True,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        self.include_stop_str = include_stop_str  # keep a completed stop string in the text (vLLM's option)
        self.stop = stop
        self.stop_matcher = StopMatcher(stop)
        self.window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.window)
        self.text = ""  # all decoded output text so far (cut at a stop string)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stop_string: str | None = None

    def add(self, token_id: int) -> None:
        """Decode one more token; sets ``stop_string`` when a stop string completes."""
        assert self.stop_string is None
        self.window.append(token_id)
        prefix = self._decode(self.window[self.prefix_offset : self.read_offset])
        full = self._decode(self.window[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return  # an incomplete character: wait for the next token
        self.prefix_offset, self.read_offset = self.read_offset, len(self.window)
        self.window, self.prefix_offset, self.read_offset = self._trimmed()
        self._append(full[len(prefix) :])

    def flush(self) -> None:
        """At the end: decode what was held back as an incomplete character (it stays U+FFFD)."""
        if self.stop_string is None and self.read_offset < len(self.window):
            prefix = self._decode(self.window[self.prefix_offset : self.read_offset])
            full = self._decode(self.window[self.prefix_offset :])
            self.read_offset = len(self.window)
            if len(full) > len(prefix):
                self._append(full[len(prefix) :])

    def take_delta(self, final: bool) -> str:
        """Text not yet handed out; unless ``final``, minus a possible stop-string start."""
        end = len(self.text) if final or self.stop_string else len(self.text) - self._held_back()
        delta = self.text[self.emitted : end]
        self.emitted = max(self.emitted, end)
        return delta

    def _append(self, new_text: str) -> None:
        hit = self.stop_matcher.feed(new_text, len(self.text)) if self.stop else None
        self.text += new_text
        if hit:
            index, self.stop_string = hit
            self.text = self.text[: index + (len(self.stop_string) if self.include_stop_str else 0)]

    def _held_back(self) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string
        (none when stop strings stay in the text: then nothing needs taking back)."""
        return 0 if self.include_stop_str else min(self.stop_matcher.held_back(), len(self.text))

    def _trimmed(self):
        """Drop window tokens before ``prefix_offset``; they are never decoded again."""
        return self.window[self.prefix_offset :], 0, self.read_offset - self.prefix_offset

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
        )
