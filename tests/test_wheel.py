"""The wheel as a user installs it (issue 38): built from the checkout, installed into fresh
virtual environments, run from a folder outside the checkout.

- The wheel holds one top-level package, `conveyor`, with the CPU kernels' C++ sources and
  the dashboard's static files.
- The base install (the light client) has no torch: `conveyor submit --help` works, a program
  whose extra is missing says which extra in one line, and its client submits a real job.
- The full install serves that job with its compiled CPU kernels loaded from where it is
  installed, and answers with the checkout's tokens. Its dependencies are the test venv's
  (a `.pth` line), so the test installs no second torch; Conveyor itself comes from the wheel
  alone (asserted: every `conveyor` module it loads lives in its own site-packages).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from fault_harness import REPO_ROOT

BUILD_S = 300.0
READY_S = 300.0  # a replica imports torch and loads SmolLM2: slow on a loaded 2-core box
PROMPT = "What is the capital of France?"
MAX_TOKENS = 8
# a user's environment: no settings of the suite's, no checkout on the path
CLEARED = ("PYTHONPATH", "REDIS_URL", "REDIS_PASSWORD", "CONVEYOR_NAMESPACE", "CONVEYOR_DATA_DIR")


def user_env(**extra: str) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if name not in CLEARED}
    return {**env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", **extra}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # no build isolation: setuptools comes from the test venv (nothing fetched for the build)
    command = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-w",
        str(out),
        str(REPO_ROOT),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=BUILD_S, cwd=out)
    (path,) = out.glob("conveyor-*.whl")
    return path


def make_venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    return path / "bin" / "python"


def pip_into(python: Path, *args: str) -> None:
    """This venv's pip, installing into another interpreter's environment (pip --python)."""
    command = [
        sys.executable,
        "-m",
        "pip",
        "--python",
        str(python),
        "install",
        "--quiet",
        "--disable-pip-version-check",
    ]
    done = subprocess.run([*command, *args], capture_output=True, text=True, timeout=BUILD_S)
    assert done.returncode == 0, done.stderr[-3000:]


def site_packages(python: Path) -> Path:
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip())


@pytest.fixture(scope="module")
def base_venv(wheel, tmp_path_factory) -> Path:
    """The base install: the wheel and its own dependencies (redis, msgpack, pydantic, tqdm)."""
    python = make_venv(tmp_path_factory.mktemp("base") / "venv")
    pip_into(python, str(wheel))
    return python


@pytest.fixture(scope="module")
def full_venv(wheel, tmp_path_factory) -> Path:
    """The full install: the wheel over the test venv's dependencies (torch, transformers, ...)."""
    python = make_venv(tmp_path_factory.mktemp("full") / "venv")
    (site_packages(python) / "test-venv-dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip_into(python, "--no-deps", str(wheel))
    return python


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("elsewhere")  # no checkout here: `import conveyor` finds the install


def run(python: Path, *args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(python), *args], cwd=cwd, env=user_env(), capture_output=True, text=True, timeout=timeout
    )


