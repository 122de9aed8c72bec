"""What the engine returns per request (vLLM's RequestOutput shape, plus step deltas).

The engine core records timestamps only (``RequestTimestamps``); the output side turns
them into ``RequestMetrics`` (``RequestOutput.metrics``), as in vLLM V1.
"""
from dataclasses import dataclass, field

from engine.plan import TokenLogprobs


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
    def from_timestamps(cls, times: RequestTimestamps, num_prompt_tokens: int, num_output_tokens: int,
                        num_preemptions: int) -> "RequestMetrics":
        return cls(times.arrival, _since(times.arrival, times.first_scheduled),
                   _since(times.arrival, times.first_token), _since(times.arrival, times.finished),
                   _time_per_output_token(times, num_output_tokens),
                   num_prompt_tokens, num_output_tokens, num_preemptions)


def _since(start: float, moment: float | None) -> float | None:
    return None if moment is None else moment - start


def _time_per_output_token(times: RequestTimestamps, num_output_tokens: int) -> float | None:
    """Mean gap between output tokens after the first (needs at least two)."""
    if not (times.finished and times.first_token and num_output_tokens > 1):
        return None
    return (times.finished - times.first_token) / (num_output_tokens - 1)


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None  # 'stop' | 'length' | 'abort' | 'error'
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None
    timestamps: RequestTimestamps | None = None  # set on the finished output
    num_preemptions: int = 0
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""  # this step's delta (stop-string prefixes are held back)
    new_logprobs: list[TokenLogprobs] | None = None  # those of new_token_ids (a copy: `logprobs` grows)

    @property
    def metrics(self) -> RequestMetrics | None:
        """Latency metrics of a finished request, computed here from the core's timestamps."""
        if not self.finished or self.timestamps is None:
            return None
        return RequestMetrics.from_timestamps(self.timestamps, len(self.prompt_token_ids), len(self.token_ids),
                                              self.num_preemptions)
