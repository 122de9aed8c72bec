"""Triton kernels for CUDA: paged attention (decode with split-K, varlen prefill over a
cached prefix), the KV-cache write, RMSNorm with the residual add, rotary, SiLU-and-mul and
sampling. The same ``@triton.jit`` code runs on CPU tensors under Triton's interpreter
(``TRITON_INTERPRET=1``, set before triton is imported), which is how the CPU-only test
machines verify it against the torch reference; a GPU compiles it.

Every kernel loads its inputs, computes in float32 and stores in the output's dtype (the
interpreter has no bfloat16 arithmetic, and float32 accumulation is what a GPU wants too).
"""

import importlib.util
import os


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


if interpreted():
    from conveyor.kernels.triton.interpreter import patch_once_per_launch

    patch_once_per_launch()


def unusable_reason(device_type: str) -> str | None:
    """Why Triton kernels cannot run on ``device_type`` here (None: they can)."""
    if importlib.util.find_spec("triton") is None:
        return "the triton package is not installed (pip install 'triton>=3.9')"
    if device_type == "cpu" and not interpreted():
        return (
            "on CPU it runs only under Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before the engine starts (slow; meant for tests)"
        )
    if device_type not in ("cpu", "cuda"):
        return f"no Triton kernels for device {device_type!r}"
    return None
