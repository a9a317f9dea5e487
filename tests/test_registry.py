"""The owner registry a supervisor records its mark in: BROOD_OWNERS_DIR names a private one,
and the test suite gives each test its own, so another brood on the machine (another suite
run at the same time) never sweeps a test's processes."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile

import pytest

import brood
from brood.backends.owners import OWNER_ENV, REGISTRY_ENV, registry_dir, sweep_orphans
from brood.testing import leftover_processes
from tests.util import FAST, Gate

RECORD = "from brood.backends.owners import register_owner; print(register_owner())"
SWEEP = "from brood.backends.owners import sweep_orphans; print(sweep_orphans())"


def _python(code: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env
    )
    return done.stdout.strip()


def test_brood_owners_dir_names_the_registry_a_supervisor_records_its_mark_in(
    tmp_path, monkeypatch
):
    folder = tmp_path / "owners"
    monkeypatch.setenv(REGISTRY_ENV, str(folder))
    assert registry_dir() == str(folder)
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700  # made private on first use
    gate = Gate(tmp_path, "held")
    model = brood.ScriptedModel({"root": [f"```repl\n{gate.wait_code}\nFINAL('done')\n```"]})
    with brood.Supervisor(model, limits=FAST, store=f"sqlite:///{tmp_path}/j.db") as sup:
        run = sup.spawn("root")
        assert len(os.listdir(folder)) == 1  # its mark, recorded there
        assert leftover_processes(), "the leftover check reads the registry the mark is in"
        gate.open()
        assert run.wait(60) == "done"
    assert os.listdir(folder) == []  # removed at close
    assert not leftover_processes()


@pytest.mark.parametrize("kind", ["relative", "shared", "missing parent"])
def test_a_registry_folder_that_cannot_be_private_is_refused_naming_the_variable(
    tmp_path, monkeypatch, kind
):
    if kind == "relative":
        given = "owners"
    elif kind == "shared":
        given = str(tmp_path / "open")
        os.mkdir(given)
        os.chmod(given, 0o755)
    else:
        given = str(tmp_path / "no" / "owners")
    monkeypatch.setenv(REGISTRY_ENV, given)
    with pytest.raises(brood.InvalidArgument, match=REGISTRY_ENV) as refused:
        registry_dir()
    assert given in str(refused.value)
    with pytest.raises(brood.InvalidArgument, match=REGISTRY_ENV):
        brood.Supervisor(brood.ScriptedModel([]), limits=FAST, store=f"sqlite:///{tmp_path}/j.db")


def test_each_test_has_a_private_registry_of_its_own():
    here = registry_dir()
    shared = os.path.join(tempfile.gettempdir(), f"brood-owners-{os.getuid()}")
    assert here is not None and here != shared
    assert os.environ[REGISTRY_ENV] == here
    assert stat.S_IMODE(os.stat(here).st_mode) == 0o700
    assert os.listdir(here) == []  # no record of another test's supervisors


def test_another_brood_on_the_machine_does_not_sweep_this_tests_processes(tmp_path):
    """A process left by a supervisor that is gone, recorded in this test's registry: a brood
    started by another suite (its own registry) leaves it alone; this test's sweep takes it."""
    mark = _python(RECORD, dict(os.environ))  # a supervisor that recorded its mark and died
    planted = subprocess.Popen(
        ["sleep", "600"], env=dict(os.environ, **{OWNER_ENV: mark}), start_new_session=True
    )
    try:
        other = tmp_path / "another-suite"
        os.mkdir(other, 0o700)
        swept = _python(SWEEP, dict(os.environ, **{REGISTRY_ENV: str(other)}))
        assert str(planted.pid) not in swept
        assert planted.poll() is None, "another brood swept this test's process"
        assert planted.pid in sweep_orphans()
        assert planted.wait(30) == -signal.SIGKILL
    finally:
        planted.kill()
        planted.wait()
