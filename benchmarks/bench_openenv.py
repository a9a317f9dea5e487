"""brood as an OpenEnv environment: episodes per second through the OpenEnv server, against
the same episodes through `brood.Session` directly, and against OpenEnv's repl_env running
them with its own `LocalRLMRunner`.

An episode is a reset and STEPS steps; each step starts one child run and waits for its
answer (`rlm_query`), the last step answers with it (FINAL), and the episode's reward
(1.0) is journaled. Children answer at once (a chat_fn that replies FINAL('ok')), so the
figures are brood's own cost: a worker per run (the root and each child), the journal, the
step messages, and for the server the HTTP/WebSocket round trips and JSON.

  Session            one `brood.Session` in this process runs the episodes one after
                     another (`reset`, `step` x STEPS, `record_reward`): the floor
  OpenEnv server     `python -m brood.integrations.openenv` in a process of its own, with
                     a reward function as its rubric; one openenv-core `GenericEnvClient`
                     (its blocking form, over the WebSocket) runs the same episodes one
                     after another. Target: at least 0.8x the floor's episodes per second,
                     as the median of the rounds' ratios (each round's server figure over
                     the Session's of the same round)
  server, 8 clients  the same episodes from CLIENTS clients at once (threads), each its
                     own session: what a trainer with parallel environments gets (no
                     target; the machine has two cores shared with the server)
  repl_env runner    repl_env's `LocalRLMRunner` on the same episodes: its root model (a
                     scripted chat_fn) writes the STEPS steps' code, whose `rlm_query`
                     runs each child as another runner in a thread of this process. It has
                     no processes, no confinement and no journal, so it shows what brood's
                     isolation and journal cost. It runs only where repl_env and its
                     dependency smolagents can be imported: BROOD_BENCH_REPL_ENV names the
                     folders to add to sys.path (os.pathsep-separated: the folder holding
                     OpenEnv's envs/repl_env package, and one holding smolagents), else the
                     row says why it did not run.

Apart from the episodes: the time to make an episode's environment, reset it and close
it, with a Session of its own (its own supervisor) and from the server's factory (one
supervisor shared by every environment), NEW_ENVS times each: why the server shares one.

Both brood paths write a file journal in a temporary folder and run confined (the
default). The episodes run in ROUNDS rounds of EPISODES each, the paths interleaved round
by round (the order rotating) so that a drift of the machine touches all alike, after one
untimed warm-up round each; the figures are medians of the rounds' episodes per second.
"""

from __future__ import annotations

import os
import re
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import psutil

import brood
from _common import Row, finish, median, no_leftovers, parse_args
from brood.backends.owners import processes_of

BENCH = "openenv"
STEPS = 3  # steps (each one child) per episode
EPISODES = 8  # episodes per round of each path
ROUNDS = 7
CLIENTS = 8
NEW_ENVS = 5  # environments made, reset and closed, each way
TARGET = 0.8  # the server's episodes per second against the Session's
START_S = 120.0  # only stops a hung server start (openenv-core imports gradio: seconds)
HERE = os.path.dirname(os.path.abspath(__file__))
SERVING = re.compile(r"brood openenv: serving at (http://127\.0\.0\.1:\d+)")
F = "```"


def child_model(messages: list[dict[str, Any]], model: str | None = None) -> str:
    """Every child answers at once (the server imports it as python:bench_openenv:...)."""
    return f"{F}repl\nFINAL('ok')\n{F}"


def reward(answer: str | None, trajectory: list[Any]) -> float:
    return 1.0 if answer == "ok" else 0.0


def step_code(k: int) -> str:
    if k < STEPS - 1:
        return f"r{k} = rlm_query('part {k}')\nprint(r{k})"
    return f"FINAL(rlm_query('part {k}'))"


# ---- the paths ------------------------------------------------------------------------------
def session_round(env: brood.Session) -> float:
    t0 = time.perf_counter()
    for i in range(EPISODES):
        env.reset(f"episode {i}")
        for k in range(STEPS):
            obs = env.step(step_code(k))
            if obs.error:
                raise RuntimeError(f"a Session step failed: {obs.error}")
        if not obs.done or obs.answer != "ok":
            raise RuntimeError(f"a Session episode ended without its answer: {obs}")
        env.record_reward(reward(obs.answer, []))
    return EPISODES / (time.perf_counter() - t0)


