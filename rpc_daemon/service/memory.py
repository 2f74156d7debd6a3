"""The machine's memory, as both sides read it: the daemon for its default
--mem and the free memory DEVICE_INFO reports, the coordinator for what it may
hold itself (the output head's rows it computes). Here, not in daemon/, because
the coordinator needs it without the daemon's modules."""
from __future__ import annotations

import os


def physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """MemAvailable of /proc/meminfo; the physical memory where there is none."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()
