"""Serving a Coordinator: the `ggml-coordinator` command (cli.py; its
commands in generate.py, benchmark.py and lifecycle.py), the
OpenAI-compatible HTTP server (http_server.py over the pure openai_api.py,
llama_server_api.py, access.py, health.py and metrics.py) with continuous
batching (batching.py), and worker daemons started on this machine
(local_workers.py). docs/architecture.md, "The HTTP server", maps them."""
