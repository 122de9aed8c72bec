"""The OpenAI API's shapes (requests to jobs, results to responses, errors) and the Batch API's
pipeline (files, batches, their runner): shared by the HTTP gateway (gateway/) and `conveyor batch`.
No HTTP server code here."""
