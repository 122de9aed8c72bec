"""``speculative_config``, as vLLM names it: ``{"method": "ngram", "num_speculative_tokens": k,
"prompt_lookup_max": n, "prompt_lookup_min": m}``.

vLLM's defaults and checks: ``method`` and ``num_speculative_tokens`` (>= 1) are required;
with neither lookup bound set both are 5, with one set the other takes its value, and
``prompt_lookup_min`` must not exceed ``prompt_lookup_max``. ``disable_by_batch_size``
(vLLM's, from its first engine): no drafts in a step of more sequences than this, where
verifying them costs more than it saves (a saturated CPU batch is compute-bound). Unknown
keys are refused by name (vLLM's other methods need a draft model, which this engine does
not load).
"""

import json
from dataclasses import dataclass, fields

METHODS = ("ngram",)
DEFAULT_PROMPT_LOOKUP = 5  # vLLM's, "arbitrarily chosen" there too
MAX_SPECULATIVE_TOKENS = 128  # vLLM's MAX_SPEC_LEN
MAX_PROMPT_LOOKUP = 1024
MAX_BATCH_SIZE = 1 << 20


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """None, a dict, a JSON object (the ``--speculative-config`` flag and its env var) or a
        SpeculativeConfig; raises ValueError naming the key and the limit."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = _json_object(value)
            if value is None:
                return None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config: must be a dict or a JSON object, got {type(value).__name__}")
        return cls(**_checked(dict(value)))


def _json_object(text: str):
    if not text.strip() or text.strip().lower() in ("none", "null"):
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"speculative_config: not valid JSON ({exc.msg} at character {exc.pos})") from None


def _checked(options: dict) -> dict:
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
    if options.get("method") not in METHODS:
        raise ValueError(f"speculative_config.method: must be one of {list(METHODS)}, got {options.get('method')!r}")
    if "num_speculative_tokens" not in options:
        raise ValueError("speculative_config.num_speculative_tokens: required (the drafts verified per step)")
    _positive(options, "num_speculative_tokens", MAX_SPECULATIVE_TOKENS)
    low, high = options.get("prompt_lookup_min"), options.get("prompt_lookup_max")
    if low is None and high is None:
        low = high = DEFAULT_PROMPT_LOOKUP
    options["prompt_lookup_min"] = high if low is None else low
    options["prompt_lookup_max"] = low if high is None else high
    _positive(options, "prompt_lookup_min", MAX_PROMPT_LOOKUP)
    _positive(options, "prompt_lookup_max", MAX_PROMPT_LOOKUP)
    if options.get("disable_by_batch_size") is not None:
        _positive(options, "disable_by_batch_size", MAX_BATCH_SIZE)
    if options["prompt_lookup_min"] > options["prompt_lookup_max"]:
        raise ValueError(
            f"speculative_config.prompt_lookup_min: must be <= prompt_lookup_max "
            f"({options['prompt_lookup_max']}), got {options['prompt_lookup_min']}"
        )
    return options


def _positive(options: dict, name: str, high: int) -> None:
    value = options[name]
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
        raise ValueError(f"speculative_config.{name}: must be an integer in [1, {high}], got {value!r}")
