"""Limits of the wire protocol: every size and range a job or payload may reach.

The protocol (clients/protocol.py) validates jobs with them. The sampling ranges and stop
budgets equal the engine's own (engine/sampling_limits.py, which the engine's
SamplingParams reads; clients may not import the engine, nor the engine clients), and a
test keeps them equal, so a job the protocol accepts is one the engine runs."""

SCHEMA_VERSION = 1
JOB_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 262_144
MAX_MESSAGES = 4_096
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 4096  # all stop strings of a job together
MAX_STOP_TOKEN_IDS = 1_024
MAX_METADATA_BYTES = 64 * 1024
MAX_CACHE_SALT_CHARS = 256
# W3C Trace Context (https://www.w3.org/TR/trace-context/): version 00, a non-zero trace and
# parent id; tracestate is at most 32 list members, 512 characters as the spec asks vendors to keep
TRACEPARENT_PATTERN = r"^00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$"  # ids not all zero (checked beside)
MAX_TRACESTATE_CHARS = 512
TRACESTATE_PATTERN = r"^[\x20-\x2b\x2d-\x3c\x3e-\x7e]*=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*(,[\x20-\x2b\x2d-\x3c\x3e-\x7e]*=[\x20-\x2b\x2d-\x3c\x3e-\x7e]*){0,31}$"
MAX_RESULT_TTL = 30 * 86_400
MAX_MSGPACK_BYTES = 8 * 1024 * 1024
MAX_JSON_BYTES = 4 * 1024 * 1024
# Values (containers and their elements) a payload may decode to, so small hostile
# input (e.g. millions of empty arrays) cannot balloon into gigabytes of objects.
MAX_DECODED_ELEMENTS = MAX_PROMPT_TOKENS + 65_536
INT32_MAX = 2**31 - 1
EARLIEST_DEADLINE = 1_000_000_000.0  # 2001-09-09: anything smaller is a relative time

# Sampling ranges (inclusive). The sampler computes in float32: logits / temperature and the
# penalties must stay finite there (temperature 1e308 overflowed to inf and made NaN logits).
SEED_MIN, SEED_MAX = 0, 2**63 - 1
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MIN_PENALTY, MAX_PENALTY = -2.0, 2.0  # presence_penalty, frequency_penalty
MAX_LOGPROBS = 20
MAX_N = 16  # outputs (samples) of one job
# structured_outputs: a schema / regex / grammar text, or all choices together, in UTF-8 bytes
MAX_STRUCTURED_BYTES = 64 * 1024
MAX_CHOICES = 1024
MAX_CHOICE_CHARS = 1024
