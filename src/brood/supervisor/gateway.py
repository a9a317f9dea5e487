"""The model gateway: every model call of every run is made here, on the supervisor's side.

Workers hold no model object, client or credential (DESIGN.md section 14): a worker asks
for a call as it asks for a child, and the gateway makes it, measures it and journals it,
so usage and budgets rest on what the gateway saw, never on what a worker reports.

A `Model` with an `acomplete` coroutine (a provider's client, an `async def` chat_fn)
runs on the supervisor's loop, and so does an `instant` one (brood's scripted models);
any other model (a `def` chat_fn) runs in a bounded pool of daemon threads. A call whose run ends is
abandoned: its awaiting task is cancelled and the thread's result, if it ever comes, is
dropped, so a `chat_fn` that never returns holds up neither a cancel nor `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
import math
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import Any

from brood.errors import RateLimited
from brood.models.base import Completion, Messages, Model, rate_gated

# Model calls in flight at once through chat_fn threads, across every tree of a supervisor.
# A call beyond this waits its turn; a chat_fn that never returns keeps its thread.
GATEWAY_THREADS = 64
# A rate-limited endpoint: every call to it waits for the server's Retry-After (else 1 s,
# doubling), with up to 10% jitter; a call is tried this many times in all.
RATE_TRIES = 5
RATE_WAIT_FIRST_S = 1.0
RATE_WAIT_MAX_S = 60.0

log = logging.getLogger("brood")


def _now() -> float:
    """The gate's clock (tests replace it, with `_sleep`, by a fake one)."""
    return time.monotonic()


async def _sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


_Job = tuple[asyncio.AbstractEventLoop, "asyncio.Future[Any]", Callable[..., Any], tuple[Any, ...]]


