"""The compiled CPU kernels, built once on first use and loaded directly afterwards.

The build goes through torch's C++ extension loader (ninja, a `lock` file while compiling).
Builders first take an flock of their own on the build folder: the kernel drops it when its
holder dies, so whoever holds it knows no live process is building, and a `lock` file left by
one killed mid-build is stale and removed (torch's loader would otherwise wait on it
forever). Once the shared library exists for this exact source, it is imported directly.
Without a compiler the torch reference path is used instead.
"""

import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path

import torch

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent.parent / "csrc"
SOURCES = [
    CSRC / "bindings.cpp",
    CSRC / "paged_attention_cpu.cpp",
    CSRC / "linear_cpu.cpp",
    CSRC / "layer_ops_cpu.cpp",
    CSRC / "decode_cpu.cpp",
    CSRC / "quant_linear_cpu.cpp",
    CSRC / "int8_dot_cpu.cpp",
    CSRC / "int8_gemm_cpu.cpp",
]
HEADERS = [CSRC / "cpu_kernels.h", CSRC / "int8_dot_kernel.inc", CSRC / "vector_math.h"]
# -fopenmp: at::parallel_for is inlined into the kernels and only runs in parallel when they
# are compiled with OpenMP; at run time they share the libgomp torch has already loaded.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


@functools.cache
def load():
    """The extension module, or None (disabled with CONVEYOR_CPU_KERNELS=0, or build failed)."""
    if os.environ.get("CONVEYOR_CPU_KERNELS", "1") == "0":
        return None
    name, build_dir = _build_location()
    built = build_dir / f"{name}.so"
    try:
        return _import(name, built) if built.exists() else _build(name, build_dir)
    except Exception as exc:  # no compiler, missing headers...: keep serving on the reference path
        log.warning("CPU kernels unavailable (%s); using the torch reference path", exc)
        return None


def for_tensors(*tensors, dtypes: tuple = (torch.float32,)):
    """The extension when every tensor is a CPU one of ``dtypes`` (float32 unless the kernel
    takes more), else None: how the per-op dispatchers (kernels/attention.py,
    kernels/layer_ops.py) pick the compiled path. (A plain loop: this runs ~15 times per
    layer per decode step.)"""
    for t in tensors:
        if not t.is_cpu or t.dtype not in dtypes:
            return None
    return load()


def _build_location() -> tuple[str, Path]:
    from torch.utils.cpp_extension import _get_build_directory

    code = b"".join(path.read_bytes() for path in [*SOURCES, *HEADERS])
    digest = hashlib.sha256(code + " ".join(CFLAGS + LDFLAGS).encode()).hexdigest()[:10]
    name = f"conveyor_cpu_kernels_{digest}"
    return name, Path(_get_build_directory(name, verbose=False))


def _build(name: str, build_dir: Path):
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "conveyor.flock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)  # waits while a live process builds; released at its death
        built = build_dir / f"{name}.so"
        if built.exists():  # built by the holder before us
            return _import(name, built)
        remove_stale_lock(build_dir)
        return _compile(name, build_dir)


def remove_stale_lock(build_dir: Path) -> bool:
    """Remove torch's `lock` file, called with the build flock held: no live builder owns it."""
    try:
        (build_dir / "lock").unlink()
    except FileNotFoundError:
        return False
    log.warning("removed a stale build lock in %s (a build was killed mid-way)", build_dir)
    return True


def _compile(name: str, build_dir: Path):
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the `ninja` wheel installs next to this interpreter
        os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    log.info("building the CPU kernels (once)")
    return load_extension(
        name=name,
        sources=[str(path) for path in SOURCES],
        extra_cflags=CFLAGS,
        extra_ldflags=LDFLAGS,
        build_directory=str(build_dir),
        verbose=False,
    )


def _import(name: str, path: Path):  # torch is imported above: the library links against it
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module
