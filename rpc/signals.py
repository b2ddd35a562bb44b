"""`stop_requested`: how a serving command (`baton worker`, `baton scheduler`, `baton gateway`) learns
that it should stop cleanly."""

from __future__ import annotations

import asyncio
import signal


def stop_requested() -> asyncio.Event:
    """An event set at SIGINT or SIGTERM, its handlers installed now on the running loop (before the
    server starts, so a signal during start-up is not lost): await it, then stop the server."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop
