"""ModelAnnouncer: publishes what light clients need about the served model (name, context,
EOS, chat template, tokenizer) under ``<ns>:model:<name>``, at start and periodically (the
hash has a TTL, so a model nobody serves any more disappears)."""
import asyncio

from actors.base import Actor
from actors.streams import Streams
from clients.model_info import MODEL_INFO_REPUBLISH_S, ModelInfo, publish_model_info_async
from engine import LLMEngine

MODEL_INFO_TTL_S = 3600


class ModelAnnouncer(Actor):
    name = "model-announcer"

    def __init__(self, streams: Streams, engine: LLMEngine, model_name: str):
        super().__init__()
        self.streams = streams
        self.info = ModelInfo.from_hf_tokenizer(
            name=model_name, max_model_len=min(engine.max_model_len, engine.inputs.max_pool_tokens),
            eos_token_ids=engine.spec.eos_token_ids, tokenizer=engine.tokenizer)

    async def run(self) -> None:
        while not self.stopped:
            await self.streams.resilient(lambda: publish_model_info_async(
                self.streams.redis, self.streams.keys, self.info, ttl_s=MODEL_INFO_TTL_S), "publish model info")
            await asyncio.sleep(MODEL_INFO_REPUBLISH_S)
