"""Service plumbing shared by the daemon and the coordinator: signals and
shutdown, sd_notify, structlog set-up, the hop tracer, the machine's memory."""