def test_the_wheel_holds_conveyor_alone_with_its_kernel_sources_and_static_files(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        (top_level,) = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["conveyor"]
        metadata = archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")} == {"conveyor"}
    for source in sorted((REPO_ROOT / "kernels" / "csrc").iterdir()):
        assert f"conveyor/kernels/csrc/{source.name}" in names, f"{source.name} is not in the wheel"
    for static in sorted((REPO_ROOT / "gateway" / "static").iterdir()):
        assert f"conveyor/gateway/static/{static.name}" in names
    for folder in ("engine", "actors", "apps/documents", "apps/openai_api", "clients", "kernels/cpu", "kernels/triton"):
        assert f"conveyor/{folder}/__init__.py" in names, folder
    requires = [line for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    base = [line for line in requires if "extra ==" not in line]
    assert sorted(line.split()[1].split(">")[0].split("<")[0] for line in base) == [
        "msgpack",
        "pydantic",
        "redis",
        "tqdm",
    ]
    for extra in ("serve", "gateway", "documents", "tokens", "all"):
        assert f"Provides-Extra: {extra}" in metadata


def test_the_base_install_is_the_light_client_without_torch(base_venv, outside):
    code = (
        "import importlib.util, sys, conveyor, conveyor.clients; from conveyor.clients import Client, AsyncClient; "
        "print(conveyor.__file__); print(importlib.util.find_spec('torch') is None, 'torch' in sys.modules)"
    )
    done = run(base_venv, "-c", code, cwd=outside)
    assert done.returncode == 0, done.stderr
    where, no_torch = done.stdout.splitlines()
    assert Path(where).is_relative_to(site_packages(base_venv)), where
    assert no_torch == "True False"
    conveyor = base_venv.parent / "conveyor"
    for command, flag in (("submit", "--max-tokens"), ("usage", "--start")):  # the light client's commands
        helped = subprocess.run(
            [str(conveyor), command, "--help"], cwd=outside, env=user_env(), capture_output=True, text=True
        )
        assert helped.returncode == 0 and flag in helped.stdout, helped.stderr


@pytest.mark.parametrize(
    ("command", "extra"), [("serve", "serve"), ("demo", "serve"), ("gateway", "gateway"), ("summarize", "documents")]
)
def test_a_program_whose_extra_is_missing_says_which_extra_in_one_line(base_venv, outside, command, extra):
    conveyor = base_venv.parent / "conveyor"
    done = subprocess.run(
        [str(conveyor), command, "--help"], cwd=outside, env=user_env(), capture_output=True, text=True
    )
    assert done.returncode == 2 and done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert f"pip install 'conveyor[{extra}]'" in line and f"conveyor {command}" in line, line


def test_the_full_install_loads_its_kernels_from_site_packages_beside_hugging_faces_kernels(full_venv, outside):
    code = (
        "import importlib.util, json, sys, conveyor, transformers; "
        "from conveyor.kernels.cpu import extension; "
        "hub = importlib.util.find_spec('kernels'); "
        "print(json.dumps({'csrc': str(extension.CSRC), 'loaded': extension.load() is not None, "
        "'hub_kernels': hub.origin if hub else None, 'transformers': transformers.__version__, "
        "'ours': sorted({m.__file__.split('/conveyor/')[0] for n, m in sys.modules.items() "
        "if n.split('.')[0] == 'conveyor' and getattr(m, '__file__', None)})}))"
    )
    done = run(full_venv, "-c", code, cwd=outside, timeout=600)  # may compile the kernels (minutes)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = json.loads(done.stdout.splitlines()[-1])
    own = site_packages(full_venv)
    assert Path(facts["csrc"]).is_relative_to(own), facts
    assert facts["loaded"], "the compiled CPU kernels did not load from the installed sources"
    assert facts["ours"] == [str(own)], "every conveyor module comes from the install"
    # Hugging Face's `kernels` (transformers >= 5.25 imports it) is never shadowed by ours
    assert facts["hub_kernels"] is None or not Path(facts["hub_kernels"]).is_relative_to(own / "conveyor"), facts


@pytest.mark.slow
def test_the_full_install_serves_what_the_base_client_submits_with_the_checkouts_tokens(
    base_venv, full_venv, outside, redis_url, namespace
):
    serve = subprocess.Popen(
        [str(full_venv.parent / "conveyor"), "serve", "--model", "smollm2", "--dtype", "float32"]
        + ["--redis-url", redis_url, "--namespace", namespace, "--max-num-seqs", "4"],
        cwd=outside,
        env=user_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        submit = [str(base_venv.parent / "conveyor"), "submit", PROMPT, "--redis-url", redis_url]
        submit += ["--chat", "--namespace", namespace, "--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--json"]
        done = subprocess.run(submit, cwd=outside, env=user_env(), capture_output=True, text=True, timeout=READY_S)
        assert done.returncode == 0, (done.stderr, serve.poll())
        served = json.loads(done.stdout.splitlines()[-1])
    finally:
        serve.terminate()
        output = serve.communicate(timeout=120)[0]
    assert serve.returncode == 0, output[-3000:]
    assert "CPU kernels unavailable" not in output, output[-3000:]
    from conveyor import LLM, SamplingParams

    llm = LLM("smollm2", dtype="float32", max_num_seqs=1)
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    (expected,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    assert served["token_ids"] == expected.outputs[0].token_ids, (served, expected.outputs[0].text)
