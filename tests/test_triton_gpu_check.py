"""benchmarks/gpu_check.py --cpu-dry-run: the device check's own code (kernel checks,
exactness against transformers, the speed rounds) on tiny shapes under Triton's
interpreter, so the script cannot rot before a GPU runs it."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_dry_run_passes_on_cpu(tmp_path):
    env = dict(
        os.environ,
        TRITON_INTERPRET="1",
    )
    plot = tmp_path / "gpu_check.png"
    result = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--cpu-dry-run", "--plot", str(plot)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "device: CPU (Triton interpreter)" in out
    for arch in ("llama", "qwen2", "qwen3"):
        assert f"exactness {arch:<6} triton eager   1/1 token-identical" in out
    assert "kernel decode splits=4" in out and "kernel sampling ids" in out
    assert "speed mixed graphs vs transformers" in out
    assert out.rstrip().endswith("all checks passed")
    assert plot.stat().st_size > 10_000  # the speed ratios' PNG
