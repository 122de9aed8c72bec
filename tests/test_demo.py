"""The README's first quick-start command, `conveyor demo`: an embedded Valkey, a replica and
a producer in one process, three prompts streamed to the terminal. Run here on the tiny model
(the quick start's own model, SmolLM2, is what scripts/demo.sh serves)."""

import os
import subprocess
import sys
from pathlib import Path

CONVEYOR = Path(sys.executable).with_name("conveyor")


def test_the_demo_streams_its_prompts_and_exits_0(tiny_model, tmp_path):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path), "OMP_NUM_THREADS": "1", "CONVEYOR_NUM_KV_BLOCKS": "64"}
    env.pop("REDIS_URL", None)
    done = subprocess.run(
        [str(CONVEYOR), "demo", "--model", tiny_model], env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    answers = [line for line in done.stdout.splitlines() if "tokens, TTFT" in line]
    assert len(answers) == done.stdout.count("> ") >= 2, done.stdout[-2000:]
