"""Plain data passed from the scheduler to the model runner and back, once per step.

The plan carries deltas: a sequence's tokens and parameters travel once (``new_seqs``);
afterwards a scheduled sequence is a few integers and the block ids it just gained.
"""

from dataclasses import dataclass, field

from conveyor.engine.sampling_params import SamplingParams


@dataclass
class NewSeqData:
    seq_id: str
    token_ids: list[int]
    params: SamplingParams
    min_tokens_stop_ids: tuple[int, ...] = ()  # token ids banned until min_tokens is reached
    grammar: object | None = None  # structured outputs: the compiled grammar (engine/grammar_compiler.py)
    lora_request: object | None = None  # engine.LoRARequest (None: the base model)
    num_prompt_tokens: int | None = None  # of token_ids (None: all; a resumed one also holds carried outputs)


@dataclass
class ScheduledSeq:
    seq_id: str
    num_computed: int  # tokens already in the KV cache before this step
    num_new: int  # tokens computed in this step (draft tokens included)
    new_block_ids: list[int]
    draft_token_ids: list[int] = field(default_factory=list)  # speculative: verified after its last token


@dataclass
class StepPlan:
    step_id: int = 0  # the scheduler's count: matches a result to the sequences it scheduled
    new_seqs: list[NewSeqData] = field(default_factory=list)
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # block tables were released
    finished_ids: list[str] = field(default_factory=list)  # the runner can forget them
    trimmed_tables: dict[str, int] = field(default_factory=dict)  # seq id -> blocks kept (rejected drafts' released)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


@dataclass
class TokenLogprobs:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first: ranks 1, 2, ...
    rank: int | None = None  # of token_id in the vocabulary: 1 + tokens more likely (ties count against it)


@dataclass
class StepResult:
    """One sampled token per sequence that completed its prompt or decoded this step; one
    that verified drafts may have more (``extra_token_ids``, the tokens after its first: the
    rest of its accepted drafts, then the bonus or correction token)."""

    seq_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    # seq id -> (first prompt position scored, the logprobs of the prompt tokens from there on)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # seq id -> why it failed (no token for it)
    extra_token_ids: dict[str, list[int]] = field(default_factory=dict)