class CallPool:
    """Up to `size` daemon threads that run blocking calls for the loop, started as needed.

    Not a ThreadPoolExecutor: its threads are joined at interpreter exit, so one call that
    never returns would hang the user's process on the way out."""

    def __init__(self, size: int, name: str = "brood-model") -> None:
        self._size = size
        self._name = name
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0  # threads blocked on the queue (or about to be)
        self._queued = 0  # jobs put and not yet taken
        self._starting = 0  # threads started that have not reached the queue yet
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Any] = loop.create_future()
        with self._lock:
            self._queued += 1
            # Exact, not approximate: a blocked call must never leave a job waiting while
            # the pool is below its size (tests' gated chat_fns would deadlock).
            if self._queued > self._idle + self._starting and self._threads < self._size:
                self._threads += 1
                self._starting += 1
                threading.Thread(target=self._work, name=self._name, daemon=True).start()
        self._jobs.put((loop, fut, fn, args))
        return fut

    def _work(self) -> None:
        with self._lock:
            self._starting -= 1
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
                if job is not None:
                    self._queued -= 1
            if job is None:
                return
            loop, fut, fn, args = job
            if not fut.cancelled():
                try:
                    value, failed = fn(*args), None
                except Exception as exc:
                    value, failed = None, exc
                except BaseException as exc:  # SystemExit and the like must not reach the loop
                    value, failed = None, RuntimeError(f"{type(exc).__name__}: {exc}")
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                    loop.call_soon_threadsafe(_settle, fut, value, failed)

    def close(self) -> None:
        """Let idle threads end; busy ones end after their call (they are daemons)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            count = self._threads
        for _ in range(count):
            self._jobs.put(None)


def _settle(fut: asyncio.Future[Any], value: Any, failed: BaseException | None) -> None:
    if fut.done():  # abandoned: the run ended while the call was under way
        return
    if failed is not None:
        fut.set_exception(failed)
    else:
        fut.set_result(value)


@functools.cache
def _is_async(cls: type) -> bool:
    """Whether the gateway awaits `acomplete` for this class: only where it is defined no
    higher up than `complete`, so a subclass that overrides `complete` is called there."""
    mro = cls.__mro__
    has_async = next((k for k in mro if "acomplete" in vars(k)), None)
    has_sync = next((k for k in mro if "complete" in vars(k)), object)
    return has_async is not None and issubclass(has_async, has_sync)


class ModelGateway:
    """Makes model calls for workers; one per supervisor (one connection pool)."""

    def __init__(self, threads: int = GATEWAY_THREADS) -> None:
        self.pool = CallPool(threads)
        # One rate-limit gate per endpoint: the loop time before which no call goes to it.
        self.gates: dict[str, float] = {}
        # Models awaited on the loop: their async clients are closed with the gateway.
        self.awaited: dict[int, Model] = {}

    async def complete(self, model: Model, messages: Messages, name: str | None) -> Completion:
        """One call. A RateLimited answer closes the endpoint's gate for every call of every
        tree until the server's Retry-After has passed (one wait, not one per call), and
        the call is tried again; after RATE_TRIES the RateLimited is the call's error."""
        endpoint: str | None = None  # named only once some endpoint was rate-limited
        for attempt in range(RATE_TRIES):
            # A deadline, which another 429 may move later meanwhile: looked at again after
            # each wait (nothing sets it as an event could signal).
            if self.gates:
                endpoint = endpoint or model.describe()
                while (left := self.gates.get(endpoint, 0.0) - _now()) > 0:
                    await _sleep(left)
            try:
                return await self._call(model, messages, name)
            except RateLimited as exc:
                if attempt == RATE_TRIES - 1:
                    raise RateLimited(
                        f"{exc} (tried {RATE_TRIES} times, each after the endpoint's wait)",
                        retry_after=exc.retry_after,
                    ) from exc
                endpoint = endpoint or model.describe()
                wait = _rate_wait(exc.retry_after, attempt, endpoint)
                self.gates[endpoint] = max(self.gates.get(endpoint, 0.0), _now() + wait)
        raise AssertionError("unreachable")

    async def _call(self, model: Model, messages: Messages, name: str | None) -> Completion:
        cls: type = type(model)
        token = rate_gated.set(True)  # seen by the call's task, and copied to its thread
        try:
            if model.instant:  # never blocks: no thread hop
                done = model.complete(messages, name)
            elif _is_async(cls):
                self.awaited.setdefault(id(model), model)
                done = await model.acomplete(messages, model=name)  # type: ignore[attr-defined]
            else:
                ctx = contextvars.copy_context()
                done = await self.pool.submit(ctx.run, model.complete, messages, name)
        finally:
            rate_gated.reset(token)
        if not isinstance(done, Completion):
            raise TypeError(
                f"model {model.describe()!r} returned {type(done).__name__} from complete(); "
                "it must return a brood.Completion"
            )
        return done

    def close(self) -> None:
        self.pool.close()

    async def aclose(self) -> None:
        """Close the async clients of the models awaited here (their connections to the
        server), then the thread pool."""
        for model in self.awaited.values():
            closing = getattr(model, "aclose", None)
            if closing is not None:
                with contextlib.suppress(Exception):  # a broken client closes as it can
                    await closing()
        self.awaited.clear()
        self.close()


def _rate_wait(asked: object, attempt: int, endpoint: str) -> float:
    """Seconds to hold an endpoint: what the server asked, else brood's backoff; a value
    that makes no sense is clamped (and said), never a crash."""
    default = min(RATE_WAIT_FIRST_S * 2**attempt, RATE_WAIT_MAX_S)
    if asked is None:
        wait = default
    elif isinstance(asked, int | float) and not isinstance(asked, bool) and math.isfinite(asked):
        wait = min(max(float(asked), 0.0), RATE_WAIT_MAX_S)
        if wait != asked:
            log.warning("brood: %s asked to wait %r s; clamped to %g s", endpoint, asked, wait)
    else:
        log.warning("brood: %s asked to wait %r s; waiting %g s", endpoint, asked, default)
        wait = default
    return wait * (1 + random.uniform(0, 0.1))
