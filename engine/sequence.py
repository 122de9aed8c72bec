"""State of one request inside the engine (tokens, progress, KV block table, timestamps)."""

import enum
import itertools
import time
from dataclasses import dataclass, field

from conveyor.engine.sampling_params import SamplingParams

PRIORITY_CLASSES = ("interactive", "batch")
_arrival_counter = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: str
    token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: never None
    priority_class: str = "interactive"
    priority: int = 0  # lower is served earlier (vLLM convention)
    arrival_time: float = field(default_factory=time.time)
    arrival_order: int = field(default_factory=lambda: next(_arrival_counter))
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_inflight_tokens: int = 0  # tokens a step still in flight computes (overlapped steps)
    num_pending_samples: int = 0  # tokens a step still in flight samples for it (0 or 1)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # chained digests of full blocks (memo)
    num_registered_blocks: int = 0  # leading blocks already published to the prefix cache
    num_blocks_sent: int = 0  # leading block-table entries the model runner already has
    admit_order: int = -1  # set each time the scheduler admits it
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None  # why it ended with finish_reason 'error'
    grammar: object | None = None  # structured outputs: its compiled grammar (engine/grammar_compiler.py)
    lora_request: object | None = None  # engine.LoRARequest: the adapter it runs with (None: the base model)
    cache_salt: str | None = None  # prefix-cache entries are shared only between requests of one salt
    tenant: str | None = None  # whose fair share it is served from (engine/fair_share.py; a replica: its namespace)
    num_preemptions: int = 0
    num_resumed_tokens: int = 0  # a resumed request: output tokens carried over (token_ids holds them)
    resumed_chars: int = 0  # a resumed request: characters of its carried output's text already published
    known_to_runner: bool = False
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served when first admitted
    sample_index: int = 0  # which of its request's n samples this is (RequestOutput.outputs[i])
    leader: "Sequence | None" = None  # n > 1: admitted once this one's prompt is computed (parallel_sampling.py)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self):
        self.num_prompt_tokens = len(self.token_ids)
        assert self.priority_class in PRIORITY_CLASSES, self.priority_class

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed or being computed by a step in flight."""
        return self.num_computed_tokens + self.num_inflight_tokens

    @property
    def num_unscheduled_tokens(self) -> int:
        """Tokens no step has taken yet, counting those steps in flight will sample."""
        return len(self.token_ids) + self.num_pending_samples - self.num_scheduled_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED
