"""The CPU backend: the compiled kernels (extension.py, the only place they are loaded),
weights in huge pages (memory.py), the fast linear layer and weight packing (linear.py) and
the compiled whole-model decoder (decoder.py), behind ``prepare`` (backend.py)."""

from conveyor.kernels.cpu.backend import CpuBackend, prepare

__all__ = ["CpuBackend", "prepare"]
