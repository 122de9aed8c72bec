"""The first hour, walked as a new user walks it (issue 22): `conveyor serve` in one folder,
then from another folder, with no URL and no password anywhere, `conveyor submit`,
`status`, `batch`, `gateway` and `Client()`; then serve is restarted under the running
gateway. Plus the README's snippets that use the local server, run as written.

One serve for the module (the tiny random Llama, served as `smollm2` so the README's
model name works), its data folder under a temporary $XDG_DATA_HOME: real processes, a
real embedded Valkey, the real openai SDK.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from fault_harness import CONVEYOR, REPO_ROOT, wait_until
from gateway_harness import free_port

READY_S = 240.0  # a replica imports torch and loads its model: slow on a loaded 2-core box
COMMAND_S = 180.0
ANSWER_AGAIN_S = 10.0  # the acceptance bound: the gateway answers this soon after serve is back
CLEARED = (
    "REDIS_URL",
    "REDIS_PASSWORD",
    "REDIS_PASSWORD_FILE",
    "REDIS_USERNAME",
    "REDIS_CLUSTER",
    "CONVEYOR_DATA_DIR",
    "CONVEYOR_NAMESPACE",
    "CONVEYOR_PARTITIONS",
    "CONVEYOR_GATEWAY_API_KEYS",
    "CONVEYOR_GATEWAY_KEYS_FILE",
    "CONVEYOR_GATEWAY_PORT",
)


class Walk:
    """The user's machine: a home for data (XDG), the folder serve runs in, another folder."""

    def __init__(self, root: Path, model: str) -> None:
        self.root, self.model = root, model
        self.data_home, self.serve_dir, self.user_dir = root / "xdg", root / "serve-here", root / "elsewhere"
        for folder in (self.serve_dir, self.user_dir):
            folder.mkdir()
        (self.user_dir / ".venv").symlink_to(REPO_ROOT / ".venv")  # as in a checkout: `.venv/bin/conveyor`
        self.env = {name: value for name, value in os.environ.items() if name not in CLEARED}
        self.env.update(
            XDG_DATA_HOME=str(self.data_home),
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            CONVEYOR_NUM_KV_BLOCKS="64",
            CONVEYOR_LOG_LEVEL="INFO",
        )
        self.serve: subprocess.Popen | None = None
        self.serve_log = root / "serve.log"
        self.gateway: subprocess.Popen | None = None

    @property
    def data_dir(self) -> Path:
        return self.data_home / "conveyor"

    def start_serve(self) -> None:
        """`conveyor serve --model ...` with no URL and no data dir; back once it serves."""
        start = len(self.serve_log.read_text()) if self.serve_log.exists() else 0
        with open(self.serve_log, "ab") as log:
            self.serve = subprocess.Popen(
                [str(CONVEYOR), "serve", "--model", self.model, "--served-model-name", "smollm2", "--grace-s", "1"],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                cwd=self.serve_dir,
                start_new_session=True,
            )
        wait_until(lambda: self._serving_since(start), READY_S, "conveyor serve to start serving")

    def _serving_since(self, offset: int) -> bool:
        assert self.serve.poll() is None, f"serve exited with {self.serve.returncode}:\n{self.serve_text()[-3000:]}"
        return "serving model" in self.serve_text()[offset:]

    def stop_serve(self) -> None:
        """Ctrl-C as a user would (SIGINT); its embedded Valkey stops with it."""
        if self.serve is None or self.serve.poll() is not None:
            return
        self.serve.send_signal(signal.SIGINT)
        try:
            self.serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.serve.pid, signal.SIGKILL)
            self.serve.wait(10)

    def serve_text(self) -> str:
        return self.serve_log.read_text(errors="replace")

    def conveyor(self, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
        """A `conveyor` command run from the other folder, as typed."""
        return subprocess.run(
            [str(CONVEYOR), *args],
            cwd=self.user_dir,
            env=env or self.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )

    def start_gateway(self, port: int) -> None:
        log = open(self.root / "conveyor.gateway.log", "ab")
        self.gateway = subprocess.Popen(
            [str(CONVEYOR), "gateway", "--port", str(port), "--log-level", "warning"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=self.user_dir,
            start_new_session=True,
        )
        log.close()

    def stop_gateway(self) -> None:
        if self.gateway is not None and self.gateway.poll() is None:
            self.gateway.terminate()
            try:
                self.gateway.wait(20)
            except subprocess.TimeoutExpired:
                self.gateway.kill()
                self.gateway.wait(10)


@pytest.fixture(scope="module")
def walk(tiny_model, tmp_path_factory):
    made = Walk(tmp_path_factory.mktemp("first_hour"), tiny_model)
    try:
        made.start_serve()
        yield made
    finally:
        made.stop_gateway()
        made.stop_serve()


@pytest.fixture
def local_env(walk, monkeypatch):
    """This test process as the user's shell: no Redis settings, the same data home."""
    for name in CLEARED:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_DATA_HOME", str(walk.data_home))


def test_serve_keeps_its_data_in_the_user_folder_and_prints_what_to_run_next(walk):
    assert (walk.data_dir / "url").read_text().startswith("redis://127.0.0.1:")
    assert (walk.data_dir / "password").stat().st_mode & 0o077 == 0
    assert list(walk.serve_dir.iterdir()) == [], "serve wrote into the folder it was started in"
    text = walk.serve_text()
    for line in (
        'submit "Tell me a joke" --stream',
        " status",
        "gateway --port 8000",
        "from conveyor.clients import Client",
    ):
        assert line in text, f"serve's start message lacks {line!r}:\n{text[:3000]}"


def test_submit_from_another_folder_sends_chat_where_the_model_has_a_template(walk):
    chat = walk.conveyor("submit", "Tell me a joke", "--max-tokens", "4", "--json")
    assert chat.returncode == 0, chat.stderr
    assert "the local server" in chat.stderr  # it says which server it chose
    raw = walk.conveyor("submit", "Tell me a joke", "--max-tokens", "4", "--json", "--raw")
    assert raw.returncode == 0, raw.stderr
    chat_prompt = json.loads(chat.stdout)["usage"]["prompt_tokens"]
    raw_prompt = json.loads(raw.stdout)["usage"]["prompt_tokens"]
    assert chat_prompt > raw_prompt  # the template's role markers around the same text


def test_status_and_batch_from_another_folder(walk):
    status = walk.conveyor("status")
    assert status.returncode == 0, status.stderr
    assert "model smollm2 (published" in status.stdout, status.stdout
    requests = [
        {
            "custom_id": f"q{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "smollm2", "messages": [{"role": "user", "content": f"Hi {i}"}], "max_tokens": 3},
        }
        for i in range(2)
    ]
    (walk.user_dir / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in requests))
    batch = walk.conveyor("batch", "in.jsonl", "out.jsonl", "--quiet")
    assert batch.returncode == 0, batch.stderr
    lines = [json.loads(line) for line in (walk.user_dir / "out.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["q0", "q1"]
    assert all(line["response"]["status_code"] == 200 for line in lines), lines


def test_client_and_async_client_with_no_arguments(walk, local_env):
    import asyncio

    from conveyor.clients import AsyncClient, Client

    with Client() as client:
        assert client.submit(prompt="Hello", max_tokens=2).result(timeout=COMMAND_S).finish_reason in ("length", "stop")

    async def submit_async() -> str:
        async with AsyncClient() as client:
            job = await client.submit(prompt="Hello", max_tokens=2)
            return (await job.result(timeout=COMMAND_S)).finish_reason

    assert asyncio.run(submit_async()) in ("length", "stop")


def test_with_nothing_to_find_or_a_wrong_password_the_error_names_the_ways_out(walk, tmp_path):
    nowhere = walk.conveyor("status", env={**walk.env, "XDG_DATA_HOME": str(tmp_path / "empty")})
    assert nowhere.returncode == 1 and "Traceback" not in nowhere.stderr
    for words in ("--redis-url", "--data-dir", "password", "conveyor serve"):
        assert words in nowhere.stderr, nowhere.stderr
    stale = tmp_path / "stale"
    stale.mkdir()
    shutil.copy(walk.data_dir / "url", stale / "url")
    (stale / "password").write_text("not-the-password\n")
    refused = walk.conveyor("status", "--data-dir", str(stale))
    assert refused.returncode == 1 and "Traceback" not in refused.stderr
    for words in ("refused the credentials", str(stale / "password"), "--data-dir", "--redis-url"):
        assert words in refused.stderr, refused.stderr
    assert "not-the-password" not in refused.stderr


# ---------------------------------------------------------------- the README, as written


def readme_blocks(language: str) -> list[str]:
    text = (REPO_ROOT / "README.md").read_text()
    return re.findall(rf"```{language}\n(.*?)```", text, re.S)


LOCAL_COMMAND = re.compile(r"^\.venv/bin/conveyor (submit|status|batch|dead)\b", re.M)


def local_shell_blocks() -> list[str]:
    """Shell blocks that run local commands (no --redis-url), less their `serve` lines (serve runs)."""
    blocks = []
    for block in readme_blocks("bash"):
        if LOCAL_COMMAND.search(block) and "--redis-url" not in block:
            blocks.append("\n".join(line for line in block.splitlines() if " serve " not in f"{line} "))
    return blocks


def local_python_blocks() -> list[str]:
    return [block for block in readme_blocks("python") if re.search(r"\b(Async)?Client\(\)", block)]


def test_the_readme_shell_and_python_snippets_that_use_the_local_server_run_as_written(walk):
    shell, python = local_shell_blocks(), local_python_blocks()
    assert shell and python, "the README shows no local-server snippet"
    for block in shell:
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block],
            cwd=walk.user_dir,
            env=walk.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )
        assert run.returncode == 0, f"README block failed:\n{block}\n--- stderr:\n{run.stderr[-3000:]}"
    for block in python:
        run = subprocess.run(
            [sys.executable, "-c", block],
            cwd=walk.user_dir,
            env=walk.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )
        assert run.returncode == 0, f"README block failed:\n{block}\n--- stderr:\n{run.stderr[-3000:]}"


GATEWAY_LINE = re.compile(r"^\.venv/bin/conveyor gateway [^&#\n]*", re.M)
README_PORT = "8000"


def test_the_readme_gateway_snippets_run_as_written_on_a_free_port(walk):
    """The README's gateway line (port 8000, which a shared machine may have taken: a free
    one instead), then its curl and openai SDK snippets against it."""
    blocks = [b for b in readme_blocks("bash") if (line := GATEWAY_LINE.search(b)) and "--redis-url" not in line[0]]
    python = [b for b in readme_blocks("python") if f'base_url="http://127.0.0.1:{README_PORT}/v1"' in b]
    assert len(blocks) == 1 and python, "the README shows the gateway on the local server"
    port = str(free_port())
    line = GATEWAY_LINE.search(blocks[0]).group(0)
    assert f"--port {README_PORT}" in line
    argv = shlex.split(line.replace(f"--port {README_PORT}", f"--port {port}"))
    gateway = subprocess.Popen(
        argv,
        cwd=walk.user_dir,
        env=walk.env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        wait_until(lambda: healthy(port), READY_S, "the README's gateway to listen", interval=0.2)
        rest = "\n".join(text for text in blocks[0].splitlines() if not GATEWAY_LINE.match(text))
        curl = rest.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")
        run = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", curl],
            cwd=walk.user_dir,
            env=walk.env,
            capture_output=True,
            text=True,
            timeout=COMMAND_S,
        )
        assert run.returncode == 0 and json.loads(run.stdout)["choices"], f"{curl}\n{run.stdout}{run.stderr}"
        for block in python:
            code = block.replace(f"127.0.0.1:{README_PORT}", f"127.0.0.1:{port}")
            run = subprocess.run(
                [sys.executable, "-c", code],
                cwd=walk.user_dir,
                env=walk.env,
                capture_output=True,
                text=True,
                timeout=COMMAND_S,
            )
            assert run.returncode == 0, f"README block failed:\n{block}\n--- stderr:\n{run.stderr[-3000:]}"
    finally:
        gateway.terminate()
        gateway.wait(30)


def healthy(port: str) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


# ---------------------------------------------------------------- serve restarted (last: it restarts)


def openai_client(port: int):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=30)


