"""Serving a Coordinator: the `ggml-coordinator` command (cli.py), the
OpenAI-compatible HTTP server (http_server.py) with continuous batching
(batching.py), and worker daemons started on this machine (local_workers.py)."""
