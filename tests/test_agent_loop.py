"""The agent loop and the helpers end to end, including bad input from model and caller."""

from __future__ import annotations

import pytest

import brood
from tests.util import FAST, Gate, fast

FENCE = "```"


def repl(code: str) -> str:
    return f"{FENCE}repl\n{code}\n{FENCE}"


def last_user(messages: list[dict]) -> str:
    return messages[-1]["content"]


def echo_feedback(messages: list[dict]) -> str:
    """A reply that ends the run with the feedback the model just received."""
    return repl(f"FINAL({last_user(messages)!r})")


@pytest.mark.parametrize(
    ("reply", "expected"),
    [
        ("I think the answer is 4.", "had no ```repl block"),
        (f"{FENCE}repl\nprint('never runs')", "never closes it"),
    ],
    ids=["no-code-block", "unclosed-fence"],
)
def test_malformed_replies_get_a_note_and_the_run_goes_on(reply, expected):
    model = brood.ScriptedModel([reply, echo_feedback])
    with brood.Supervisor(model, limits=FAST) as sup:
        result = sup.run("task")
    assert result.state == "completed"
    assert expected in result.answer
    assert "never runs" not in result.answer.replace("print('never runs')", "")


def test_huge_output_is_truncated_with_a_note():
    model = brood.ScriptedModel([repl("print('x' * 1_000_000)"), echo_feedback])
    with brood.Supervisor(model, limits=fast(output_limit=1000)) as sup:
        answer = sup.run("task").answer
    assert "output truncated: 1,000,001 characters" in answer
    assert len(answer) < 1300


def run_printing_errors(*calls: str) -> brood.RunResult:
    """A run whose code makes each call in turn and prints the BroodError it raises; the
    next turn echoes the output back as the answer."""
    lines = ["for call in ("] + [f"    lambda: {c}," for c in calls] + ["):"]
    lines += ["    try:", "        call()", "    except BroodError as e:", "        print(e)"]
    model = brood.ScriptedModel([repl("\n".join(lines)), echo_feedback])
    with brood.Supervisor(model, limits=FAST) as sup:
        return sup.run("task")


def test_helpers_called_with_wrong_types_explain_themselves():
    answer = run_printing_errors(
        "llm_query(123)", "rlm_query_batched('not a list')", "rlm_wait('r-123')",
        "spawn(print, 'x')",
    ).answer  # fmt: skip
    assert "llm_query: prompt must be str, got int" in answer
    assert "rlm_query_batched: prompts must be a list of str, got str" in answer
    assert "rlm_wait takes a handle" in answer
    assert "spawn(fn, ...) starts one of llm_query" in answer


def test_a_request_of_the_wrong_type_is_refused_in_the_repl_and_the_run_goes_on():
    # Values a typed protocol field cannot hold are refused before they are sent (the
    # supervisor could not decode them), naming the field.
    result = run_printing_errors(
        "rlm_query('child', timeout='soon')",
        "rlm_spawn('child', model=5)",
        "flow_wait('r-123', timeout=[1])",
        "flow_run({'states': []}, inputs=[1])",
        "flow_run({'states': [{1, 2}]})",
        "flow_run({'states': []}, inputs={'x': float('nan')})",
    )
    assert result.state == "completed", result.error
    answer = result.answer
    assert "timeout: Expected `float | null`, got `str`" in answer
    assert "model: Expected `str | null`, got `int`" in answer
    assert (
        "flow_wait: timeout must be seconds, a number >= 0 (or None: until it ends), got list"
        in answer
    )
    assert "inputs must be a dict {name: value}, got list" in answer
    assert "flow_run: spec must hold only JSON values" in answer
    assert "flow_run: inputs must hold only JSON values" in answer


def test_a_blocked_builtin_says_it_is_blocked_on_purpose():
    model = brood.ScriptedModel([repl("input('name? ')"), echo_feedback])
    with brood.Supervisor(model, limits=FAST) as sup:
        answer = sup.run("task").answer
    assert "input() is blocked on purpose" in answer


