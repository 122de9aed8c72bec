"""The compiled CPU kernels, built once on first use (torch's C++ extension loader caches the
build). When no compiler is available the torch reference path is used instead."""
import functools
import logging
import os
import shutil
import sys
from pathlib import Path

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


@functools.cache
def load():
    """The extension module, or None (disabled with CONVEYOR_CPU_KERNELS=0, or build failed)."""
    if os.environ.get("CONVEYOR_CPU_KERNELS", "1") == "0":
        return None
    if shutil.which("ninja") is None:  # the `ninja` wheel installs next to this interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    try:
        from torch.utils.cpp_extension import load as load_extension
        return load_extension(name="conveyor_cpu_kernels", sources=[str(SOURCE)],
                              extra_cflags=["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only"],
                              verbose=False)
    except Exception as exc:  # no compiler, missing headers...: keep serving on the reference path
        log.warning("CPU attention kernel unavailable (%s); using the torch reference path", exc)
        return None