def client_episodes(env: Any, n: int) -> None:
    for i in range(n):
        env.reset(prompt=f"episode {i}")
        for k in range(STEPS):
            r = env.step({"code": step_code(k)})
            if r.observation["error"]:
                raise RuntimeError(f"a server step failed: {r.observation['error']}")
        if not r.done or r.reward != 1.0:
            raise RuntimeError(f"a server episode ended without its reward: {r}")


def server_round(env: Any) -> float:
    t0 = time.perf_counter()
    client_episodes(env, EPISODES)
    return EPISODES / (time.perf_counter() - t0)


def concurrent_round(envs: list[Any]) -> float:
    errors: list[BaseException] = []

    def one(env: Any) -> None:
        try:
            client_episodes(env, EPISODES)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(env,)) for env in envs]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    if errors:
        raise errors[0]
    return len(envs) * EPISODES / elapsed


def repl_env_runner() -> tuple[Callable[[], float] | None, str]:
    """A round of repl_env's LocalRLMRunner, or None and why it cannot run here."""
    paths = [p for p in os.environ.get("BROOD_BENCH_REPL_ENV", "").split(os.pathsep) if p]
    if not paths:
        return None, (
            "BROOD_BENCH_REPL_ENV is not set: name the folder holding OpenEnv's envs/repl_env "
            "and one holding smolagents"
        )
    sys.path.extend(paths)
    try:
        from repl_env import LocalRLMRunner
    except Exception as exc:
        return None, f"repl_env cannot be imported from {paths}: {type(exc).__name__}: {exc}"

    def chat(messages: list[dict[str, Any]], model: str | None = None) -> str:
        if any("ROOT-TASK" in m["content"] for m in messages if m["role"] == "user"):
            turn = sum(1 for m in messages if m["role"] == "assistant")
            return f"{F}repl\n{step_code(turn)}\n{F}"
        return child_model(messages)

    runner = LocalRLMRunner(chat, max_depth=2, max_iterations=STEPS + 2)

    def one_round() -> float:
        t0 = time.perf_counter()
        for _ in range(EPISODES):
            res = runner.run("", "ROOT-TASK")
            if res.final_answer != "ok" or res.iterations != STEPS:
                raise RuntimeError(f"a repl_env episode went otherwise: {res.final_answer!r}")
        return EPISODES / (time.perf_counter() - t0)

    return one_round, ""


def environment_costs(store: str) -> tuple[list[float], list[float]]:
    """Seconds to make an episode's environment, reset it and close it: with a Session of
    its own (its own supervisor: zygote, journal, loop), and from a factory whose
    environments share one supervisor (what the server does), NEW_ENVS times each."""
    from brood.integrations.openenv import BroodEnvironmentFactory

    own: list[float] = []
    shared: list[float] = []
    with BroodEnvironmentFactory(child_model, store=store) as make:
        make().close()  # warm-up
        for _ in range(NEW_ENVS):
            t0 = time.perf_counter()
            with brood.Session(child_model, store=store) as env:
                env.reset("one")
            own.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            one = make()
            one.reset(prompt="one")
            one.close()
            shared.append(time.perf_counter() - t0)
    return own, shared


