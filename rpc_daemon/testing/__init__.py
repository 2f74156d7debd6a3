"""Test-only code: fault injection (--test-fault). Imported only when a test flag is given."""
