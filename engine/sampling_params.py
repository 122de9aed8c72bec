"""Per-request sampling parameters (vLLM names and defaults)."""

import math
from dataclasses import dataclass, field, fields

from conveyor.engine import sampling_limits as limits
from conveyor.engine.errors import InvalidRequest
from conveyor.engine.structured_outputs import StructuredOutputsParams

MAX_LOGPROBS = limits.MAX_LOGPROBS
MAX_N = limits.MAX_N
GREEDY_TEMPERATURE = 1e-5  # below this, sampling is greedy (as in vLLM): no logits / ~0 overflow
# generation_config.json's fields that give a model's sampling defaults (vLLM's list), and the
# SamplingParams field each one sets; nothing else of the file counts (do_sample neither, as in vLLM)
GENERATION_CONFIG_FIELDS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    Validation happens when the engine accepts a request (``validate``), so one bad
    request in a batch fails alone instead of raising in the caller's loop.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # chosen token + this many top alternatives
    skip_special_tokens: bool = True
    n: int = 1  # samples of the prompt, returned as RequestOutput.outputs[0..n-1]
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling
    prompt_logprobs: int | None = None  # each prompt token's logprob + this many top alternatives
    include_stop_str_in_output: bool = False  # keep the stop string (or stop token's text) in the text
    spaces_between_special_tokens: bool = True  # passed to the tokenizer's decode
    structured_outputs: StructuredOutputsParams | None = None  # a dict is read as its fields

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self, vocab_size: int) -> None:
        _number("temperature", self.temperature, low=0.0, high=limits.MAX_TEMPERATURE)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _integer("top_k", self.top_k, low=0)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        _number(
            "repetition_penalty",
            self.repetition_penalty,
            low=limits.MIN_REPETITION_PENALTY,
            high=limits.MAX_REPETITION_PENALTY,
        )
        _number("presence_penalty", self.presence_penalty, low=limits.MIN_PENALTY, high=limits.MAX_PENALTY)
        _number("frequency_penalty", self.frequency_penalty, low=limits.MIN_PENALTY, high=limits.MAX_PENALTY)
        if self.seed is not None:
            _integer("seed", self.seed, low=limits.SEED_MIN, high=limits.SEED_MAX)
        if self.max_tokens is not None:
            _integer("max_tokens", self.max_tokens, low=1)
        _integer("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequest("min_tokens", f"must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _stop_strings(self.stop)
        for token_id in self.stop_token_ids:
            _integer("stop_token_ids", token_id, low=0, high=vocab_size - 1)
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidRequest("structured_outputs", "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        self._validate_vllm_extras(vocab_size)

    def _validate_vllm_extras(self, vocab_size: int) -> None:
        _integer("n", self.n, low=1, high=MAX_N)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        for name in (
            "include_stop_str_in_output",
            "spaces_between_special_tokens",
            "skip_special_tokens",
            "ignore_eos",
        ):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequest(name, f"must be a bool, got {type(getattr(self, name)).__name__}")
        if self.logit_bias is not None:
            _logit_bias(self.logit_bias, vocab_size)


@dataclass(frozen=True)
class SamplingDefaults:
    """The values a request's unset sampling fields take: the model's generation config
    (vLLM's ``generation_config="auto"``), or none (``"vllm"``: SamplingParams' own defaults).
    ``source`` says where they came from, for the logs."""

    values: dict = field(default_factory=dict)  # SamplingParams field -> value
    source: str = "SamplingParams' own defaults"

    @classmethod
    def from_generation_config(cls, config: dict, source: str) -> "SamplingDefaults":
        """The sampling fields ``config`` (a generation_config.json's object) states; a value
        SamplingParams would refuse is left out (the logs say which), so it never fails a request."""
        values, refused = {}, []
        for key, name in GENERATION_CONFIG_FIELDS.items():
            value = config.get(key)
            if value is None:
                continue
            value = 0 if name == "top_k" and value == -1 else value
            try:
                SamplingParams(**{name: value}).validate(vocab_size=1)
            except InvalidRequest:
                refused.append(f"{key}={value!r}")
                continue
            values[name] = value
        if not values:
            source += ", which states no sampling field"
        if refused:
            source += f" (left out, out of range: {', '.join(refused)})"
        return cls(values, source)

    def params(self, **given) -> SamplingParams:
        """SamplingParams with these defaults under the fields ``given``."""
        return SamplingParams(**{**self.values, **given})

    def fill(self, params: dict, given) -> dict:
        """``params`` (SamplingParams keyword arguments) with the defaults in every field not in ``given``."""
        return {**params, **{name: value for name, value in self.values.items() if name not in given}}

    def describe(self) -> str:
        """For the logs: "sampling defaults of ...: temperature=0.2, top_p=0.9 (from ...)"."""
        stated = ", ".join(f"{name}={value}" for name, value in self.values.items())
        own = f"SamplingParams' own: {_own_defaults()}"
        return f"sampling defaults of unset request fields: {stated or own} (from {self.source})"


def _own_defaults() -> str:
    own = {f.name: f.default for f in fields(SamplingParams) if f.name in GENERATION_CONFIG_FIELDS.values()}
    return ", ".join(f"{name}={value}" for name, value in own.items())


def _logit_bias(bias, vocab_size: int) -> None:
    """OpenAI's rules: token ids of the vocabulary, biases in [-100, 100]."""
    if not isinstance(bias, dict):
        raise InvalidRequest("logit_bias", f"must be a dict of token id -> bias, got {type(bias).__name__}")
    if len(bias) > limits.MAX_LOGIT_BIAS_TOKENS:
        raise InvalidRequest("logit_bias", f"at most {limits.MAX_LOGIT_BIAS_TOKENS} tokens, got {len(bias)}")
    for token_id, value in bias.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < vocab_size:
            raise InvalidRequest("logit_bias", f"keys must be token ids (ints in [0, {vocab_size})), got {token_id!r}")
        _number(f"logit_bias[{token_id}]", value, low=-limits.MAX_LOGIT_BIAS, high=limits.MAX_LOGIT_BIAS)


def _stop_strings(stops: list) -> None:
    if len(stops) > limits.MAX_STOP_STRINGS:
        raise InvalidRequest("stop", f"at most {limits.MAX_STOP_STRINGS} stop strings, got {len(stops)}")
    for stop in stops:
        if not isinstance(stop, str) or not stop:
            raise InvalidRequest("stop", f"must be non-empty strings, got {stop!r}")
        if len(stop) > limits.MAX_STOP_STRING_CHARS:
            raise InvalidRequest(
                "stop", f"each stop string at most {limits.MAX_STOP_STRING_CHARS} characters, got {len(stop)}"
            )
    total = sum(len(stop) for stop in stops)
    if total > limits.MAX_STOP_TOTAL_CHARS:
        raise InvalidRequest(
            "stop", f"stop strings at most {limits.MAX_STOP_TOTAL_CHARS} characters in all, got {total}"
        )


def _number(name, value, low=None, high=None, low_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(name, f"must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise InvalidRequest(name, f"must be finite, got {value}")
    if low is not None and (value <= low if low_open else value < low):
        raise InvalidRequest(name, f"must be {'>' if low_open else '>='} {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequest(name, f"must be <= {high}, got {value}")


def _integer(name, value, low=None, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(name, f"must be an integer, got {type(value).__name__}")
    if low is not None and value < low:
        raise InvalidRequest(name, f"must be >= {low}, got {value}")
    if high is not None and value > high:
        raise InvalidRequest(name, f"must be <= {high}, got {value}")
