"""The prompt forms ``LLM.generate`` takes, as vLLM's: a string, a list of token ids,
``{"prompt": str}`` (TextPrompt), ``{"prompt_token_ids": [...]}`` (TokensPrompt, which may
also carry the ``prompt`` text), or a list of any of these."""

from conveyor.engine.errors import InvalidRequest

PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")
MAX_CACHE_SALT_CHARS = 256


def prompt_list(prompts) -> list:
    """One prompt or a list of them -> a list of prompts."""
    if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
        return [prompts]
    return list(prompts)


def engine_prompt(prompt) -> tuple[object, str | None]:
    """(text or token ids for the engine, the text RequestOutput.prompt reports).
    InvalidRequest (that prompt alone fails) for a dict the engine cannot serve."""
    if not isinstance(prompt, dict):
        return prompt, prompt if isinstance(prompt, str) else None
    unsupported = sorted(str(key) for key in prompt if key not in PROMPT_KEYS)
    if unsupported:
        raise InvalidRequest(
            f"prompt[{unsupported[0]!r}]", f"is not supported here (a prompt dict holds {' and/or '.join(PROMPT_KEYS)})"
        )
    text = prompt.get("prompt")
    cache_salt_of(prompt)  # refused here, with the prompt, when it is not a salt
    if "prompt_token_ids" in prompt:
        return prompt["prompt_token_ids"], text if isinstance(text, str) else None
    if "prompt" in prompt:
        return text, text if isinstance(text, str) else None
    raise InvalidRequest("prompt", "a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def cache_salt_of(prompt) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): prefix-cache blocks are shared only between
    prompts of the same salt. InvalidRequest naming the field for anything but a short string."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and not (isinstance(salt, str) and 0 < len(salt) <= MAX_CACHE_SALT_CHARS):
        raise InvalidRequest("cache_salt", f"a string of 1..{MAX_CACHE_SALT_CHARS} characters")
    return salt
