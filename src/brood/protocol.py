"""Wire messages between the supervisor, the zygote and workers.

Frames are a 4-byte big-endian length followed by one msgpack-encoded, tagged msgspec struct.
Both sides import this module; it imports nothing of either side.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from brood import errors
from brood.errors import ProtocolError
from brood.lifecycle import AskState
from brood.limits import may_start_children

if TYPE_CHECKING:
    import asyncio

    from brood.limits import Limits

HEADER = struct.Struct(">I")
MAX_FRAME = 256 * 1024 * 1024  # a frame larger than this is a protocol error, not data
# A worker's frames are capped lower: its output and FINAL are capped before sending, so
# only a context handed to children can be large, and a worker must not make the
# supervisor buffer hundreds of MB.
MAX_WORKER_FRAME = 64 * 1024 * 1024
# A root's context travels in its worker's Start: it must fit one frame, with room to spare.
MAX_CONTEXT_BYTES = MAX_FRAME - 16 * 1024 * 1024


class Msg(msgspec.Struct, tag=True, omit_defaults=True):
    pass


# ---- zygote <-> supervisor ------------------------------------------------------------------
class Fork(Msg):
    count: int


class Forked(Msg):
    pid: int


class Exited(Msg):
    """A worker process was reaped; `status` is its return code (-N for signal N).
    `group_empty` says no process of its group is left (else GroupGone follows later)."""

    pid: int
    status: int
    group_empty: bool = False
    cpu: float = 0.0  # seconds of CPU the worker used (user + system), from wait4
    oom_kills: int = 0  # processes of its cgroup the kernel killed at its memory limit


class GroupGone(Msg):
    """No process of the worker's process group is left: exit is confirmed."""

    pid: int


class Quit(Msg):
    pass


# ---- worker -> supervisor -------------------------------------------------------------------
# Everything a worker sends is untrusted (DESIGN.md section 14): the supervisor decodes it
# with `WorkerMsg` only, so the types, sizes and ranges below are checked at the boundary.
MAX_RETRIES = 100  # a child's attempts after its first (rlm_query(..., retries=N))
ReqId = Annotated[int, msgspec.Meta(ge=0, le=2**53)]
Count = Annotated[int, msgspec.Meta(ge=0, le=2**31)]
Seconds = Annotated[float, msgspec.Meta(ge=0, le=1e9)]  # NaN and -1 are refused here
Id = Annotated[str, msgspec.Meta(max_length=200)]
ShortText = Annotated[str, msgspec.Meta(max_length=1000)]
ChatMessage = dict[str, str]

# Bounds both sides apply, so a worker that keeps them never meets the supervisor's check:
SYSTEM_PROMPT_CAP = 200_000  # characters of a run's system prompt (brood's is ~10,000)
MAX_REMEMBER_BYTES = 16 * 2**20  # one remember() value, pickled
FAILURE_TEXT_CAP = 8_000  # characters of a failure's reason and of its error text kept
# What one REPL step keeps (and journals) of its stdout, and as much of its stderr: 50 times
# what the model is shown, at least 1,000,000 characters, at most 4,000,000, so one step's
# StepDone stays well under the cap of a worker's message whatever output_limit says.
STEP_CAPTURE_MIN = 1_000_000
STEP_CAPTURE_PER_SHOWN = 50
STEP_CAPTURE_MAX = 4_000_000


# A compaction (Limits.compact_at): the one user message of a "compact" model call, after the
# run's conversation as the supervisor answered it. The supervisor accepts only this text.
COMPACT_PROMPT = (
    "[brood] This conversation is about to be compacted: your turns so far will be replaced "
    "by a summary you write now. Write it for yourself, to go on from: the task, what you "
    "have found, every REPL variable you made that matters (its name and what it holds), "
    "and what is left to do. Your REPL variables persist, so name them rather than copying "
    "their contents. Reply with the summary only: no code runs from this reply."
)


