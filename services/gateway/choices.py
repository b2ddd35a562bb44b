"""`Choices`: the requests of one OpenAI call — ``best_of`` choices for each of its prompts — each run
through the `Dispatcher` as a request of its own (id ``ID-i``, routed, migrated and cancelled alone),
and their outputs merged for the one client that asked.

* Every prompt is validated and tokenized before any choice starts: a bad prompt in a batch fails the
  whole call with its 4xx, and nothing runs.
* Choice j of a prompt samples with the prompt's seed + j (vLLM's rule), so a seeded choice equals a
  single request with that seed, and the choices of an unseeded call differ.
* A prompt is computed once for all its choices: its first choice starts at once, the others once it
  has its second token. By then the prompt's full blocks are in the prefix cache of the worker that
  computed them and of the decode worker that pulled them, so each other choice computes only the
  prompt's last partial block — on the prefill worker, whose decode worker then pulls only what its own
  prefix cache lacks, or, where the scheduler has seen the decode worker's cached blocks, on the decode
  worker itself with no handoff at all (the placer's local-prefill rule). The cost: the other choices'
  first tokens come one inter-token gap and a short prefill after the first one's.
* Usage: each prompt's tokens once, every choice's completion tokens (best_of ones included, as OpenAI
  bills them); the cached tokens are the first choice's.
* Cancelling the call (a disconnect, an error in one choice) cancels every choice.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace

from core.errors import ServingError
from core.outputs import FinishReason
from core.sampling_params import MAX_SEED
from services.gateway.admission import GenerationRequest
from services.gateway.dispatch import Dispatcher
from services.gateway.openai_api import OpenAICall
from services.gateway.openai_responses import ChoiceOutput
from services.gateway.request_stream import Delta, Finished, RequestStream, Timings, Usage

Event = tuple["Choice", Delta | Finished]


@dataclass(slots=True)
class Choice:
    """One choice of the call: which prompt, its request, and its stream once submitted."""

    index: int  # prompt × best_of + j; the answer's index (best_of reorders at the end)
    prompt: int
    request: GenerationRequest
    prompt_tokens: int
    stream: RequestStream | None = None
    output: Delta | None = None  # collected (non-streaming)
    finished: Finished | None = None


class Choices:
    """The choices of one call; `start` them, then iterate `events` (streaming) or `collect` them."""

    def __init__(
        self, dispatcher: Dispatcher, call: OpenAICall, request_id: str | None, api_key: str
    ) -> None:
        self.dispatcher = dispatcher
        self.call = call
        self.id = request_id or uuid.uuid4().hex
        self.api_key = api_key
        self.choices: list[Choice] = []
        # Bounded: a slow client's tokens wait in each choice's own stream, which fails past its limit.
        self._queue: asyncio.Queue[Event | tuple[Choice, ServingError]] = asyncio.Queue(1)
        self._tasks: list[asyncio.Task[None]] = []  # what feeds the events
        self._starters: list[asyncio.Task[None]] = []  # each prompt's choices after its first
        self._cancelled = False

    async def start(self) -> None:
        """Validates every prompt (raising the first one's error), then starts the choices."""
        prepared = await asyncio.gather(
            *(self.dispatcher.prepare(replace(r, api_key=self.api_key)) for r in self.call.requests)
        )
        per_prompt = self.call.best_of
        single = len(prepared) * per_prompt == 1
        for p, ((ids, params), request) in enumerate(zip(prepared, self.call.requests, strict=True)):
            for j in range(per_prompt):
                index = p * per_prompt + j
                child = GenerationRequest(
                    # seed + j, wrapped into the seed range (prepare always sets a seed)
                    params=replace(params, seed=((params.seed or 0) + j) % (MAX_SEED + 1)),
                    prompt_token_ids=tuple(ids),
                    request_id=self.id if single else f"{self.id}-{index}",
                    model=request.model,
                    timeout_s=request.timeout_s,
                    api=request.api,
                    api_key=self.api_key,
                )
                self.choices.append(Choice(index, p, child, len(ids)))
            group = self.choices[p * per_prompt :]
            # The first choice's placement charges the tenant for all of them, before any runs.
            others = tuple(c.request.request_id or "" for c in group[1:])
            group[0].request = replace(group[0].request, siblings=others)
            for c in group[1:]:
                c.request = replace(c.request, precharged=True)
        loop = asyncio.get_running_loop()
        for p in range(len(prepared)):
            group = self.choices[p * per_prompt : (p + 1) * per_prompt]
            self._submit(group[0])  # raises for the first prompt: a draining gateway, a duplicate id
            self._tasks.append(loop.create_task(self._pump(group[0])))
            if len(group) > 1:
                self._starters.append(loop.create_task(self._start_rest(group[0], group[1:])))
        if len(self.choices) > 1:  # a Cancel by the call's id reaches every choice, started or not
            self.dispatcher.calls[self.id] = self.cancel

    def _submit(self, choice: Choice) -> None:
        choice.stream = self.dispatcher.submit(choice.request)

    async def _start_rest(self, first: Choice, rest: list[Choice]) -> None:
        """The prompt's other choices, once its first one decodes (its prompt is cached by then)."""
        assert first.stream is not None
        await first.stream.decoding.wait()
        loop = asyncio.get_running_loop()
        for choice in rest:
            try:
                self._submit(choice)
            except ServingError as e:
                await self._queue.put((choice, e))
                continue
            self._tasks.append(loop.create_task(self._pump(choice)))

    async def _pump(self, choice: Choice) -> None:
        assert choice.stream is not None
        try:
            async for event in choice.stream:
                await self._queue.put((choice, event))
        except ServingError as e:
            await self._queue.put((choice, e))

    async def events(self) -> AsyncIterator[Event]:
        """Every choice's deltas and finish as they come; a choice's error is raised (the call fails)."""
        left = len(self.choices)
        while left:
            choice, event = await self._queue.get()
            if isinstance(event, ServingError):
                raise event
            if isinstance(event, Finished):
                choice.finished = event
                left -= 1
            yield choice, event

    async def collect(self) -> list[ChoiceOutput]:
        """Every choice's whole output; with best_of, the n best of each prompt (by the sum of their
        tokens' log-probabilities), numbered in that order."""
        async for choice, event in self.events():
            if isinstance(event, Delta):
                if choice.output is None:
                    choice.output = Delta([], "")
                choice.output.extend(event)
        outputs = []
        n, per_prompt = self.call.n, self.call.best_of
        for p in range(len(self.call.requests)):
            group = self.choices[p * per_prompt : (p + 1) * per_prompt]
            if per_prompt > n:
                group = sorted(group, key=lambda c: -sum(lp.logprob for lp in _output(c).logprobs))[:n]
            for rank, c in enumerate(group):
                assert c.finished is not None
                outputs.append(
                    ChoiceOutput(
                        p * n + rank, _output(c), c.finished, self.echo(c), c.request.prompt_token_ids or ()
                    )
                )
        return outputs

    def echo(self, choice: Choice) -> str:
        """The prompt's text to send before the choice's output ("" without echo)."""
        if not self.call.echo:
            return ""
        request = self.call.requests[choice.prompt]
        if request.prompt is not None:
            return request.prompt
        return self.dispatcher.tokenizer.decode(list(choice.request.prompt_token_ids or ()))

    def usage(self) -> Usage:
        """The call's usage so far: each prompt once, every choice's tokens."""
        prompt = cached = completion = 0
        for c in self.choices:
            if c.index % self.call.best_of == 0:
                prompt += c.prompt_tokens
                cached += c.finished.usage.cached_tokens if c.finished is not None else 0
            if c.finished is not None:
                completion += c.finished.usage.completion_tokens
            elif c.stream is not None:
                completion += c.stream.num_tokens
        return Usage(prompt, completion, cached)

    def cancel(self, reason: str) -> None:
        """Cancels every choice still running, and every choice not started yet: each ends with a
        cancelled finish in `events` (one not started, with no tokens)."""
        if self._cancelled:
            return
        self._cancelled = True
        loop = asyncio.get_running_loop()
        for task in self._starters:
            task.cancel()
        for c in self.choices:
            if c.stream is not None:
                c.stream.cancel(reason)
            else:
                ended = Finished(FinishReason.CANCELLED, Usage(c.prompt_tokens, 0), Timings())
                self._tasks.append(loop.create_task(self._queue.put((c, ended))))

    async def close(self, reason: str) -> None:
        """`cancel`, then stops the tasks that feed the events."""
        self.cancel(reason)
        self.dispatcher.calls.pop(self.id, None)
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _output(choice: Choice) -> Delta:
    return choice.output if choice.output is not None else Delta([], "")
