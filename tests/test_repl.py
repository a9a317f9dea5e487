"""The REPL namespace: persistence, captured output, blocked builtins, truncation, step clock."""

from __future__ import annotations

import builtins
import signal
import threading
from collections.abc import Callable
from typing import Any

import pytest

from brood.worker.repl import (
    BLOCKED_BUILTINS,
    FinalSignal,
    Repl,
    StepClock,
    StepTimeout,
    truncate,
)

SPIN = """
import time
def spin(seconds):
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass
"""


def make_repl(context: Any = None, **helpers: Callable[..., Any]) -> Repl:
    return Repl(dict(helpers), context)


def add_wait_outside(repl: Repl) -> None:
    """A helper that waits the way rlm_wait does: with the step clock paused."""

    def wait_outside(seconds: float) -> None:
        with repl.clock.paused():
            threading.Event().wait(seconds)  # stands in for a wait on a child run

    repl.namespace["wait_outside"] = wait_outside


# ---- namespace ----------------------------------------------------------------------------
def test_variables_functions_and_imports_persist_across_steps() -> None:
    repl = make_repl()
    assert repl.run("x = 2\ndef double(v):\n    return 2 * v\nimport math", None).error is None
    out = repl.run("print(double(x), math.floor(2.5))", None)
    assert (out.stdout, out.stderr, out.error) == ("4 2\n", "", None)


def test_context_and_helpers_are_in_the_namespace() -> None:
    repl = make_repl({"doc": "text"}, shout=lambda s: s.upper())
    assert repl.run("print(context['doc'], shout('hi'))", None).stdout == "text HI\n"


def test_user_variables_leave_out_helpers_context_and_private_names() -> None:
    repl = make_repl("ctx", helper=lambda: None)
    repl.run("a = 1\nb = 'two'\n_hidden = 3\ncontext = 'changed'", None)
    assert repl.user_variables() == {"a": "int", "b": "str"}


def test_errors_keep_what_ran_before_them() -> None:
    repl = make_repl()
    out = repl.run("x = 1\nprint('before')\n1 / 0\nprint('after')", None)
    assert out.stdout == "before\n"
    assert out.error == "ZeroDivisionError: division by zero"
    assert repl.run("print(x)", None).stdout == "1\n"


# ---- output -------------------------------------------------------------------------------
def test_stdout_and_stderr_are_captured_separately() -> None:
    out = make_repl().run(
        "import sys\nprint('out')\nprint('err', file=sys.stderr)\n_ = sys.stdout.write('more')",
        None,
    )
    assert out.stdout == "out\nmore"
    assert out.stderr == "err\n"
    assert out.error is None
    assert out.duration >= 0


def test_output_does_not_leak_to_the_real_streams(capsys: pytest.CaptureFixture[str]) -> None:
    make_repl().run("import sys\nprint('x')\nprint('y', file=sys.stderr)", None)
    assert capsys.readouterr() == ("", "")


@pytest.mark.parametrize(
    ("code", "shown"),
    [
        ("1 + 1", "2\n"),
        ("'text'", "'text'\n"),
        ("x = 3\nx * 2", "6\n"),
        ("[1, 2]", "[1, 2]\n"),
        ("None", ""),
        ("print('p')", "p\n"),  # print returns None: shown once, not twice
        ("x = 5", ""),
        ("if True:\n    7", ""),  # only a top-level trailing expression is shown
        ("", ""),
    ],
)
def test_a_trailing_expression_is_shown_like_an_interactive_prompt(code: str, shown: str) -> None:
    out = make_repl().run(code, None)
    assert (out.stdout, out.error) == (shown, None)


def test_an_error_in_the_trailing_expression_reports_its_line() -> None:
    out = make_repl().run("x = 1\n\n1 / x * 0 + 1 / 0", None)
    assert out.error == "ZeroDivisionError: division by zero"
    assert 'File "<repl>", line 3' in out.stderr


