"""The per-step engine: admission, the KV cell table, a step through the stages and the head,
micro-batches in flight, resuming after a lost worker, and generation on top (docs/architecture.md)."""
