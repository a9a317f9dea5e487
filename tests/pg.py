"""A real PostgreSQL server for the tests, started from the Debian package's binaries.

The server runs in a temporary folder, listens only on a Unix socket, and is stopped at the
end of the session. Tests that need it skip, with the reason, only when no server can be
started here (no postgresql package). BROOD_TEST_PG_URL points the tests at a server of
your own instead.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import pytest

START_TIMEOUT_S = 60


def _bin(name: str) -> str | None:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return found[-1] if found else shutil.which(name)


def _as_postgres(cmd: list[str]) -> list[str]:
    # initdb refuses to run as root; the Debian package creates a `postgres` user.
    if os.geteuid() == 0:
        return ["runuser", "-u", "postgres", "--", *cmd]
    return cmd


PREFIX = "brood-pg-"
OWNER = "owner"  # the pid of the test process that started the server in that folder


def _sweep_stale(pg_ctl: str) -> None:
    """Stop and remove the servers of test processes that are gone (killed before their
    `finally` ran); another live session's server is left alone."""
    for base in glob.glob(os.path.join(tempfile.gettempdir(), PREFIX + "*")):
        try:
            with open(os.path.join(base, OWNER)) as f:
                owner = int(f.read())
            os.kill(owner, 0)
            continue  # its session still runs
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # not ours to judge: no owner recorded, or it cannot be read
        subprocess.run(
            _as_postgres([pg_ctl, "-D", os.path.join(base, "data"), "-m", "immediate", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


class NoPostgres(Exception):
    """No PostgreSQL server can be started here; the message says why."""


@contextmanager
def local_postgres(port: str, *options: str) -> Iterator[str]:
    """A PostgreSQL server on a Unix socket in a temporary folder (`-c` settings
    `options` added); its URL. Stopped and removed after. Raises NoPostgres when none can
    be started here."""
    initdb, pg_ctl = _bin("initdb"), _bin("pg_ctl")
    if not initdb or not pg_ctl:
        raise NoPostgres(
            "no PostgreSQL server can be started here: install the Debian package "
            "`postgresql` (.ci/run does), or set BROOD_TEST_PG_URL"
        )
    if os.geteuid() == 0:
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            raise NoPostgres(
                "running as root and there is no `postgres` user to run the server"
            ) from None
    _sweep_stale(pg_ctl)
    base = tempfile.mkdtemp(prefix=PREFIX)
    data, sock = os.path.join(base, "data"), os.path.join(base, "sock")
    os.makedirs(sock)
    with open(os.path.join(base, OWNER), "w") as f:
        f.write(str(os.getpid()))  # a later session stops it if this one is killed
    if os.geteuid() == 0:
        for path in (base, sock):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    settings = " ".join(f"-c {o}" for o in ("listen_addresses=''", "fsync=off", *options))
    try:
        subprocess.run(
            _as_postgres([initdb, "-D", data, "-U", "postgres", "-A", "trust", "--no-sync"]),
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S,
        )
        subprocess.run(
            _as_postgres(
                [
                    pg_ctl,
                    "-D",
                    data,
                    "-w",
                    "-t",
                    str(START_TIMEOUT_S),
                    "-l",
                    os.path.join(base, "log"),
                    "-o",
                    f"-k {sock} -p {port} {settings}",
                    "start",
                ]
            ),
            check=True,
            capture_output=True,
            timeout=START_TIMEOUT_S + 10,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        out = getattr(exc, "stderr", b"") or b""
        shutil.rmtree(base, ignore_errors=True)
        raise NoPostgres(
            f"PostgreSQL could not be started: {out.decode(errors='replace')[-500:]}"
        ) from exc
    try:
        yield f"postgresql://postgres@/postgres?host={sock}&port={port}"
    finally:
        subprocess.run(
            _as_postgres([pg_ctl, "-D", data, "-m", "immediate", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(base, ignore_errors=True)


def new_database(server_url: str, prefix: str = "brood_") -> str:
    """The URL of a new, empty database on the server at `server_url`."""
    import psycopg

    name = prefix + os.urandom(4).hex()
    with psycopg.connect(server_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    base, _, query = server_url.partition("?")
    return f"{base.rsplit('/', 1)[0]}/{name}?{query}"


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    url = os.environ.get("BROOD_TEST_PG_URL")
    if url:
        yield url
        return
    with ExitStack() as stack:
        try:
            url = stack.enter_context(local_postgres("54329"))
        except NoPostgres as exc:
            pytest.skip(str(exc))
        yield url


@pytest.fixture
def fresh_pg_url(postgres_url: str) -> Iterator[str]:
    """A new, empty database on the test server for one test."""
    import psycopg

    url = new_database(postgres_url)
    yield url
    name = url.partition("?")[0].rsplit("/", 1)[1]
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
