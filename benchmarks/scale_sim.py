"""Many replicas on one Valkey cluster, simulated (issue 30): the real front door (Streams,
JobLedger, IngestActor, PartitionKeeper, PublisherActor) of hundreds of replicas in a few
processes, each replica's engine replaced by a timed stub (the only stub: `StubCore`, which
emits one token per running job every --step-ms), against a real 3-master Valkey cluster
started here (tests/cluster_harness.py, masters only).

For each replica count R and partition count N it measures, per master node:
- idle commands/s (INFO total_commands_processed deltas, and script calls from commandstats)
  once the partitions settled, per replica;
- pickup latency of a job submitted to an idle cluster (submit -> the stub core has it);
- jobs/s under load (J jobs queued at once), commands/s under load, how evenly the
  partitions' jobs waited (fairness), how many jobs each replica ran;
- a ledger: every job id submitted was started exactly once and its hash says done.
`--old` runs the layout before partition ownership (every replica reads every partition at
every poll, 20 ms idle cap) for the idle figure alone.

    .venv/bin/python benchmarks/scale_sim.py --replicas 100 300 --partitions 4 16 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the test harnesses (cluster_harness)

from conveyor.actors.base import Actor  # noqa: E402
from conveyor.actors.config import ReplicaConfig  # noqa: E402
from conveyor.actors.ingest import IngestActor  # noqa: E402
from conveyor.actors.ledger import JobLedger  # noqa: E402
from conveyor.actors.messages import AbortJob, NewJob, StepOutputs  # noqa: E402
from conveyor.actors.partitions import PartitionKeeper  # noqa: E402
from conveyor.actors.publisher import PublisherActor  # noqa: E402
from conveyor.actors.streams import Streams  # noqa: E402
from conveyor.clients.connection import RedisSettings  # noqa: E402
from conveyor.engine.core_request import EngineCoreRequest  # noqa: E402
from conveyor.engine.outputs import CompletionOutput, RequestOutput  # noqa: E402

NAMESPACE = "sim"
MODEL = "sim-model"
MAX_NUM_SEQS = 8


# ---- the one stub: the engine ------------------------------------------------------------
class StubInputs:
    """The engine's input processor, stubbed: no tokenizer, three prompt tokens."""

    def request_for(self, request_id, prompt=None, params=None, priority_class="interactive", priority=0,
                    arrival_time=None, messages=None, tools=None) -> EngineCoreRequest:  # fmt: skip
        return EngineCoreRequest(
            request_id, (1, 2, 3), params, params.max_tokens or 4, priority_class, priority, arrival_time or 0.0
        )


class StubEngine:
    def own_input_processor(self) -> StubInputs:
        return StubInputs()


class StubCore(Actor):
    """The scheduler role with a timed engine: every step, one token for each of up to
    MAX_NUM_SEQS running jobs; records when each job arrived (the pickup)."""

    name = "engine_core"
    mailbox_size = 1024

    def __init__(self, publisher: Actor, consumer: str, step_s: float, starts: list):
        super().__init__()
        self.publisher, self.consumer, self.step_s, self.starts = publisher, consumer, step_s, starts
        self.waiting: list[NewJob] = []
        self.running: dict[str, tuple[NewJob, list[int]]] = {}

    async def run(self) -> None:
        while not self.stopped:
            await self._take_mail(block=not self.running and not self.waiting)
            while self.waiting and len(self.running) < MAX_NUM_SEQS:
                job = self.waiting.pop(0)
                self.running[job.delivery.job_id] = (job, [])
            await asyncio.sleep(self.step_s)
            await self._step()

    async def _take_mail(self, block: bool) -> None:
        if block:
            self._on(await self.mailbox.get())
        while not self.mailbox.empty():
            self._on(self.mailbox.get_nowait())

    def _on(self, message) -> None:
        if isinstance(message, NewJob):
            self.starts.append((message.delivery.job_id, self.consumer, time.time(), message.delivery.attempt))
            self.waiting.append(message)
        elif isinstance(message, AbortJob):
            pass  # the simulation cancels nothing

    async def _step(self) -> None:
        items = []
        for job_id, (job, tokens) in list(self.running.items()):
            tokens.append(7)
            done = len(tokens) >= job.request.max_tokens
            completion = CompletionOutput(
                0, "x" * len(tokens), list(tokens), finish_reason="length" if done else None,
                new_token_ids=[7], new_text="x",
            )  # fmt: skip
            items.append(
                (job.delivery, RequestOutput(job_id, None, [1, 2, 3], outputs=[completion], finished=done), None)
            )
            if done:
                del self.running[job_id]
        if items:
            await self.publisher.send(StepOutputs(items))


