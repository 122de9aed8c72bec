"""`conveyor gateway` (``python -m conveyor.gateway``): the OpenAI-compatible HTTP gateway's program.
Parsing its flags imports nothing heavy; FastAPI and uvicorn are loaded only when it runs."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys

from conveyor.clients.cli import connection_options
from conveyor.clients.connection import check_credentials, settings_from_args
from conveyor.clients.errors import ConveyorError
from conveyor.gateway.settings import GatewaySettings

# (flag, GatewaySettings field, type, help)
OPTIONS = [
    ("--host", "host", str, "address to bind (env CONVEYOR_GATEWAY_HOST, default 127.0.0.1: loopback only)"),
    ("--port", "port", int, "port (env CONVEYOR_GATEWAY_PORT, default 8000)"),
    (
        "--keys-file",
        "keys_file",
        str,
        "JSON/YAML file of API keys: {key: {namespace, priority_class}} "
        "(env CONVEYOR_GATEWAY_KEYS_FILE; also env CONVEYOR_GATEWAY_API_KEYS="
        "'key=ns[:class],...'); without keys: no auth, one namespace",
    ),
    (
        "--timeout-s",
        "timeout_s",
        float,
        "deadline of every job, seconds (env CONVEYOR_GATEWAY_TIMEOUT_S, "
        "default 600); a request may ask for less with X-Conveyor-Timeout-S",
    ),
    (
        "--max-queue-len",
        "max_queue_len",
        int,
        "refuse (429) when a request stream holds this many jobs "
        "(env CONVEYOR_GATEWAY_MAX_QUEUE_LEN, default 0 = only the "
        "replicas' bound)",
    ),
    (
        "--replica-idle-s",
        "replica_idle_s",
        float,
        "a model is served while a replica of it was seen this "
        "recently (env CONVEYOR_GATEWAY_REPLICA_IDLE_S, default 60)",
    ),
    (
        "--result-ttl",
        "result_ttl",
        int,
        "seconds jobs' results stay in Redis (env CONVEYOR_GATEWAY_RESULT_TTL, default 3600)",
    ),
    ("--log-level", "log_level", str, "uvicorn's log level (env CONVEYOR_LOG_LEVEL, default info)"),
    (
        "--max-body-bytes",
        "max_body_bytes",
        int,
        "largest request body but uploads (env CONVEYOR_GATEWAY_MAX_BODY_BYTES, default 16 MiB)",
    ),
    (
        "--max-connections",
        "max_connections",
        int,
        "open connections at most; one more gets 503 and is closed "
        "(env CONVEYOR_GATEWAY_MAX_CONNECTIONS, default 1000)",
    ),
    (
        "--max-connections-per-peer",
        "max_connections_per_peer",
        int,
        "open connections of one client address (IPv6: its /64) at most; past it, or past --max-connections, "
        "a newcomer replaces the oldest idle connection that never sent a request with a valid API key (any "
        "request, without keys), else gets 503 (env CONVEYOR_GATEWAY_MAX_CONNECTIONS_PER_PEER, default 0 = 3/4 "
        "of --max-connections)",
    ),
    (
        "--header-timeout-s",
        "header_timeout_s",
        float,
        "a request's headers must arrive within this (env CONVEYOR_GATEWAY_HEADER_TIMEOUT_S, default 10)",
    ),
    (
        "--body-timeout-s",
        "body_timeout_s",
        float,
        "a request's whole body must arrive within this, else 408 (env CONVEYOR_GATEWAY_BODY_TIMEOUT_S, default 60)",
    ),
    (
        "--keep-alive-s",
        "keep_alive_s",
        float,
        "idle keep-alive connections are closed after this (env CONVEYOR_GATEWAY_KEEP_ALIVE_S, default 5)",
    ),
    (
        "--max-requests-per-tenant",
        "max_requests_per_tenant",
        int,
        "requests of one namespace in flight at once, "
        "more get 429 (env CONVEYOR_GATEWAY_MAX_REQUESTS_"
        "PER_TENANT, default 256)",
    ),
    (
        "--max-samples",
        "max_samples",
        int,
        "largest n (samples) of one request (env CONVEYOR_GATEWAY_MAX_SAMPLES, default 16)",
    ),
    (
        "--max-total-tokens",
        "max_total_tokens",
        int,
        "largest n x max_tokens of one request (env CONVEYOR_GATEWAY_MAX_TOTAL_TOKENS, default 32768)",
    ),
    (
        "--max-stored-bytes",
        "max_stored_bytes",
        int,
        "bytes of stored responses (/v1/responses store and background) one namespace may hold at once; "
        "past it 429 (env CONVEYOR_GATEWAY_MAX_STORED_BYTES, default 64 MiB)",
    ),
    (
        "--allowed-hosts",
        "allowed_hosts",
        str,
        "Host header names answered besides localhost, IP addresses and --host, comma-separated "
        "('*.example.com': its subdomains; '*': any); others get 400, against DNS rebinding "
        "(env CONVEYOR_GATEWAY_ALLOWED_HOSTS, default none)",
    ),
    (
        "--webhook-url",
        "webhook_url",
        str,
        "POST signed events (batch.*, response.* of background responses, job.* of jobs asking for them) "
        "of every served namespace to this http(s) URL; a keys-file grant's webhook_url overrides it for its "
        "namespace (env CONVEYOR_GATEWAY_WEBHOOK_URL; docs/webhooks.md)",
    ),
    (
        "--webhook-secret-file",
        "webhook_secret_file",
        str,
        "file holding the signing secret 'whsec_<base64>' (Standard Webhooks) "
        "(env CONVEYOR_GATEWAY_WEBHOOK_SECRET_FILE)",
    ),
    (
        "--webhook-retry-for",
        "webhook_retry_for",
        float,
        "seconds an event is retried (backoff up to 5 min) before it is dead-lettered "
        "(env CONVEYOR_GATEWAY_WEBHOOK_RETRY_FOR, default 259200 = 72 h)",
    ),
    (
        "--webhook-timeout",
        "webhook_timeout",
        float,
        "seconds one delivery attempt may take (env CONVEYOR_GATEWAY_WEBHOOK_TIMEOUT, default 10)",
    ),
    (
        "--webhook-concurrency",
        "webhook_concurrency",
        int,
        "delivery attempts in flight at once per namespace (env CONVEYOR_GATEWAY_WEBHOOK_CONCURRENCY, default 8)",
    ),
]
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


HELP = {
    "gateway": "OpenAI-compatible HTTP gateway over the queue, with the operator's dashboard",
    "dashboard": "the operator's web dashboard alone (no /v1 API)",
}
DESCRIPTIONS = {
    "gateway": "OpenAI-compatible HTTP gateway (/v1/completions, /v1/chat/completions, /v1/responses, "
    "Batch API) over the queue, with the operator's /dashboard",
    "dashboard": "the operator's dashboard alone (/dashboard, /metrics, /health): no /v1 API",
}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add `conveyor gateway` and `conveyor dashboard` (registered by conveyor/cli.py)."""
    for program, help_text in HELP.items():
        parser = subparsers.add_parser(
            program, parents=[connection_options()], description=DESCRIPTIONS[program], help=help_text
        )
        add_options(parser)
        parser.set_defaults(func=lambda args, program=program: run_program(args, program))


