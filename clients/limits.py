"""Limits of the wire protocol: every size and range a job or payload may reach."""

SCHEMA_VERSION = 1
JOB_ID_PATTERN = r"^[A-Za-z0-9_.:-]{1,128}$"
MAX_PROMPT_CHARS = 1_000_000
MAX_PROMPT_TOKENS = 262_144
MAX_MESSAGES = 4_096
MAX_STOP_STRINGS = 64
MAX_STOP_TOKEN_IDS = 1_024
MAX_METADATA_BYTES = 64 * 1024
MAX_RESULT_TTL = 30 * 86_400
MAX_MSGPACK_BYTES = 8 * 1024 * 1024
MAX_JSON_BYTES = 4 * 1024 * 1024
# Values (containers and their elements) a payload may decode to, so small hostile
# input (e.g. millions of empty arrays) cannot balloon into gigabytes of objects.
MAX_DECODED_ELEMENTS = MAX_PROMPT_TOKENS + 65_536
INT32_MAX = 2**31 - 1
EARLIEST_DEADLINE = 1_000_000_000.0  # 2001-09-09: anything smaller is a relative time