def history_size(prompt_tokens: int, messages: list[dict[str, Any]]) -> tuple[int, str]:
    """How big a run's history is, as Limits.compact_at measures it, in one place for both
    sides: the prompt tokens the model reported for the run's last turn, or (when it reports
    none) the characters of `messages` (that turn's messages and its reply); with the unit."""
    if prompt_tokens > 0:
        return prompt_tokens, "tokens"
    return sum(len(str(m.get("content", ""))) for m in messages), "characters"


def step_capture(output_limit: int) -> int:
    """Characters of a step's stdout (and of its stderr) kept, for Limits.output_limit."""
    return min(STEP_CAPTURE_MAX, max(STEP_CAPTURE_MIN, STEP_CAPTURE_PER_SHOWN * output_limit))


def clip(text: str, cap: int) -> str:
    """`text` if it holds at most `cap` characters; else its start and end with a note on
    what was dropped between them (the whole stays within `cap` where cap allows a note)."""
    if len(text) <= cap:
        return text
    keep = max(0, cap - len(_clip_note(len(text), cap)))
    head = keep // 2
    return text[:head] + _clip_note(len(text) - keep, cap) + text[len(text) - (keep - head) :]


def _clip_note(dropped: int, cap: int) -> str:
    return f"\n[... {dropped:,} characters dropped here: over the cap of {cap:,} ...]\n"


def user_message_cap(
    max_prompt_chars: int, task: str = "", messages: list[str] | None = None
) -> int:
    """Characters one user message of a run's conversation may hold: Limits.max_prompt_chars,
    and for the first message also the run's task and the messages it started with."""
    return max_prompt_chars + len(task) + sum(len(m) for m in messages or ())


class SpawnReq(Msg):
    req_id: ReqId
    prompts: list[str]
    context: bytes | None = None  # cloudpickled context value, shared by every prompt
    model: ShortText | None = None
    timeout: Seconds | None = None
    step: Count = 0
    replaying: bool = False  # the step is one the journal holds: its children must be there
    pool: ShortText | None = None  # the capacity pool each child holds from start to end
    retries: Annotated[int, msgspec.Meta(ge=0, le=MAX_RETRIES)] = 0  # attempts after the first
    placement: Literal["local", "spread"] = "local"  # "spread": on another node of a cluster


class CancelReq(Msg):
    req_id: ReqId
    child_id: Id


class AskOption(msgspec.Struct, frozen=True):
    id: ShortText
    label: ShortText


class AskReq(Msg):
    """ask_person: open an ask; the reply is its id (`a-…`)."""

    req_id: ReqId
    question: Annotated[str, msgspec.Meta(max_length=100_000)]
    options: Annotated[list[AskOption], msgspec.Meta(max_length=100)] = []
    deadline: Seconds | None = None  # seconds from now
    default: ShortText | None = None  # an option id, or text
    step: Count = 0
    replaying: bool = False  # the step is one the journal holds: its asks must be there


class AskCancelReq(Msg):
    """rlm_cancel of an ask: withdraw it."""

    req_id: ReqId
    ask_id: Id


class SendReq(Msg):
    req_id: ReqId
    child_id: Id
    message: str
    replaying: bool = False  # a replayed step's send was delivered before the crash


class Blocked(Msg):
    """The run waits on children (`blocked=True`) or wants to compute again (False).

    A block releases the run's concurrency slot; an unblock is answered once a slot is free.
    `hazard` (with a block) says why a rebuild of the run by replay could diverge from what
    its worker holds now (threads or open files of its code, spawned work in flight, a wait
    with a timeout); empty when the worker knows of none. It can only keep a run live.
    """

    req_id: ReqId
    blocked: bool
    hazard: str = ""