# ---- one simulated replica: the real front door ------------------------------------------
class SimReplica:
    def __init__(self, settings: RedisSettings, consumer: str, old: bool, step_s: float, starts: list):
        self.config = ReplicaConfig(redis=settings, namespace=NAMESPACE, consumer=consumer, partition_ownership=not old)
        if old:
            self.config.idle_poll_max_s = 0.02  # the default before partition ownership
        self.streams = Streams(settings.async_client(), settings.keys(NAMESPACE), consumer, MODEL, 1 << 20)
        self.ledger = JobLedger(self.streams, self.config, 2 * MAX_NUM_SEQS)
        self.publisher = PublisherActor(self.streams, self.ledger)
        self.core = StubCore(self.publisher, consumer, step_s, starts)
        self.ingest = IngestActor(self.streams, StubEngine(), self.ledger, self.core, self.publisher, self.config)
        self.ledger.connect(self.ingest, self.core)
        self.actors = [self.publisher, self.core, self.ledger]
        if not old:
            keeper = PartitionKeeper(
                self.streams, self.config.partition_lease_ms, self.config.partition_check_s, self.ingest.wake
            )
            self.ingest.partitions = self.ledger.partitions = keeper
            self.actors.append(keeper)
        self.actors.append(self.ingest)

    def start(self, on_crash) -> None:
        for actor in self.actors:
            actor.start(on_crash)

    async def stop(self) -> None:
        for actor in reversed(self.actors):
            await actor.stop()
        await self.streams.close()


async def worker_main(args) -> None:
    settings = RedisSettings(url=args.url, cluster=True, partitions=args.partitions[0])
    starts: list = []
    crashes: list = []
    replicas = [
        SimReplica(settings, f"sim-{i}", args.old, args.step_ms / 1000, starts)
        for i in range(args.first, args.first + args.count)
    ]
    for replica in replicas:
        replica.start(lambda name, exc: crashes.append(f"{name}: {exc!r}"))
        await asyncio.sleep(0.002)  # spread the first claims
    Path(args.out + ".ready").write_text("1")
    while not Path(args.stop_file).exists():
        await asyncio.sleep(0.5)
    await asyncio.gather(*(replica.stop() for replica in replicas), return_exceptions=True)
    Path(args.out).write_text(json.dumps({"starts": starts, "crashes": crashes[:20]}))


# ---- the driver ----------------------------------------------------------------------------
def cpu_line() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "")
    flags = next((line.split(":", 1)[1].split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "sse"
    return f"{platform.machine()} {isa}, {os.cpu_count()} cores, {model}"


def node_counts(cluster) -> list[dict]:
    out = []
    for master in cluster.masters:
        client = _node(master)
        stats, commands = client.info("stats"), client.info("commandstats")
        scripts = sum(commands.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))
        calls = {name[len("cmdstat_") :]: row.get("calls", 0) for name, row in commands.items()}
        out.append({"commands": stats["total_commands_processed"], "scripts": scripts, "calls": calls})
    return out


_nodes: dict = {}


def _node(master):
    import redis

    if master.port not in _nodes:
        _nodes[master.port] = redis.Redis.from_url(master.url, socket_timeout=10)
    return _nodes[master.port]


def by_command(before: list[dict], after: list[dict], seconds: float) -> dict[str, float]:
    """Calls/s of each command over all nodes (commands scripts run included)."""
    out: dict[str, float] = {}
    for b, a in zip(before, after):
        for name, calls in a["calls"].items():
            out[name] = out.get(name, 0.0) + (calls - b["calls"].get(name, 0)) / seconds
    return {name: round(rate, 2) for name, rate in sorted(out.items()) if rate > 0}


def rates(before: list[dict], after: list[dict], seconds: float) -> list[dict]:
    # minus our own two INFO calls per node
    return [
        {"commands_per_s": (a["commands"] - b["commands"] - 2) / seconds, "scripts_per_s": (a["scripts"] - b["scripts"]) / seconds}
        for b, a in zip(before, after)
    ]  # fmt: skip


def start_workers(args, url: str, replicas: int, partitions: int, old: bool, scratch: Path) -> tuple[list, list, Path]:
    stop_file = scratch / "stop"
    stop_file.unlink(missing_ok=True)
    workers, outs = [], []
    per = math.ceil(replicas / args.workers)
    for w in range(args.workers):
        first, count = w * per, min(per, replicas - w * per)
        if count <= 0:
            break
        out = scratch / f"worker{w}.json"
        for path in (out, Path(str(out) + ".ready")):
            path.unlink(missing_ok=True)
        command = [sys.executable, __file__, "--worker", "--url", url, "--partitions", str(partitions),
                   "--first", str(first), "--count", str(count), "--out", str(out), "--stop-file", str(stop_file),
                   "--step-ms", str(args.step_ms)] + (["--old"] if old else [])  # fmt: skip
        env = {**os.environ, "CONVEYOR_LOG_LEVEL": "WARNING"}
        workers.append(subprocess.Popen(command, env=env, stderr=open(scratch / f"worker{w}.log", "w")))
        outs.append(out)
    return workers, outs, stop_file


def workers_ready(workers: list, outs: list) -> bool:
    if any(worker.poll() is not None for worker in workers):
        raise SystemExit("a worker process exited: see its log in the scratch folder")
    return all(Path(str(o) + ".ready").exists() for o in outs)


def wait_for(predicate, timeout: float, what: str) -> float:
    started = time.monotonic()
    while not predicate():
        if time.monotonic() - started > timeout:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.2)
    return time.monotonic() - started


