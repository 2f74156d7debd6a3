"""The compute processes: the parent-side pool (one process per client, a spare),
the link between them, and the child (`python -m rpc_daemon.compute.worker`)."""
