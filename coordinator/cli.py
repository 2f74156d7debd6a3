"""Kept for entry points installed before the CLI moved to coordinator.serving.cli."""
from coordinator.serving.cli import main

__all__ = ["main"]
