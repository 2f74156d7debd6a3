"""Text: tokenizers (SentencePiece, byte-level BPE), streaming detokenized text, sampling."""
