"""`services.supervisor`: a child that dies is started again after a backoff that doubles with each
quick death and resets once it has run a while; `processes.json` says which pid is which. Real
processes (a shell that exits at once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from services.supervisor import BACKOFF_S, MAX_BACKOFF_S, STABLE_S, Child, Supervisor

pytestmark = pytest.mark.unit


def dying(tmp_path: Path) -> Supervisor:
    child = Child("quitter", ["/bin/sh", "-c", "exit 3"], "127.0.0.1:1", tmp_path / "q.log")
    sup = Supervisor([child], state_path=tmp_path / "processes.json")
    sup.start_phase(child.phase)
    assert child.proc is not None and child.proc.wait(10) == 3
    return sup


def test_a_dead_child_is_started_again_after_a_doubling_backoff(tmp_path: Path) -> None:
    sup = dying(tmp_path)
    child = sup.children[0]
    t0 = child.started_at
    backoffs = []
    for n in range(1, 7):
        assert child.proc is not None
        child.proc.wait(10)
        died_at = child.started_at + 0.1  # a quick death
        (event,) = sup.supervise(died_at)
        assert "quitter exited (3)" in event
        assert child.restart_at is not None
        backoffs.append(round(child.restart_at - died_at, 3))
        assert sup.supervise(child.restart_at - 0.01) == [], "not before its backoff is over"
        old = child.proc.pid
        (event,) = sup.supervise(child.restart_at)
        assert "started again" in event and child.restarts == n and child.proc.pid != old
        assert json.loads((tmp_path / "processes.json").read_text())[0] == {
            "name": "quitter",
            "pid": child.proc.pid,
            "address": "127.0.0.1:1",
            "restarts": n,
            "pool": "",
            "retiring": False,
        }
    assert backoffs == [
        BACKOFF_S * 2**i if BACKOFF_S * 2**i < MAX_BACKOFF_S else MAX_BACKOFF_S for i in range(6)
    ]
    assert child.started_at > t0


def test_a_child_that_ran_a_while_starts_again_at_the_first_backoff(tmp_path: Path) -> None:
    sup = dying(tmp_path)
    child = sup.children[0]
    child.quick_deaths = 5  # it had been dying quickly …
    sup.supervise(child.started_at + STABLE_S + 1)  # … but this time it ran for a minute
    assert child.restart_at == pytest.approx(child.started_at + STABLE_S + 1 + BACKOFF_S)


def test_stop_ends_a_child_that_is_waiting_for_its_restart(tmp_path: Path) -> None:
    sup = dying(tmp_path)
    sup.supervise(sup.children[0].started_at + 0.1)
    sup.stop(grace_s=1)  # nothing to signal, nothing raised
    assert sup.children[0].proc is not None and sup.children[0].proc.poll() == 3
