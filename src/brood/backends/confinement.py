"""What the supervisor decides about its workers' confinement (DESIGN.md section 14).

The mechanisms themselves are applied inside each worker by `brood.worker.confine`; this
module turns `Limits` and the user's choices into the settings workers are made with, and
says once, loudly, what this machine does not enforce.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping

from brood.backends.base import WorkerSettings
from brood.errors import InvalidArgument
from brood.limits import Limits
from brood.worker import confine

log = logging.getLogger("brood")

# The environment every worker gets from the supervisor's (if set): what a program needs to
# run and print, and nothing that names a secret. HOME, TMPDIR and the cwd are the run's
# scratch directory. Anything else is passed with Supervisor(worker_env=...).
DEFAULT_ENV = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TERM")
FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"


def worker_environment(
    extra: Mapping[str, str] | Iterable[str] | None, base: Mapping[str, str] | None = None
) -> dict[str, str]:
    """The allow-listed environment: DEFAULT_ENV from `base` (the supervisor's own), plus
    `extra`, a mapping of names to values or a list of names to copy from `base`."""
    base = os.environ if base is None else base
    env = {k: base[k] for k in DEFAULT_ENV if k in base}
    env.setdefault("PATH", FALLBACK_PATH)
    if extra is None:
        return env
    if isinstance(extra, str):
        raise InvalidArgument(
            f"worker_env must be a dict of names to values or a list of names, got the "
            f"str {extra!r}; write worker_env=[{extra!r}]"
        )
    if isinstance(extra, Mapping):
        for k, v in extra.items():
            if not isinstance(k, str) or not isinstance(v, str) or not k or "=" in k:
                raise InvalidArgument(
                    f"worker_env entry {k!r}: {v!r} is not a variable name and a str value"
                )
            env[k] = v
        return env
    for name in extra:
        if not isinstance(name, str):
            raise InvalidArgument(f"worker_env names must be str, got {name!r}")
        if name in base:
            env[name] = base[name]
    return env


def policy_of(limits: Limits, keep_scratch: bool = False) -> confine.Policy:
    return confine.Policy(
        confine=limits.confine,
        scratch="",  # each worker's own, filled in by the zygote
        fs_read=list(limits.fs_read),
        fs_write=list(limits.fs_write),
        network=limits.network,
        read_only=limits.read_only,
        memory=limits.worker_memory,
        cpu_seconds=limits.worker_cpu_seconds,
        processes=limits.worker_processes,
        file_size=limits.worker_file_size,
        open_files=limits.worker_open_files,
        disk=limits.worker_disk,
        keep_scratch=keep_scratch,
    )


def worker_settings(
    limits: Limits,
    worker_env: Mapping[str, str] | Iterable[str] | None = None,
    keep_scratch: bool = False,
) -> WorkerSettings:
    if not isinstance(keep_scratch, bool):
        raise InvalidArgument(f"keep_scratch must be True or False, got {keep_scratch!r}")
    policy = policy_of(limits, keep_scratch)
    return WorkerSettings(policy, worker_environment(worker_env), keep_scratch)


def unenforced(settings: WorkerSettings) -> list[str]:
    """What the policy asks for that this machine will not enforce, one line each (or the
    single line saying confinement is off)."""
    support = confine.probe()
    policy = settings.policy
    private = policy.confine and not policy.network and support.netns
    return confine.gaps(policy, support, private_network=private)


def announce(lines: list[str]) -> None:
    """Say once (per supervisor) what is not enforced: a warning on the `brood` logger."""
    for line in lines:
        log.warning("brood confinement: %s", line)
