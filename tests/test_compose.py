"""The compose deployment, checked without a Docker engine: parse the files and run the
services' own commands (the redis start script, both healthchecks, the engine command)
locally, with stand-ins for what only exists inside the containers."""

import http.server
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from conveyor.clients import Client

COMPOSE = Path(__file__).resolve().parents[1] / "compose"
REPO_ROOT = COMPOSE.parent
SECRET_PATH = "/run/secrets/redis_password"
# where the image's entrypoint copies the secrets, owned by the conveyor user (compose/entrypoint.sh)
OWN_SECRET_PATH = "/run/conveyor/secrets/redis_password"
CONVEYOR_UID = 10001
LOOPBACK = ("127.0.0.1", "[::1]", "::1", "localhost")
ROOT_USERS = ("root", "0")


@pytest.fixture(scope="module")
def compose():
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def container_text(value: str) -> str:
    """What a compose string is inside the container: `$$` is a literal `$`. A lone `$`
    would be interpolated from the host's environment, which no command or healthcheck relies
    on (only the tracing endpoint does: test_only_the_tracing_endpoint_comes_from_the_host)."""
    held = value.replace("$$", "\0")
    assert "$" not in held, f"unescaped $ (host interpolation) in {value!r}"
    return held.replace("\0", "$")


def shell_script(command) -> str:
    """The script of a ``["sh", "-c", SCRIPT]`` command."""
    assert isinstance(command, list) and command[:2] == ["sh", "-c"], command
    return container_text(command[2])


def healthcheck_command(test) -> list[str]:
    """A compose healthcheck `test` as an argv that runs here."""
    if isinstance(test, str):
        return ["sh", "-c", container_text(test)]
    kind, *rest = test
    if kind == "CMD-SHELL":
        return ["sh", "-c", container_text(rest[0])]
    assert kind == "CMD", test
    return [container_text(arg) for arg in rest]


def seconds(duration: str) -> float:
    units = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|us|h|m|s)", str(duration))
    assert parts and "".join(n + u for n, u in parts) == str(duration), duration
    return sum(float(n) * units[u] for n, u in parts)


def published_host_ips(service: dict) -> list[str]:
    """The host address of every port a service publishes ('' means all interfaces)."""
    addresses = []
    for port in service.get("ports", []) or []:
        if isinstance(port, dict):  # long syntax
            addresses.append(str(port.get("host_ip", "")))
            continue
        spec = str(port).split("/")[0]
        if spec.startswith("["):  # "[::1]:6379:6379"
            addresses.append(spec[: spec.index("]") + 1])
        else:
            fields = spec.split(":")
            addresses.append(fields[0] if len(fields) == 3 else "")
    return addresses


