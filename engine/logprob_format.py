"""The sampler's TokenLogprobs in vLLM's shape: per position a dict token id -> Logprob
(logprob, rank, decoded_token), the sampled (or prompt) token first, then the top ones.

``decoded_token`` is the token decoded alone, as vLLM's ``convert_ids_list_to_tokens``
does (``tokenizer.decode([token_id])``); each id is decoded once per formatter.
"""

from conveyor.engine.outputs import Logprob
from conveyor.engine.plan import TokenLogprobs


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text (at most the vocabulary)

    def position(self, entry: TokenLogprobs) -> dict[int, Logprob]:
        logprobs = {entry.token_id: Logprob(entry.logprob, entry.rank, self.text(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            logprobs[token_id] = Logprob(logprob, rank, self.text(token_id))  # as vLLM: a top entry wins
        return logprobs

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id]) or ""
        return text
