"""The supervisor's watch of scratch sizes, where the kernel does not bound them.

A worker puts its scratch on a tmpfs of `Limits.worker_disk` where it can
(`brood.worker.disk`). Where it cannot (no CAP_SYS_ADMIN and no user namespace), or must not
(`keep_scratch=True`: the user reads scratch after the run, so it stays on disk), scratch
lives on the scratch root's filesystem, and the backend looks at each busy worker's scratch
every SCRATCH_WATCH_S: a run past the limit fails, naming it. What holds then: each run is
bounded to worker_disk plus what it writes between two looks (RLIMIT_FSIZE, worker_file_size,
still bounds each file), and scratch shares its filesystem with whatever else is there (the
temporary directory, and a default journal made in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import shutil
import stat
import threading
from typing import NamedTuple

__all__ = [
    "SCRATCH_WATCH_S",
    "Measure",
    "Remover",
    "over_limit",
    "remove_scratch",
    "scratch_bytes",
    "scratch_sizes",
]

# A look walks every busy scratch directory in a thread: a few calls for the few files a run
# usually leaves. Shorter would bound a fast writer more tightly at more cost to every run.
SCRATCH_WATCH_S = 0.5
_BLOCK = 512  # st_blocks counts 512-byte units, whatever the filesystem's block size


def scratch_bytes(path: str) -> int:
    """Bytes the files under `path` take on disk: allocated blocks, so a sparse file counts
    what it uses; a file with several hard links once. A directory model code made
    unreadable is made readable again (the supervisor's user owns everything its workers
    write), so nothing can hide from the count. 0 for a missing `path`. Raises OSError when
    a directory cannot be read even so."""
    total = 0
    seen: set[tuple[int, int]] = set()
    todo = [path]
    while todo:
        directory = todo.pop()
        try:
            entries = _entries(directory)
        except (FileNotFoundError, NotADirectoryError):
            continue  # removed (or replaced) meanwhile
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed meanwhile
            if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
                if (st.st_dev, st.st_ino) in seen:
                    continue
                seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * _BLOCK
            if stat.S_ISDIR(st.st_mode):
                todo.append(entry.path)
    return total


class Measure(NamedTuple):
    size: int
    error: str = ""  # why the size could not be taken (then `size` is 0)


def scratch_sizes(paths: list[str]) -> list[Measure]:
    """`scratch_bytes` of each path: one call (one thread) for a look at every busy worker."""
    out = []
    for path in paths:
        try:
            out.append(Measure(scratch_bytes(path)))
        except OSError as exc:
            out.append(Measure(0, f"{type(exc).__name__}: {exc}"))
    return out


def _entries(directory: str) -> list[os.DirEntry[str]]:
    try:
        with os.scandir(directory) as it:
            return list(it)
    except PermissionError:
        os.chmod(directory, stat.S_IRWXU)
        with os.scandir(directory) as it:
            return list(it)


def over_limit(measure: Measure, limit: int) -> str | None:
    """The reason a run fails with when its scratch measured `measure`, past `limit` (or
    could not be measured: then the limit cannot hold), else None."""
    if measure.error:
        what = (
            f"its scratch directory could not be measured ({measure.error}), so "
            f"Limits.worker_disk={limit} cannot be held"
        )
    elif measure.size > limit:
        what = f"its scratch directory holds {measure.size} bytes, past Limits.worker_disk={limit}"
    else:
        return None
    return (
        f"worker disk limit: {what} (scratch is watched here, not a tmpfs of its own: "
        "`brood doctor` says why); write less there, or raise the limit"
    )


def remove_scratch(path: str) -> None:
    """Most runs leave their scratch directory empty: one rmdir instead of rmtree's walk (a
    dozen calls); a directory with something in it is walked."""
    try:
        os.rmdir(path)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)


class Remover:
    """Removes ended workers' scratch directories on a thread of its own, off the loop (an
    rmdir waits for the filesystem's journal). It takes what was queued meanwhile as one
    batch and settles the batch's futures with one call onto the loop: a fan-out's children
    cost it one wake-up per batch, where an executor job per directory costs two each."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, asyncio.Future[None]] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def remove(self, path: str) -> asyncio.Future[None]:
        """A future (of the running loop) settled once `path` is gone."""
        fut = asyncio.get_running_loop().create_future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="brood-scratch", daemon=True)
            self._thread.start()
        self._queue.put((path, fut))
        return fut

    def close(self) -> None:
        """Remove what is queued, then end the thread."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while True:
            batch = [self._queue.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(self._queue.get_nowait())
            done = []
            for item in batch:
                if item is not None:
                    remove_scratch(item[0])
                    done.append(item[1])
            if done:
                loop = done[0].get_loop()
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                    loop.call_soon_threadsafe(_settle, done)
            if None in batch:
                return


def _settle(futures: list[asyncio.Future[None]]) -> None:
    for fut in futures:
        if not fut.done():
            fut.set_result(None)
