"""`AsyncEngine`: one engine thread per worker, and the small object where asyncio code meets it.

The engine (torch) runs only on its own thread, from its construction on; grpc.aio handlers run on the
event loop. They meet
here: commands go in through a thread-safe inbox (``call``), outputs come out through one bounded
``OutputStream`` per request. The engine thread never blocks on a client: a stream that falls too far
behind is ended with an error for that request alone, so a slow reader cannot stall the batch.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from core.errors import CapacityExceeded, InvalidRequest, ServingError, Unavailable
from core.outputs import RequestOutput
from engine.llm_engine import LLMEngine

log = logging.getLogger(__name__)

T = TypeVar("T")

IDLE_WAIT_S = 0.05  # how often an idle engine thread runs its service hooks (lease expiry)
TRANSFER_WAIT_S = 0.001  # the pause between polls while only KV pulls are in flight


class OutputStream:
    """A request's outputs, pushed by the engine thread and read on the event loop.

    ``pending`` counts outputs pushed but not yet read; the engine thread reads it to detect a slow
    reader (a plain int, written under the GIL by one thread each side)."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, max_pending: int) -> None:
        self.request_id = request_id
        self.max_pending = max_pending
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.pushed = 0
        self.taken = 0
        self.closed = False

    @property
    def pending(self) -> int:
        return self.pushed - self.taken

    def push(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: queue an output (or the error that ends the stream) on its own."""
        self.pushed += 1
        self.loop.call_soon_threadsafe(self._queue.put_nowait, item)

    def stage(self, item: RequestOutput | BaseException) -> None:
        """Engine thread: count an output that `AsyncEngine` hands over with the rest of its step."""
        self.pushed += 1

    def put(self, item: RequestOutput | BaseException) -> None:
        """Event loop: deliver a staged output."""
        self._queue.put_nowait(item)

    async def get(self) -> RequestOutput:
        """Event loop: the next output; raises the error that ended the stream."""
        item = await self._queue.get()
        self.taken += 1
        if isinstance(item, BaseException):
            raise item
        return item


class AsyncEngine:
    """Owns the engine thread. ``service`` hooks run on it between steps and while idle."""

    engine: LLMEngine
    max_pending_outputs: int
    service_hooks: list[Callable[[], object]]
    _inbox: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]]]
    _wake: threading.Event
    _streams: dict[str, OutputStream]
    _stop: bool
    _thread: threading.Thread
    _ready: Future[None] | None
    _factory: Callable[[], LLMEngine] | None
    num_slow_reader_aborts: int
    num_steps: int
    on_abort: Callable[[float], object] | None

    def __init__(self, engine: LLMEngine, max_pending_outputs: int = 256) -> None:
        self.engine = engine
        self._ready: Future[None] | None = None
        self._factory: Callable[[], LLMEngine] | None = None
        self._setup(max_pending_outputs)

    @classmethod
    async def launch(cls, factory: Callable[[], LLMEngine], max_pending_outputs: int = 256) -> AsyncEngine:
        """Builds the engine *on the engine thread* and starts it there.

        So every torch op of the process runs on that one thread. Each thread that starts parallel
        torch work gets its own OpenMP team; with two teams libgomp counts more threads than cores on a
        small machine and stops its workers spin-waiting between ops, so every op pays a futex wake-up
        (about 10% of decode throughput on two cores). One team keeps them spinning, like the offline
        engine's."""
        self = cls.__new__(cls)
        self._setup(max_pending_outputs)
        self._factory = factory
        self._ready = Future()
        self._thread.start()
        await asyncio.wrap_future(self._ready)
        return self

    def _setup(self, max_pending_outputs: int) -> None:
        self.max_pending_outputs = max_pending_outputs
        self.service_hooks = []
        self._inbox = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams = {}
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.num_slow_reader_aborts = 0
        self.num_steps = 0
        self.on_abort = None  # hears how long each `abandon` took, asked -> blocks freed (metrics)

    def start(self) -> None:
        """Starts the engine thread of an engine built elsewhere (`launch` starts its own)."""
        if self._factory is None:
            self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)

    # ------------------------------------------------------------------ the event-loop side
    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Runs ``fn(engine)`` on the engine thread between two steps and returns its result."""
        if self._stop:
            raise Unavailable("the engine is shutting down")
        fut: Future[T] = Future()
        self._inbox.put((fn, fut))
        self._wake.set()
        return await asyncio.wrap_future(fut)

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Queues ``fn(engine)`` without waiting for it: for cleanup from a handler being cancelled,
        where awaiting is no longer possible."""
        self._inbox.put((fn, Future()))
        self._wake.set()

    def open_stream(self, request_id: str) -> OutputStream:
        """Registers where a request's outputs go; call before the request is added to the engine."""
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use on this worker")
        stream = OutputStream(request_id, asyncio.get_running_loop(), self.max_pending_outputs)
        self._streams[request_id] = stream
        return stream

    def close_stream(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            stream.closed = True

    def abandon(self, request_id: str, abort: Callable[[LLMEngine], bool]) -> None:
        """Event loop: the caller of a request went away. Between two steps, the engine thread closes
        its stream and runs ``abort`` (which drops the request and frees its blocks; True if it found
        it). Closing the stream there, not here, means no step can see the stream gone and drop the
        request on its own first, so ``on_abort`` hears of every abort it caused."""
        asked = time.monotonic()

        def run(engine: LLMEngine) -> bool:
            self.close_stream(request_id)
            found = abort(engine)
            if found and self.on_abort is not None:
                self.on_abort(time.monotonic() - asked)
            return found

        self.post(run)

    # ------------------------------------------------------------------ the engine thread
    def _run(self) -> None:
        if self._factory is not None and self._ready is not None:
            try:
                self.engine = self._factory()
            except BaseException as e:
                self._stop = True
                self._ready.set_exception(e)
                return
            self._ready.set_result(None)
        engine = self.engine
        while not self._stop:
            self._drain_inbox()
            for hook in self.service_hooks:
                try:
                    hook()
                except Exception:
                    log.exception("engine service hook failed")
            if not engine.has_unfinished:
                self._wake.wait(IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug or a device error: fail every request, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            self.num_steps += 1
            staged: list[tuple[OutputStream, RequestOutput]] = []
            for out in outputs:
                self._deliver(out, staged)
            if staged:  # one wake-up of the event loop per step, not one per request
                loop = staged[0][0].loop
                loop.call_soon_threadsafe(_put_all, staged)
            if not outputs and not engine.scheduler.has_unfinished:
                self._wake.wait(TRANSFER_WAIT_S)  # only pulls in flight: poll them, don't spin
                self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as e:
                fut.set_exception(e)

    def _deliver(self, out: RequestOutput, staged: list[tuple[OutputStream, RequestOutput]]) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            if not out.finished:  # nobody listens (the caller went away): stop the work
                self.engine.abort_request(out.request_id)
            return
        if out.finished:
            self._streams.pop(out.request_id, None)
        elif stream.pending >= stream.max_pending:
            # A slow reader: end this request only. The engine never waits for a client.
            self._streams.pop(out.request_id, None)
            self.engine.abort_request(out.request_id)
            self.num_slow_reader_aborts += 1
            log.warning(
                "request %s: client too slow (%d outputs unread); aborted", out.request_id, stream.pending
            )
            stream.push(
                CapacityExceeded(
                    f"the client did not read {stream.pending} outputs in time; request aborted",
                    retry_after_s=0.0,
                )
            )
            return
        stream.stage(out)
        staged.append((stream, out))

    def end_streams(self, error: ServingError, abort: Callable[[str], object]) -> int:
        """Engine thread: ends every open stream with ``error`` once ``abort(request_id)`` has dropped
        its request here (a draining worker hands its requests back). Returns how many it ended."""
        streams = list(self._streams.items())
        for rid, stream in streams:
            abort(rid)
            self._streams.pop(rid, None)
            stream.push(error)
        return len(streams)

    def _fail_all(self, error: Exception) -> None:
        err = error if isinstance(error, ServingError) else ServingError("internal engine error")
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            stream.push(err)
        self._streams.clear()


def _put_all(staged: list[tuple[OutputStream, RequestOutput]]) -> None:
    for stream, out in staged:
        stream.put(out)
