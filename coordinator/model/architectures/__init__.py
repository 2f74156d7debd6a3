"""Architectures: each module gives hparams(gguf) (which also refuses the variants it
does not compute), embed(builder, tokens), layer(builder, il, x, positions),
extra_weights(tensor names) (what every stage holds besides its layers) and
FALLBACK_CHAT_TEMPLATE; the output head is shared (common.py). What differs between
architectures lives here."""
from coordinator.model.architectures import gemma3, llama, phi3, qwen2, qwen3, qwen3moe

ARCHITECTURES = {"llama": llama, "qwen2": qwen2, "qwen3": qwen3, "phi3": phi3, "gemma3": gemma3, "qwen3moe": qwen3moe}


def architecture(name: str):
    try:
        return ARCHITECTURES[name]
    except KeyError:
        raise ValueError(f"architecture {name!r} is not supported (supported: {', '.join(ARCHITECTURES)})") from None
