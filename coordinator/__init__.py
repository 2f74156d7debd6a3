"""Run one GGUF model split across ggml-rpc-server workers.

    import coordinator
    with coordinator.Coordinator(endpoints=["host1:50052", "host2:50052"]) as c:
        print(c.generate("The capital of France is", max_tokens=32))
"""
from coordinator.api import (
    Batch,
    Coordinator,
    DecodeError,
    DecodeResult,
    DoesNotFit,
    EndpointFailure,
    FailureKind,
    default_model_path,
    plan_split,
)
from coordinator.text.tokenizer import Detokenizer, Tokenizer

__all__ = ["Batch", "Coordinator", "DecodeError", "DecodeResult", "DoesNotFit", "EndpointFailure", "FailureKind",
           "default_model_path", "plan_split", "Tokenizer", "Detokenizer"]
