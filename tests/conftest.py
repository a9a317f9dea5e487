"""What every test gets: a private owner registry, and a check that no process is left behind.

Each test has its own registry of owner marks (BROOD_OWNERS_DIR, see brood.backends.owners),
in a folder of this test session alone: the supervisors a test starts, in this process or in
a CLI subprocess (which inherits the variable), record their marks there and sweep only what
is recorded there. So two suites running at once on one machine, or a user's own brood beside
them, never sweep each other's processes, and the leftover check reads the registry the
test's supervisors wrote. The Ray tests share one cluster per module, whose node agents keep
the environment they started with: they use the session's registry instead.

The session has its own temporary folder (TMPDIR, and `tempfile`'s default), removed when
it ends: what its supervisors make there (private journals, scratch and control folders),
even those a test kills, goes with it; each test also sweeps the folders of the supervisors
it killed, as the next supervisor's start-up would.

A user's own BROOD_STORE, BROOD_MODEL and BROOD_TOKEN do not reach the tests.
"""

from __future__ import annotations

import os
import shutil
import signal
import tempfile
from collections.abc import Iterator
from itertools import count

import pytest

from brood.backends.owners import REGISTRY_ENV, registry_dir, sweep_orphans
from brood.testing import leftover_processes

USER_SETTINGS = ("BROOD_STORE", "BROOD_MODEL", "BROOD_TOKEN")

_tests = count(1)


@pytest.fixture(scope="session", autouse=True)
def suite_folder(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A folder of this session alone, holding the owner registries (each mode 0700) and the
    session's temporary folder; the session's own registry is set for everything started
    before a test's (Ray's nodes)."""
    tmp_path_factory.getbasetemp()  # pytest's own stays where it was
    folder = tempfile.mkdtemp(prefix="brood-suite-")
    os.chmod(folder, 0o711)  # others may pass through to the temporary folder, not list it
    temp = os.path.join(folder, "tmp")
    os.mkdir(temp)
    os.chmod(temp, 0o1777)  # like /tmp: a test may hand a folder in it to another user
    names = ("TMPDIR", REGISTRY_ENV, *USER_SETTINGS)
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ[REGISTRY_ENV] = os.path.join(folder, "owners")
    os.environ["TMPDIR"] = tempfile.tempdir = temp
    try:
        yield folder
    finally:
        tempfile.tempdir = None
        for name in names:
            os.environ.pop(name, None)
        os.environ.update({k: v for k, v in saved.items() if v is not None})
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def private_registry(request: pytest.FixtureRequest, suite_folder: str) -> Iterator[str | None]:
    """This test's own owner registry (the session's for the Ray tests: see above)."""
    if request.node.get_closest_marker("ray") is not None:
        yield registry_dir()
        return
    session = os.environ[REGISTRY_ENV]
    folder = os.path.join(suite_folder, f"owners-{next(_tests)}")
    os.environ[REGISTRY_ENV] = folder
    try:
        yield registry_dir()
    finally:
        sweep_orphans()  # the folders of the supervisors the test killed, before the records go
        os.environ[REGISTRY_ENV] = session
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_leftover_processes(private_registry: str | None) -> Iterator[None]:
    """Every test that starts processes ends by checking that none is left behind (read from
    the test's registry, before it is given up)."""
    assert private_registry is not None, "the test's owner registry is not private"
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
