"""vLLM's ``LLM(...)`` options, as a user switching imports passes them: the ones that map
onto Conveyor's EngineConfig are translated, the ones that cannot change anything here are
accepted (each with the reason it is a no-op), and the rest are refused with a message
that names the option and why. Names with the same meaning in both (dtype, seed,
max_model_len, max_num_seqs, max_num_batched_tokens, block_size, enable_prefix_caching,
quantization, tensor_parallel_size, enforce_eager) pass through, with vLLM's spellings of their values normalised."""

import logging

log = logging.getLogger(__name__)

NO_OPS = {
    "swap_space": "preempted sequences are recomputed, never swapped to CPU memory (as in vLLM V1)",
    "disable_log_stats": "the offline engine keeps no periodic stats log",
}
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def translate(options: dict) -> dict:
    """EngineConfig keyword arguments for vLLM-style ``options``; ValueError for a refused one."""
    options = dict(options)
    for name, reason in NO_OPS.items():
        if name in options:
            log.info("%s=%r accepted with no effect: %s", name, options.pop(name), reason)
    _refuse_unsupported(options)
    if "kv_cache_memory_bytes" in options:
        options["kv_cache_memory"] = options.pop("kv_cache_memory_bytes")
    if options.get("dtype") in DTYPE_ALIASES:
        options["dtype"] = DTYPE_ALIASES[options["dtype"]]
    for name, ours in (("quantization", "auto"), ("seed", 0)):  # vLLM's None defaults
        if name in options and options[name] is None:
            options[name] = ours
    return options


def _refuse_unsupported(options: dict) -> None:
    if options.get("trust_remote_code"):
        raise ValueError(
            "trust_remote_code=True: Conveyor never runs code shipped with a model; it builds "
            "the architectures it supports itself (pass False or leave it out)"
        )
    options.pop("trust_remote_code", None)


def kv_budget_from_utilization(utilization: float, total_bytes: int, free_bytes: int) -> int:
    """vLLM's gpu_memory_utilization: this fraction of the device's memory may be in use in
    all (weights, activations, other processes); the KV cache gets what of it is left now."""
    budget = int(utilization * total_bytes) - (total_bytes - free_bytes)
    if budget <= 0:
        used = (total_bytes - free_bytes) / total_bytes
        raise ValueError(
            f"gpu_memory_utilization={utilization}: {used:.0%} of the device is already in use "
            f"(weights and other processes), which leaves no room for the KV cache"
        )
    return budget