class ModelReq(Msg):
    """A model call, made for the worker by the supervisor's model gateway (the worker holds
    no model, client or credential). The reply's value is the model's text.

    `messages` is the whole conversation; `new_from` is where the messages not journaled
    yet begin ("turn": the conversation grows, so the journal keeps each message once).
    A "compact" call is the conversation plus COMPACT_PROMPT (Limits.compact_at); its reply
    is the summary that replaces the turns so far."""

    req_id: ReqId
    kind: Literal["turn", "llm_query", "compact"]
    messages: list[ChatMessage]
    new_from: Count = 0
    model: ShortText | None = None


class ToolReq(Msg):
    """A call of a tool the supervisor runs (brood.tools), from model code: its arguments
    as the code passed them, checked against the tool's signature on receipt."""

    req_id: ReqId
    name: Id
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    step: Count = 0


class Remember(Msg):
    """A value `remember(fn)` computed live, journaled so a replay gets it back."""

    value: bytes  # cloudpickled


class FlowReq(Msg):
    """A run's code starts or steers a flow: op is run (with spec and inputs as JSON or
    YAML text), status, wait (with timeout), stop or resume (with ref, the flow's run id)."""

    req_id: ReqId
    op: Literal["run", "status", "wait", "stop", "resume"]
    ref: Id | None = None
    spec: str | None = None
    inputs: str | None = None
    timeout: Seconds | None = None
    replaying: bool = False  # asked by a journaled step a resumed run replays


class StepBegan(Msg):
    """A REPL step is about to run. Answered once the supervisor has journaled it (so a
    step during which the host dies is known on resume) and started its own clock of it."""

    req_id: ReqId
    step: Count
    replaying: bool = False  # a step the journal holds, run again to rebuild the REPL


class StepDone(Msg):
    step: Count
    code: str
    stdout: str
    stderr: str
    error: str | None
    duration: Seconds
    # Plain calls still in flight when the step ended (started with spawn): a replay of
    # this step may find no journaled reply for them, and then asks the model live.
    pending: list[str] = []
    replayed: bool = False  # a replayed step's end: it stops the clock, it is not journaled


class Final(Msg):
    answer: str
    reason: str = "answer"
    products: dict[str, Any] | None = None  # FINAL(answer, products=...): a JSON object


class Failed(Msg):
    """The run cannot go on. `kind` "diverged" says its replay of the journal diverged; the
    supervisor believes that only of a run it is itself replaying (a failure a worker
    reports is data, never a decision)."""

    reason: str
    error: str
    kind: Literal["error", "diverged"] = "error"


class StepResult(Msg):
    req_id: ReqId
    stdout: str
    stderr: str
    error: str | None
    done: bool
    answer: str | None


# ---- supervisor -> worker -------------------------------------------------------------------
class Replay(msgspec.Struct, omit_defaults=True):
    """What a resumed run's journal holds: its model turns' replies in order (and their
    prompt tokens), its compactions' summaries, its plain calls' replies by prompt, and how
    many REPL steps it had run."""

    turns: list[str] = []
    calls: dict[str, list[str]] = {}
    steps: int = 0
    remembered: list[bytes] = []  # values of remember(), in order
    pending: list[str] = []  # plain calls in flight when a journaled step ended
    turn_tokens: list[int] = []  # each turn's prompt tokens, as its model reported them
    # Each compaction's summary, by the number of turns answered before it.
    compactions: dict[int, str] = {}
    user_turns: list[str] = []  # a conversation root's journaled user turns, in order


class ToolInfo(msgspec.Struct, frozen=True, omit_defaults=True):
    """A tool in the run's REPL (brood.tools): its name, its signature as text and its
    docstring, for the system prompt; `fn`, for a tool that runs in the worker, is the
    function itself, cloudpickled (else a call is a ToolReq to the supervisor)."""

    name: str
    signature: str
    doc: str
    fn: bytes | None = None


