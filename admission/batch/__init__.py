"""The OpenAI Batch API: files and batches on the sidecar (api), their state in Redis (store),
and the workers that run the lines through the edge (worker)."""
