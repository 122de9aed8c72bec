"""Owns the model weights and the KV cache tensors; executes step plans.

It mirrors just enough per-sequence state (tokens, block table, sampling params) to turn
the scheduler's compact plan into flat, unpadded batch tensors.
"""

import collections
import contextlib
import dataclasses
import logging
from dataclasses import dataclass, field

import torch

from conveyor.engine.attention_metadata import AttentionMetadata, PrefillSpan, pack_prefills
from conveyor.engine.config import EngineConfig
from conveyor.engine.cuda_graphs import DecodeGraphs, graph_buckets
from conveyor.engine.distributed.group import RankGroup, rank_device
from conveyor.engine.distributed.launcher import Workers
from conveyor.engine.distributed.pipeline import StageLink, check_pipelinable, keep_stage, run_stage
from conveyor.engine.distributed.shard import check_shardable, shard_model
from conveyor.engine.distributed.step_message import Tail, encode_step, sampled_tails
from conveyor.engine.grammar_masks import GrammarMasks, GrammarState
from conveyor.engine.lora.manager import LoRAManager
from conveyor.engine.models.decoder_layout import decoder_layout
from conveyor.engine.models.layers import PagedAttention
from conveyor.engine.models.loader import ARCHITECTURES, ModelSpec, build_model, gguf_kernel_mode, native_quantization
from conveyor.engine.plan import ScheduledSeq, StepPlan, StepResult
from conveyor.engine.prompt_logprobs import PromptSpan, prompt_span, score_prompt
from conveyor.engine.sampler import Sampler, SamplingRow
from conveyor.engine.spec_decode.verifier import verify
from conveyor.engine.vllm_options import kv_budget_from_utilization
from conveyor.kernels.cpu.dispatch import cpu_auto_dtype, cpu_flags
from conveyor.kernels.prepare import prepare

log = logging.getLogger(__name__)
CPU_KV_CACHE_BYTES = 1 << 30
CUDA_KV_CACHE_FRACTION = 0.5  # of the memory free after the weights are loaded


@dataclass
class RunnerSeq(SamplingRow):
    block_table: list[int] = field(default_factory=list)
    grammar: GrammarState | None = None  # structured outputs: its matcher (kept across preemption)
    lora_request: object | None = None  # engine.LoRARequest (None: the base model)


