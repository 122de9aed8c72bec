"""`conveyor serve` and `conveyor demo`: the programs that run the engine (the `serve`
extra). Registered by the `conveyor` command (conveyor/cli.py)."""

import argparse
import asyncio
import dataclasses
import logging
import os
import shlex
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from conveyor.clients import connection
from conveyor.clients.local_server import default_data_dir
from conveyor.clients.tool_parsers import PARSERS

log = logging.getLogger("conveyor")


def register(subparsers: argparse._SubParsersAction) -> None:
    serve = subparsers.add_parser("serve", help="run one engine replica")
    _add_replica_options(serve)
    serve.set_defaults(func=run_serve)
    demo = subparsers.add_parser("demo", help="embedded Valkey + one replica + a few prompts, streamed")
    _add_engine_options(demo)
    demo.set_defaults(func=run_demo)
    rank = subparsers.add_parser(
        "rank", help="one tensor/pipeline-parallel rank on this host, joining a replica's engine on another"
    )
    rank.add_argument("--master-addr", required=True, help="the host of rank 0 (the replica started with --nnodes)")
    rank.add_argument("--master-port", type=int, required=True, help="its rendezvous port (--master-port there)")
    rank.add_argument(
        "--rank",
        type=int,
        required=True,
        help="this rank's number, from world size / nnodes (rank 0's host runs the ones below)",
    )
    rank.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    rank.set_defaults(func=run_rank)


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (``--max-num-seqs`` ...), defaults from the config."""
    import typing

    from conveyor.engine.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    for field in dataclasses.fields(EngineConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = _flag_type(hints[field.name])
        parser.add_argument(
            flag,
            dest=field.name,
            type=kind,
            default=None,
            help=f"default: {_default_of(field)} (env CONVEYOR_{field.name.upper()})",
        )


def _default_of(field):
    return field.default if field.default is not dataclasses.MISSING else field.default_factory()


def _flag_type(hint):
    """int for ``int`` and ``int | None``; float likewise; bool flags take true/false; else str."""
    import typing

    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if len(options) != 1:
        return str  # e.g. kv_cache_memory: int | str, parsed by the engine
    if options[0] is bool:
        return lambda text: text.lower() in ("1", "true", "yes", "on")
    return options[0] if options[0] in (int, float) else str


def _add_replica_options(parser: argparse.ArgumentParser) -> None:
    _add_engine_options(parser)
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("REDIS_URL"),
        help="default: $REDIS_URL; without one, an embedded Valkey is started",
    )
    parser.add_argument(
        "--namespace",
        action="append",
        default=None,
        help="key prefix (default: conveyor); repeat it to serve several namespaces from one engine, "
        "shared by token-weighted fair share",
    )
    parser.add_argument(
        "--namespace-user",
        action="append",
        default=None,
        metavar="NAMESPACE=USERNAME:PASSWORD_FILE",
        help="connect for this served namespace as its own Redis (ACL) user (default: the connection's user)",
    )
    parser.add_argument(
        "--share",
        action="append",
        default=None,
        metavar="NAMESPACE=N",
        help="a served namespace's share of the engine (default 1 each): tokens are shared in proportion",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="embedded Valkey's directory: AOF, password (0600), url; local commands find it "
        f"there (env CONVEYOR_DATA_DIR, default {connection.DEFAULT_DATA_DIR})",
    )
    connection.add_connection_arguments(parser, data_dir=False)
    parser.add_argument("--lease-s", type=float, default=None)
    parser.add_argument("--grace-s", type=float, default=None)
    parser.add_argument("--max-deliveries", type=int, default=None)
    parser.add_argument(
        "--max-resumes",
        type=int,
        default=None,
        help="times a reclaimed job may continue from the tokens it already published, rather than "
        "rerun from the start (default 3; 0: always rerun)",
    )
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model name jobs use to reach this replica (default: the model's basename)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="serve Prometheus metrics on this port (env CONVEYOR_METRICS_PORT)",
    )
    parser.add_argument(
        "--metrics-host",
        default=None,
        help="address the metrics endpoint binds (default 127.0.0.1; env CONVEYOR_METRICS_HOST)",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=None,
        help="refuse jobs asking for more output tokens (env CONVEYOR_MAX_TOKENS_CAP)",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=None,
        help="refuse prompts longer than this, below max_model_len (env CONVEYOR_MAX_PROMPT_TOKENS)",
    )
    parser.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="server-side bound of each request stream: submits past it are refused (env CONVEYOR_MAX_QUEUE_LEN)",
    )
    parser.add_argument(
        "--token-budget",
        type=int,
        default=None,
        help="prompt + completion tokens each served namespace may use per UTC day; then submits are "
        "refused until midnight UTC (env CONVEYOR_TOKEN_BUDGET)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=DIR",
        help="PEFT LoRA adapters jobs may name in `lora` (Llama family; turns on --enable-lora)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=PARSERS,
        default=None,
        help="how jobs with tools have the model's calls read (default: by the chat template, "
        "hermes or llama3_json; env CONVEYOR_TOOL_CALL_PARSER)",
    )
    parser.add_argument(
        "--max-bytes-in-flight",
        type=int,
        default=None,
        help="bytes of request entries held at once (default 64 MiB; env CONVEYOR_MAX_BYTES_IN_FLIGHT)",
    )
    parser.add_argument(
        "--engine-process",
        type=_flag_type(bool),
        default=_env_flag("CONVEYOR_ENGINE_PROCESS", True),
        help="run the engine core in a process of its own (default true; false: on a thread "
        "of the replica's process; env CONVEYOR_ENGINE_PROCESS)",
    )


def _env_flag(name: str, default: bool) -> bool:
    value = os.environ.get(name)
    return default if value is None else value.lower() in ("1", "true", "yes", "on")


def lora_modules(given: list[str] | dict | None) -> dict[str, str]:
    """``--lora-modules name=DIR ...`` -> {name: DIR}, each a PEFT adapter the engine can serve."""
    if isinstance(given, dict) or not given:
        return dict(given or {})
    from conveyor.engine.lora.adapter import ADAPTER_NAME, check_adapter
    from conveyor.engine.lora.request import LoRARequest

    modules = {}
    for item in given:
        name, _, path = item.partition("=")
        if not ADAPTER_NAME.match(name) or not path or name in modules:
            raise ValueError(f"--lora-modules: {item!r} is not NAME=DIR with a new name of [A-Za-z0-9_.-]{{1,64}}")
        try:
            check_adapter(LoRARequest(name, len(modules) + 1, path), max_rank=2**16)
        except Exception as exc:  # InvalidRequest: which file is missing, which option unsupported
            raise ValueError(f"--lora-modules {name}: {exc}") from None
        modules[name] = path
    return modules


def build_engine(args: argparse.Namespace, own_process: bool = False):
    """The front door's end of an engine core, started in a process of its own (``own_process``)
    or on a thread of this one (actors/engine_client.py)."""
    from conveyor.actors.engine_client import (
        EngineCoreClient,  # light: a child core starts before torch is imported here
    )
    from conveyor.engine.config import EngineConfig

    if getattr(args, "lora_modules", None):
        args.enable_lora = True
    options = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if getattr(args, f.name, None) is not None
    }
    config = EngineConfig(**options)
    engine = EngineCoreClient.in_child_process(config) if own_process else EngineCoreClient.on_thread(config)
    try:
        engine.sampling_defaults = served_sampling_defaults(config)  # ingest fills unset job fields with them
    except BaseException:
        engine.close()
        raise
    return engine


def served_sampling_defaults(config):
    """The defaults of the sampling fields jobs leave unset (--generation-config); the engine
    logged them as it loaded the model ("sampling defaults: ...")."""
    from conveyor.engine.models.loader import sampling_defaults

    return sampling_defaults(config.model, config.generation_config)


def replica_config(args: argparse.Namespace, redis_settings: connection.RedisSettings):
    from conveyor.actors.config import ReplicaConfig

    config = ReplicaConfig(redis=redis_settings)
    if getattr(args, "namespace", None):  # `conveyor demo` has no --namespace
        config.namespace, *more = args.namespace
        config.more_namespaces = tuple(more)
    config.namespace_users = namespace_users(getattr(args, "namespace_user", None) or [])
    config.__post_init__()  # one namespace served once, users only for served ones
    for name in (
        "lease_s",
        "grace_s",
        "max_deliveries",
        "max_resumes",
        "metrics_port",
        "metrics_host",
        "served_model_name",
        "max_tokens_cap",
        "max_prompt_tokens",
        "max_queue_len",
        "token_budget",
        "max_bytes_in_flight",
        "tool_call_parser",
        "lora_modules",
    ):
        if getattr(args, name, None) is not None:
            setattr(config, name, getattr(args, name))
    return config


def run_rank(args: argparse.Namespace) -> int:
    """Joins rank 0's rendezvous and serves as rank ``--rank`` until rank 0 stops (or dies:
    then this exits 1, as a rank of rank 0's own host does)."""
    from conveyor.engine.tp_worker import join

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    join(args.master_addr, args.master_port, args.rank, args.threads)
    return 0


