"""The in-process path's weights on 2 MiB pages (LocalExecutor; the daemon's: tests/daemon/test_shared_memory.py)."""
from __future__ import annotations

import os

import pytest

MiB = 1 << 20


def anon_huge_kib_at(addr: int) -> int:
    """AnonHugePages of this process's mapping that holds `addr`, in KiB."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and ":" not in first:
                lo, hi = (int(x, 16) for x in first.split("-"))
                inside = lo <= addr < hi
            elif inside and first == "AnonHugePages:":
                return int(line.split()[1])
    return 0


THP = "/sys/kernel/mm/transparent_hugepage/enabled"


@pytest.mark.skipif(not os.path.exists(THP) or "[madvise]" not in open(THP).read(),
                    reason="transparent huge pages are not 'madvise' here: off (nothing to ask for), or 'always' "
                           "(huge pages without asking: the test could not fail)")
def test_the_in_process_path_keeps_its_weights_on_huge_pages(tmp_path):
    """Coordinator(["local"]) asks for huge pages over its weights before it writes them
    (MADV_HUGEPAGE: "madvise" is many systems' THP setting), so they are on 2 MiB pages."""
    from coordinator import Coordinator
    from ggml_ffi import ffi, lib
    from tiny_models import Dims, write_plain_llama

    path = write_plain_llama(tmp_path / "llama.gguf", Dims(n_embd=256, n_layer=16, n_head=4, n_head_kv=2, n_ff=512),
                             "q8_0")
    with Coordinator(["local"], model=path, n_ctx=64) as c:
        buf = c._endpoints.places[0].executor.buffers[0]
        base, size = int(ffi.cast("uintptr_t", lib.ggml_backend_buffer_get_base(buf))), \
            lib.ggml_backend_buffer_get_size(buf)
        assert size >= 8 * MiB, size  # its middle is inside a whole 2 MiB page
        assert anon_huge_kib_at(base + size // 2) >= 2048, "the weights are not on 2 MiB pages"