def settled(raw, keys, replicas: int) -> bool:
    """Every partition leased, and nobody over its fair share."""
    seconds, micros = raw.time()
    now = seconds * 1000 + micros // 1000
    owners = []
    for value in raw.hgetall(keys.partition_owners).values():
        expiry, _, owner = value.decode().partition(" ")
        if expiry.isdigit() and int(expiry) > now:
            owners.append(owner)
    share = math.ceil(keys.partitions / replicas)
    return len(owners) == keys.partitions and max(owners.count(o) for o in set(owners)) <= share


def submit_one(client, job_id: str) -> float:
    at = time.time()
    client.submit(prompt="hi", max_tokens=4, job_id=job_id)
    return at


def run_config(args, cluster, replicas: int, partitions: int, old: bool, scratch: Path) -> dict:
    import redis.cluster

    from conveyor.clients import Client

    for master in cluster.masters:
        _node(master).flushall()
    settings = RedisSettings(url=cluster.url, cluster=True, partitions=partitions)
    keys = settings.keys(NAMESPACE)
    asyncio.run(_create_groups(settings))  # once, not once per replica (XGROUP CREATE x 4N each)
    raw = redis.cluster.RedisCluster.from_url(cluster.url)
    client = Client(connection=settings, namespace=NAMESPACE)
    workers, outs, stop_file = start_workers(args, cluster.url, replicas, partitions, old, scratch)
    label = f"{'old' if old else 'new'} R={replicas} N={partitions}"
    try:
        start_s = wait_for(lambda: workers_ready(workers, outs), 600, "workers")
        settle_s = 3.0 if old else wait_for(lambda: settled(raw, keys, replicas), 120, "partitions to settle")
        time.sleep(args.settle_s)
        print(f"[{label}] started in {start_s:.1f} s, partitions settled in {settle_s:.1f} s", flush=True)
        before = node_counts(cluster)
        time.sleep(args.idle_s)
        after = node_counts(cluster)
        idle = rates(before, after, args.idle_s)
        row = {"mode": "old" if old else "new", "replicas": replicas, "partitions": partitions, "idle_nodes": idle}
        row["idle_by_command"] = by_command(before, after, args.idle_s)
        total = sum(n["commands_per_s"] for n in idle)
        print(f"[{label}] idle: {total:.0f} commands/s, {total / replicas:.2f} per replica", flush=True)
        if not old:
            row.update(measure_work(args, cluster, client, raw, keys, label))
    finally:
        stop_file.write_text("1")
        for worker in workers:
            worker.wait(120)
    results = [json.loads(o.read_text()) for o in outs if o.exists()]
    row["crashes"] = [c for r in results for c in r["crashes"]]
    if not old:
        row.update(ledger(row.pop("_submitted"), [s for r in results for s in r["starts"]], raw, keys, replicas))
    client.close()
    raw.close()
    return row


async def _create_groups(settings: RedisSettings) -> None:
    streams = Streams(settings.async_client(), settings.keys(NAMESPACE), "sim-setup", MODEL, 1 << 20)
    await streams.ensure_groups()
    await streams.close()


