"""Finishing a sequence, in one place.

After a step's tokens are appended and detokenized, ``StopRules.reason`` checks every stop
condition of a sequence in one fixed order; the engine then ends it exactly once, through
``Scheduler.finish``. The first condition that holds wins:

1. text-level: a stop string completed by this step's text -> ("stop", the string)
   (it wins even when the same token also hit EOS, a stop token id or a length limit)
2. token-level, only once ``min_tokens`` output tokens exist:
   a. EOS, unless ``ignore_eos``                       -> ("stop", None)
   b. one of ``stop_token_ids``                         -> ("stop", the token id)
3. length: ``max_tokens`` output tokens or ``max_model_len`` tokens -> ("length", None)

Before ``min_tokens``, EOS and stop token ids are also masked out of sampling
(``min_tokens_stop_ids``), so rule 2 cannot fire early on a sampled token.

Structured outputs: the grammar allows EOS only once the output is complete, and then only
EOS, so for such a request EOS always ends it (2a holds whatever ``ignore_eos`` and
``min_tokens`` say, and EOS is not banned before ``min_tokens``): nothing valid could follow.
``min_tokens`` still bans the request's ``stop_token_ids``.
"""

from conveyor.engine.sequence import Sequence

StopReason = tuple[str, str | int | None]  # (finish_reason, stop_reason)


class StopRules:
    def __init__(self, eos_token_ids: set[int], max_model_len: int):
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def reason(self, seq: Sequence, stop_string: str | None = None) -> StopReason | None:
        """Why ``seq`` ends after its last token (rules in the module's order), or None."""
        if stop_string is not None:
            return ("stop", stop_string)
        return self._token_reason(seq) or self._length_reason(seq)

    def stops_on_token(self, seq: Sequence) -> bool:
        """Whether rule 2 (EOS or a stop token id) holds for the last token: then, as in vLLM,
        that token's text is left out of the output unless include_stop_str_in_output."""
        return self._token_reason(seq) is not None

    def ends_after_pending(self, seq: Sequence) -> bool:
        """Whether the token a step in flight samples for ``seq`` certainly ends it (rule 3):
        then the next step, planned before that token is known, leaves it out."""
        if not seq.num_pending_samples:
            return False
        num_tokens = seq.num_tokens + seq.num_pending_samples
        return num_tokens - seq.num_prompt_tokens >= seq.max_tokens or num_tokens >= self.max_model_len

    def min_tokens_stop_ids(self, seq: Sequence) -> tuple[int, ...]:
        """Token ids the sampler must not pick while ``min_tokens`` is not yet reached."""
        if seq.params.min_tokens == 0:
            return ()
        eos = () if seq.params.ignore_eos or _structured(seq) else tuple(self.eos_token_ids)
        return eos + tuple(seq.params.stop_token_ids)

    def _token_reason(self, seq: Sequence) -> StopReason | None:
        params, token_id = seq.params, seq.token_ids[-1]
        if _structured(seq) and token_id in self.eos_token_ids:
            return ("stop", None)  # the grammar is complete (see the module docstring)
        if seq.num_output_tokens < params.min_tokens:
            return None
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return ("stop", None)
        if token_id in params.stop_token_ids:
            return ("stop", token_id)
        return None

    def _length_reason(self, seq: Sequence) -> StopReason | None:
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return ("length", None)
        return None


def _structured(seq: Sequence) -> bool:
    return seq.params.structured_outputs is not None
