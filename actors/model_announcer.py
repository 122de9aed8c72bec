"""ModelAnnouncer: publishes what light clients need about the served model (name, context,
EOS, chat template, tokenizer) under ``<ns>:model:<name>``, and the operator's queue bound
under ``<ns>:limits`` (the submit script enforces it), at start and periodically (both have
a TTL, so what nobody serves any more disappears)."""

import asyncio
import dataclasses
import logging

from redis.exceptions import ResponseError

from actors.base import Actor
from actors.log_limits import RateLimitedLog, shown
from actors.streams import Streams
from clients.model_info import MODEL_INFO_REPUBLISH_S, ModelInfo
from engine.engine_core import CoreFacts

MODEL_INFO_TTL_S = 3600
log = logging.getLogger(__name__)


class ModelAnnouncer(Actor):
    name = "model-announcer"

    def __init__(
        self,
        streams: Streams,
        facts: CoreFacts,
        tokenizer,
        model_name: str,
        max_queue_len: int | None = None,
        max_tokens_cap: int | None = None,
        lora_adapters: tuple[str, ...] = (),
    ):
        super().__init__()
        self.streams = streams
        # what producers should know of the operator's limits (the submit script and the gateway read them)
        self.limits = {
            name: value
            for name, value in (("max_queue_len", max_queue_len), ("max_tokens_cap", max_tokens_cap))
            if value
        }
        self.info = ModelInfo.from_hf_tokenizer(
            name=model_name,
            max_model_len=min(facts.max_model_len, facts.max_pool_tokens),
            eos_token_ids=facts.eos_token_ids,
            tokenizer=tokenizer,
        )
        self.info = dataclasses.replace(self.info, lora_adapters=tuple(lora_adapters))

    async def run(self) -> None:
        warnings = RateLimitedLog(log)
        while not self.stopped:
            try:
                await self.streams.publish_model_info(self.info, MODEL_INFO_TTL_S)
            except ResponseError as exc:  # e.g. a producer replaced <ns>:models by another type
                warnings.warning("publish", "cannot publish the model info: %s", shown(str(exc), 200))
            if self.limits:
                await self.streams.publish_limits(self.limits, MODEL_INFO_TTL_S)
            await asyncio.sleep(MODEL_INFO_REPUBLISH_S)
