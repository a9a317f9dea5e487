"""Wire frames: every message round-trips, bad frames give ProtocolError, errors cross intact."""

from __future__ import annotations

import io
import signal
import socket
import threading
import typing

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from brood import errors
from brood.limits import Limits
from brood.protocol import (
    HEADER,
    MAX_FRAME,
    MAX_WORKER_FRAME,
    AnyMsg,
    AskCancelReq,
    AskOption,
    AskReq,
    AskUpdate,
    Blocked,
    BudgetReq,
    CancelReq,
    ChildUpdate,
    CtlAnswer,
    CtlAuth,
    CtlCancel,
    CtlFlow,
    CtlSend,
    Deliver,
    ErrorInfo,
    Exec,
    Exited,
    Failed,
    Final,
    FlowReq,
    Fork,
    Forked,
    GroupGone,
    ModelReq,
    Msg,
    Notice,
    Progress,
    ProtocolError,
    Quit,
    Remember,
    Reply,
    SendReq,
    SpawnReq,
    Start,
    StepBegan,
    StepDone,
    StepResult,
    Stop,
    SyncChannel,
    ToolInfo,
    ToolReq,
    Turn,
    WorkerLimits,
    WorkerMsg,
    check,
    decode,
    decode_worker,
    encode,
    error_info,
    rebuild_error,
)

SAMPLES: list[Msg] = [
    Fork(count=2),
    Forked(pid=4242),
    Exited(pid=4242, status=-9),
    GroupGone(pid=4242),
    Quit(),
    CtlAuth(secret="k" * 64),
    SpawnReq(req_id=1, prompts=["a", "b"], context=b"\x80\x04N.", model="m", timeout=1.5, step=3),
    SpawnReq(req_id=2, prompts=[]),
    CancelReq(req_id=3, child_id="r-1"),
    SendReq(req_id=4, child_id="r-1", message="hurry up"),
    Blocked(req_id=0, blocked=True),
    ModelReq(req_id=13, kind="turn", messages=[{"role": "user", "content": "hi"}], new_from=0),
    ModelReq(req_id=14, kind="llm_query", messages=[], model="m"),
    StepBegan(req_id=5, step=1),
    StepDone(step=1, code="print(1)", stdout="1\n", stderr="", error=None, duration=0.01),
    Final(answer="42"),
    Final(answer="", reason="answer after max_iterations"),
    Failed(reason="worker error", error="Traceback ..."),
    StepResult(req_id=5, stdout="", stderr="", error=None, done=True, answer="42"),
    Start(
        run_id="r-1",
        depth=1,
        prompt="task",
        context=None,
        limits=WorkerLimits.from_limits(Limits(max_depth=2, step_timeout=None)),
        driven=True,
        messages=["first"],
        tools=[ToolInfo(name="lookup", signature="(word: str) -> str", doc="Looks up.")],
    ),
    ToolReq(req_id=20, name="lookup", args=["w"], kwargs={"n": 1}, step=1),
    Reply(req_id=6, value=["r-2", "r-3"]),
    Reply(req_id=7, error=ErrorInfo(type="ValueError", message="bad", fields={"x": 1})),
    ChildUpdate(child_id="r-2", state="completed", answer="yes"),
    Deliver(message="more"),
    Exec(req_id=8, code="x = 1"),
    Turn(prompt="now double x"),
    Stop(),
    Remember(value=b"\x80\x04K*."),
    FlowReq(req_id=12, op="run", spec="{}", inputs="{}"),
    Notice(text="flow r-1 finished"),
    CtlCancel(req_id=9, run_id="r-1"),
    CtlSend(req_id=10, run_id="r-1", message="hurry"),
    CtlFlow(req_id=11, run_id="r-1", op="stop"),
    CtlAnswer(req_id=15, ask_id="a-1", value="yes", by="alice"),
    AskReq(
        req_id=16,
        question="Ship?",
        options=[AskOption("y", "Yes")],
        deadline=60.0,
        default="y",
        step=2,
    ),
    AskReq(req_id=17, question="Who?"),
    AskCancelReq(req_id=18, ask_id="a-1"),
    AskUpdate(ask_id="a-1", state="answered", result={"resolved_by": "alice"}),
    AskUpdate(ask_id="a-2", state="cancelled", reason="withdrawn"),
    BudgetReq(req_id=19),
    Progress(child_id="r-2"),
]