def run_serve(args: argparse.Namespace) -> int:
    try:
        args.lora_modules = lora_modules(args.lora_modules)  # before loading a model: fail fast
        if args.share:
            args.tenant_shares = served_shares(args.share, args.namespace)
    except ValueError as exc:
        return _usage_error(str(exc))
    if not args.redis_url:
        return _serve_embedded(args)
    try:
        settings = connection.settings_from_args(args)
        config = replica_config(args, settings)  # namespaces, their users: before loading a model
    except (OSError, ValueError) as exc:  # unreadable password file, TLS flags without rediss://
        return _usage_error(str(exc))
    for namespace in config.namespaces:  # fail fast, before loading a model: each door's user
        refused = connection.check_credentials(config.for_namespace(namespace).redis)
        if refused:
            return _usage_error(refused)
    print(f"REDIS_URL={connection.redact(settings.url)}", flush=True)
    return _run_loop(_serve(build_engine(args, args.engine_process), config))


def namespace_users(flags: list[str]) -> dict[str, tuple[str, str]]:
    """--namespace-user NAMESPACE=USERNAME:PASSWORD_FILE flags: namespace -> (user, password)."""
    users = {}
    for flag in flags:
        namespace, _, rest = flag.partition("=")
        username, _, password_file = rest.partition(":")
        if not (namespace and username and password_file):
            raise ValueError(f"--namespace-user {flag!r}: NAMESPACE=USERNAME:PASSWORD_FILE")
        users[namespace] = (username, connection.read_password_file(password_file))
    return users