class WorkerLimits(msgspec.Struct, frozen=True, kw_only=True):
    """The fields of `Limits` a worker reads, and only those: the supervisor builds them from
    its `Limits` for every Start, so the worker has no defaults of its own. What the worker
    enforces here is for the model's convenience; the supervisor enforces it again."""

    max_depth: int
    max_iterations: int
    step_timeout: float | None
    stall_timeout: float | None
    output_limit: int
    answer_limit: int
    max_prompt_chars: int
    max_chunks: int
    compact_at: int | None
    # A model call unanswered this long is a wait the run may hibernate in (Blocked).
    hibernate_after: float | None
    read_only: bool
    blocked_builtins: tuple[str, ...]
    # Named in a note when a step fails in a way the limit explains (agent.LIMIT_ERRORS).
    worker_memory: int | None
    worker_processes: int | None
    worker_file_size: int | None
    worker_open_files: int | None
    worker_disk: int | None

    @classmethod
    def from_limits(cls, limits: Limits) -> WorkerLimits:
        return cls(**{name: getattr(limits, name) for name in cls.__struct_fields__})

    def can_start_child(self, depth: int) -> bool:
        """Whether a run at `depth` may start child runs (else rlm_query is a plain call)."""
        return may_start_children(depth, self.max_depth)


class Start(Msg):
    run_id: str
    depth: int
    prompt: str
    context: bytes | None
    limits: WorkerLimits
    driven: bool = False  # True for a Session root: steps come from Exec, not a model
    messages: list[str] = []
    model_name: str | None = None  # rlm_query(model=...): passed to every model call
    replay: Replay | None = None  # set when the run is resumed from the journal
    budget: dict[str, Any] | None = None  # its place in the tree and what is left, at start
    tools: list[ToolInfo] = []  # the user's tools, placed in the REPL beside the helpers
    # A conversation root (Supervisor.conversation): its user turns come as `Turn`s, each
    # continuing the same history and REPL until FINAL; `prompt` is then only a label.
    conversation: bool = False


class BudgetReq(Msg):
    """budget_remaining(): the run's place in the tree and the budgets left, now."""

    req_id: ReqId


# Where a system prompt's run-specific part (its place in the tree, the budgets left)
# begins: the journal keeps what comes before once per tree, and the rest with each call.
BUDGET_MARK = "\n\nYour place in the tree:"


class ErrorInfo(msgspec.Struct, omit_defaults=True):
    type: str
    message: str
    fields: dict[str, Any] = {}


class Reply(Msg):
    req_id: int
    value: Any = None
    error: ErrorInfo | None = None
    # A model turn's prompt tokens, as its model reported them (0: not reported), for
    # Limits.compact_at.
    prompt_tokens: int = 0


class ChildUpdate(Msg):
    child_id: str
    state: str
    answer: str | None = None
    reason: str | None = None
    error: str | None = None
    products: dict[str, Any] | None = None


class Progress(Msg):
    """A heartbeat from below: `child_id` (the id its parent's handle has), or something
    under it, made progress (a step, a model call). A waiting step is not stalled."""

    child_id: str


class AskUpdate(Msg):
    """An ask of the run moved: `answered` (with its result) or `cancelled` (withdrawn, or
    its deadline passed with no default; `reason` says which)."""

    ask_id: str
    state: AskState
    result: dict[str, Any] | None = None
    reason: str | None = None


class Deliver(Msg):
    message: str
    req_id: int = 0  # when set, the worker answers Reply(req_id) once the message is queued


class Notice(Msg):
    """A line for the run's next model turn (e.g. a milestone of a flow it started)."""

    text: str


class Turn(Msg):
    """A conversation root's next user turn: the user's message, handed once the turn is
    journaled and the run holds a slot again."""

    prompt: str


class Exec(Msg):
    req_id: int
    code: str
    timeout: float | None = None  # Session.step(timeout=): this step's compute limit


class Stop(Msg):
    pass


# ---- another process (the CLI) -> a supervisor's control socket ---------------------------
class CtlAuth(Msg):
    """The first frame on a control connection: the secret in the socket's key file, which
    only the supervisor's user can read and which workers never see."""

    secret: str


