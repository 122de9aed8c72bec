"""Ranges the sampler computes in (float32: logits / temperature and the penalties must stay
finite) and the stop-string budget of the incremental matcher. The wire protocol states the
same numbers in clients/limits.py for producers (clients may not import the engine); a test
(tests/test_hostile_producers.py) keeps the two equal."""

SEED_MIN, SEED_MAX = 0, 2**63 - 1
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0  # presence_penalty, frequency_penalty
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 4096  # all stop strings of a request together
MAX_N = 16  # samples per request (SamplingParams.n)
MAX_LOGIT_BIAS = 100.0  # |bias| (OpenAI's range)
MAX_LOGIT_BIAS_TOKENS = 1024
# structured outputs: a schema / regex / grammar text, or all choices together, in UTF-8 bytes
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
SHARED_WITH_THE_WIRE = (
    "SEED_MIN",
    "SEED_MAX",
    "MAX_TEMPERATURE",
    "MIN_REPETITION_PENALTY",
    "MAX_REPETITION_PENALTY",
    "MIN_PENALTY",
    "MAX_PENALTY",
    "MAX_LOGPROBS",
    "MAX_STOP_STRINGS",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOTAL_CHARS",
    "MAX_N",
    "MAX_STRUCTURED_BYTES",
    "MAX_CHOICES",
    "MAX_CHOICE_CHARS",
)
