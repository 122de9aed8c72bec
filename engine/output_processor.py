"""Per-request output state: incremental text, stop strings, logprobs, timestamps."""

from dataclasses import dataclass

from conveyor.engine.detokenizer import IncrementalDetokenizer
from conveyor.engine.logprob_format import LogprobFormatter
from conveyor.engine.outputs import CompletionOutput, PromptLogprobs, RequestOutput, RequestTimestamps, SampleLogprobs
from conveyor.engine.plan import TokenLogprobs
from conveyor.engine.sequence import Sequence


@dataclass
class RequestState:
    detokenizer: IncrementalDetokenizer
    prompt: str | None
    logprobs: list[TokenLogprobs] | None  # engine form: the deltas are slices of it
    sample_logprobs: SampleLogprobs | None  # vLLM form, grown with it
    prompt_logprobs: PromptLogprobs | None
    cumulative_logprob: float | None
    num_seen_tokens: int = 0  # output tokens already fed to the detokenizer
    num_reported_tokens: int = 0  # output tokens already returned as deltas


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.formatter = LogprobFormatter(tokenizer)
        # keyed by the Sequence itself: an aborted request's final output may still be due
        # when a new request reuses its id
        self.states: dict[Sequence, RequestState] = {}

    def add(self, seq: Sequence, prompt: str | None = None) -> None:
        params = seq.params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer,
            seq.prompt_token_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            params.spaces_between_special_tokens,
        )
        wants_logprobs = params.logprobs is not None
        state = self.states[seq] = RequestState(
            detokenizer,
            prompt,
            [] if wants_logprobs else None,
            [] if wants_logprobs else None,
            [None] if params.prompt_logprobs is not None else None,
            0.0 if wants_logprobs else None,
        )
        if seq.num_resumed_tokens:
            self._resume(seq, state)

    @staticmethod
    def _resume(seq: Sequence, state: RequestState) -> None:
        """A resumed request's carried outputs: decoded (stop strings see their text), not
        reported again; its deltas start after the text its readers already have. Their
        logprobs are in the events that published them (placeholders here keep positions)."""
        for token_id in seq.output_token_ids:
            if state.detokenizer.stop_string is None:  # the replica trims carried outputs before one
                state.detokenizer.add(token_id)
        state.detokenizer.emitted = min(seq.resumed_chars, len(state.detokenizer.text))
        state.num_seen_tokens = state.num_reported_tokens = seq.num_output_tokens
        if state.logprobs is not None:
            state.logprobs.extend([None] * seq.num_output_tokens)
            state.sample_logprobs.extend([None] * seq.num_output_tokens)

    def feed(self, seq: Sequence, logprobs: TokenLogprobs | None = None, hold_last: bool = False) -> str | None:
        """Decode the sequence's new tokens; returns the stop string if one just completed.
        ``hold_last``: the last token ended the sequence as a stop token; as in vLLM, its text
        is not part of the output (unless include_stop_str_in_output)."""
        state = self.states[seq]
        if logprobs is not None and state.logprobs is not None:
            state.logprobs.append(logprobs)
            state.sample_logprobs.append(self.formatter.position(logprobs))
            state.cumulative_logprob += logprobs.logprob
        detok = state.detokenizer
        new_tokens = seq.output_token_ids[state.num_seen_tokens :]
        for token_id in new_tokens[:-1] if hold_last else new_tokens:
            if detok.stop_string is None:
                detok.add(token_id)
        state.num_seen_tokens = seq.num_output_tokens
        return detok.stop_string

    def feed_prompt_logprobs(self, seq: Sequence, start: int, entries: list[TokenLogprobs]) -> None:
        """Logprobs of prompt tokens ``start``, ``start + 1``, ...; positions already held
        (a preempted sequence computes its prompt again) are skipped."""
        held = self.states[seq].prompt_logprobs
        if held is None:
            return
        for position, entry in enumerate(entries, start):
            if position == len(held):
                held.append(self.formatter.position(entry))

    def output(self, seq: Sequence) -> RequestOutput:
        """The request's output now, with the delta since the last call. Forgets finished ones."""
        state = self.states[seq]
        finished = seq.is_finished
        if finished:
            state.detokenizer.flush()
            del self.states[seq]
        completion = self._completion(seq, state, finished)
        return RequestOutput(
            request_id=seq.seq_id,
            prompt=state.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=state.prompt_logprobs,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=seq.num_cached_tokens,
            timestamps=timestamps_of(seq) if finished else None,
            num_preemptions=seq.num_preemptions,
            error=seq.error,
        )

    @staticmethod
    def _completion(seq: Sequence, state: RequestState, finished: bool) -> CompletionOutput:
        detok = state.detokenizer
        new_text = detok.take_delta(final=finished)
        new_tokens = seq.output_token_ids[state.num_reported_tokens :]
        new_logprobs = (
            None
            if state.logprobs is None
            else state.logprobs[state.num_reported_tokens : state.num_reported_tokens + len(new_tokens)]
        )
        state.num_reported_tokens = seq.num_output_tokens
        return CompletionOutput(
            index=seq.sample_index,
            text=detok.text[: detok.emitted],
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=state.cumulative_logprob,
            logprobs=state.sample_logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            new_token_ids=new_tokens,
            new_text=new_text,
            new_logprobs=new_logprobs,
        )


def timestamps_of(seq: Sequence) -> RequestTimestamps:
    """A copy of what the core recorded; metrics are computed from it on the output side."""
    return RequestTimestamps(seq.arrival_time, seq.first_scheduled_time, seq.first_token_time, seq.finished_time)
