"""Per-request output state: incremental text, stop strings, logprobs, timestamps."""
from dataclasses import dataclass, field

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import RequestOutput, RequestTimestamps
from engine.plan import TokenLogprobs
from engine.sequence import Sequence


@dataclass
class RequestState:
    detokenizer: IncrementalDetokenizer
    logprobs: list[TokenLogprobs] | None
    num_seen_tokens: int = 0  # output tokens already fed to the detokenizer
    num_reported_tokens: int = 0  # output tokens already returned as deltas
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # keyed by the Sequence itself: an aborted request's final output may still be due
        # when a new request reuses its id
        self.states: dict[Sequence, RequestState] = {}

    def add(self, seq: Sequence) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, seq.params.stop,
                                             seq.params.skip_special_tokens)
        self.states[seq] = RequestState(detokenizer, [] if seq.params.logprobs is not None else None)

    def feed(self, seq: Sequence, logprobs: TokenLogprobs | None = None) -> str | None:
        """Decode the sequence's new tokens; returns the stop string if one just completed."""
        state = self.states[seq]
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(logprobs)
        detok = state.detokenizer
        for token_id in seq.output_token_ids[state.num_seen_tokens:]:
            if detok.stop_string is None:
                detok.add(token_id)
        state.num_seen_tokens = seq.num_output_tokens
        return detok.stop_string

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output now, with the delta since the last call. Forgets finished ones."""
        state = self.states[seq]
        finished = seq.is_finished
        if finished:
            state.detokenizer.flush()
        new_text = state.detokenizer.take_delta(final=finished)
        new_tokens = seq.output_token_ids[state.num_reported_tokens:]
        new_logprobs = None if state.logprobs is None else \
            state.logprobs[state.num_reported_tokens:state.num_reported_tokens + len(new_tokens)]
        state.num_reported_tokens = seq.num_output_tokens
        if finished:
            del self.states[seq]
        return RequestOutput(
            request_id=seq.seq_id, prompt_token_ids=seq.prompt_token_ids,
            token_ids=list(seq.output_token_ids), text=state.detokenizer.text[:state.detokenizer.emitted],
            finished=finished, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason, error=seq.error,
            logprobs=state.logprobs, timestamps=timestamps_of(seq) if finished else None,
            num_preemptions=seq.num_preemptions,
            new_token_ids=new_tokens, new_text=new_text, new_logprobs=new_logprobs)


def timestamps_of(seq: Sequence) -> RequestTimestamps:
    """A copy of what the core recorded; metrics are computed from it on the output side."""
    return RequestTimestamps(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time,
                             seq.finished_time)
