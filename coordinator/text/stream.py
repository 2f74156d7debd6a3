"""Generated tokens to the text a caller may see, shared by generate/stream and
the HTTP batcher."""
from __future__ import annotations

from typing import Sequence

from coordinator.text.tokenizer import Detokenizer, Tokenizer


class TextStream:
    """Feed tokens, get text back: decoded incrementally (never half a UTF-8
    character), cut before the first stop string, and holding back the tail
    that could be the start of one. After a stop string `stopped` is set and
    nothing more comes; text still held back when a step fails is simply never
    asked for."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()):
        if isinstance(stop, str):  # one stop string, not a set of characters
            stop = (stop,)
        self.stop = tuple(stop)
        self.stopped = False
        self._detok = Detokenizer(tokenizer)
        self._hold = max((len(s) - 1 for s in self.stop), default=0)
        self._text, self._emitted = "", 0

    @property
    def decoded(self) -> int:
        """Characters decoded so far, those held back included: where the next token's text starts."""
        return len(self._text)

    @property
    def stop_word(self) -> str:
        """The stop string the text ended at ("" if it did not)."""
        if not self.stopped:
            return ""
        return min((s for s in self.stop if s in self._text), key=lambda s: (self._text.find(s), -len(s)))

    def feed(self, token: int) -> str:
        """The text that became safe to show with `token` (maybe "")."""
        self._text += self._detok.feed(token)
        cut = min((self._text.find(s) for s in self.stop if s in self._text), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._take(cut)
        return self._take(len(self._text) - self._hold)

    def finish(self) -> str:
        """The end: what was held back (nothing after a stop string)."""
        if self.stopped:
            return ""
        self._text += self._detok.flush()
        return self._take(len(self._text))

    def _take(self, end: int) -> str:
        if end <= self._emitted:
            return ""
        piece, self._emitted = self._text[self._emitted:end], end
        return piece
