"""Programs built on the light client: the OpenAI shapes and Batch API pipeline (shared by
the gateway and `conveyor batch`) and document summarization (`conveyor summarize`)."""
