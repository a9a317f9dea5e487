"""Every test that starts processes ends by checking that none is left behind."""

from __future__ import annotations

import os
import signal

import pytest

from brood.testing import leftover_processes


@pytest.fixture(autouse=True)
def no_leftover_processes():
    yield
    left = leftover_processes()
    for pid in left:  # kill them so one leak does not cascade into the next tests
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes left behind: {left}"


pytest_plugins = ["tests.pg", "tests.flowcheck", "tests.ray_util"]


@pytest.fixture
def gate_clock(monkeypatch):
    """The model gateway's rate-limit gate on a fake clock: its waits are recorded, not
    slept (each advances the clock by its length). Returns the list of waits."""
    import asyncio

    from brood.supervisor import gateway

    now = [0.0]
    waits: list[float] = []

    async def sleep(seconds: float) -> None:
        waits.append(seconds)
        now[0] += seconds
        await asyncio.sleep(0)

    monkeypatch.setattr(gateway, "_now", lambda: now[0])
    monkeypatch.setattr(gateway, "_sleep", sleep)
    return waits
