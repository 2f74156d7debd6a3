"""The worker daemon: config, connections, command handlers, client memory,
tensor cache, limits, metrics, the app (bind/serve/shutdown) and the CLI."""