def test_samples_cover_every_message_type() -> None:
    assert {type(m) for m in SAMPLES} == set(typing.get_args(AnyMsg))


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_frame(msg: Msg) -> None:
    frame = encode(msg)
    (size,) = HEADER.unpack(frame[: HEADER.size])
    assert size == len(frame) - HEADER.size
    assert decode(frame[HEADER.size :]) == msg


def test_tags_are_unique() -> None:
    tags = [t.__struct_config__.tag for t in typing.get_args(AnyMsg)]
    assert len(tags) == len(set(tags))


@pytest.mark.parametrize(
    "body",
    [b"", b"\xc1", b"not msgpack at all", msgspec.msgpack.encode({"type": "Nope"})],
    ids=["empty", "reserved-byte", "garbage", "unknown-tag"],
)
def test_an_undecodable_frame_raises_protocol_error_with_its_size(body: bytes) -> None:
    with pytest.raises(ProtocolError, match=f"undecodable frame of {len(body)} bytes"):
        decode(body)


def test_a_frame_with_a_field_of_the_wrong_type_is_a_protocol_error() -> None:
    body = msgspec.msgpack.encode({"type": "Fork", "count": "two"})
    with pytest.raises(ProtocolError):
        decode(body)


def test_protocol_error_is_a_brood_error() -> None:
    assert issubclass(ProtocolError, errors.BroodError)


# ---- SyncChannel --------------------------------------------------------------------------
@pytest.fixture
def pair() -> typing.Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    with a, b:
        yield a, b