def test_the_traceback_shows_only_the_models_own_frames() -> None:
    def helper() -> None:
        raise ValueError("bad value 7")

    out = make_repl(helper=helper).run("def f():\n    helper()\n\nf()", None)
    assert out.error == "ValueError: bad value 7"
    assert out.stderr.startswith("Traceback (most recent call last):\n")
    assert 'File "<repl>", line 4' in out.stderr and 'File "<repl>", line 2' in out.stderr
    assert __file__ not in out.stderr and "repl.py" not in out.stderr
    assert out.stderr.rstrip().endswith("ValueError: bad value 7")


def test_a_syntax_error_runs_nothing_of_the_block() -> None:
    repl = make_repl()
    out = repl.run("print('first')\nx = = 2", None)
    assert out.stdout == ""
    assert out.error is not None and out.error.startswith("SyntaxError")
    assert "line 2" in out.stderr
    assert repl.user_variables() == {}


@pytest.mark.parametrize("code", ["raise SystemExit(3)", "raise KeyboardInterrupt"])
def test_exits_and_interrupts_raised_by_code_end_only_the_step(code: str) -> None:
    repl = make_repl()
    out = repl.run(code, None)
    assert out.error is not None
    assert out.error.split(":")[0] in {"SystemExit", "KeyboardInterrupt"}
    assert repl.run("print('still here')", None).stdout == "still here\n"


def test_final_signal_ends_the_step_quietly() -> None:
    def final() -> None:
        raise FinalSignal

    out = make_repl(FINAL=final).run("print(1)\nFINAL()\nprint(2)", None)
    assert (out.stdout, out.stderr, out.error) == ("1\n", "", None)


# ---- blocked builtins ---------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(BLOCKED_BUILTINS))
def test_blocked_builtins_say_they_are_blocked_on_purpose_and_why(name: str) -> None:
    out = make_repl().run(f"{name}()", None)
    expected = f"RuntimeError: {name}() is blocked on purpose in the brood REPL: "
    assert out.error == expected + BLOCKED_BUILTINS[name]


def test_blocked_builtins_cover_the_ones_that_would_hang_or_kill_the_worker() -> None:
    assert {"input", "exit", "quit", "help", "breakpoint"} <= set(BLOCKED_BUILTINS)


def test_blocking_does_not_touch_the_process_builtins() -> None:
    real = {name: getattr(builtins, name) for name in BLOCKED_BUILTINS}
    make_repl().run("x = 1", None)
    assert {name: getattr(builtins, name) for name in BLOCKED_BUILTINS} == real


def test_other_builtins_still_work() -> None:
    out = make_repl().run("print(len([1, 2]), sorted('cba'), isinstance(1, int))", None)
    assert out.stdout == "2 ['a', 'b', 'c'] True\n"


# ---- truncate -----------------------------------------------------------------------------
def test_short_text_is_not_truncated() -> None:
    assert truncate("abc", 3) == "abc"
    assert truncate("", 0) == ""


def test_long_text_keeps_head_and_tail_with_a_note_that_says_so() -> None:
    text = "".join(f"line {i}\n" for i in range(10_000))
    cut = truncate(text, 1000)
    assert cut.startswith(text[:500])
    assert cut.endswith(text[-500:])
    assert cut[500:-500] == (
        f"\n[... output truncated: {len(text):,} characters, {len(text) - 1000:,} not shown; "
        "print less, or slice the value ...]\n"
    )


@pytest.mark.parametrize("limit", [2, 10, 11, 100, 20_000])
def test_truncated_output_never_shows_more_than_the_limit(limit: int) -> None:
    cut = truncate("x" * (3 * limit), limit)
    assert 0 < cut.count("x") <= limit


@pytest.mark.parametrize("limit", [0, 1])
def test_truncation_to_a_tiny_limit_respects_it(limit: int) -> None:
    assert truncate("x" * 6, limit).count("x") <= limit


# ---- the step clock -----------------------------------------------------------------------
def test_runaway_code_is_stopped_at_the_step_limit() -> None:
    repl = make_repl()
    out = repl.run("n = 0\nwhile True:\n    n += 1", 0.1)
    assert out.error == "StepTimeout: the step used its compute limit of 0.1 s"
    assert out.error in out.stderr
    assert out.duration >= 0.1
    assert repl.namespace["n"] > 0


