"""Trying a confinement mechanism in a short-lived child, so the caller keeps what it has
(its network, its mounts, its cgroup) whatever the trial does."""

from __future__ import annotations

import os
from collections.abc import Callable

WHY_LIMIT = 4000  # bytes of the trial's error text carried back


def in_child(trial: Callable[[], None]) -> tuple[int, str]:
    """Run `trial` in a forked child that leaves with _exit; (its pid, "") when it returned,
    else (its pid, why not): the text of what it raised, or how the child ended. The pid is
    -1 when no child could be forked. `trial` should make system calls only: the child of a
    threaded caller must not wait on a lock another thread held at the fork."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError as exc:
        os.close(r)
        os.close(w)
        return -1, f"could not fork to probe ({exc})"
    if pid == 0:  # pragma: no cover - child
        code = 0
        try:
            os.close(r)
            trial()
        except BaseException as exc:
            os.write(w, str(exc).encode()[:WHY_LIMIT])
            code = 1
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        why = f.read().decode(errors="replace")
    _, status = os.waitpid(pid, 0)
    if not why and (code := os.waitstatus_to_exitcode(status)) != 0:
        why = f"the probe child ended with status {code}"
    return pid, why
