"""`expire_later`: a waiter's own timeout, as a timer that fails the future with `Expired` — cheaper on a
hot path than wrapping each wait in `asyncio.wait_for`, and kept apart from any TimeoutError raised
around it."""

from __future__ import annotations

import asyncio
from typing import Any


class Expired(Exception):
    """The waiter's time ran out (set on it by its timer)."""


def expire_later(waiter: asyncio.Future[Any], timeout_s: float) -> asyncio.TimerHandle:
    """Fails ``waiter`` with `Expired` after ``timeout_s`` unless it is done by then; cancel the handle
    once it is."""
    return asyncio.get_running_loop().call_later(timeout_s, _expire, waiter)


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(Expired())
