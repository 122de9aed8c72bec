"""What the engine returns per request (vLLM's RequestOutput shape, plus step deltas)."""
from dataclasses import dataclass, field

from engine.plan import TokenLogprobs


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
    metrics: RequestMetrics | None = None
    new_token_ids: list[int] = field(default_factory=list)  # this step's delta
    new_text: str = ""  # this step's delta (stop-string prefixes are held back)
    new_logprobs: list[TokenLogprobs] | None = None  # those of new_token_ids (a copy: `logprobs` grows)