def served_shares(shares: list[str], namespaces: list[str] | None) -> dict[str, float]:
    """--share NAMESPACE=N flags: the engine's tenant shares, each naming a served namespace."""
    from conveyor.clients.keys import default_namespace
    from conveyor.engine.fair_share import check_shares

    served = namespaces or [default_namespace()]
    checked = check_shares(",".join(shares))
    for name in checked:
        if name not in served:
            raise ValueError(f"--share {name}=...: {name!r} is not a served namespace ({', '.join(served)})")
    return checked


def _serve_embedded(args: argparse.Namespace) -> int:
    """No --redis-url: an embedded Valkey in --data-dir, with its own password (or
    --redis-password-file / $REDIS_PASSWORD when given)."""
    from conveyor.actors.embedded_valkey import GENERATE, EmbeddedValkey

    try:
        explicit = connection.resolve_settings(
            "redis://127.0.0.1",
            password_file=args.redis_password_file,
            ca_cert=args.redis_ca_cert,
            cert=args.redis_cert,
            key=args.redis_key,
        )  # TLS flags: an error
    except (OSError, ValueError) as exc:
        return _usage_error(str(exc))
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    # SIGTERM while the model loads (before the replica's loop takes it over) must still run
    # the finally below: an orphaned server would keep the data dir, refusing the next serve
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        server = EmbeddedValkey(data_dir, password=explicit.password or GENERATE).start()
    except RuntimeError as exc:  # EmbeddedValkeyError: its data dir is already served, the binary failed
        return _usage_error(str(exc))
    try:
        print(
            f"embedded Valkey (AOF in {server.data_dir}) at {server.url}, password in {server.password_path}",
            flush=True,
        )
        print(f"REDIS_URL={server.url}", flush=True)
        print(next_steps(server.data_dir, args.namespace and args.namespace[0]), flush=True)
        try:
            config = replica_config(args, server.settings)
        except (OSError, ValueError) as exc:
            return _usage_error(str(exc))
        return _run_loop(_serve(build_engine(args, args.engine_process), config))
    finally:
        server.stop()