class CtlCancel(Msg):
    req_id: int
    run_id: str
    reason: str = "cancelled by user"


class CtlSend(Msg):
    req_id: int
    run_id: str
    message: str


class CtlFlow(Msg):
    """stop, resume or status of a flow this supervisor runs."""

    req_id: int
    run_id: str
    op: str


class CtlAnswer(Msg):
    """Answer an open ask of a run this supervisor runs (`brood answer`)."""

    req_id: int
    ask_id: str
    value: str
    by: str


# What a worker may send; anything else from a worker ends its run.
WorkerMsg = (
    SpawnReq
    | CancelReq
    | AskReq
    | AskCancelReq
    | BudgetReq
    | SendReq
    | Blocked
    | ModelReq
    | StepBegan
    | StepDone
    | FlowReq
    | ToolReq
    | Remember
    | Final
    | Failed
    | StepResult
    | Reply
)

# Every message: what workers send, and what the supervisor, the zygote and the CLI send.
AnyMsg = (
    WorkerMsg
    | Fork
    | Forked
    | Exited
    | GroupGone
    | Quit
    | Notice
    | Start
    | ChildUpdate
    | Progress
    | AskUpdate
    | Deliver
    | Turn
    | Exec
    | Stop
    | CtlAuth
    | CtlCancel
    | CtlSend
    | CtlFlow
    | CtlAnswer
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(AnyMsg)
_worker_decoder = msgspec.msgpack.Decoder(WorkerMsg)


def encode(msg: Msg) -> bytes:
    body = _encoder.encode(msg)
    return HEADER.pack(len(body)) + body


def decode(body: bytes | bytearray) -> Msg:
    try:
        return _decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"undecodable frame of {len(body)} bytes: {exc}") from exc
    except RecursionError:
        raise ProtocolError(f"frame of {len(body)} bytes is nested too deeply") from None


def decode_worker(body: bytes | memoryview) -> Msg:
    """A frame from a worker, which may only be one of `WorkerMsg` with valid values."""
    if len(body) > MAX_WORKER_FRAME:
        raise ProtocolError(
            f"frame of {len(body)} bytes exceeds the {MAX_WORKER_FRAME}-byte bound of a worker"
        )
    try:
        return _worker_decoder.decode(body)
    except msgspec.DecodeError as exc:
        raise ProtocolError(f"invalid frame of {len(body)} bytes: {exc}") from exc
    except RecursionError:  # msgspec's own bound on nesting, far below a thread's stack
        raise ProtocolError(f"frame of {len(body)} bytes is nested too deeply") from None


def check(msg: Msg) -> None:
    """Refuse, before it is sent, a message its receiver could not decode (a helper called
    with a value of the wrong type): InvalidArgument naming the field."""
    try:
        body = _encoder.encode(msg)
        if len(body) > MAX_WORKER_FRAME:
            raise errors.InvalidArgument(
                f"the request is {len(body)} bytes, over the {MAX_WORKER_FRAME}-byte bound of "
                "one message; pass less (a smaller context, fewer prompts)"
            )
        _decoder.decode(body)
    except (msgspec.ValidationError, msgspec.EncodeError, TypeError) as exc:
        text = str(exc)
        field = text.rsplit("at `$.", 1)[1].split("`")[0] if "at `$." in text else "a value"
        reason = text.split(" - at ")[0]
        raise errors.InvalidArgument(f"{field}: {reason}; pass a value of that type") from None


def error_info(exc: BaseException) -> ErrorInfo:
    fields = {
        k: v
        for k, v in vars(exc).items()
        if isinstance(v, str | int | float | list | type(None)) and not k.startswith("_")
    }
    return ErrorInfo(type=type(exc).__name__, message=str(exc), fields=fields)