def test_step_timeout_is_raised_in_the_main_thread_and_except_exception_cannot_hide_it() -> None:
    repl = make_repl()
    code = (
        "import threading\n"
        "try:\n"
        "    try:\n"
        "        while True:\n"
        "            pass\n"
        "    except Exception:\n"
        "        hidden = True\n"
        "except BaseException as exc:\n"
        "    where = threading.current_thread() is threading.main_thread()\n"
        "    what = type(exc).__name__\n"
        "    raise\n"
    )
    out = repl.run(code, 0.1)
    assert out.error is not None and out.error.startswith("StepTimeout")
    assert "hidden" not in repl.namespace
    assert repl.namespace["where"] is True
    assert repl.namespace["what"] == "StepTimeout"
    assert not issubclass(StepTimeout, Exception)


def test_the_clock_is_disarmed_and_the_signal_handler_restored_after_a_step() -> None:
    before = signal.getsignal(signal.SIGALRM)
    repl = make_repl()
    assert repl.run("x = 1", 5.0).error is None
    assert signal.getsignal(signal.SIGALRM) is before
    repl.run("while True:\n    pass", 0.05)
    assert signal.getsignal(signal.SIGALRM) is before
    assert repl.clock.limit is None
    out = repl.run(SPIN + "spin(0.06)\nprint('ok')", None)
    assert (out.stdout, out.error) == ("ok\n", None)


def test_time_inside_paused_is_not_counted() -> None:
    repl = make_repl()
    add_wait_outside(repl)
    out = repl.run(SPIN + "spin(0.05)\nwait_outside(0.3)\nprint('done')", 0.1)
    assert (out.stdout, out.error) == ("done\n", None)
    assert out.duration >= 0.35


def test_the_clock_resumes_with_what_was_left_not_a_fresh_limit() -> None:
    repl = make_repl()
    add_wait_outside(repl)
    code = SPIN + (
        "phase = 'first spin'\nspin(0.1)\n"
        "phase = 'waiting'\nwait_outside(0.2)\n"
        "phase = 'second spin'\nspin(0.15)\n"
        "phase = 'finished'\n"
    )
    # 0.25 s of compute against a 0.2 s limit: it must run out 0.1 s into the second spin.
    out = repl.run(code, 0.2)
    assert out.error is not None and out.error.startswith("StepTimeout")
    assert repl.namespace["phase"] == "second spin"


def test_nested_pauses_resume_the_clock_only_at_the_outermost() -> None:
    repl = make_repl()

    def nested_wait(seconds: float) -> None:
        with repl.clock.paused():
            with repl.clock.paused():
                pass
            threading.Event().wait(seconds)  # still paused: the inner exit must not resume

    repl.namespace["nested_wait"] = nested_wait
    out = repl.run("nested_wait(0.2)\nprint('done')", 0.1)
    assert (out.stdout, out.error) == ("done\n", None)


def test_a_pause_in_another_thread_does_not_stop_the_clock() -> None:
    repl = make_repl()

    def pause_in_thread() -> None:
        def body() -> None:
            with repl.clock.paused():
                pass

        t = threading.Thread(target=body)
        t.start()
        t.join()

    repl.namespace["pause_in_thread"] = pause_in_thread
    out = repl.run("pause_in_thread()\nwhile True:\n    pass", 0.1)
    assert out.error is not None and out.error.startswith("StepTimeout")


def test_paused_outside_a_step_leaves_the_timer_alone() -> None:
    clock = StepClock()
    armed = signal.getitimer(signal.ITIMER_REAL)[0] > 0  # pytest-timeout may hold the timer
    with clock.paused():
        assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == armed
    assert (signal.getitimer(signal.ITIMER_REAL)[0] > 0) == armed


def test_a_zero_step_timeout_is_not_unlimited() -> None:
    out = make_repl().run(SPIN + "spin(0.1)", 0)
    assert out.error is not None and out.error.startswith("StepTimeout")
