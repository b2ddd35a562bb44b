"""Streaming text out of generated token ids: incremental detokenization and stop-string matching.

No torch here; both classes are per-request state owned by whoever streams text to the client.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

_REPLACEMENT = "\ufffd"
# Tokens of prompt context decoded before the first generated token, so that decoders which strip
# a leading space (sentencepiece) or merge across tokens see the same neighbourhood as the full text.
_PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    """What the detokenizer needs from a tokenizer (`engine.tokenizer.Tokenizer` is one)."""

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, never splitting a multi-byte UTF-8 character.

    It keeps only a short window of ids: the first `read_offset` were already emitted and serve as
    context (the vLLM/TGI prefix_offset), the rest are not emitted yet. The delta is
    decode(window) minus decode(context), so each call costs O(window), not O(sequence).
    """

    __slots__ = ("_tokenizer", "_window", "_read_offset", "_skip_special_tokens")

    def __init__(
        self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int], skip_special_tokens: bool = True
    ) -> None:
        self._tokenizer = tokenizer
        self._window = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._read_offset = len(self._window)
        self._skip_special_tokens = skip_special_tokens

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; return the text they complete (possibly "")."""
        self._window.extend(token_ids)
        context_text, full_text = self._decode_window()
        # Hold back while nothing new decoded (e.g. a skipped special token) or while the text ends
        # in U+FFFD: the next byte-level token may complete that character. As in vLLM and TGI, held
        # tokens widen the window until the text ends cleanly; flush() releases a permanent U+FFFD.
        if len(full_text) <= len(context_text) or full_text.endswith(_REPLACEMENT):
            return ""
        return self._advance(context_text, full_text)

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character shows as U+FFFD)."""
        context_text, full_text = self._decode_window()
        return self._advance(context_text, full_text) if len(full_text) > len(context_text) else ""

    def _decode_window(self) -> tuple[str, str]:
        return self._decode(self._window[: self._read_offset]), self._decode(self._window)

    def _advance(self, context_text: str, full_text: str) -> str:
        # The ids just emitted become the next context; older ones are never read again.
        del self._window[: self._read_offset]
        self._read_offset = len(self._window)
        return full_text[len(context_text) :]

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


class StopStringMatcher:
    """Cuts a text stream at the earliest stop string, never emitting a stop string's beginning early.

    Text that could be the start of a stop string is held back until the next delta decides it;
    `flush()` releases it when the request ends for another reason (EOS, max_tokens).
    """

    __slots__ = ("_stops", "_include_stop", "_held", "_matched")

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self._stops = tuple(s for s in stop if s)  # an empty stop string would match everywhere
        self._include_stop = include_stop_str_in_output
        self._held = ""
        self._matched: str | None = None

    @property
    def stopped(self) -> bool:
        return self._matched is not None

    @property
    def stop_string(self) -> str | None:
        """The stop string that ended the stream, if one did."""
        return self._matched

    def feed(self, text_delta: str) -> tuple[str, bool]:
        """Return (text safe to emit now, whether a stop string was reached)."""
        if self._matched is not None:
            return "", True
        text = self._held + text_delta
        match = self._earliest_match(text)
        if match is not None:
            start, stop = match
            self._matched, self._held = stop, ""
            return text[: start + len(stop)] if self._include_stop else text[:start], True
        keep = self._partial_suffix_len(text)
        self._held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], False

    def flush(self) -> str:
        """Release held-back text at the end of a stream that did not stop on a stop string."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str) -> tuple[int, str] | None:
        # Earliest end first: token by token, that stop string is the one completed first.
        # Among those, the earliest start, so that no part of any stop string is emitted.
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0 and (best is None or (start + len(stop), start) < best[:2]):
                best = (start + len(stop), start, stop)
        return None if best is None else (best[1], best[2])

    def _partial_suffix_len(self, text: str) -> int:
        # The held text is shorter than the longest stop string, so `find` above stays O(delta).
        longest = min(len(text), max((len(s) - 1 for s in self._stops), default=0))
        for n in range(longest, 0, -1):
            suffix = text[-n:]
            if any(s.startswith(suffix) for s in self._stops):
                return n
        return 0