def rebuild_error(info: ErrorInfo) -> BaseException:
    """The exception an ErrorInfo describes, as a brood error class where one matches."""
    cls = getattr(errors, info.type, None)
    if not (isinstance(cls, type) and issubclass(cls, BaseException)):
        cls = {"TimeoutError": TimeoutError, "ValueError": ValueError}.get(info.type)
    if cls is None:
        return errors.BroodError(f"{info.type}: {info.message}")
    exc = cls.__new__(cls)
    BaseException.__init__(exc, info.message)
    for k, v in info.fields.items():
        setattr(exc, k, v)
    return exc


class _SocketStream:
    """A socket as SyncChannel's two files: `read(n)` gives n bytes (fewer only at the end
    of the stream), `write` sends them all. No file objects: a buffered reader and a raw
    writer made with socket.makefile cost a freshly forked worker about 90 page faults."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def read(self, n: int) -> bytes | bytearray:
        if n <= 0:
            return b""
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            k = self._sock.recv_into(view[got:])
            if k == 0:
                del view
                del buf[got:]  # the stream ended inside the frame: what came of it
                return buf
            got += k
        return buf

    def write(self, data: bytes) -> None:
        self._sock.sendall(data)

    def close(self) -> None:
        self._sock.close()


class SyncChannel:
    """Blocking framed messages over a socket or a pair of pipe fds; sends are thread-safe."""

    def __init__(self, rfile: Any, wfile: Any, *, limit: int = MAX_FRAME) -> None:
        self._r = rfile
        self._w = wfile
        self._lock = threading.Lock()
        self.limit = limit  # the largest frame body this side may send

    @classmethod
    def over_socket(cls, sock: socket.socket, *, limit: int = MAX_FRAME) -> SyncChannel:
        """A channel over `sock`, read frame by frame (never past the frame it reads, so a
        reader may wait in select() between frames)."""
        stream = _SocketStream(sock)
        return cls(stream, stream, limit=limit)

    def close(self) -> None:
        for f in (self._r, self._w):
            close = getattr(f, "close", None)
            if close is not None:
                close()

    def send(self, msg: Msg) -> None:
        """Send `msg`; one over this side's frame cap is refused here, before any byte is
        sent, with the sizes (the channel stays usable)."""
        data = encode(msg)
        if len(data) - HEADER.size > self.limit:
            raise errors.InvalidArgument(
                f"{type(msg).__name__} of {len(data) - HEADER.size:,} bytes is over the "
                f"{self.limit:,}-byte cap of one message to the supervisor; send less "
                "(a smaller context, prompt or answer)"
            )
        with self._lock:
            self._w.write(data)
            flush = getattr(self._w, "flush", None)
            if flush is not None:
                flush()

    def recv(self) -> Msg | None:
        """The next message, or None at end of stream."""
        head = self._read(HEADER.size)
        if head is None:
            return None
        (size,) = HEADER.unpack(head)
        if size > MAX_FRAME:
            raise ProtocolError(f"frame of {size} bytes exceeds the {MAX_FRAME}-byte bound")
        body = self._read(size)
        if body is None:
            return None
        return decode(body)

    def _read(self, n: int) -> bytes | bytearray | None:
        buf = self._r.read(n)
        while len(buf) < n:  # a file that gives less than it was asked for, or none
            chunk = self._r.read(n - len(buf))
            if not chunk:
                return None
            buf += chunk
        return buf


async def read_frame(reader: asyncio.StreamReader, *, worker: bool = False) -> Msg | None:
    """The next message from an asyncio stream, or None at end of stream. With `worker`,
    the frame is held to what a worker may send (raises ProtocolError otherwise)."""
    import asyncio  # here: the worker side never needs it (nor ssl, which it brings)

    bound = MAX_WORKER_FRAME if worker else MAX_FRAME
    try:
        head = await reader.readexactly(HEADER.size)
        (size,) = HEADER.unpack(head)
        if size > bound:  # refused before the body is read, so it is never buffered
            raise ProtocolError(f"frame of {size} bytes exceeds the {bound}-byte bound")
        body = await reader.readexactly(size)
        return decode_worker(body) if worker else decode(body)
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
