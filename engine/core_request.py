"""EngineCoreRequest: what a front door hands the engine core for one request (as vLLM's
EngineCoreRequest). Only validated inputs cross; the engine's own ``Sequence`` (block table,
progress, timestamps) is made and kept inside the core."""

from dataclasses import dataclass

from conveyor.engine.sampling_params import SamplingParams
from conveyor.engine.sequence import Sequence


@dataclass(frozen=True)
class EngineCoreRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    max_tokens: int  # resolved against the model's limits: never None
    priority_class: str
    priority: int
    arrival_time: float
    grammar: object | None = None  # compiled grammar (serialized where it crosses a process: grammar_compiler.py)
    lora_request: object | None = None  # engine.LoRARequest: the adapter it runs with (None: the base model)
    cache_salt: str | None = None  # prefix-cache entries are shared only within one salt (a replica: its namespace's)
    tenant: str | None = None  # whose fair share it is served from (engine/fair_share.py)
    # a resumed job (actors/resume.py): output tokens an earlier attempt already published,
    # prefilled with the prompt, and the characters of their text its readers already have
    resumed_token_ids: tuple[int, ...] = ()
    resumed_chars: int = 0

    def to_sequence(self) -> Sequence:
        seq = Sequence(
            self.request_id,
            list(self.prompt_token_ids),
            self.params,
            self.max_tokens,
            self.priority_class,
            self.priority,
            self.arrival_time,
            grammar=self.grammar,
            lora_request=self.lora_request,
            cache_salt=self.cache_salt,
            tenant=self.tenant,
        )
        if self.resumed_token_ids:  # its outputs so far: the prompt stays the prompt
            seq.token_ids.extend(self.resumed_token_ids)
            seq.num_resumed_tokens, seq.resumed_chars = len(self.resumed_token_ids), self.resumed_chars
        return seq