def chat_once(client) -> bool:
    try:
        client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        return True
    except Exception:  # openai.APIError (503 while the replica is away), connection errors
        return False


def test_the_gateway_answers_again_soon_after_serve_restarts_and_old_results_stay(walk, local_env):
    from conveyor.clients import Client

    port = free_port()
    walk.start_gateway(port)
    client = openai_client(port)
    wait_until(lambda: chat_once(client), READY_S, "the gateway's first answer", interval=0.2)
    with Client() as producer:
        before = producer.submit(prompt="Remember me", max_tokens=3).result(timeout=COMMAND_S)
    url = (walk.data_dir / "url").read_text()

    first_serve = walk.serve.pid
    walk.stop_serve()
    walk.start_serve()
    assert walk.serve.pid != first_serve
    back = time.monotonic()
    wait_until(lambda: chat_once(client), ANSWER_AGAIN_S, "the gateway to answer again", interval=0.2)
    print(f"gateway answered again {time.monotonic() - back:.2f} s after serve was back")
    assert walk.gateway.poll() is None, "the gateway restarted or exited"
    assert (walk.data_dir / "url").read_text() == url, "the embedded server moved to another port"
    with Client() as producer:
        after = producer.job(before.job_id).result(timeout=10)
    assert after.token_ids == before.token_ids and after.job_id == before.job_id
