"""What one request did, as the client saw it: the `RequestRecord` a target fills in and results reads."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class RequestRecord:
    """One request's timeline (``time.perf_counter`` seconds) and outcome.

    ``chunk_times`` are the arrival times of the streamed chunks that carried output (text, or token ids
    on gRPC); ``chunk_tokens`` how many tokens each carried (1 per chunk over HTTP, where chunks carry
    text only). ``error`` is "" for a success, else a one-line message whose class is ``error_kind``
    (``grpc:CODE``, ``http:STATUS``, ``connection``, ``timeout``, ``stream``, ``empty``).
    """

    index: int
    prompt_len: int  # the workload's count (exact with a tokenizer)
    max_tokens: int
    tenant: str | None = None
    warmup: bool = False
    start: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    generated_text: str = ""
    output_tokens: int | None = None  # the server's count (gRPC token ids, or HTTP usage) when it gives one
    server_prompt_tokens: int | None = None  # usage.prompt_tokens when the server reports it
    cached_tokens: int | None = None  # prompt tokens the server served from its prefix cache
    server_timings: dict[str, float] | None = None  # Baton gRPC: Completion.timings, milliseconds
    error: str = ""
    error_kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        """Send → first chunk with output, seconds (0.0 when none came, as vLLM records it)."""
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def itl(self) -> list[float]:
        """Gaps between successive output chunks, seconds."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def latency(self) -> float:
        """Send → the stream's end (end-to-end latency), seconds."""
        return self.end - self.start if self.end else 0.0

    def fail(self, kind: str, message: str, now: float) -> None:
        """Marks the request failed (the first failure wins)."""
        if not self.error:
            self.error_kind, self.error = kind, " ".join(message.split())[:300] or kind
        self.end = self.end or now
