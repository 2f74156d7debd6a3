"""Text: tokenizers (SentencePiece, byte-level BPE), streaming detokenized text, sampling."""
# every tokenizer class, so Tokenizer.from_gguf finds the one a GGUF names (Tokenizer.register)
from coordinator.text import tokenizer_bpe  # noqa: F401
from coordinator.text.tokenizer import Detokenizer, Tokenizer  # noqa: F401
