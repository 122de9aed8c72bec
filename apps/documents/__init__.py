"""Document summarization through the queue (`conveyor summarize`, the `documents` extra):
formats, the limited extraction worker, chunking, prompts, watch mode and the report."""
