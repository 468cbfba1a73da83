"""Incremental output text with stop strings. No tensors.

Text is released as soon as it can no longer become part of a stop string: the longest tail of the
pending text that is a prefix of some stop string is held back. So a streamed stop string is never
shown, and the concatenation of released chunks equals the final text.
Example: stop ("\\n\\n",), pending "Hello\\n" -> release "Hello", hold "\\n".
"""

from __future__ import annotations

from collections.abc import Sequence

from eaglespec.tokenizer import StreamDecoder


class TextStream:
    def __init__(self, decoder: StreamDecoder, stop: Sequence[str]) -> None:
        self._decoder = decoder
        self._stop = tuple(s for s in stop if s)
        self._pending = ""
        self.text = ""  # everything released so far
        self.stopped = False  # a stop string appeared; nothing more will be released

    def push(self, token_id: int) -> str:
        """Feed one generated token; returns the text newly released (may be empty)."""
        if self.stopped:
            return ""
        self._pending += self._decoder.push(token_id)
        cut = min((i for i in (self._pending.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._pending) - self._held_tail())

    def finish(self) -> str:
        """End of generation: release whatever is still held."""
        if self.stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._release(len(self._pending))

    def _held_tail(self) -> int:
        """Length of the longest suffix of pending text that starts some stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(s[:n]):
                    best = n
                    break
        return best

    def _release(self, upto: int) -> str:
        out, self._pending = self._pending[:upto], self._pending[upto:]
        self.text += out
        return out