def main(argv: list[str] | None = None, program: str = "gateway") -> int:
    """``python -m conveyor.gateway`` / ``conveyor.gateway.dashboard``: one program alone."""
    parser = argparse.ArgumentParser(
        prog=f"conveyor {program}", parents=[connection_options()], description=DESCRIPTIONS[program]
    )
    add_options(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("CONVEYOR_LOG_LEVEL", "INFO"), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return run_program(args, program)


def add_options(parser: argparse.ArgumentParser) -> None:
    for flag, name, kind, help_text in OPTIONS:
        parser.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    parser.add_argument(
        "--allow-no-keys",
        action="store_true",
        default=bool(os.environ.get("CONVEYOR_GATEWAY_ALLOW_NO_KEYS")),
        help="listen beyond loopback without API keys (env "
        "CONVEYOR_GATEWAY_ALLOW_NO_KEYS=1): anyone who reaches the port uses --namespace",
    )


def run_program(args: argparse.Namespace, program: str) -> int:
    if program == "dashboard":
        os.environ.setdefault("CONVEYOR_GATEWAY_PORT", "8001")  # beside a gateway on 8000
    return run_gateway(args, api=program == "gateway")


def settings_from(args: argparse.Namespace) -> GatewaySettings:
    chosen = {name: getattr(args, name) for _, name, _, _ in OPTIONS if getattr(args, name) is not None}
    if args.namespace:
        chosen["namespace"] = args.namespace
    return GatewaySettings(redis=settings_from_args(args), **chosen)


def run_gateway(args: argparse.Namespace, api: bool = True) -> int:
    try:
        settings = settings_from(args)
    except (ValueError, OSError, ConveyorError) as exc:  # ConveyorError: no server to connect to
        return _fail(str(exc), EXIT_USAGE)
    if not (settings.keys_file or settings.api_keys) and not _loopback(settings.host) and not args.allow_no_keys:
        return _fail(
            f"--host {settings.host} reaches beyond this machine, and no API keys are set (--keys-file, "
            "CONVEYOR_GATEWAY_API_KEYS): every caller would get in; set keys, or --allow-no-keys",
            EXIT_USAGE,
        )
    problem = check_credentials(settings.redis)
    if problem:
        return _fail(problem, EXIT_FAILED)
    from conveyor.gateway import batch_routes, responses  # fastapi + uvicorn: only now
    from conveyor.gateway.server import serve

    try:
        if not api:
            return serve(settings, api=False)
        return serve(settings, extra_routers=(batch_routes.router, responses.router))
    except (ValueError, OSError) as exc:  # a bad keys file, a port in use
        return _fail(str(exc), EXIT_USAGE)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code