def next_steps(data_dir: Path, namespace: str | None) -> str:
    """What to run next, from any folder: the local commands find this server by themselves
    (a data dir other than the user's default is named, as the commands would not find it)."""
    conveyor = _conveyor_command()
    own_dir = data_dir.resolve() != default_data_dir({**os.environ, "CONVEYOR_DATA_DIR": ""}).resolve()
    where = shlex.quote(str(data_dir.resolve()))
    flags = (f" --data-dir {where}" if own_dir else "") + (f" --namespace {namespace}" if namespace else "")
    python_env = f"CONVEYOR_DATA_DIR={where} " if own_dir else ""
    client = f'Client(namespace="{namespace}")' if namespace else "Client()"
    message = '[{"role": "user", "content": "Hi!"}]'
    code = (
        f"from conveyor.clients import Client; print({client}.submit(messages={message}, max_tokens=32).result().text)"
    )
    python = f"{python_env}{shlex.quote(sys.executable)} -c '{code}'"
    return "\n".join(
        [
            "next, from any folder (they find this server and its password by themselves):",
            f'  {conveyor} submit "Tell me a joke" --stream{flags}',
            f"  {conveyor} status{flags}",
            f"  {conveyor} gateway --port 8000{flags}      # OpenAI-compatible: http://127.0.0.1:8000/v1",
            f"  {python}",
        ]
    )


def _conveyor_command() -> str:
    """`conveyor` when that is what the PATH finds, else the full path of this venv's one."""
    ours = Path(sys.executable).with_name("conveyor")
    found = shutil.which("conveyor")
    if found and ours.exists() and Path(found).resolve() == ours.resolve():
        return "conveyor"
    return shlex.quote(str(ours if ours.exists() else Path(sys.argv[0]).resolve()))


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def _usage_error(message: str) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return 2


async def _serve(engine, config) -> int:
    from conveyor.actors.replica import Replica

    try:
        return await Replica(engine, config).run()
    finally:
        await engine.aclose()  # the engine core, and its tensor-parallel ranks if any


def run_demo(args: argparse.Namespace) -> int:
    from conveyor.actors.demo import run as run_demo_async
    from conveyor.actors.embedded_valkey import EmbeddedValkey

    engine = build_engine(args)
    with tempfile.TemporaryDirectory(prefix="conveyor-demo-") as data_dir:
        with EmbeddedValkey(data_dir) as server:  # a random password, given to the demo's client
            print(f"embedded Valkey at {server.url} (password in {server.password_path})", flush=True)
            return _run_loop(run_demo_async(engine, replica_config(args, server.settings)))


def _run_loop(coroutine) -> int:
    try:
        import uvloop

        return uvloop.run(coroutine)
    except ImportError:
        return asyncio.run(coroutine)
