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


pytest_plugins = ["tests.pg", "tests.flowcheck"]
