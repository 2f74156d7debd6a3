"""Test-only code: the test entry point (daemon_cli.py: ggml-rpc-server's flags plus --test-fault and
--unsafe-no-validation) and fault injection (faults.py: the specs and what they do;
faulty_connection.py: the connections that do it). The production CLI has neither flag."""