def flag_value(command: list[str], flag: str) -> str | None:
    for i, arg in enumerate(command):
        if arg == flag:
            return command[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def fake_bin(directory: Path, name: str, script: str) -> None:
    path = directory / name
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(0o755)


def dockerfile_user() -> str | None:
    """The user of the image's last stage: its last USER instruction."""
    user = None
    for line in (COMPOSE / "Dockerfile").read_text().splitlines():
        words = line.split()
        if words and words[0].upper() == "FROM":
            user = None  # a new stage starts as root again
        elif words and words[0].upper() == "USER":
            user = words[1]
    return user


# --- Redis ---------------------------------------------------------------------------------


def test_redis_service_persists_and_reports_health(compose):
    redis_service = compose["services"]["redis"]
    script = shell_script(redis_service["command"])
    assert re.search(r"redis-server .*--appendonly yes", script)
    assert "redis-cli ping" in " ".join(healthcheck_command(redis_service["healthcheck"]["test"]))


def test_no_service_publishes_a_port_beyond_loopback(compose):
    for name, service in compose["services"].items():
        for address in published_host_ips(service):
            assert address in LOOPBACK, f"{name} publishes a port on {address or 'all interfaces'}"
    assert not compose["services"]["redis"].get("ports"), "redis is not published by default"
    text = (COMPOSE / "docker-compose.yml").read_text()
    assert re.search(r'^\s*#\s*ports: \["127\.0\.0\.1:6379:6379"\]', text, re.M), (
        "the commented way to open redis on loopback only"
    )


def test_redis_requires_a_password_read_from_a_secret(compose):
    redis_service = compose["services"]["redis"]
    script = shell_script(redis_service["command"])
    value = re.search(r"--requirepass\s+(\S+)", script)
    assert value, "redis-server is started with --requirepass"
    assert value.group(1).lstrip('"').startswith("$"), (
        f"the password is a shell value read at start, not a literal: {value.group(1)}"
    )
    assert SECRET_PATH in script
    assert "redis_password" in redis_service["secrets"]
    secret = compose["secrets"]["redis_password"]
    assert secret.get("file") or secret.get("environment")
    text = (COMPOSE / "docker-compose.yml").read_text()
    for literal in re.findall(r"requirepass[\s=]+(\S+)", text):
        assert literal.lstrip("\"'").startswith("$"), f"a literal password in the YAML: {literal}"
    if secret.get("file"):
        assert (COMPOSE / (Path(secret["file"]).name + ".example")).is_file(), (
            "an example next to the secret file, saying how to make one"
        )


@pytest.fixture
def secret_file(tmp_path):
    path = tmp_path / "redis_password"
    path.write_text(secrets.token_hex(32) + "\n")  # as `openssl rand -hex 32 >` writes it
    return path


def run_redis_start_script(compose, tmp_path, secret_file):
    """The redis service's start script, with docker-entrypoint.sh replaced by one that
    records its arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    record = tmp_path / "entrypoint-args"
    fake_bin(bin_dir, "docker-entrypoint.sh", f'printf "%s\\n" "$@" > {record}\n')
    script = shell_script(compose["services"]["redis"]["command"]).replace(SECRET_PATH, str(secret_file))
    done = subprocess.run(
        ["sh", "-c", script],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=30,
    )
    return done, (record.read_text().splitlines() if record.exists() else None)


def test_redis_start_script_passes_the_secret_and_refuses_an_empty_one(compose, tmp_path, secret_file):
    done, args = run_redis_start_script(compose, tmp_path, secret_file)
    assert done.returncode == 0, done.stderr
    assert args[0] == "redis-server", "through the image's entrypoint: it drops root for `redis`"
    assert args[args.index("--requirepass") + 1] == secret_file.read_text().strip()
    assert args[args.index("--appendonly") + 1] == "yes"
    for content in ("", "\n", (COMPOSE / "redis_password.txt.example").read_text()):
        secret_file.write_text(content)
        (tmp_path / "entrypoint-args").unlink(missing_ok=True)
        done, args = run_redis_start_script(compose, tmp_path, secret_file)
        assert done.returncode != 0 and args is None, f"started with the secret {content!r}"
        assert "openssl rand -hex 32" in done.stderr
    secret_file.unlink()
    done, args = run_redis_start_script(compose, tmp_path, secret_file)
    assert done.returncode != 0 and args is None, "started without a secret file"


def test_redis_healthcheck_authenticates_without_the_password_in_its_args(compose, tmp_path, secret_file):
    test = compose["services"]["redis"]["healthcheck"]["test"]
    password = secret_file.read_text().strip()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "redis-cli-args"
    fake_bin(
        bin_dir,
        "redis-cli",
        f'printf "%s\\n" "$@" > {record}\n'
        f'if [ "$REDISCLI_AUTH" = "{password}" ]; then echo PONG; '
        'else echo "NOAUTH Authentication required."; fi\n',
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("REDISCLI_AUTH", None)
    argv = [arg.replace(SECRET_PATH, str(secret_file)) for arg in healthcheck_command(test)]
    assert password not in " ".join(map(str, test))
    assert subprocess.run(argv, env=env, timeout=30).returncode == 0
    assert password not in record.read_text() and "-a" not in record.read_text().split()
    secret_file.write_text("not-the-password\n")
    assert subprocess.run(argv, env=env, timeout=30).returncode != 0, "healthy without authenticating"


# --- Engine --------------------------------------------------------------------------------


def test_engine_waits_for_healthy_redis_and_drains_on_sigterm(compose):
    engine = compose["services"]["engine"]
    assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    grace = float(engine["environment"]["CONVEYOR_GRACE_S"])
    assert seconds(engine["stop_grace_period"]) > grace
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    assert re.search(r'^ENTRYPOINT \["conveyor-entrypoint"\]', dockerfile, re.M)  # exec form: gets SIGTERM
    assert re.search(r"^COPY --chmod=0755 compose/entrypoint.sh /usr/local/bin/conveyor-entrypoint$", dockerfile, re.M)
    script = (COMPOSE / "entrypoint.sh").read_text()
    assert re.findall(r'^\s*exec .*conveyor "\$@"$', script, re.M), "the entrypoint execs conveyor (PID 1)"
    assert "model-cache:/cache" in engine["volumes"]


def test_engine_does_not_run_as_root(compose):
    user = dockerfile_user()
    assert user is not None, "the Dockerfile sets a USER (else the engine runs as root)"
    assert user.split(":")[0] not in ROOT_USERS, f"USER {user}"
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    owner = rf"(?:{re.escape(user.split(':')[0])}|conveyor)"
    assert re.search(rf"chown (?:-R )?{owner}\S* /cache", dockerfile), "the cache volume is the user's"
    for name in ("engine", "gateway"):
        user = str(compose["services"][name].get("user", user)).split(":")[0]
        if user in ROOT_USERS:  # only for the entrypoint, which drops to the image's user for good
            script = (COMPOSE / "entrypoint.sh").read_text()
            assert re.search(r'exec setpriv --reuid="\$CONVEYOR_UID" --regid="\$CONVEYOR_UID" --clear-groups', script)
            assert f"CONVEYOR_UID={dockerfile_user().split(':')[0]}" in script


@pytest.mark.parametrize("name", ["engine", "gateway"])
def test_engine_reads_the_redis_password_from_the_secret_never_from_a_url(compose, name):
    service = compose["services"][name]
    command = service["command"]
    for arg in [*command, *map(str, service.get("environment", {}).values())]:
        if "://" in arg:
            parts = urlsplit(arg)
            assert parts.password is None and "@" not in parts.netloc, f"credentials in {arg}"
    assert flag_value(command, "--redis-url") == "redis://redis:6379"
    assert flag_value(command, "--redis-password-file") == OWN_SECRET_PATH  # the entrypoint's copy
    assert "redis_password" in service["secrets"]
    assert "REDIS_PASSWORD" not in service.get("environment", {}), "no password literal in the YAML"


def test_engine_metrics_bind_inside_the_container_only(compose):
    engine = compose["services"]["engine"]
    command = engine["command"]
    host = flag_value(command, "--metrics-host") or engine.get("environment", {}).get("CONVEYOR_METRICS_HOST")
    assert host == "0.0.0.0", "reachable from the healthcheck and the compose network"
    assert flag_value(command, "--metrics-port") == "9400"
    assert all(address in LOOPBACK for address in published_host_ips(engine))
    text = (COMPOSE / "docker-compose.yml").read_text()
    assert re.search(r'^\s*#\s*ports: \["127\.0\.0\.1:9400:9400"\]', text, re.M), (
        "the commented way to publish metrics on loopback only"
    )


def test_engine_has_a_healthcheck_on_its_metrics_port(compose):
    engine = compose["services"]["engine"]
    check = engine["healthcheck"]
    argv = healthcheck_command(check["test"])
    assert f"127.0.0.1:{flag_value(engine['command'], '--metrics-port')}/metrics" in " ".join(argv)
    assert seconds(check["start_period"]) >= 300, "long enough to convert and load the model"
    assert seconds(check["timeout"]) < seconds(check["interval"])


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve_help() -> str:
    conveyor = Path(sys.executable).with_name("conveyor")
    return subprocess.run([str(conveyor), "serve", "--help"], capture_output=True, text=True, timeout=120).stdout


@pytest.fixture
def password_flag():
    if "--redis-password-file" not in serve_help():
        pytest.skip("`conveyor serve --help` does not list --redis-password-file yet (being added)")


@pytest.fixture
def password_server(tmp_path, secret_file, password_flag):
    """A Valkey of its own that requires the secret's password, as the redis service does."""
    import redis

    from conveyor.actors.embedded_valkey import EmbeddedValkey

    password = secret_file.read_text().strip()
    server = EmbeddedValkey(tmp_path / "valkey", password=password).start()
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        yield server.url, password
    finally:
        server.stop()


@pytest.mark.slow
def test_engine_command_serves_jobs_and_exits_cleanly_on_sigterm(compose, password_server, secret_file):
    url, password = password_server
    engine = compose["services"]["engine"]
    metrics_port = str(free_port())
    local = {
        "redis://redis:6379": url,
        OWN_SECRET_PATH: str(secret_file),
        "0.0.0.0": "127.0.0.1",
    }  # here: loopback, not every interface of a shared box
    command = [local.get(arg, arg) for arg in engine["command"]]
    command[command.index("--metrics-port") + 1] = metrics_port
    assert password not in " ".join(command)
    namespace = f"compose-{uuid.uuid4().hex[:12]}"
    conveyor = Path(sys.executable).with_name("conveyor")
    env = {
        **os.environ,
        **{k: str(v) for k, v in engine["environment"].items()},
        "CONVEYOR_NAMESPACE": namespace,
        "CONVEYOR_MAX_NUM_SEQS": "8",
    }
    for name in (
        "REDIS_URL",
        "REDIS_PASSWORD",
        "REDIS_PASSWORD_FILE",
        "REDIS_USERNAME",
        "CONVEYOR_METRICS_HOST",
        "CONVEYOR_METRICS_PORT",
    ):
        env.pop(name, None)
    health = [
        sys.executable if arg == "python" else arg.replace(":9400/", f":{metrics_port}/")
        for arg in healthcheck_command(engine["healthcheck"]["test"])
    ]
    process = subprocess.Popen(
        [str(conveyor), *command], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        host, port = urlsplit(url).hostname, urlsplit(url).port
        client = Client(f"redis://:{password}@{host}:{port}", namespace=namespace)
        job = client.submit(messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0)
        result = job.result(timeout=300)  # submitted at once: it waits for SmolLM2 to load (minutes on a busy box)
        assert result.text and result.finish_reason in ("stop", "length")
        deadline = time.monotonic() + 30
        while subprocess.run(health, capture_output=True, timeout=30).returncode != 0:
            assert time.monotonic() < deadline, "the engine healthcheck never passed"
            time.sleep(0.5)
        client.close()
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 0, output[-2000:]
    assert "serving model" in output
    assert password not in output, "the password is never logged"


# --- Gateway -------------------------------------------------------------------------------


def test_gateway_runs_from_the_engine_image_as_its_non_root_user(compose):
    gateway, engine = compose["services"]["gateway"], compose["services"]["engine"]
    command = gateway["command"]
    assert command[0] == "gateway"
    assert engine["build"]["dockerfile"] == "compose/Dockerfile"
    assert "build" not in gateway and gateway["image"] == engine["image"], "one image, built once, for both"
    assert gateway["pull_policy"] == "never", "a local image: never pulled from a registry"
    assert str(gateway.get("user")) == str(engine.get("user")), "the same user (checked above)"
    assert gateway["depends_on"]["redis"]["condition"] == "service_healthy"
    assert "engine" not in gateway["depends_on"], "requests queue in Redis until a replica is up"
    assert gateway["restart"] in ("always", "unless-stopped", "on-failure")
    assert gateway["environment"]["CONVEYOR_NAMESPACE"] == engine["environment"]["CONVEYOR_NAMESPACE"]


def test_gateway_binds_its_host_port_on_loopback_only(compose):
    gateway = compose["services"]["gateway"]
    command = gateway["command"]
    assert flag_value(command, "--host") == "0.0.0.0", "inside the container: reachable by the published port"
    port = flag_value(command, "--port")
    assert published_host_ips(gateway) == ["127.0.0.1"]
    assert gateway["ports"] == [f"127.0.0.1:{port}:{port}"]
    text = (COMPOSE / "docker-compose.yml").read_text()
    comment = text[text.index("\n  gateway:") : text.index('ports: ["127.0.0.1:8000:8000"]')]
    for needed in ("CONVEYOR_GATEWAY_API_KEYS", "key=namespace", "CONVEYOR_GATEWAY_KEYS_FILE"):
        assert needed in comment, f"how to open it wider says to set API keys ({needed})"
    assert not re.search(r"^\s*CONVEYOR_GATEWAY_API_KEYS:", text, re.M), "no API key literal in the YAML"


class _StandInGateway(http.server.BaseHTTPRequestHandler):
    status = 200
    paths: list[str] = []

    def do_GET(self):
        type(self).paths.append(self.path)
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_gateway_healthcheck_asks_health_and_fails_on_an_error(compose):
    gateway = compose["services"]["gateway"]
    check = gateway["healthcheck"]
    assert f"127.0.0.1:{flag_value(gateway['command'], '--port')}/health" in " ".join(
        healthcheck_command(check["test"])
    )
    assert seconds(check["timeout"]) < seconds(check["interval"])
    _StandInGateway.paths = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _StandInGateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    argv = [
        sys.executable if arg == "python" else arg.replace(":8000/", f":{port}/")
        for arg in healthcheck_command(check["test"])
    ]
    try:
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
        assert _StandInGateway.paths == ["/health"]
        _StandInGateway.status = 503
        assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0, "healthy on a 503"
    finally:
        server.shutdown()
        server.server_close()
        _StandInGateway.status = 200
    assert subprocess.run(argv, capture_output=True, timeout=30).returncode != 0, "healthy with nothing listening"


def gateway_help() -> str:
    conveyor = Path(sys.executable).with_name("conveyor")
    return subprocess.run([str(conveyor), "gateway", "--help"], capture_output=True, text=True, timeout=120).stdout


@pytest.mark.slow
def test_gateway_command_passes_its_healthcheck_with_the_secret(compose, tmp_path, secret_file):
    """The compose command itself, on a Valkey that requires the secret's password."""
    if "--redis-password-file" not in gateway_help():
        pytest.skip("`conveyor gateway --help` does not list --redis-password-file yet (being written)")
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    password = secret_file.read_text().strip()
    server = EmbeddedValkey(tmp_path / "valkey", password=password).start()
    gateway = compose["services"]["gateway"]
    port = str(free_port())
    local = {
        "redis://redis:6379": server.url,
        OWN_SECRET_PATH: str(secret_file),
        "0.0.0.0": "127.0.0.1",
    }  # here: loopback, not every interface of a shared box
    command = [local.get(arg, arg) for arg in gateway["command"]]
    command[command.index("--port") + 1] = port
    env = {
        **os.environ,
        **{k: str(v) for k, v in gateway["environment"].items()},
        "CONVEYOR_NAMESPACE": f"compose-{uuid.uuid4().hex[:12]}",
    }
    for name in (
        "REDIS_URL",
        "REDIS_PASSWORD",
        "REDIS_PASSWORD_FILE",
        "REDIS_USERNAME",
        "CONVEYOR_GATEWAY_API_KEYS",
        "CONVEYOR_GATEWAY_KEYS_FILE",
    ):
        env.pop(name, None)
    health = [
        sys.executable if arg == "python" else arg.replace(":8000/", f":{port}/")
        for arg in healthcheck_command(gateway["healthcheck"]["test"])
    ]
    process = subprocess.Popen(
        [str(Path(sys.executable).with_name("conveyor")), *command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 60
        while subprocess.run(health, capture_output=True, timeout=30).returncode != 0:
            assert process.poll() is None, "the gateway exited"
            assert time.monotonic() < deadline, "the gateway healthcheck never passed"
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
        server.stop()
    assert password not in output, "the password is never logged"


# --- The image: its build context and its entrypoint -------------------------------------------


def dockerignore_patterns() -> list[tuple[bool, re.Pattern]]:
    """(negated, pattern) of .dockerignore, in order, as Docker reads them."""
    patterns = []
    for line in (REPO_ROOT / ".dockerignore").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated, glob = line.startswith("!"), line.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(?:.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        patterns.append((negated, re.compile(regex.replace(r"\?", "[^/]") + "$")))
    return patterns


def sent_to_the_builder(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
    sent = True
    for negated, pattern in dockerignore_patterns():
        if any(pattern.match(prefix) for prefix in prefixes):
            sent = negated
    return sent


def test_the_build_context_leaves_out_the_venv_git_data_secrets_and_caches():
    for path in (
        ".venv/bin/python",
        ".git/HEAD",
        "conveyor-data/password",
        "conveyor-data/appendonlydir/x.aof",
        "compose/redis_password.txt",
        "compose/gateway_keys.json",
        "clients/__pycache__/cli.cpython-311.pyc",
        ".pytest_cache/v/x",
        "engine/.hypothesis/x",
        "conveyor.egg-info/PKG-INFO",
        "tests/test_compose.py",
        "benchmarks/results/x.json",
        "actors/conveyor-data/url",
    ):
        assert not sent_to_the_builder(path), f"{path} would be sent to the builder"
    dockerfile = (COMPOSE / "Dockerfile").read_text()
    for sources in re.findall(r"^COPY (?!.*--from=)(?:--\S+ )*(.+) \S+$", dockerfile, re.M):
        for source in sources.split():
            assert sent_to_the_builder(source), f"COPY {source}: left out of the build context"
            assert sent_to_the_builder(f"{source}/x.py") or (REPO_ROOT / source).is_file()


def dockerfile_stages() -> list[list[str]]:
    """The Dockerfile's instructions, one list per FROM stage (continuation lines joined)."""
    text = (COMPOSE / "Dockerfile").read_text().replace("\\\n", " ")
    stages: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("FROM "):
            stages.append([])
        if line and not line.startswith("#"):
            stages[-1].append(line)
    return stages


def test_the_image_runs_the_installed_wheel_and_holds_no_copy_of_the_source():
    """The first stage builds the wheel; the image installs it (all its programs) and copies
    nothing else of the build context but the entrypoint, so its commands import Conveyor
    from site-packages only (the wheel-install test runs what an installed wheel serves)."""
    *builders, image = dockerfile_stages()
    assert builders and any("pip wheel" in line for line in builders[0]), "a stage builds the wheel"
    copies = [line for line in image if line.startswith("COPY ")]
    from_builder = [line for line in copies if "--from=" in line]
    from_context = [line.split()[-2] for line in copies if "--from=" not in line]
    assert from_builder and from_context == ["compose/entrypoint.sh"], copies
    runs = [line for line in image if line.startswith("RUN ")]
    assert any(".whl" in line and "[all]" in line and "pip install" in line for line in runs), "installs the wheel"
    workdir = [line.split()[1] for line in image if line.startswith("WORKDIR ")]
    assert workdir and workdir[-1] not in ("/src", "/app"), "the commands do not start in a folder of sources"
    for folder in ("engine", "actors", "kernels", "clients", "gateway", "apps", "conveyor"):
        assert not any(f" {folder} " in f" {line} " for line in copies), f"the image copies {folder}/"


@pytest.fixture
def open_dir():
    """A folder uid 10001 can enter (pytest's tmp_path is under a 0700 folder of root's)."""
    path = Path(tempfile.mkdtemp(prefix="conveyor-entrypoint-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def run_entrypoint(work: Path, secrets_in: Path, *args: str, as_uid: int | None = None):
    """compose/entrypoint.sh with `conveyor` a stand-in that records who ran it, with what."""
    bin_dir, record, out = work / "bin", work / "ran", work / "own-secrets"
    bin_dir.mkdir(exist_ok=True)
    record.write_text("")
    record.chmod(0o666)  # written by whoever the entrypoint runs conveyor as
    fake_bin(bin_dir, "conveyor", f'{{ id -u; id -G; printf "%s\\n" "$@"; }} > {record}\n')
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "CONVEYOR_SECRETS_IN": str(secrets_in),
        "CONVEYOR_SECRETS_OUT": str(out),
    }
    argv = ["sh", str(COMPOSE / "entrypoint.sh"), *args]
    if as_uid is not None:
        argv = ["setpriv", f"--reuid={as_uid}", f"--regid={as_uid}", "--clear-groups", "--", *argv]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
    return done, (record.read_text().splitlines() if record.exists() else None), out


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root and setpriv, as in the image")
def test_entrypoint_hands_the_secret_to_the_conveyor_user_then_drops_root(tmp_path, open_dir, secret_file):
    secrets_in = tmp_path / "secrets"  # root's only, as the host's file is its owner's: compose keeps that
    secrets_in.mkdir()
    shutil.copy(secret_file, secrets_in / "redis_password")
    (secrets_in / "redis_password").chmod(0o600)
    done, ran, out = run_entrypoint(open_dir, secrets_in, "serve", "--model", "smollm2")
    assert done.returncode == 0, done.stderr
    assert ran == [str(CONVEYOR_UID), str(CONVEYOR_UID), "serve", "--model", "smollm2"], "not root, no groups"
    copy = out / "redis_password"
    assert copy.read_text() == secret_file.read_text()
    assert (copy.stat().st_uid, copy.stat().st_mode & 0o777) == (CONVEYOR_UID, 0o400)
    assert (out.stat().st_uid, out.stat().st_mode & 0o777) == (CONVEYOR_UID, 0o700)
    done, ran, _ = run_entrypoint(open_dir, secrets_in, "gateway", as_uid=CONVEYOR_UID)  # as the image's USER
    assert done.returncode == 0 and ran == [str(CONVEYOR_UID), str(CONVEYOR_UID), "gateway"], done.stderr


def test_gateway_needs_api_keys_from_a_secret(compose):
    """Any container of the compose network reaches the gateway's 0.0.0.0: every request needs
    a key, read from a secret file kept out of git; the example's key is refused, and the
    command refuses to listen beyond loopback without keys at all."""
    from conveyor.gateway.tenants import load_grants

    gateway = compose["services"]["gateway"]
    assert (
        gateway["environment"]["CONVEYOR_GATEWAY_KEYS_FILE"] == "/run/conveyor/secrets/gateway_keys"
    )  # entrypoint's copy
    assert "gateway_keys" in gateway["secrets"]
    keys_file = Path(compose["secrets"]["gateway_keys"]["file"]).name
    assert f"compose/{keys_file}" in (COMPOSE.parent / ".gitignore").read_text().split(), "kept out of git"
    with pytest.raises(ValueError, match="example"):
        load_grants(str(COMPOSE / "gateway_keys.json.example"), None)
    conveyor = Path(sys.executable).with_name("conveyor")
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVEYOR_GATEWAY_")}
    refused = subprocess.run(
        [str(conveyor), "gateway", "--host", "0.0.0.0", "--redis-url", "redis://127.0.0.1:1"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert refused.returncode == 2 and "no API keys" in refused.stderr, refused.stderr


# --- Monitoring (the `monitoring` profile) -------------------------------------------------

MONITORING = ("prometheus", "grafana")
OPTIONAL_SERVICES = {"prometheus": ["monitoring"], "grafana": ["monitoring"], "jaeger": ["tracing"]}


def exported_series() -> dict[str, set[str]]:
    """Every sample name the engine's and the gateway's /metrics can carry, with its labels
    (Prometheus adds `instance` and `job`), from the real metric objects."""
    from conveyor.actors.metrics import ReplicaMetrics
    from conveyor.gateway.app import Metrics
    from conveyor.gateway.queue_gauges import QueueCollector

    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    series: dict[str, set[str]] = {}
    gateway = Metrics()
    labelled = {m._name: set(m._labelnames) for m in (gateway.requests, gateway.latency, gateway.in_flight)}
    for family in [*ReplicaMetrics().registry.collect(), *gateway.registry.collect(), *QueueCollector().collect()]:
        labels = labelled.get(family.name, set(getattr(family, "_labelnames", ())))
        for suffix in suffixes[family.type]:
            series[family.name + suffix] = labels | {"instance", "job"} | ({"le"} if suffix == "_bucket" else set())
    return series


def test_monitoring_and_tracing_are_off_by_default_and_mount_files_that_exist(compose):
    for name, service in compose["services"].items():
        assert service.get("profiles") == OPTIONAL_SERVICES.get(name), name
    for name in MONITORING:
        for volume in compose["services"][name]["volumes"]:
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (COMPOSE / source).exists(), f"{name} mounts {source}, which compose/ lacks"


def test_prometheus_scrapes_every_engine_replica_and_the_gateway_on_their_ports(compose):
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    engine_port = int(flag_value(compose["services"]["engine"]["command"], "--metrics-port"))
    gateway_port = int(flag_value(compose["services"]["gateway"]["command"], "--port"))
    (engines,) = jobs["conveyor-engine"]["dns_sd_configs"]  # the service name: every --scale replica
    assert (engines["names"], engines["type"], engines["port"]) == (["engine"], "A", engine_port)
    assert jobs["conveyor-gateway"]["static_configs"] == [{"targets": [f"gateway:{gateway_port}"]}]


def test_the_grafana_board_queries_only_series_the_code_exports():
    """A renamed metric or label would leave a panel empty without any error: every series
    and every `by (...)` label of every panel is one the engine or the gateway exports."""
    import json

    sources = yaml.safe_load((COMPOSE / "grafana/provisioning/datasources/prometheus.yml").read_text())
    (source,) = sources["datasources"]
    assert source["url"] == "http://prometheus:9090"
    board = json.loads((COMPOSE / "grafana/dashboards/conveyor.json").read_text())
    series = exported_series()
    wanted = ("conveyor_queue_lag", "conveyor_queue_oldest_age_seconds", "conveyor_dead_letters")
    wanted += ("conveyor_time_to_first_token_seconds_bucket", "conveyor_inter_token_latency_seconds_bucket")
    wanted += ("conveyor_kv_cache_usage_perc", "conveyor_generation_tokens_total", "conveyor_queue_deadline_seconds")
    queried = set()
    for panel in board["panels"]:
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            names = set(re.findall(r"\bconveyor_[a-z_]+", target["expr"]))
            assert names and names <= series.keys(), (panel["title"], names - series.keys())
            for group in re.findall(r"by \(([^)]*)\)", target["expr"]):
                for label in (part.strip() for part in group.split(",")):
                    assert all(label in series[name] for name in names), (panel["title"], label)
            queried |= names
    assert set(wanted) <= queried, set(wanted) - queried


# --- Tracing (the `tracing` profile and compose/tracing.env) -------------------------------

TRACED_SERVICES = {"engine": "conveyor-replica", "gateway": "conveyor-gateway"}
TRACING_ENV = COMPOSE / "tracing.env"
TRACING_UP = "--env-file compose/tracing.env --profile tracing up"
HOST_VARIABLE = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(:?-)([^}]*)\}|\$\{?[A-Za-z_]")


def interpolate(value: str, host_env: dict[str, str]) -> str:
    """Compose's interpolation of `${NAME:-default}` (the default when NAME is unset or empty)
    and `${NAME-default}` (when unset) from the host; `$$` is a literal `$`."""

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        assert match.group(1), f"only ${{NAME:-default}} is used here, not {match.group(0)!r}"
        name, operator, default = match.groups()
        value = host_env.get(name)
        return default if value is None or (operator == ":-" and value == "") else value

    return HOST_VARIABLE.sub(substitute, value)


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines, as `docker compose --env-file` reads this one (no quotes, no spaces)."""
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, value = line.split("=", 1)
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", name) and value == value.strip(), line
            pairs[name] = value
    return pairs


def container_port(port) -> int:
    return int(str(port).split("/")[0].rsplit(":", 1)[-1])


def test_tracing_is_off_unless_its_endpoint_is_set(compose):
    """Without compose/tracing.env (OTEL_EXPORTER_OTLP_ENDPOINT unset or empty on the host) the engine and the
    gateway get an empty OTLP endpoint, which the code treats as not configured: no exporter."""
    for name, service_name in TRACED_SERVICES.items():
        environment = compose["services"][name]["environment"]
        assert environment["OTEL_SERVICE_NAME"] == service_name
        for host_env in ({}, {"OTEL_EXPORTER_OTLP_ENDPOINT": ""}):
            assert interpolate(environment["OTEL_EXPORTER_OTLP_ENDPOINT"], host_env) == "", name
    for name, service in compose["services"].items():  # an optional service is never waited for
        assert "jaeger" not in (service.get("depends_on") or {}), name


def test_tracing_env_sends_the_engine_and_gateway_spans_to_jaeger_over_otlp_http(compose):
    jaeger = compose["services"]["jaeger"]
    assert re.fullmatch(r"jaegertracing/jaeger:2\.\d+\.\d+", jaeger["image"]), "Jaeger v2, pinned"
    assert jaeger["environment"]["JAEGER_LISTEN_HOST"] == "0.0.0.0"  # else OTLP listens on its loopback
    ports = {container_port(port) for port in jaeger["ports"]}
    assert {16686, 4317, 4318} <= ports  # the UI, OTLP gRPC, OTLP HTTP (loopback: checked above)
    host_env = read_env_file(TRACING_ENV)
    for name in TRACED_SERVICES:
        endpoint = interpolate(compose["services"][name]["environment"]["OTEL_EXPORTER_OTLP_ENDPOINT"], host_env)
        url = urlsplit(endpoint)
        assert (url.scheme, url.hostname, url.port, url.path) == ("http", "jaeger", 4318, ""), endpoint
    for text in ((COMPOSE / "docker-compose.yml").read_text(), TRACING_ENV.read_text()):
        assert TRACING_UP in text  # the documented command needs both the file and the profile
    assert TRACING_UP in (REPO_ROOT / "docs/dashboard.md").read_text()


def test_only_the_tracing_endpoint_comes_from_the_host():
    """Every other `$` of the compose file is a `$$` for the container's shell."""
    text = (COMPOSE / "docker-compose.yml").read_text()
    used = {m.group(0) for m in HOST_VARIABLE.finditer(text) if m.group(0) != "$$"}
    assert used == {"${OTEL_EXPORTER_OTLP_ENDPOINT:-}"}, used  # empty when unset: no exporter


def test_the_image_installs_the_otlp_http_exporter():
    """The image installs the wheel with [all]; `all` includes `otel`, which brings the OTLP/HTTP
    exporter that port 4318 speaks."""
    import tomllib

    assert re.search(r'pip install [^\n]*"\$\{wheel\}\[all\]"', (COMPOSE / "Dockerfile").read_text())
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (everything,) = extras["all"]
    assert "otel" in re.fullmatch(r"conveyor\[([a-z,]+)\]", everything).group(1).split(",")
    assert any(r.startswith("opentelemetry-exporter-otlp-proto-http") for r in extras["otel"])
