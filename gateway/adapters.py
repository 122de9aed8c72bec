"""LoRA adapters by model name: a request's `model` may be a published model, `base:adapter`,
or an adapter's own name (as vLLM lists them); the job then names the base model (its
streams) and the adapter in `lora`. /v1/models lists each adapter with its `parent`."""

from __future__ import annotations

from conveyor.gateway.tenants import ServedModel, Tenant


async def resolve_model(tenant: Tenant, fields: dict) -> ServedModel:
    """The live base model of `fields["model"]`, with fields rewritten for an adapter."""
    name = fields["model"]
    models = await tenant.models.published()
    base, _, adapter = name.rpartition(":")
    if name not in models and base in models and adapter in models[base].adapters:
        fields.update(model=base, lora=adapter)
    elif name not in models:
        owner = next((m for m in models.values() if name in m.adapters), None)
        if owner is not None:
            fields.update(model=owner.name, lora=name)
    return await tenant.models.require(fields["model"])


def adapter_objects(models: list[ServedModel]) -> list[dict]:
    return [
        {
            "id": adapter,
            "object": "model",
            "created": int(model.published_at),
            "owned_by": "conveyor",
            "parent": model.name,
            "root": model.name,
            "max_model_len": model.max_model_len,
        }
        for model in models
        for adapter in model.adapters
    ]