class Server:
    """The OpenEnv server in a process of its own, and the processes it started."""

    def __init__(self, store: str) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("BROOD_TOKEN", "BROOD_MODEL")}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "brood.integrations.openenv",
                "--model",
                "python:bench_openenv:child_model",
                "--rubric",
                "bench_openenv:reward",
                "--port",
                "0",
                "--store",
                store,
                "--max-envs",
                str(CLIENTS + 2),
                "--max-concurrency",
                str(2 * CLIENTS),
            ],
            cwd=HERE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        assert self.proc.stderr is not None
        said = ""
        while not (found := SERVING.search(said)):
            ready, _, _ = select.select([self.proc.stderr], [], [], START_S)
            chunk = os.read(self.proc.stderr.fileno(), 65536) if ready else b""
            if not chunk:
                self.stop()
                raise RuntimeError(f"the server said no address: {said!r}")
            said += chunk.decode(errors="replace")
        self.url = found[1]

    def stop(self) -> list[int]:
        """SIGTERM, as a terminal's Ctrl-C would be SIGINT; returns what it left."""
        started = processes_of(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(START_S)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            if self.proc.stderr is not None:
                self.proc.stderr.close()
        return [p for p in started if alive(p)]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def main() -> None:
    args = parse_args(__doc__ or "")
    try:
        from openenv.core.generic_client import GenericEnvClient
    except ModuleNotFoundError as exc:
        print(f"[{BENCH}] not run: {exc.name} is missing; pip install 'rlm-brood[openenv]'")
        finish(BENCH, [], no_leftovers(BENCH), args.json)
        return
    runner, why_not = repl_env_runner()
    folder = tempfile.mkdtemp(prefix="bench-openenv-")
    own, shared = environment_costs(f"sqlite:///{os.path.join(folder, 'envs.db')}")
    server = Server(f"sqlite:///{os.path.join(folder, 'server.db')}")
    left: list[int] = []
    figures: dict[str, list[float]] = {}
    try:
        session = brood.Session(child_model, store=f"sqlite:///{os.path.join(folder, 's.db')}")
        one = GenericEnvClient(base_url=server.url).sync()
        many = [GenericEnvClient(base_url=server.url).sync() for _ in range(CLIENTS)]
        try:
            one.connect()
            for env in many:
                env.connect()
            paths: dict[str, Callable[[], float]] = {
                "Session": lambda: session_round(session),
                "server": lambda: server_round(one),
                "server, 8 clients": lambda: concurrent_round(many),
            }
            if runner is not None:
                paths["repl_env runner"] = runner
            for run in paths.values():  # warm-up: pools, pages, first imports
                run()
            names = list(paths)
            for r in range(ROUNDS):
                for name in names[r % len(names) :] + names[: r % len(names)]:
                    figures.setdefault(name, []).append(paths[name]())
        finally:
            one.close()
            for env in many:
                env.close()
            session.close()
    finally:
        left = server.stop()
    floor = median(figures["Session"])
    # Each round's server figure against the Session's of the same round: the machine's
    # drift (other work on its two cores) touches both alike within a round.
    ratio = median([a / b for a, b in zip(figures["server"], figures["Session"], strict=True)])
    rows = [
        Row(BENCH, "Session in-process (episodes/s)", floor, "/s"),
        Row(BENCH, "OpenEnv server, 1 client (episodes/s)", median(figures["server"]), "/s", floor),
        Row(
            BENCH,
            "server / Session, median of rounds",
            ratio,
            "x",
            target=f">= {TARGET}x",
            met=ratio >= TARGET,
        ),
        Row(
            BENCH,
            "OpenEnv server, 8 clients (episodes/s)",
            median(figures["server, 8 clients"]),
            "/s",
            floor,
        ),
    ]
    rows += [
        Row(BENCH, "new environment, reset, close: shared", median(shared), "s"),
        Row(BENCH, "new environment, reset, close: own Session", median(own), "s", median(shared)),
    ]
    if runner is not None:
        rows.append(
            Row(
                BENCH,
                "repl_env LocalRLMRunner (episodes/s)",
                median(figures["repl_env runner"]),
                "/s",
                floor,
            )
        )
    else:
        print(f"[{BENCH}] repl_env's LocalRLMRunner not run: {why_not}")
    print(
        f"[{BENCH}] {EPISODES} episodes x {ROUNDS} rounds per path, {STEPS} steps (one child "
        f"each) per episode; rounds (episodes/s): "
        + "; ".join(f"{k}: {', '.join(f'{v:.1f}' for v in vs)}" for k, vs in figures.items())
    )
    if left:
        print(f"[{BENCH}] the server left processes behind: {left}")
    finish(BENCH, rows, no_leftovers(BENCH) + left, args.json)


if __name__ == "__main__":
    main()