@dataclass
class InputBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor
    sampling_ids: list[str]
    prompt_spans: list[PromptSpan] = field(default_factory=list)  # prompt positions to score
    row_loras: list = field(default_factory=list)  # each token's LoRARequest or None (enable_lora only)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_attention_backend(name: str, device: torch.device) -> str:
    """``auto``: Triton on CUDA where it is installed, else the torch reference; ``triton``
    where it cannot run is refused with the reason."""
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return "torch"
    from conveyor.kernels.triton import unusable_reason

    reason = unusable_reason(device.type)
    if name == "auto":
        return "torch" if reason else "triton"
    if reason is not None:
        raise ValueError(f"attention_backend='triton' on {device.type}: {reason}")
    return "triton"


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto" and device.type == "cpu":  # the fastest on the CPU found (kernels/cpu/dispatch.py)
        dtype, why = cpu_auto_dtype(cpu_flags())
        log.info("dtype auto on CPU: %s (%s)", str(dtype).removeprefix("torch."), why)
        return dtype
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def resolve_kv_cache_dtype(
    config: EngineConfig, dtype: torch.dtype, attention_backend: str, approximate_matmuls: bool
) -> torch.dtype:
    """The KV cache's element (``config.kv_cache_dtype``): the model's ``dtype``, or bfloat16
    under float32 activations on the CPU's torch backend, whose kernels widen it as they read
    (float32 sums). "auto" takes that where the model's matmuls already round (a .gguf model's
    bfloat16 copy, dtype=auto on bf16 hardware, or its int8 activations, gguf_int8:
    ``approximate_matmuls``): decode attention reads half the bytes; a float checkpoint, or
    dtype=float32 with float32 activations, keeps a float32 cache (token-exact)."""
    name = config.kv_cache_dtype
    if name == "auto":
        mixed = approximate_matmuls and dtype == torch.float32 and attention_backend == "torch"
        return torch.bfloat16 if mixed else dtype
    wanted = {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    mixed_on_cpu = wanted == torch.bfloat16 and dtype == torch.float32 and attention_backend == "torch"
    if wanted != dtype and not mixed_on_cpu:
        raise ValueError(
            f"kv_cache_dtype: {name} with dtype {str(dtype).removeprefix('torch.')} on the {attention_backend} "
            "attention backend is not supported (auto, the model's dtype, or bfloat16 under float32 on CPU)"
        )
    return wanted


class ModelRunner:
    def __init__(self, config: EngineConfig, spec: ModelSpec, max_model_len: int, tp: RankGroup | None = None):
        """``tp``: a follower rank's group (engine/tp_worker.py); rank 0 starts the other
        ranks itself when ``config.tensor_parallel_size`` or ``pipeline_parallel_size`` > 1."""
        self.config = config
        self.max_model_len = max_model_len
        self.block_size = config.block_size
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.attention_backend = resolve_attention_backend(config.attention_backend, self.device)
        self.workers: Workers | None = None  # rank 0 of a parallel group: the other ranks
        self.tp = tp or self._start_workers(spec)
        if self.tp is not None:
            self.device = rank_device(self.device, self.tp.global_rank % (config.world_size // config.nnodes))
        # how CPU layers run GGUF blocks (a CUDA model ignores it, so nothing is refused there)
        gguf_mode = gguf_kernel_mode(config.quantization, config.dtype) if self.device.type == "cpu" else "blocks"
        approximate_matmuls = (
            self.tp is None
            and gguf_mode in ("bf16_copy", "int8")
            and native_quantization(spec, config.quantization, self.dtype, self.device)
        )
        self.kv_dtype = resolve_kv_cache_dtype(config, self.dtype, self.attention_backend, approximate_matmuls)
        if self.tp is None:
            self.model = build_model(spec, max_model_len, self.dtype, self.device, config.quantization)
            # the CPU's compiled whole-model decoder has its own attention: not with Triton's
            layout = decoder_layout if self.attention_backend == "torch" else None
            self.backend = prepare(self.model, self.device, layout, gguf_mode=gguf_mode)
        else:  # float shards on the layers' path (the compiled decoder has no all-reduce)
            self.model = self._build_share(spec)
            self.backend = prepare(self.model, self.device)
        self.lora = (
            LoRAManager(self.model, config.max_loras, config.max_lora_rank, self.dtype, self.device)
            if config.enable_lora
            else None
        )  # after prepare: it wraps the backend's projections
        self._tails: list[Tail] = []  # rank 0: what the last step sampled, sent with the next plan
        # pipeline parallel: this rank's hand-offs, and (rank 0) its steps in flight, oldest first
        self.link = self._stage_link(spec)
        self._launched: collections.deque = collections.deque()
        self.attention_layers = [m for m in self.model.modules() if isinstance(m, PagedAttention)]
        self._bind_triton_kernels()
        self.num_blocks = self._allocate_kv_cache()
        self.graphs = self._capture_decode_graphs()
        self.sampler = Sampler(
            self.device, config.seed, fused=self.attention_backend == "triton" and self.device.type == "cuda"
        )
        self.grammar_masks = GrammarMasks(spec.hf_config.vocab_size)
        self.seqs: dict[str, RunnerSeq] = {}

    def _bind_triton_kernels(self) -> None:
        if self.attention_backend != "triton":
            return
        from conveyor.kernels import layer_ops
        from conveyor.kernels.triton import attention

        for layer in self.attention_layers:
            layer.triton = attention
        if self.device.type == "cuda":  # the fused norms and SiLU-and-mul too (CPU has its own)
            layer_ops.use_triton_on_cuda()

    def _capture_decode_graphs(self) -> DecodeGraphs | None:
        """CUDA graphs for decode-only steps: on CUDA with the Triton backend (whose kernels
        take padded rows), one process, unless ``enforce_eager``."""
        if (
            self.device.type != "cuda"
            or self.attention_backend != "triton"
            or self.config.enforce_eager
            or self.tp is not None
        ):
            return None
        graphs = DecodeGraphs(
            self.model, graph_buckets(self.config.max_num_seqs), -(-self.max_model_len // self.block_size), self.device
        )
        graphs.capture()
        log.info("CUDA graphs captured for decode batches %s", graphs.buckets)
        return graphs

    def _start_workers(self, spec: ModelSpec) -> RankGroup | None:
        size, stages = self.config.tensor_parallel_size, self.config.pipeline_parallel_size
        if size * stages == 1:
            return None
        model_class = ARCHITECTURES[spec.model_type][0]
        if stages > 1:
            check_pipelinable(model_class, spec.hf_config, stages, self.config.quantization)
        if size > 1:
            check_shardable(
                model_class, spec.hf_config, size, self.config.quantization, self.config.enable_expert_parallel
            )
        # every rank computes in rank 0's dtype, whatever "auto" would pick on its own host
        same_dtype = dataclasses.replace(self.config, dtype=str(self.dtype).removeprefix("torch."))
        self.workers = Workers(same_dtype, self.max_model_len, rank_device(self.device, 0))
        return self.workers.group

    def _build_share(self, spec: ModelSpec):
        """This rank's layers (its pipeline stage's), split by heads and columns (its tensor
        shard), built on the CPU so a device never holds more than its share."""
        model = build_model(spec, self.max_model_len, self.dtype, torch.device("cpu"), "none")
        if self.tp.num_stages > 1:
            keep_stage(model, self.tp.stage, self.tp.num_stages)
        if self.tp.size > 1:
            shard_model(model, self.tp.rank, self.tp.size, self.tp)
        return model.to(self.device)

    def _stage_link(self, spec: ModelSpec) -> StageLink | None:
        if self.tp is None or self.tp.num_stages == 1:
            return None
        return StageLink(self.tp, spec.hf_config.hidden_size, self.dtype)

    def close(self) -> None:
        """Stops the other parallel ranks (nothing to do without them)."""
        if self.workers is not None:
            self.workers.close(self.link)

    # ---- KV cache --------------------------------------------------------------------
    def _allocate_kv_cache(self) -> int:
        first = self.attention_layers[0]
        per_block = (
            2
            * len(self.attention_layers)
            * self.block_size
            * first.num_kv_heads
            * first.head_dim
            * self.kv_dtype.itemsize
        )
        # never more than every running sequence at full length could use
        useful = -(-self.config.max_num_seqs * self.max_model_len // self.block_size)
        num_blocks = self.config.num_kv_blocks or max(1, min(useful, self._kv_budget_bytes() // per_block))
        if self.tp is not None:  # every rank's pool has the same block ids
            with self.workers.failures() if self.workers else contextlib.nullcontext():
                num_blocks = self.tp.agree_min(num_blocks)
        shape = (len(self.attention_layers), first.num_kv_heads, num_blocks, self.block_size, first.head_dim)
        # zeros, not empty: padded decode slots are masked, but 0 * NaN would still be NaN
        self.k_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.kv_dtype, device=self.device)
        for index, layer in enumerate(self.attention_layers):
            layer.k_cache, layer.v_cache = self.k_cache[index], self.v_cache[index]
        log.info(
            "KV cache: %d blocks of %d tokens, %s (%.0f MiB)",
            num_blocks,
            self.block_size,
            str(self.kv_dtype).removeprefix("torch."),
            num_blocks * per_block / 2**20,
        )
        return num_blocks

    def _kv_budget_bytes(self) -> int:
        if self.config.kv_cache_bytes is not None:
            return self.config.kv_cache_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            if self.config.gpu_memory_utilization is not None:
                return kv_budget_from_utilization(self.config.gpu_memory_utilization, total, free)
            return int(free * CUDA_KV_CACHE_FRACTION)
        return CPU_KV_CACHE_BYTES

    # ---- one step --------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        if self.workers is None:
            return self._execute(plan)
        if self.link is not None:  # one step through the whole pipeline
            self.launch(plan)
            return self.finish(plan)
        with self.workers.watch():  # rank 0: the plan to the others first, who run the same forward
            self.tp.send_step(encode_step(plan, self._tails))
            result = self._execute(plan)
        self._tails = sampled_tails(plan, [*result.seq_ids, *result.errors], self.seqs)
        return result

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> None:
        """Rank 0 under pipeline parallel: the plan to stage 0's other ranks, stage 0's layers,
        then the plan and its activations on to stage 1; ``finish`` takes the step's result
        once the last stage is done (several steps may be in flight meanwhile)."""
        with self.workers.watch():
            message = encode_step(plan, self._tails)
            self._tails = []
            if self.tp.size > 1:
                self.tp.send_step(message)
            self._apply_deltas(plan)
            pending = activations = None
            if plan.scheduled:
                batch = self._prepare(plan.scheduled)
                activations = run_stage(self.model, batch, None, first=True, last=False)
                pending = (batch, self._rows(batch))
            self.link.send_on(message, activations)
        self._launched.append((plan.step_id, pending))

    @torch.inference_mode()
    def finish(self, plan: StepPlan) -> StepResult:
        """The oldest launched step's result: the last stage's hidden states, logits, sampling."""
        step_id, pending = self._launched.popleft()
        assert step_id == plan.step_id, (step_id, plan.step_id)
        if pending is None:
            return StepResult()
        batch, rows = pending
        with self.workers.watch():
            hidden = self.link.receive_final(batch.input_ids.shape[0])
        result = self._sample(plan, batch, hidden, rows)
        self._tails += sampled_tails(plan, [*result.seq_ids, *result.errors], self.seqs)
        return result

    @torch.inference_mode()
    def follow(self, plan: StepPlan, tails: list[Tail], activations=None):
        """A follower rank's step: rank 0's sampled tokens, the plan's deltas, the forward
        (its all-reduces are the only result under tensor parallel; a pipeline stage's
        output goes on to the next); no logits, no sampling."""
        for seq_id, start, token_ids in tails:
            del self.seqs[seq_id].token_ids[start:]
            self.seqs[seq_id].token_ids.extend(token_ids)
        self._apply_deltas(plan)
        if not plan.scheduled:
            return None
        batch = self._prepare(plan.scheduled)
        if self.link is None:
            return self._forward(batch)
        last = self.tp.stage == self.tp.num_stages - 1
        return run_stage(self.model, batch, activations, first=self.tp.stage == 0, last=last)

    def tp_stats(self) -> dict:
        return self.tp.stats() if self.tp is not None else {}

    @torch.inference_mode()
    def _execute(self, plan: StepPlan) -> StepResult:
        self._apply_deltas(plan)
        if not plan.scheduled:
            return StepResult()
        batch = self._prepare(plan.scheduled)
        return self._sample(plan, batch, self._forward(batch), self._rows(batch))

    def _rows(self, batch: InputBatch) -> dict[str, RunnerSeq]:
        """The sequences a step samples or scores (held by the step: one aborted while it is
        in flight leaves the runner before the step ends)."""
        return {seq_id: self.seqs[seq_id] for seq_id in [*batch.sampling_ids, *(s.seq_id for s in batch.prompt_spans)]}

    def _sample(self, plan: StepPlan, batch: InputBatch, hidden: torch.Tensor, rows_by_id: dict) -> StepResult:
        logits = self.model.compute_logits(hidden[batch.logits_indices])
        rows = [rows_by_id[seq_id] for seq_id in batch.sampling_ids]
        drafts = {item.seq_id: item.draft_token_ids for item in plan.scheduled if item.draft_token_ids}
        if drafts:  # speculative: a token at every verified position, the agreeing drafts kept
            result = verify(self.sampler, logits, batch.sampling_ids, rows, drafts, self.grammar_masks)
            result.prompt_logprobs = self._prompt_logprobs(batch, hidden, rows_by_id)
            return result
        masked = self.grammar_masks.apply(logits, rows)
        token_ids, logprobs = self.sampler(logits, rows)
        failed = self.grammar_masks.accept(rows, token_ids, masked)
        for row, token_id in zip(rows, token_ids):
            row.token_ids.append(token_id)  # also a failed row's: a step already planned counts on it
        result = _result(batch.sampling_ids, token_ids, logprobs, failed)
        result.prompt_logprobs = self._prompt_logprobs(batch, hidden, rows_by_id)
        return result

    def _prompt_logprobs(self, batch: InputBatch, hidden: torch.Tensor, rows_by_id: dict) -> dict:
        scored = {}
        for span in batch.prompt_spans:
            seq = rows_by_id[span.seq_id]
            scored[span.seq_id] = (
                span.start + 1,
                score_prompt(hidden, self.model.compute_logits, span, seq.token_ids, seq.params.prompt_logprobs),
            )
        return scored

    def _forward(self, batch: InputBatch) -> torch.Tensor:
        """Final hidden states: the backend's whole-model decoder where it serves the step,
        else the model's layers."""
        meta, tokens = batch.meta, batch.input_ids.shape[0]
        with_adapters = self.lora is not None and self.lora.set_batch(batch.row_loras)
        # captured graphs and the backend's whole-model decoder hold the base projections: steps without adapters only
        if not with_adapters and self.graphs is not None and self.graphs.serves(tokens, meta):
            return self.graphs.replay(batch.input_ids, batch.positions, meta)
        if not with_adapters and meta.num_decode_tokens == tokens and self.backend.decodes(tokens):
            return self.backend.decode(
                batch.input_ids, batch.positions, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens
            )
        return self.model(batch.input_ids, batch.positions, meta)

    def _apply_deltas(self, plan: StepPlan) -> None:
        for seq_id in plan.finished_ids:
            self.seqs.pop(seq_id, None)
        for new in plan.new_seqs:
            self.seqs[new.seq_id] = self._runner_seq(new)
        for seq_id in plan.preempted_ids:
            self.seqs[seq_id].block_table = []
        for seq_id, num_blocks in plan.trimmed_tables.items():
            del self.seqs[seq_id].block_table[num_blocks:]
        for item in plan.scheduled:
            self.seqs[item.seq_id].block_table.extend(item.new_block_ids)
            self.seqs[item.seq_id].token_ids.extend(item.draft_token_ids)  # verify() keeps the right ones

    def _runner_seq(self, new) -> RunnerSeq:
        """The runner's copy of a new sequence. A resumed one (outputs an earlier attempt
        published) has its seeded generator and its grammar where they would be after those
        outputs: one draw per sampled token (as speculation rewinds), each token accepted."""
        num_prompt = len(new.token_ids) if new.num_prompt_tokens is None else new.num_prompt_tokens
        carried = new.token_ids[num_prompt:]
        generator = None
        if new.params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(new.params.seed)
            if carried:
                self.sampler.advance(generator, len(carried), self.grammar_masks.vocab_size)
        grammar = GrammarState(new.grammar) if new.grammar else None
        if grammar is not None and carried:
            grammar.resume(carried)
        return RunnerSeq(
            new.params,
            list(new.token_ids),
            num_prompt,
            new.min_tokens_stop_ids,
            generator,
            grammar=grammar,
            lora_request=new.lora_request,
        )

    def _prepare(self, scheduled: list[ScheduledSeq]) -> InputBatch:
        # decodes (one new token, or one and its drafts) first: they share one batched attention call
        ordered = sorted(scheduled, key=lambda s: not _decodes(s))
        input_ids, positions, logits_indices, sampling_ids, prompt_spans, row_loras = [], [], [], [], [], []
        decode_tables, decode_lens, prefills, prefill_tables = [], [], [], []
        for item in ordered:
            seq = self.seqs[item.seq_id]
            start, end = item.num_computed, item.num_computed + item.num_new
            assert end <= len(seq.token_ids)
            offset = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            row_loras += [seq.lora_request] * item.num_new if self.lora is not None else []
            if _decodes(item):  # each verified draft too: a decode query over the cache up to itself
                decode_tables += [seq.block_table] * item.num_new
                decode_lens += range(start + 1, end + 1)
            else:
                prefills.append(PrefillSpan(offset, offset + item.num_new, start, self._tensor(seq.block_table)))
                prefill_tables.append(seq.block_table)
            if end == len(seq.token_ids):  # logits at the last token and at each draft
                last = offset + item.num_new
                logits_indices += range(last - 1 - len(item.draft_token_ids), last)
                sampling_ids.append(item.seq_id)
            span = prompt_span(item, offset, seq.num_prompt_tokens) if seq.params.prompt_logprobs is not None else None
            if span is not None:
                prompt_spans.append(span)
        num_decode = len(decode_lens)
        positions_t = self._tensor(positions)
        meta = AttentionMetadata(self._slots(ordered, positions_t), num_decode, prefills=prefills)
        if prefills and self.attention_backend == "triton":
            meta.packed_prefills = pack_prefills(prefills, prefill_tables, self.device)
        if num_decode:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables])
            meta.decode_context_lens = self._tensor(decode_lens)
        return InputBatch(
            self._tensor(input_ids),
            positions_t,
            meta,
            self._tensor(logits_indices),
            sampling_ids,
            prompt_spans,
            row_loras,
        )

    def _slots(self, ordered: list[ScheduledSeq], positions: torch.Tensor) -> torch.Tensor:
        """Flat cache slot of every token: block_table[pos // block_size] * block_size + pos % block_size."""
        tables = [self.seqs[s.seq_id].block_table for s in ordered]
        width = max(len(t) for t in tables)
        table_rows = self._tensor([t + [0] * (width - len(t)) for t in tables])
        row_of_token = torch.repeat_interleave(
            torch.arange(len(ordered), device=self.device), self._tensor([s.num_new for s in ordered])
        )
        blocks = table_rows[row_of_token, positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def _tensor(self, values) -> torch.Tensor:
        if self.device.type == "cuda":  # from pinned host memory, copied without waiting for the device
            return torch.tensor(values, dtype=torch.long, pin_memory=True).to(self.device, non_blocking=True)
        return torch.tensor(values, dtype=torch.long, device=self.device)


def _result(seq_ids: list[str], token_ids: list[int], logprobs: dict, failed: dict[int, str]) -> StepResult:
    """The step's tokens; a row whose structured output failed gets its error instead."""
    kept = [index for index in range(len(seq_ids)) if index not in failed]
    return StepResult(
        [seq_ids[i] for i in kept],
        [token_ids[i] for i in kept],
        {seq_ids[i]: lp for i, lp in logprobs.items() if i not in failed},
        errors={seq_ids[i]: reason for i, reason in failed.items()},
    )


def _decodes(item: ScheduledSeq) -> bool:
    return item.num_new == 1 or bool(item.draft_token_ids)