def test_channel_carries_messages_in_order_then_none_at_end(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    tx, rx = SyncChannel.over_socket(a), SyncChannel.over_socket(b)
    for msg in SAMPLES:
        tx.send(msg)
    a.shutdown(socket.SHUT_WR)
    assert [rx.recv() for _ in SAMPLES] == SAMPLES
    assert rx.recv() is None


def test_a_send_interrupted_by_signals_still_sends_whole_frames(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """A worker's step clock is SIGALRM: a signal landing while a big frame is being sent
    (a context, an answer) must not cut the frame short and break the stream after it."""
    a, b = pair
    tx, rx = SyncChannel.over_socket(a), SyncChannel.over_socket(b)
    big = Deliver(message="z" * 2_000_000)  # many times a socket's buffer
    got: list[object] = []

    def read() -> None:
        try:
            got.extend(rx.recv() for _ in range(5))
        except Exception as exc:
            got.append(exc)

    reader = threading.Thread(target=read)
    old = signal.signal(signal.SIGALRM, lambda *_: None)
    signal.setitimer(signal.ITIMER_REAL, 0.0005, 0.0005)  # the point under test: signals
    reader.start()
    try:
        for _ in range(5):
            tx.send(big)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        a.shutdown(socket.SHUT_WR)
        reader.join()
    assert got == [big] * 5


def test_channel_over_plain_file_objects() -> None:
    out = io.BytesIO()
    SyncChannel(io.BytesIO(), out).send(Quit())
    rx = SyncChannel(io.BytesIO(out.getvalue()), io.BytesIO())
    assert rx.recv() == Quit()
    assert rx.recv() is None


def test_a_frame_cut_short_reads_as_end_of_stream() -> None:
    frame = encode(Deliver(message="x" * 100))
    for cut in (2, HEADER.size, len(frame) - 1):
        assert SyncChannel(io.BytesIO(frame[:cut]), io.BytesIO()).recv() is None


def test_an_oversized_frame_header_is_refused_before_reading_the_body() -> None:
    head = HEADER.pack(MAX_FRAME + 1)
    with pytest.raises(ProtocolError, match="exceeds the"):
        SyncChannel(io.BytesIO(head), io.BytesIO()).recv()


def test_concurrent_sends_never_interleave_frames(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    a, b = pair
    tx, rx = SyncChannel.over_socket(a), SyncChannel.over_socket(b)
    senders, per_sender = 4, 50
    big = "y" * 50_000  # larger than a socket buffer, so writes are split by the kernel

    def send_all(n: int) -> None:
        for i in range(per_sender):
            tx.send(StepDone(step=i, code=f"{n}", stdout=big, stderr="", error=None, duration=0.0))

    threads = [threading.Thread(target=send_all, args=(n,)) for n in range(senders)]
    for t in threads:
        t.start()
    got = [rx.recv() for _ in range(senders * per_sender)]
    for t in threads:
        t.join()
    assert all(isinstance(m, StepDone) and m.stdout == big for m in got)
    for n in range(senders):
        steps = [m.step for m in got if isinstance(m, StepDone) and m.code == f"{n}"]
        assert steps == list(range(per_sender))


# ---- errors across the boundary -----------------------------------------------------------
def through_the_wire(exc: BaseException) -> BaseException:
    """`exc` as the other side rebuilds it after a Reply frame."""
    frame = encode(Reply(req_id=1, error=error_info(exc)))
    reply = decode(frame[HEADER.size :])
    assert isinstance(reply, Reply) and reply.error is not None
    return rebuild_error(reply.error)


def test_limit_exceeded_crosses_with_its_fields_and_message() -> None:
    exc = errors.LimitExceeded("max_children", 11, 10, hint="the tree has 8 children already")
    back = through_the_wire(exc)
    assert type(back) is errors.LimitExceeded
    assert (back.kind, back.value, back.limit) == ("max_children", 11, 10)
    assert str(back) == str(exc)


def test_child_failed_crosses_with_batch_details() -> None:
    exc = errors.ChildFailed(
        "1 of 3 failed",
        run_id=None,
        status="failed",
        reason="boom",
        failed=[1],
        answers=["a", None, "c"],
    )
    back = through_the_wire(exc)
    assert type(back) is errors.ChildFailed
    assert str(back) == "1 of 3 failed"
    assert back.failed == [1] and back.answers == ["a", None, "c"]
    assert back.status == "failed" and back.reason == "boom" and back.run_id is None


@pytest.mark.parametrize(
    "exc",
    [
        errors.InvalidArgument("prompt must be str, got int"),
        errors.StaleHandle("the session was reset"),
        errors.SupervisorClosed("closed"),
        errors.ChildNotReady("child r-1 is running"),
        errors.ChildCleanupError("2 processes survived", pids=[11, 12], answer="42"),
    ],
    ids=lambda e: type(e).__name__,
)
def test_brood_errors_come_back_as_their_own_class(exc: BaseException) -> None:
    back = through_the_wire(exc)
    assert type(back) is type(exc)
    assert str(back) == str(exc)
    assert vars(back) == vars(exc)


@pytest.mark.parametrize("cls", [TimeoutError, ValueError])
def test_timeout_and_value_errors_keep_their_builtin_class(cls: type[Exception]) -> None:
    back = through_the_wire(cls("waited 1 s"))
    assert type(back) is cls and str(back) == "waited 1 s"


def test_an_unknown_error_becomes_a_brood_error_naming_its_type() -> None:
    back = through_the_wire(KeyError("k"))
    assert type(back) is errors.BroodError
    assert str(back) == "KeyError: 'k'"


def test_a_type_name_that_is_not_an_exception_class_is_not_instantiated() -> None:
    for name in ("annotations", "Any", "__all__", "BroodError.__init__"):
        back = rebuild_error(ErrorInfo(type=name, message="m"))
        assert type(back) is errors.BroodError
        assert str(back) == f"{name}: m"


def test_error_info_keeps_only_plain_public_fields() -> None:
    exc = errors.BroodError("x")
    exc.count = 3  # type: ignore[attr-defined]
    exc.table = {"a": 1}  # type: ignore[attr-defined]
    exc._private = "p"  # type: ignore[attr-defined]
    info = error_info(exc)
    assert info == ErrorInfo(type="BroodError", message="x", fields={"count": 3})


def test_check_refuses_a_request_its_receiver_could_not_decode_naming_the_field():
    check(SpawnReq(req_id=1, prompts=["p"], timeout=2.5, model="m"))  # well typed: passes
    with pytest.raises(errors.InvalidArgument, match=r"^timeout: Expected `float \| null`"):
        check(SpawnReq(req_id=1, prompts=["p"], timeout="soon"))  # type: ignore[arg-type]
    with pytest.raises(errors.InvalidArgument, match=r"^prompts\[0\]: Expected `str`"):
        check(SpawnReq(req_id=1, prompts=[3]))  # type: ignore[list-item]


# ---- what a worker may send: untrusted frames, checked at the boundary -----------------------
WORKER_TYPES = set(typing.get_args(WorkerMsg))


@pytest.mark.parametrize("msg", [m for m in SAMPLES if type(m) in WORKER_TYPES])
def test_every_message_a_worker_may_send_decodes_as_a_worker_frame(msg: Msg) -> None:
    assert decode_worker(encode(msg)[HEADER.size :]) == msg


@pytest.mark.parametrize("msg", [m for m in SAMPLES if type(m) not in WORKER_TYPES])
def test_a_message_only_the_supervisor_sends_is_refused_from_a_worker(msg: Msg) -> None:
    with pytest.raises(ProtocolError, match="invalid frame"):
        decode_worker(encode(msg)[HEADER.size :])


@pytest.mark.parametrize(
    "fields",
    [
        {"type": "SpawnReq", "req_id": -5, "prompts": []},
        {"type": "SpawnReq", "req_id": 1, "prompts": [], "timeout": float("nan")},
        {"type": "SpawnReq", "req_id": 1, "prompts": [], "timeout": -1.0},
        {"type": "SpawnReq", "req_id": 1, "prompts": [], "step": -1},
        {"type": "CancelReq", "req_id": 1, "child_id": "r-" + "x" * 500},
        {"type": "ModelReq", "req_id": 1, "kind": "shell", "messages": []},
        {"type": "ModelReq", "req_id": 1, "kind": "turn", "messages": [{"role": 5}]},
        {"type": "FlowReq", "req_id": 1, "op": "delete"},
        {
            "type": "StepDone",
            "step": 1,
            "code": "",
            "stdout": "",
            "stderr": "",
            "error": None,
            "duration": -3.0,
        },
    ],
)
def test_a_worker_frame_with_a_bad_value_is_refused_naming_the_field(fields: dict) -> None:
    with pytest.raises(ProtocolError, match=r"at `\$\."):
        decode_worker(msgspec.msgpack.encode(fields))


def test_garbage_and_oversized_worker_frames_are_refused() -> None:
    with pytest.raises(ProtocolError, match="invalid frame of 4 bytes"):
        decode_worker(b"\xc1\xc1\xc1\xc1")
    with pytest.raises(ProtocolError, match="exceeds the 67108864-byte bound of a worker"):
        decode_worker(b"\0" * (MAX_WORKER_FRAME + 1))


def test_check_refuses_a_request_over_the_worker_frame_bound_before_it_is_sent() -> None:
    big = SpawnReq(req_id=1, prompts=["p"], context=b"\0" * (MAX_WORKER_FRAME + 1))
    with pytest.raises(errors.InvalidArgument, match="over the 67108864-byte bound"):
        check(big)


@given(st.binary(max_size=512))
@settings(max_examples=300, deadline=None)
def test_any_bytes_from_a_worker_decode_or_raise_protocol_error_only(body: bytes) -> None:
    try:
        msg = decode_worker(body)
    except ProtocolError:
        return
    assert type(msg) in WORKER_TYPES


@given(
    st.dictionaries(
        st.sampled_from(["type", "req_id", "prompts", "kind", "messages", "op", "step", "x"]),
        st.one_of(
            st.sampled_from([t.__name__ for t in WORKER_TYPES] + ["Start", "CtlCancel"]),
            st.integers(min_value=-(2**63), max_value=2**64 - 1),
            st.floats(),
            st.text(max_size=20),
            st.lists(st.text(max_size=5), max_size=3),
            st.none(),
        ),
        max_size=6,
    )
)
@settings(max_examples=300, deadline=None)
def test_any_msgpack_map_from_a_worker_decodes_or_raises_protocol_error_only(
    fields: dict,
) -> None:
    try:
        msg = decode_worker(msgspec.msgpack.encode(fields))
    except ProtocolError:
        return
    assert type(msg) in WORKER_TYPES
