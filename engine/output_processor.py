"""`OutputProcessor`: a request's sampled tokens become its `RequestOutput`s — incremental
detokenization, stop strings, logprobs — one per step, as deltas (core/outputs.py). The engine's step
loop hands it each sampled token; everything about text lives here."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from core.errors import InvalidRequest
from core.outputs import FinishReason, RequestOutput, TokenLogprobs
from core.request import Request, RequestId, RequestStatus
from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.tokenizer import Tokenizer


@dataclass(slots=True)
class _OutputState:
    detok: IncrementalDetokenizer
    matcher: StopStringMatcher | None
    pieces: list[str] = field(default_factory=list)  # the text emitted so far (joined once, at the end)
    logprobs: list[TokenLogprobs] | None = None
    continues_elsewhere: bool = False  # a handoff prefill: reaching max_tokens is not the end of the text
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """The output state of every request an engine tracks (from admission to its final output)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[RequestId, _OutputState] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._states

    def track(self, request: Request, continues_elsewhere: bool = False) -> None:
        """``continues_elsewhere``: the request's ``max_tokens`` is a handoff point (a prefill whose decode
        runs on another worker): text held back there (part of a character, the start of a stop string)
        stays held back — the decode side emits it."""
        params = request.params
        matcher = StopStringMatcher(params.stop, params.include_stop_str_in_output) if params.stop else None
        self._states[request.request_id] = _OutputState(
            detok=IncrementalDetokenizer(
                self.tokenizer, request.prompt_token_ids, params.skip_special_tokens
            ),
            matcher=matcher,
            logprobs=[] if params.logprobs is not None else None,
            continues_elsewhere=continues_elsewhere,
        )

    def replay(self, request: Request, sent: list[int]) -> None:
        """Tokens another worker already streamed become context: their text is not emitted again (a
        held-back start of a stop string stays held back). Replayed one token at a time, as the first
        worker saw them, so the held-back text matches what the client has exactly."""
        state = self._states[request.request_id]
        for token in sent:
            delta = state.detok.add([token])
            if state.matcher is not None:
                delta, hit_stop = state.matcher.feed(delta)
                if hit_stop:
                    del self._states[request.request_id]
                    raise InvalidRequest("the tokens already sent complete a stop string: nothing to decode")
            state.pieces.append(delta)

    def forget(self, request_id: str) -> bool:
        return self._states.pop(RequestId(request_id), None) is not None

    def ended(self, request: Request) -> RequestOutput:
        """The final output of a request ended outside a step (aborted, or its KV pull failed)."""
        return self._output(request, self._states.pop(request.request_id), "", [], None)

    def sampled(
        self,
        request: Request,
        token: int,
        logprobs: TokenLogprobs | None,
        finish: Callable[[Request, FinishReason], None],
    ) -> RequestOutput:
        """The output of a step that sampled ``token`` for ``request`` (already appended to it).
        ``finish`` ends a request that a stop string ended (the scheduler's)."""
        rid = request.request_id
        state = self._states[rid]
        new_logprobs = None
        if state.logprobs is not None and logprobs is not None:
            new_logprobs = [logprobs]
            state.logprobs.append(logprobs)
        stopped_by_token = request.finish_reason is FinishReason.STOP and request.stop_reason == token
        delta = "" if stopped_by_token else state.detok.add([token])
        # At a handoff (length, more to come on the decode worker) held-back text stays held back.
        final = request.is_finished and not (
            state.continues_elsewhere and request.finish_reason is FinishReason.LENGTH
        )
        if final:
            delta += state.detok.flush()  # a character left incomplete at the end shows as U+FFFD
        if state.matcher is not None:
            delta, hit = state.matcher.feed(delta)
            if hit:
                if request.is_finished:  # it also hit max_tokens: the stop string is the reason
                    request.finish_reason = FinishReason.STOP
                else:
                    finish(request, FinishReason.STOP)
                request.stop_reason = state.matcher.stop_string
            elif final and not hit:
                delta += state.matcher.flush()
        out = self._output(request, state, delta, [token], new_logprobs)
        if request.prompt_logprobs is not None and not state.prompt_logprobs_sent:
            out.prompt_logprobs, state.prompt_logprobs_sent = request.prompt_logprobs, True
        if request.is_finished:
            del self._states[rid]
        return out

    @staticmethod
    def _output(
        request: Request,
        state: _OutputState,
        delta: str,
        new_tokens: list[int],
        new_logprobs: list[TokenLogprobs] | None,
    ) -> RequestOutput:
        if delta:
            state.pieces.append(delta)
        out = RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_text=delta,
            new_token_ids=new_tokens,
            num_output_tokens=len(request.output_token_ids),
            new_logprobs=new_logprobs if state.logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
        )
        if request.status is RequestStatus.FINISHED:  # the whole output, built once
            out.finish_reason = request.finish_reason or FinishReason.CANCELLED
            out.stop_reason = request.stop_reason
            out.token_ids = list(request.output_token_ids)
            out.text = "".join(state.pieces)
            out.logprobs = list(state.logprobs) if state.logprobs is not None else None
        return out
