"""What the engine returns per request, in vLLM's shape: a ``RequestOutput`` holding one
``CompletionOutput`` per sample (``SamplingParams.n``), logprobs as ``Logprob`` dicts.

Each CompletionOutput also carries the step's deltas (``new_token_ids``, ``new_text``,
``new_logprobs``): the replica streams them as token events.

The engine core records timestamps only (``RequestTimestamps``); the output side turns
them into ``RequestMetrics`` (``RequestOutput.metrics``), as in vLLM V1.
"""

from dataclasses import dataclass, field

from conveyor.engine.plan import TokenLogprobs


@dataclass
class Logprob:
    """vLLM's: one token's logprob, its rank in the vocabulary (1: the most likely) and its
    text decoded alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]  # per output token: the sampled token and the top ones
PromptLogprobs = list[dict[int, Logprob] | None]  # per prompt token; None for the first


@dataclass(frozen=True)
class RequestTimestamps:
    """Wall-clock times (time.time()) the core recorded for one request; None: not yet."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    queue_time: float | None = None  # arrival -> first scheduled
    ttft: float | None = None  # arrival -> first token
    e2e: float | None = None  # arrival -> finished
    tpot: float | None = None  # mean time per output token after the first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @classmethod
    def from_timestamps(
        cls, times: RequestTimestamps, num_prompt_tokens: int, num_output_tokens: int, num_preemptions: int
    ) -> "RequestMetrics":
        return cls(
            times.arrival,
            _since(times.arrival, times.first_scheduled),
            _since(times.arrival, times.first_token),
            _since(times.arrival, times.finished),
            _time_per_output_token(times, num_output_tokens),
            num_prompt_tokens,
            num_output_tokens,
            num_preemptions,
        )


def _since(start: float, moment: float | None) -> float | None:
    return None if moment is None else moment - start


def _time_per_output_token(times: RequestTimestamps, num_output_tokens: int) -> float | None:
    """Mean gap between output tokens after the first (needs at least two)."""
    if not (times.finished and times.first_token and num_output_tokens > 1):
        return None
    return (times.finished - times.first_token) / (num_output_tokens - 1)


@dataclass
class CompletionOutput:
    """One sample of a request (vLLM's fields first, then this step's deltas)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs, when logprobs were asked
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""  # this step's delta (stop-string prefixes are held back)
    new_logprobs: list[TokenLogprobs] | None = None  # those of new_token_ids, engine form (the wire's)

    def finished(self) -> bool:
        return self.finish_reason is not None

    def without_deltas(self) -> "CompletionOutput":
        """The same output as of a step that did not advance it."""
        return CompletionOutput(
            self.index,
            self.text,
            self.token_ids,
            self.cumulative_logprob,
            self.logprobs,
            self.finish_reason,
            self.stop_reason,
            new_logprobs=None if self.new_logprobs is None else [],
        )


@dataclass
class RequestOutput:
    """vLLM's RequestOutput (``outputs`` in index order), plus Conveyor's ``error``.

    ``text``, ``token_ids``, ``logprobs``, ``cumulative_logprob``, ``finish_reason``,
    ``stop_reason`` and the deltas ``new_token_ids``, ``new_text``, ``new_logprobs`` are
    read-only shortcuts to ``outputs[0]`` for a request with one output (n=1); with more
    they raise, so code written for one output cannot silently drop the others.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache
    error: str | None = None  # why the request failed (finish_reason 'error')
    timestamps: RequestTimestamps | None = None  # set on the finished output
    num_preemptions: int = 0

    @property
    def metrics(self) -> RequestMetrics | None:
        """Latency metrics of a finished request, computed here from the core's timestamps."""
        if not self.finished or self.timestamps is None:
            return None
        metrics = RequestMetrics.from_timestamps(
            self.timestamps, len(self.prompt_token_ids), self.num_output_tokens, self.num_preemptions
        )
        if len(self.outputs) > 1:  # n samples decode side by side: per token of the longest one
            metrics.tpot = _time_per_output_token(self.timestamps, max(len(o.token_ids) for o in self.outputs))
        return metrics

    @property
    def num_output_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    @property
    def num_new_tokens(self) -> int:
        """Tokens this step added, all outputs together."""
        return sum(len(o.new_token_ids) for o in self.outputs)

    def _only(self, name: str) -> CompletionOutput:
        if len(self.outputs) != 1:
            raise AttributeError(
                f"RequestOutput.{name}: this request has {len(self.outputs)} outputs (n > 1); read outputs[i].{name}"
            )
        return self.outputs[0]

    text = property(lambda self: self._only("text").text)
    token_ids = property(lambda self: self._only("token_ids").token_ids)
    logprobs = property(lambda self: self._only("logprobs").logprobs)
    cumulative_logprob = property(lambda self: self._only("cumulative_logprob").cumulative_logprob)
    finish_reason = property(lambda self: self._only("finish_reason").finish_reason)
    stop_reason = property(lambda self: self._only("stop_reason").stop_reason)
    new_token_ids = property(lambda self: self._only("new_token_ids").new_token_ids)
    new_text = property(lambda self: self._only("new_text").new_text)
    new_logprobs = property(lambda self: self._only("new_logprobs").new_logprobs)