def measure_work(args, cluster, client, raw, keys, label: str) -> dict:
    submitted: dict[str, float] = {}
    for i in range(args.pickups):  # one at a time at an idle cluster
        submitted[f"idle-{i}"] = submit_one(client, f"idle-{i}")
        time.sleep(args.pickup_gap_s)
    wait_for(lambda: queued(raw, keys) == 0, 60, "the idle jobs")
    time.sleep(1.0)
    before, began = node_counts(cluster), time.monotonic()
    items = [{"prompt": "hi", "max_tokens": 4, "job_id": f"load-{i}"} for i in range(args.jobs)]
    at = time.time()
    client.submit_many(items)
    submit_s = time.monotonic() - began
    submitted.update({item["job_id"]: at for item in items})
    drained_s = wait_for(lambda: queued(raw, keys) == 0, 900, "the load") + submit_s
    load = rates(before, node_counts(cluster), time.monotonic() - began)
    print(f"[{label}] load: {args.jobs} jobs in {drained_s:.1f} s ({args.jobs / drained_s:.0f} jobs/s)", flush=True)
    time.sleep(args.settle_s + 1.0)  # idle again: a second idle window, for the spread
    before = node_counts(cluster)
    time.sleep(args.idle_s)
    idle_after = rates(before, node_counts(cluster), args.idle_s)
    return {"idle_after_nodes": idle_after, "_submitted": submitted, "load_nodes": load, "load_s": drained_s, "jobs": args.jobs,
            "jobs_per_s": args.jobs / drained_s, "submit_s": submit_s}  # fmt: skip


def queued(raw, keys) -> int:
    """Entries still in the request streams (finished ones are deleted) plus pending ones."""
    return sum(raw.xlen(keys.model_requests(MODEL, "interactive", p)) + raw.xlen(keys.requests("interactive", p))
               for p in range(keys.partitions))  # fmt: skip


