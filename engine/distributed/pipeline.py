"""Pipeline parallel (``pipeline_parallel_size`` = P > 1): the decoder layers split into P
contiguous stages, each on its own ranks (with its own tensor split inside), each rank
holding the KV cache of its layers only. A step's plan and its activations (the hidden
states and the residual stream) go from every rank to the same tensor rank of the next
stage; the last stage's final (normed) hidden states go back to rank 0, which holds the
embedding and the head, computes the logits and samples. Rank 0 keeps up to P steps in
flight (the scheduler plans a step without the sequences of the ones in flight, as vLLM's
virtual engines do), so the stages work on different steps at the same time. Every stage
runs the plans in order, so a KV block released in one step and reused by the next is
never written out of turn."""

import collections
import time

import torch
from torch import nn

from conveyor.engine.errors import ModelLoadError
from conveyor.engine.models.llama import LlamaForCausalLM

STOP = -1  # a plan length that means: no more steps
HEADER_TAG, PLAN_TAG, ACTIVATION_TAG, FINAL_TAG = 11, 12, 13, 14
MAX_SENDS_IN_FLIGHT = 16  # hand-offs not yet taken by the next stage before a send waits


def stage_layers(num_layers: int, num_stages: int, stage: int) -> range:
    """The layers of ``stage``: contiguous, the first stages one more where they do not divide."""
    base, extra = divmod(num_layers, num_stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


def check_pipelinable(model_class, hf_config, num_stages: int, quantization: str) -> None:
    """ModelLoadError naming what cannot be split into ``num_stages`` stages."""
    if model_class is not LlamaForCausalLM:
        raise ModelLoadError(
            f"pipeline_parallel_size={num_stages}: only the Llama family (Llama, Mistral, Qwen2, "
            f"Qwen3, Mixtral, Qwen-MoE) can be split into stages; run this model with pipeline_parallel_size=1"
        )
    layers = hf_config.num_hidden_layers
    if layers < num_stages:
        raise ModelLoadError(
            f"pipeline_parallel_size={num_stages}: the model has {layers} layers, fewer than the stages"
        )
    if quantization == "gguf":
        raise ModelLoadError(
            f"pipeline_parallel_size={num_stages}: GGUF blocks are not split; use quantization='auto' "
            f"or 'none' (the stages' layers are then dequantized)"
        )


def keep_stage(model: LlamaForCausalLM, stage: int, num_stages: int) -> None:
    """Drops every layer but this stage's (before the KV cache is sized: it holds these only)."""
    layers = model.model.layers
    model.model.layers = nn.ModuleList(layers[i] for i in stage_layers(len(layers), num_stages, stage))


def run_stage(model: LlamaForCausalLM, batch, inputs, first: bool, last: bool):
    """This stage's layers on the step's tokens: from the embedding (``first``) or the
    previous stage's ``inputs`` (hidden states, residual); returns the next stage's
    inputs, or the last stage's final hidden states (normed, as the head takes them)."""
    if first:
        x, residual = model.model.embed_tokens(batch.input_ids), None
    else:
        x, residual = inputs
    cos_sin = model.rotary(batch.positions)
    for layer in model.model.layers:
        x, residual = layer(x, residual, cos_sin, batch.meta)
    if not last:
        return x, residual
    return model.model.norm(x, residual)[0].to(model.model.norm.weight.dtype)


class StageLink:
    """One rank's hand-offs on the pipe group: what it receives from the previous stage and
    sends to the next (and, at the last stage's tensor rank 0, back to rank 0). Sends do not
    wait for the receiver (a stage may still be busy with an earlier step) until
    MAX_SENDS_IN_FLIGHT are queued; their tensors are kept until they are taken."""

    def __init__(self, group, hidden_size: int, dtype: torch.dtype):
        self.group, self.pipe = group, group.pipe
        self.hidden_size, self.dtype = hidden_size, dtype
        n, stage = group.size, group.stage
        self.previous = (stage - 1) * n + group.rank if stage > 0 else None
        self.next = (stage + 1) * n + group.rank if stage + 1 < group.num_stages else None
        self.sends: collections.deque = collections.deque()

    # ---- stage to stage ------------------------------------------------------------------
    def send_on(self, message: bytes | None, activations=None) -> None:
        """The plan (None: stop) and, for a plan that scheduled tokens, its (hidden, residual)."""
        if self.next is None:
            return
        if message is None:
            self._send(torch.tensor([STOP, 0], dtype=torch.int64), self.next, HEADER_TAG)
            return
        num_tokens = 0 if activations is None else activations[0].shape[0]
        self._send(torch.tensor([len(message), num_tokens], dtype=torch.int64), self.next, HEADER_TAG)
        self._send(torch.frombuffer(bytearray(message), dtype=torch.uint8), self.next, PLAN_TAG)
        if num_tokens:
            self._send(torch.stack(activations).to(self.dtype).contiguous(), self.next, ACTIVATION_TAG)

    def receive(self):
        """(plan message or None at stop, (hidden, residual) or None)."""
        header = self._receive(torch.empty(2, dtype=torch.int64), self.previous, HEADER_TAG)
        length, num_tokens = (int(v) for v in header.tolist())
        if length == STOP:
            return None, None
        message = self._receive(torch.empty(length, dtype=torch.uint8), self.previous, PLAN_TAG)
        if not num_tokens:
            return message.cpu().numpy().tobytes(), None
        both = self._receive(
            torch.empty(2, num_tokens, self.hidden_size, dtype=self.dtype), self.previous, ACTIVATION_TAG
        )
        return message.cpu().numpy().tobytes(), (both[0], both[1])

    # ---- the last stage and rank 0 -------------------------------------------------------
    def send_final(self, hidden: torch.Tensor) -> None:
        """The last stage's tensor rank 0: a step's final hidden states to rank 0."""
        if self.next is None and self.group.rank == 0:
            self._send(hidden.to(self.dtype).contiguous(), 0, FINAL_TAG)

    def receive_final(self, num_tokens: int) -> torch.Tensor:
        """Rank 0: the final hidden states of its oldest step in flight (the wait counted)."""
        last_stage = (self.group.num_stages - 1) * self.group.size
        started = time.perf_counter()
        hidden = self._receive(torch.empty(num_tokens, self.hidden_size, dtype=self.dtype), last_stage, FINAL_TAG)
        self.group.seconds_waiting_on_stages += time.perf_counter() - started
        return hidden

    def _send(self, tensor: torch.Tensor, to: int, tag: int) -> None:
        tensor = tensor.cpu()  # the pipe group is gloo, through host memory (group.py)
        self.sends.append((self.pipe.send([tensor], to, tag), tensor))
        self.group.bytes_handed_on += tensor.numel() * tensor.element_size()
        while self.sends and (len(self.sends) > MAX_SENDS_IN_FLIGHT or self.sends[0][0].is_completed()):
            self.sends.popleft()[0].wait()

    def _receive(self, tensor: torch.Tensor, source: int, tag: int) -> torch.Tensor:
        self.pipe.recv([tensor], source, tag).wait()
        return tensor.to(self.group.device)
