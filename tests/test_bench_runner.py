"""`make bench` (benchmarks/run_all.py) fails when a benchmark cannot run.

run_all is copied beside stand-in benchmarks that fail in each way a real one can: exit
before writing results, write results that cannot be read, hang past the timeout. The
stand-ins start no process of brood's, so these tests stay fast.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

WRITES_ROWS = """import sys
from _common import Row, finish
finish("spawn", [Row("spawn", "a figure", 1.0, "")], [], sys.argv[2])
"""

STAND_INS = {
    "exits": 'raise SystemExit("this benchmark cannot run here")\n',
    "garbled": 'import sys\nopen(sys.argv[2], "w").write("{not json")\n',
    "hangs": "import time\ntime.sleep(60)\n",
}


def run_all(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """run_all on one stand-in benchmark (as bench_spawn), with a 1 s timeout."""
    for f in ("run_all.py", "_common.py"):
        shutil.copy(BENCHMARKS / f, tmp_path / f)
    runner = tmp_path / "run_all.py"
    text = runner.read_text()
    assert "\nTIMEOUT_S = " in text
    runner.write_text(text.replace("\nTIMEOUT_S = ", "\nTIMEOUT_S = 1.0 or ", 1))
    (tmp_path / "bench_spawn.py").write_text(body)
    src = str(BENCHMARKS.parent / "src")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, str(runner), "bench_spawn"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )


def test_a_benchmark_that_runs_passes(tmp_path: Path) -> None:
    proc = run_all(tmp_path, WRITES_ROWS)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 of 1 benchmarks ran" in proc.stdout


@pytest.mark.parametrize("kind", sorted(STAND_INS))
def test_a_benchmark_that_cannot_run_fails_make_bench(tmp_path: Path, kind: str) -> None:
    proc = run_all(tmp_path, STAND_INS[kind])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED  bench_spawn" in proc.stdout
    assert "0 of 1 benchmarks ran; failed: ['bench_spawn']" in proc.stdout
