"""What a worker computes, as far as a client must know it before it builds a
graph: the weight types the CPU matmul and get_rows kernels accept, the dot
type each quantized one's matmul takes its input in, and the most experts a
MUL_MAT_ID may choose from. Part of the contract of
GRAPH_COMPUTE (docs/protocol.md), so it lives with the wire format: the
daemon's validation (validation/graph.py) refuses anything else, and the
coordinator checks a model against the same values before it loads one
(coordinator/model/architectures), so it never uploads a model its workers
would refuse.
"""
from __future__ import annotations

from ggml_ffi import lib

FLOAT_TYPES = (lib.GGML_TYPE_F32, lib.GGML_TYPE_F16, lib.GGML_TYPE_BF16)
# weight types the CPU matmul and get_rows kernels accept (those llama and gemma3 GGUFs use)
WEIGHT_TYPES = FLOAT_TYPES + tuple(getattr(lib, f"GGML_TYPE_{n}") for n in (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"))
# the type a weight type's CPU matmul converts src1 to before its dot products (ggml's CPU type traits'
# vec_dot_type): a client may convert one input once into it (CPY, or ggml_cast: CPY onto itself) and
# hand it to every MUL_MAT of weights that share it, instead of each product converting it again
# (feature "dot_type_inputs"); tests/ffi checks this table against the loaded ggml's traits
DOT_TYPES = {getattr(lib, f"GGML_TYPE_{w}"): getattr(lib, f"GGML_TYPE_{d}") for w, d in (
    ("Q4_0", "Q8_0"), ("Q4_1", "Q8_1"), ("Q5_0", "Q8_0"), ("Q5_1", "Q8_1"), ("Q8_0", "Q8_0"),
    ("Q2_K", "Q8_K"), ("Q3_K", "Q8_K"), ("Q4_K", "Q8_K"), ("Q5_K", "Q8_K"), ("Q6_K", "Q8_K"))}
# MUL_MAT_ID's kernel holds n_as (the experts, src0 ne[2]) in a C int and keeps a row map of
# n_as * ids.ne0 * ids.ne1 entries in its work memory; a worker accepts at most this many experts
MAX_EXPERTS = 1024