@pytest.mark.parametrize(
    ("chat_fn", "reason"),
    [
        (lambda messages: 1 / 0, "raised ZeroDivisionError"),
        (lambda messages: 42, "returned int, not text"),
    ],
    ids=["raises", "non-text"],
)
def test_a_broken_chat_fn_fails_the_run_and_the_supervisor_keeps_working(chat_fn, reason):
    with brood.Supervisor(chat_fn, limits=FAST) as sup:
        bad = sup.run("task")
        assert bad.state == "failed"
        assert bad.error.startswith("model error: chat_fn")
        assert reason in bad.error
        good = sup.run("task", model=brood.ScriptedModel([repl("FINAL('fine')")]))
        assert good.answer == "fine"


def test_after_max_iterations_one_answer_now_turn():
    def last_turn(messages):
        assert "You have used all 2 iterations" in last_user(messages)
        return "best guess: 7"

    model = brood.ScriptedModel([repl("x = 1"), repl("x += 1"), last_turn])
    with brood.Supervisor(model, limits=fast(max_iterations=2)) as sup:
        result = sup.run("task")
    assert result.answer == "best guess: 7"
    assert result.usage["model_calls"] == 3


def test_settled_children_are_announced_in_the_next_turn():
    model = brood.ScriptedModel(
        {
            "root": [
                # The child ends while the root is busy; the root never collects it.
                repl("h = rlm_spawn('child: quick')\nwhile not h.done:\n    pass"),
                echo_feedback,
            ],
            "child:": [repl("FINAL('c')")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        answer = sup.run("root").answer
    assert "[notice] child r-" in answer
    assert "(task: 'child: quick') answered; collect it with rlm_result" in answer


def test_a_collected_child_is_not_announced_again():
    model = brood.ScriptedModel(
        {
            "root": [repl("print(rlm_query('child: quick'))"), echo_feedback],
            "child:": [repl("FINAL('c')")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        assert "[notice]" not in sup.run("root").answer


def test_batched_failure_keeps_every_other_answer():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "try:\n    rlm_query_batched(['child ok 1', 'child bad', 'child ok 2'])\n"
                    "except ChildFailed as e:\n    FINAL(f'{e.failed} {e.answers}')"
                )
            ],
            "child ok": [repl("FINAL('fine')")],
            "child bad": [repl("import os\nos._exit(1)")],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        assert sup.run("root").answer == "[1] ['fine', None, 'fine']"


def test_spawned_plain_calls_run_concurrently_and_are_collected_later():
    model = brood.ScriptedModel(
        {
            "root": [
                repl(
                    "t1 = spawn(llm_query, 'q: one')\n"
                    "t2 = spawn(llm_query_batched, ['q: two', 'q: three'])\n"
                    "x = 'independent work'"
                ),
                repl("FINAL(str(rlm_await_all([t1, t2])))"),
            ],
            "q: one": ["1"],
            "q: two": ["2"],
            "q: three": ["3"],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        assert sup.run("root").answer == "['1', ['2', '3']]"


def test_wait_any_returns_the_first_child_to_end(tmp_path):
    slow = Gate(tmp_path, "slow")
    model = brood.ScriptedModel(
        {
            "child fast": [repl("FINAL('fast')")],
            "child slow": [slow.blocking_reply(repl("FINAL('slow')"))],
        }
    )
    with brood.Session(model, limits=FAST) as env:
        env.reset("root")
        obs = env.step(
            "a = rlm_spawn('child slow')\nb = rlm_spawn('child fast')\n"
            "first = rlm_wait_any([a, b])\nprint(first is b, rlm_result(first), rlm_status(a))"
        )
        assert obs.stdout.split() == ["True", "fast", "running"]
        slow.open()
        assert env.step("print(rlm_wait(a))").stdout.strip() == "slow"


def test_token_budget_cancels_the_tree_with_reason_budget():
    # Nobody ends by themselves. The budget is checked after each model call, and a fast run
    # may make a few more calls before the cancel reaches it, so the scripts are long.
    model = brood.ScriptedModel(
        {
            "root": [repl("h = rlm_spawn('child: spin')")] + [repl("x = 1")] * 2000,
            "child:": [repl("x = 1")] * 2000,
        },
        tokens_per_call=(40, 10),
    )
    with brood.Supervisor(model, limits=fast(token_budget=200, max_iterations=2000)) as sup:
        result = sup.run("root")
        assert result.state == "cancelled"
        assert result.error == "budget: tokens"
        runs = sup.store.runs(result.run_id)
    assert [r["state"] for r in runs] == ["cancelled", "cancelled"]
    assert runs[1]["reason"] == "parent cancelled"


def test_session_handles_are_stale_after_reset_and_close():
    model = brood.ScriptedModel({"child:": [repl("FINAL('c')")]})
    env = brood.Session(model, limits=FAST)
    env.reset("first")
    h = env.handle()
    assert h.status() == "running"
    env.reset("second")
    with pytest.raises(brood.StaleHandle, match="its session was reset"):
        h.status()
    h2 = env.handle()
    env.close()
    with pytest.raises(brood.StaleHandle, match="closed"):
        h2.status()


def test_run_handles_are_stale_after_close():
    sup = brood.Supervisor(brood.ScriptedModel([repl("FINAL('x')")]), limits=FAST)
    h = sup.spawn("task")
    assert h.wait(timeout=30) == "x"
    sup.close()
    with pytest.raises(brood.StaleHandle):
        h.result()


def test_step_errors_are_reported_and_the_namespace_survives():
    with brood.Session(brood.ScriptedModel([]), limits=FAST) as env:
        env.reset("task")
        obs = env.step("a = 5\nb = undefined_name")
        assert obs.error == "NameError: name 'undefined_name' is not defined"
        assert "Traceback" in obs.stderr
        obs = env.step("print(a, SHOW_VARS())")
        assert obs.stdout.strip() == "5 {'a': 'int'}"
        obs = env.step("FINAL_VAR('a')")
        assert obs.done and obs.answer == "5"
        with pytest.raises(brood.BroodError, match="the episode has ended"):
            env.step("print(1)")


def test_a_model_that_cannot_be_pickled_serves_every_run():
    """The gateway calls the model in the supervisor: it need not pickle, and its state
    (here a lock and a count) is one object shared by every run of the tree."""
    import threading

    import cloudpickle

    class Counting:
        def __init__(self) -> None:
            self.lock = threading.Lock()  # not picklable
            self.calls = 0

        def __call__(self, messages: list[dict]) -> str:
            with self.lock:
                self.calls += 1
            task = messages[-1]["content"]
            if task == "plain":
                return "plain answer"
            if task.startswith("child task"):
                return repl("FINAL('from child')")
            return repl("FINAL(rlm_query('child task') + ' ' + llm_query('plain'))")

    chat = Counting()
    with pytest.raises(TypeError, match="lock"):
        cloudpickle.dumps(chat)
    with brood.Supervisor(chat, limits=FAST) as sup:
        result = sup.run("root task")
    assert (result.state, result.answer) == ("completed", "from child plain answer")
    assert chat.calls == 3


def test_a_step_error_a_worker_limit_causes_names_the_limit():
    limits = fast(worker_memory=256 * 2**20, worker_file_size=10_000)
    with brood.Session(brood.ScriptedModel([]), limits=limits) as env:
        env.reset("limits")
        obs = env.step("x = bytearray(1024 * 2**20)")
        assert obs.error.startswith("MemoryError"), obs.error
        assert f"Limits.worker_memory={256 * 2**20} bytes of address space" in obs.stderr
        obs = env.step("open('big', 'wb').write(b'x' * 100_000)")
        assert obs.error.startswith("OSError: [Errno 27]"), obs.error
        assert "Limits.worker_file_size=10000 bytes per file" in obs.stderr
        assert env.step("print('still here')").stdout == "still here\n"


def test_a_worker_that_fills_its_memory_with_scratch_files_is_failed_naming_the_limit():
    """Files on the scratch tmpfs count toward the worker's memory cgroup, not its address
    space: a run that writes past Limits.worker_memory there is killed by the kernel, and
    its reason names the limit (the zygote reads its slot's OOM kills at the reap)."""
    from brood.worker import confine

    support = confine.probe()
    if not support.cgroup_memory_dir or not support.disk:
        pytest.skip("needs a memory cgroup and a scratch tmpfs: `brood doctor` says why not")
    fill = "with open('fill', 'wb') as f:\n    for _ in range(512):\n        f.write(bytes(2**20))"
    model = brood.ScriptedModel([f"```repl\n{fill}\n```"])
    limits = fast(worker_memory=96 * 2**20, worker_disk=2**30)
    with brood.Supervisor(model, limits=limits) as sup:
        result = sup.run("fill the scratch")
    assert result.state == "failed", result
    assert result.error == (
        "worker exited with signal 9: the kernel killed it at its memory limit, "
        f"Limits.worker_memory={96 * 2**20}"
    ), result


def test_a_worker_the_kernel_killed_at_its_memory_limit_says_so():
    """The zygote reads the worker's cgroup OOM count at the reap (cgroup_oom_kills); the
    reason names the limit. (Reaching the cgroup limit before RLIMIT_AS is not reliable to
    provoke, so the reason is checked from what the zygote would report.)"""
    import signal
    from types import SimpleNamespace

    from brood.supervisor.core import Core

    core = SimpleNamespace(limits=fast(worker_memory=2**28))
    reason = Core._exit_reason(core, -signal.SIGKILL, 0.1, 1)  # type: ignore[arg-type]
    assert reason == (
        "worker exited with signal 9: the kernel killed it at its memory limit, "
        f"Limits.worker_memory={2**28}"
    )
    assert Core._exit_reason(core, -signal.SIGKILL, 0.1, 0) == "worker exited with signal 9"  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 0, float("nan"), float("inf"), "soon", True])
def test_a_root_timeout_that_is_no_duration_is_refused_naming_it(bad):
    with brood.Supervisor(brood.ScriptedModel([]), limits=FAST) as sup:
        with pytest.raises(brood.InvalidArgument, match="timeout must be a number of seconds"):
            sup.spawn("task", timeout=bad)
        assert sup.statistics()["runs"] == {}


def test_a_token_budget_is_overshot_by_one_call_at_most_with_many_in_flight():
    """16 plain calls run at once; the gateway admits a call only while the budget left
    covers those in flight (each estimated by the largest call seen)."""

    import threading

    together = threading.Barrier(16)  # plain calls answer 16 at once where they can
    lock = threading.Lock()

    class Fifty(brood.Model):  # every call: 30 + 20 tokens
        name = "fifty"

        made = 0  # calls made, whether their usage was counted or abandoned
        now = peak = 0

        def complete(self, messages, model=None):
            with lock:
                Fifty.made += 1
                Fifty.now += 1
                Fifty.peak = max(Fifty.peak, Fifty.now)
            if messages[-1]["content"] == "q":
                try:
                    together.wait(timeout=0.05)  # fewer in flight: each goes on alone
                except threading.BrokenBarrierError:
                    together.reset()
                with lock:
                    Fifty.now -= 1
                return brood.Completion("a", input_tokens=30, output_tokens=20)
            code = "for _ in range(100):\n    llm_query_batched(['q'] * 100)\nFINAL('unbounded')"
            return brood.Completion(repl(code), input_tokens=30, output_tokens=20)

    with brood.Supervisor(Fifty(), limits=fast(token_budget=4400)) as sup:
        result = sup.run("spend")
        tokens = sum(
            r["usage"].get("input_tokens", 0) + r["usage"].get("output_tokens", 0)
            for r in sup.store.runs(root_id=result.run_id)
        )
    assert (result.state, result.error) == ("cancelled", "budget: tokens")
    assert 4400 < tokens <= 4400 + 50, tokens
    # What was spent, not only what was counted: calls the cancel abandoned cost too.
    assert Fifty.made <= 4400 // 50 + 1, Fifty.made


def test_statistics_count_the_live_workers_and_their_own_memory(tmp_path):
    from tests.util import Signal

    go, child_running = Gate(tmp_path, "go"), Signal(tmp_path, "child-running")
    never = Gate(tmp_path, "never")
    model = brood.ScriptedModel(
        {
            "parent": [repl("h = rlm_spawn('child: wait')\n" + go.wait_code + "\nFINAL('ok')")],
            "child:": [repl(child_running.code + "\n" + never.wait_code)],
        }
    )
    with brood.Supervisor(model, limits=FAST) as sup:
        handle = sup.spawn("parent")
        child_running.wait()  # the parent is waiting on its gate, the child on its own
        workers = sup.statistics()["workers"]
        assert workers["runs"] == 2 and workers["warm"] >= 1
        assert 0 < workers["memory_bytes"] < (workers["runs"] + workers["warm"]) * 64 * 2**20
        go.open()
        assert handle.wait(timeout=60) == "ok"


def test_a_chat_fn_that_raises_system_exit_fails_its_run_not_the_supervisor():
    def chat(messages):
        if "exit" in messages[-1]["content"]:
            raise SystemExit(3)
        return repl("FINAL('fine')")

    with brood.Supervisor(chat, limits=FAST) as sup:
        failed = sup.run("exit please")
        assert failed.state == "failed"
        assert "SystemExit: 3" in failed.error, failed.error
        assert sup.run("go on").answer == "fine"


def test_a_retry_after_is_honoured_once_for_the_whole_tree(tmp_path):
    """Six calls in flight meet a 429 with Retry-After 0.3 s: the gateway holds the
    endpoint for every call until then (no call reaches the server meanwhile), and each
    call is made again once, not six separate backoffs."""
    import threading
    import time

    lock = threading.Lock()
    first_429: list[float] = []
    starts: dict[str, list[float]] = {}

    def chat_fn(messages):
        prompt = messages[-1]["content"]
        if not prompt.startswith("item"):
            code = "FINAL('|'.join(llm_query_batched([f'item {i}' for i in range(6)])))"
            return f"```repl\n{code}\n```"
        now = time.monotonic()
        with lock:
            starts.setdefault(prompt, []).append(now)
            if not first_429 or now < first_429[0] + 0.3:
                first_429[:1] = first_429[:1] or [now]
                raise brood.RateLimited("429 Too Many Requests", retry_after=0.3)
        return prompt.upper()

    with brood.Supervisor(chat_fn, limits=FAST) as sup:
        result = sup.run("root: rate limited")
    assert result.answer == "|".join(f"ITEM {i}" for i in range(6)), result
    for prompt, times in starts.items():
        assert len(times) <= 2, (prompt, times)  # one refusal at most, then the retry
        for t in times[1:]:  # every retry waited for the endpoint's gate to open
            assert t >= first_429[0] + 0.3, (prompt, t - first_429[0])


def test_a_rate_limit_that_never_lifts_fails_the_call_with_rate_limited(monkeypatch):
    from brood.supervisor import gateway

    monkeypatch.setattr(gateway, "RATE_WAIT_FIRST_S", 0.01)
    calls = []

    def chat_fn(messages):
        prompt = messages[-1]["content"]
        if prompt == "plain":
            calls.append(prompt)
            raise brood.RateLimited("429", retry_after=float("nan"))  # nonsense: clamped
        code = "try:\n    llm_query('plain')\nexcept Exception as e:\n    FINAL(repr(e))"
        return f"```repl\n{code}\n```"

    with brood.Supervisor(chat_fn, limits=FAST) as sup:
        result = sup.run("root: never lifts")
    assert result.answer.startswith("RateLimited("), result
    assert len(calls) == gateway.RATE_TRIES