def ledger(submitted: dict[str, float], starts: list, raw, keys, replicas: int) -> dict:
    """No job lost (each one's hash says done), none run twice (one start each)."""
    started: dict[str, list] = {}
    for job_id, consumer, at, attempt in starts:
        started.setdefault(job_id, []).append((at, consumer, attempt))
    statuses = _statuses(raw, keys, list(submitted))
    idle = [started[j][0][0] - submitted[j] for j in submitted if j.startswith("idle-") and j in started]
    waits_by_partition: dict[int, list[float]] = {}
    per_replica: dict[str, int] = {}
    for job_id, at in submitted.items():
        if job_id.startswith("load-") and job_id in started:
            waits_by_partition.setdefault(keys.partition_of(job_id), []).append(started[job_id][0][0] - at)
            per_replica[started[job_id][0][1]] = per_replica.get(started[job_id][0][1], 0) + 1
    means = [statistics.fmean(w) for w in waits_by_partition.values()]
    counts = sorted(per_replica.get(f"sim-{i}", 0) for i in range(replicas))
    return {
        "submitted": len(submitted),
        "lost": sum(1 for j in submitted if statuses.get(j) != "done"),
        "run_twice": sum(1 for j in submitted if len(started.get(j, [])) > 1),
        "unknown_starts": sum(1 for j in started if j not in submitted),
        "pickup_p50_ms": 1000 * _quantile(idle, 0.5),
        "pickup_p99_ms": 1000 * _quantile(idle, 0.99),
        "pickup_max_ms": 1000 * max(idle, default=float("nan")),
        "pickups": len(idle),
        "partition_wait_mean_s": statistics.fmean(means) if means else None,
        "partition_wait_max_over_min": max(means) / max(min(means), 1e-9) if means else None,
        "jobs_per_replica_min_median_max": [counts[0], counts[len(counts) // 2], counts[-1]],
    }


def _statuses(raw, keys, job_ids: list[str]) -> dict[str, str]:
    out = {}
    for start in range(0, len(job_ids), 2000):
        chunk = job_ids[start : start + 2000]
        pipe = raw.pipeline()
        for job_id in chunk:
            pipe.hget(keys.job(job_id), "status")
        out.update({j: (s or b"").decode() for j, s in zip(chunk, pipe.execute())})
    return out


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for mode, style in (("new", "-o"), ("old", "--s")):
        for replicas in sorted({r["replicas"] for r in rows if r["mode"] == mode}):
            mine = sorted(
                (r for r in rows if r["mode"] == mode and r["replicas"] == replicas), key=lambda r: r["partitions"]
            )
            per = [sum(n["commands_per_s"] for n in r["idle_nodes"]) / replicas for r in mine]
            left.plot([r["partitions"] for r in mine], per, style, label=f"{mode}: {replicas} replicas")
            if mode == "new":
                right.plot(
                    [r["partitions"] for r in mine], [r["pickup_p99_ms"] for r in mine], "-o", label=f"p99, {replicas}"
                )
                right.plot(
                    [r["partitions"] for r in mine], [r["pickup_p50_ms"] for r in mine], ":", label=f"p50, {replicas}"
                )
    if any(r["mode"] == "old" for r in rows):  # 2N scripts (each: EVALSHA + 2 XREADGROUP) every 20 ms
        ns = sorted({r["partitions"] for r in rows})
        left.plot(ns, [2 * n * 50 * 3 for n in ns], ":", color="grey", label="old: on paper")
    for axis, title in ((left, "idle commands/s per replica"), (right, "pickup latency at idle (ms)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("partitions N")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
        axis.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def table(rows: list[dict]) -> str:
    """The markdown table of docs/performance.md."""
    lines = [
        "| layout | replicas | N | idle cmds/s per replica (before / after the load) | idle scripts/s per replica | idle cmds/s per node | "
        "pickup p50 / p99 / max ms | jobs/s | load cmds/s per node | partition wait max/min | jobs per replica min/median/max | lost | run twice |",
        "|---|---:|---:|---:|---:|---|---|---:|---|---:|---|---:|---:|",
    ]
    for r in rows:
        idle = r["idle_nodes"]
        cells = [r["mode"], r["replicas"], r["partitions"],
                 " / ".join(f"{sum(n['commands_per_s'] for n in w) / r['replicas']:.1f}"
                            for w in (idle, r.get("idle_after_nodes")) if w),
                 f"{sum(n['scripts_per_s'] for n in idle) / r['replicas']:.2f}",
                 " / ".join(f"{n['commands_per_s']:.0f}" for n in idle)]  # fmt: skip
        if r["mode"] == "new":
            cells += [f"{r['pickup_p50_ms']:.0f} / {r['pickup_p99_ms']:.0f} / {r['pickup_max_ms']:.0f}",
                      f"{r['jobs_per_s']:.0f}", " / ".join(f"{n['commands_per_s']:.0f}" for n in r["load_nodes"]),
                      f"{r['partition_wait_max_over_min']:.2f}",
                      " / ".join(str(c) for c in r["jobs_per_replica_min_median_max"]), r["lost"], r["run_twice"]]  # fmt: skip
        else:
            cells += ["-"] * 7
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def driver(args) -> None:
    from cluster_harness import ValkeyCluster

    print(f"CPU: {cpu_line()}; Python {platform.python_version()}", flush=True)
    scratch = Path(tempfile.mkdtemp(prefix="scale_sim_"))
    rows = []
    with ValkeyCluster(scratch / "cluster", with_replicas=False, appendfsync="no") as cluster:
        configs = [(r, n, False) for r in args.replicas for n in args.partitions]
        configs += [(r, n, True) for r in args.old_replicas for n in args.partitions]
        for index, (replicas, partitions, old) in enumerate(configs, 1):
            print(
                f"--- {index}/{len(configs)}: {'old' if old else 'new'} layout, {replicas} replicas, N={partitions}",
                flush=True,
            )
            rows.append(run_config(args, cluster, replicas, partitions, old, scratch))
            Path(args.json).write_text(json.dumps({"cpu": cpu_line(), "args": vars(args), "rows": rows}, indent=1))
    plot(rows, Path(args.plot))
    print(f"wrote {args.json} and {args.plot}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, nargs="+", default=[100, 300])
    parser.add_argument("--partitions", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--old-replicas", type=int, nargs="*", default=[], help="replica counts for the old layout")
    parser.add_argument("--workers", type=int, default=4, help="processes the replicas are spread over")
    parser.add_argument("--idle-s", type=float, default=8.0)
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--pickups", type=int, default=40)
    parser.add_argument("--pickup-gap-s", type=float, default=0.15)
    parser.add_argument("--jobs", type=int, default=3000)
    parser.add_argument("--step-ms", type=float, default=50.0, help="the stub engine's time per token")
    parser.add_argument("--json", default=str(REPO / "benchmarks" / "results" / "scale_sim.json"))
    parser.add_argument("--plot", default=str(REPO / "docs" / "scale_sim.png"))
    # a worker process (started by the driver)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--old", action="store_true", help=argparse.SUPPRESS)
    for name in ("--url", "--out", "--stop-file"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name in ("--first", "--count"):
        parser.add_argument(name, type=int, help=argparse.SUPPRESS)
    parser.add_argument("--table", nargs="+", metavar="JSON", help="print the table of these results and plot them")
    args = parser.parse_args()
    if args.table:
        rows = [row for path in args.table for row in json.loads(Path(path).read_text())["rows"]]
        print(table(rows))
        plot(rows, Path(args.plot))
    elif args.worker:
        import uvloop

        uvloop.run(worker_main(args))
    else:
        driver(args)


if __name__ == "__main__":
    main()
