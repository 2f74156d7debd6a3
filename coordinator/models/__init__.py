"""Architectures: each module gives hparams(gguf), embed(builder, tokens) and
layer(builder, il, x, positions); the output head is shared (common.py)."""
from coordinator.models import gemma3, llama

ARCHITECTURES = {"llama": llama, "gemma3": gemma3}


def architecture(name: str):
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})") from None
