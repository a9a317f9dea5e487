"""The escape catalogue (DESIGN.md section 14): model code, run in a real confined worker,
tries to get out; each case asserts it was refused or contained with a clear reason, then
that the supervisor still serves a run and the journal still opens and lists the runs.

Every attempt is model code (a ```repl block or a Session step), as a model would write it:
the model itself (chat_fn, Model) runs in the supervisor, which is trusted. Workers here
get brood's default confinement; only cases that must meet the test through a fifo widen
`fs_write` to their tmp_path, and none of those tests file confinement.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import threading
import uuid

import psutil
import pytest

import brood
from brood.protocol import MAX_WORKER_FRAME, CtlAuth, CtlCancel, encode
from brood.supervisor.control import control_request, key_path
from brood.worker.confine import CGROUP_HEADROOM, probe
from brood.worker.repl import CAPTURE_LIMIT
from tests.trust_util import (
    CHANNEL,
    NO_FINAL,
    as_seen_by,
    coder,
    limits,
    outcome,
    probe_code,
    refused,
    require,
    still_serves,
    task,
)
from tests.util import Gate, Signal, pid_alive

SECRET_KEY = "sk-secret-" + "7f3a9c1e5b2d4f6a8c0e"


@pytest.fixture
def store(tmp_path) -> str:
    return f"sqlite:///{tmp_path}/j.db"


def sup_of(store: str, lim: brood.Limits | None = None, **kw) -> brood.Supervisor:
    return brood.Supervisor(coder, limits=lim or limits(), store=store, **kw)


# ---- 1-2: secrets ---------------------------------------------------------------------------
def test_01_worker_environment_is_an_allow_list(store, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "aws-" + SECRET_KEY)
    monkeypatch.setenv("NAME", "passed-by-name")
    body = "R['env'] = dict(os.environ)\nR['cwd'] = os.getcwd()"
    with sup_of(store, worker_env={"EXTRA": "1"}) as sup:
        r1, got = outcome(sup, body)
        env = got["env"]
        assert "OPENAI_API_KEY" not in env and "AWS_SECRET_ACCESS_KEY" not in env
        assert SECRET_KEY not in json.dumps(got)
        assert env["HOME"] == env["TMPDIR"] == got["cwd"]
        assert "brood-scratch" in got["cwd"]
        assert env["PATH"]
        assert env["EXTRA"] == "1" and "NAME" not in env
        still_serves(sup, store, r1.run_id)
    with sup_of(store, worker_env=["NAME"]) as sup:
        r2, got = outcome(sup, body)
        assert got["env"]["NAME"] == "passed-by-name"
        assert "OPENAI_API_KEY" not in got["env"] and "EXTRA" not in got["env"]
        still_serves(sup, store, r1.run_id, r2.run_id)


def test_02_model_api_key_is_not_in_worker_memory(store):
    model = brood.OpenAIModel("m", api_key=SECRET_KEY, base_url="http://127.0.0.1:9/v1")
    # The needle is built at run time (the code text does not hold it) and skipped by identity.
    scan = f"""import gc
import os
def scan():
    needle = {SECRET_KEY[::-1]!r}[::-1]
    found, models = [], []
    def has(v):
        return isinstance(v, str) and v is not needle and needle in v
    for o in gc.get_objects():
        mod = getattr(type(o), '__module__', '') or ''
        if mod.startswith('brood.models'):
            models.append(type(o).__name__)
        items = ()
        if isinstance(o, dict):
            items = [*o.keys(), *o.values()]
        elif isinstance(o, (list, tuple, set, frozenset)):
            items = o
        if any(has(v) for v in items):
            found.append(type(o).__name__)
    return found, models, any(needle in v for v in os.environ.values())
print(json.dumps(scan()))"""
    with brood.Session(model, limits=limits(), store=store) as env:
        env.reset("find the key")
        obs = env.step("import json\n" + scan)
        assert obs.error is None, obs
        found, models, in_env = json.loads(obs.stdout)
        assert found == [] and models == [] and in_env is False
        obs = env.step("FINAL('done')")
        assert obs.done and obs.answer == "done"
        still_serves(env._engine, store, env.run_id)


# ---- 3-8: other processes -------------------------------------------------------------------
def test_03_supervisor_proc_environ_and_mem_refused(store):
    pid = os.getpid()
    with sup_of(store) as sup:
        require(sup.limits, "files")
        result, got = outcome(
            sup,
            f"tr('environ', lambda: open('/proc/{pid}/environ', 'rb').read())\n"
            f"tr('mem', lambda: open('/proc/{pid}/mem', 'rb'))\n"
            f"tr('cmdline', lambda: open('/proc/{pid}/cmdline', 'rb').read())",
        )
        refused(got["environ"])
        refused(got["mem"])
        refused(got["cmdline"])
        still_serves(sup, store, result.run_id)


def test_04_ptrace_attach_of_supervisor_refused(store):
    pid = os.getpid()
    with sup_of(store) as sup:
        require(sup.limits, "signals")
        # PTRACE_ATTACH (16); should it ever succeed, the code detaches (17) at once.
        result, got = outcome(
            sup,
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "libc.ptrace.restype = ctypes.c_long\n"
            f"args = [ctypes.c_long(a) for a in (16, {pid}, 0, 0)]\n"
            "rc = libc.ptrace(*args)\nR['attach'] = [rc, ctypes.get_errno()]\n"
            f"if rc == 0:\n    libc.ptrace(ctypes.c_long(17), ctypes.c_long({pid}), 0, 0)",
        )
        assert got["attach"] == [-1, 1], got  # EPERM
        still_serves(sup, store, result.run_id)


def test_05_signals_to_supervisor_refused(store):
    pid = os.getpid()
    with sup_of(store) as sup:
        require(sup.limits, "signals")
        result, got = outcome(
            sup,
            f"tr('probe', lambda: os.kill({pid}, 0))\ntr('kill', lambda: os.kill({pid}, 9))",
        )
        refused(got["probe"])
        refused(got["kill"])
        assert pid_alive(os.getpid())
        still_serves(sup, store, result.run_id)


def test_06_kill_of_zygote_refused(store):
    with sup_of(store) as sup:
        require(sup.limits, "signals")
        result, got = outcome(
            sup, "R['parent'] = os.getppid()\ntr('kill', lambda: os.kill(os.getppid(), 9))"
        )
        refused(got["kill"])
        assert got["parent"] == sup._engine.backend._zygote.pid
        assert pid_alive(got["parent"])
        still_serves(sup, store, result.run_id)
        still_serves(sup, store, result.run_id)


def _blocked_sibling(sup: brood.Supervisor, tmp_path):
    """A run whose code announces itself, then waits on a gate; and that gate."""
    started, go = Signal(tmp_path, "sib-started"), Gate(tmp_path, "sib-go")
    handle = sup.spawn(task(f"{started.code}\n{go.wait_code}\nFINAL('sibling done')"))
    started.wait()
    return handle, go


def test_07_kill_minus_one_hits_only_the_attackers_own_processes(store, tmp_path):
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        require(sup.limits, "signals")
        sibling, go = _blocked_sibling(sup, tmp_path)
        sibling_pid = sup._engine.core.runs[sibling.id].rec.pid
        zygote = sup._engine.backend._zygote.pid
        # The attacker starts a process of its own first: kill(-1) reaches it (so the signal
        # really went out), and nothing outside the run's Landlock signal scope.
        attack, got = outcome(
            sup,
            "import subprocess\nown = subprocess.Popen(['sleep', '1000'])\n"
            "tr('kill', lambda: os.kill(-1, 9))\nR['own'] = own.wait()",
        )
        assert got["kill"][0] == "ok" and got["own"] == -9, got
        assert pid_alive(os.getpid()) and pid_alive(zygote) and pid_alive(sibling_pid)
        assert sibling.status() == "running"
        go.open()
        assert sibling.wait() == "sibling done"
        still_serves(sup, store, attack.run_id, sibling.id)


def test_08_kill_of_sibling_worker_refused(store, tmp_path):
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        require(sup.limits, "signals")
        sibling, go = _blocked_sibling(sup, tmp_path)
        pid = sup._engine.core.runs[sibling.id].rec.pid
        assert pid and pid_alive(pid)
        result, got = outcome(
            sup, f"tr('probe', lambda: os.kill({pid}, 0))\ntr('kill', lambda: os.kill({pid}, 9))"
        )
        refused(got["probe"])
        refused(got["kill"])
        assert sibling.status() == "running"
        go.open()
        assert sibling.wait() == "sibling done"
        still_serves(sup, store, result.run_id, sibling.id)


# ---- 9-11: files ----------------------------------------------------------------------------
def test_09_journal_file_refused(store, tmp_path):
    db = str(tmp_path / "j.db")
    with sup_of(store) as sup:
        require(sup.limits, "files")
        other = sup.run(task("# TOPSECRET-TASK\nFINAL('TOPSECRET-' + 'ANSWER')"))
        assert other.answer == "TOPSECRET-ANSWER"
        result, got = outcome(
            sup,
            "import sqlite3\n"
            f"tr('read', lambda: open({db!r}, 'rb').read())\n"
            f"tr('wal', lambda: open({db + '-wal'!r}, 'rb').read())\n"
            f"tr('list', lambda: os.listdir({str(tmp_path)!r}))\n"
            f"tr('sqlite', lambda: sqlite3.connect('file:{db}?mode=ro', uri=True)"
            ".execute('select * from runs').fetchall())",
        )
        refused(got["read"])
        refused(got["list"])
        refused(got["wal"], "PermissionError", "FileNotFoundError")
        refused(got["sqlite"], "OperationalError", "DatabaseError")
        assert "TOPSECRET" not in result.answer
        still_serves(sup, store, other.run_id, result.run_id)


def test_10_other_runs_scratch_dir_refused(tmp_path):
    store_a, store_b = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    model = brood.ScriptedModel([])
    with (
        brood.Session(model, limits=limits(), store=store_a) as run_a,
        brood.Session(model, limits=limits(), store=store_b) as run_b,
    ):
        require(limits(), "files")
        run_a.reset("a")
        obs = run_a.step("import os\nopen('secret.txt', 'w').write('S3CRET')\nprint(os.getcwd())")
        scratch_a = obs.stdout.strip()
        # Scratch may be a tmpfs in run A's own mount namespace: look through its worker.
        seen_by_a = as_seen_by(run_a._engine, run_a.run_id, scratch_a)
        assert os.path.exists(os.path.join(seen_by_a, "secret.txt"))
        run_b.reset("b")
        obs = run_b.step(
            probe_code(
                f"tr('read', lambda: open({scratch_a!r} + '/secret.txt').read())\n"
                f"tr('list', lambda: os.listdir({scratch_a!r}))\n"
                f"tr('write', lambda: open({scratch_a!r} + '/planted', 'w'))\n"
                "R['own'] = os.getcwd()"
            )
        )
        got = json.loads(obs.answer)
        # Where A's scratch is a tmpfs of its own, B does not even find the file.
        refused(got["read"], "PermissionError", "FileNotFoundError")
        refused(got["list"])
        refused(got["write"])
        assert got["own"] != scratch_a
        assert "S3CRET" not in obs.answer
        assert not os.path.exists(os.path.join(seen_by_a, "planted"))
        still_serves(run_b._engine, store_b, run_b.run_id)
        still_serves(run_a._engine, store_a)


def test_11a_default_files(store, tmp_path):
    outside = f"/tmp/brood-trust-{uuid.uuid4().hex}"
    with sup_of(store) as sup:
        require(sup.limits, "files")
        result, got = outcome(
            sup,
            "tr('shadow', lambda: open('/etc/shadow').read())\n"
            "tr('etc', lambda: open('/etc/brood-trust-x', 'w'))\n"
            f"tr('tmp', lambda: open({outside!r}, 'w'))\n"
            f"tr('tmp_path', lambda: open({str(tmp_path / 'x')!r}, 'w'))\n"
            "tr('scratch', lambda: open('mine.txt', 'w').write('ok'))\n"
            "tr('scratch_back', lambda: open('mine.txt').read())",
        )
        refused(got["shadow"])
        refused(got["etc"])
        refused(got["tmp"])
        refused(got["tmp_path"])
        assert got["scratch"] == ["ok", "2"] and got["scratch_back"] == ["ok", "'ok'"]
        assert not os.path.exists("/etc/brood-trust-x") and not os.path.exists(outside)
        assert not (tmp_path / "x").exists()
        still_serves(sup, store, result.run_id)


def test_11b_fs_write_widens(store, tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with sup_of(store, limits(fs_write=[str(target)])) as sup:
        require(sup.limits, "files")
        result, got = outcome(
            sup,
            f"tr('write', lambda: open({str(target / 'w.txt')!r}, 'w').write('hi'))\n"
            f"tr('beside', lambda: open({str(tmp_path / 'beside')!r}, 'w'))",
        )
        assert got["write"] == ["ok", "2"]
        assert (target / "w.txt").read_text() == "hi"
        refused(got["beside"])
        still_serves(sup, store, result.run_id)


def test_11c_fs_read_widens_read_only(store, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "in.txt").write_text("readable")
    with sup_of(store, limits(fs_read=[str(data)])) as sup:
        require(sup.limits, "files")
        result, got = outcome(
            sup,
            f"tr('read', lambda: open({str(data / 'in.txt')!r}).read())\n"
            f"tr('write', lambda: open({str(data / 'new.txt')!r}, 'w'))\n"
            f"tr('append', lambda: open({str(data / 'in.txt')!r}, 'a'))",
        )
        assert got["read"] == ["ok", "'readable'"]
        refused(got["write"])
        refused(got["append"])
        assert not (data / "new.txt").exists()
        still_serves(sup, store, result.run_id)


# ---- 12: network ----------------------------------------------------------------------------
NET_CODE = """import socket
def tcp():
    s = socket.create_connection(('127.0.0.1', {tcp}), timeout=5)
    s.close()
    return 'connected'
def udp():
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    return s.sendto(b'escape', ('127.0.0.1', {udp}))
tr('tcp', tcp)
tr('udp', udp)
tr('ifaces', lambda: [n for _, n in socket.if_nameindex()])"""


def test_12a_network_off(store):
    lim = limits()
    require(lim, "network")
    with (
        socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener,
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
    ):
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        udp.bind(("127.0.0.1", 0))
        with sup_of(store, lim) as sup:
            result, got = outcome(
                sup,
                NET_CODE.format(tcp=listener.getsockname()[1], udp=udp.getsockname()[1]),
            )
            assert got["tcp"][0] != "ok", got
            if probe().seccomp:  # no netlink socket to list interfaces, no addressed send
                refused(got["ifaces"])
                refused(got["udp"])
            elif probe().netns:  # brood put the zygote in a private network namespace
                assert got["ifaces"] == ["ok", "['lo']"]
            udp.setblocking(False)
            with pytest.raises(BlockingIOError):
                udp.recv(100)
            listener.setblocking(False)
            with pytest.raises(BlockingIOError):
                listener.accept()
            still_serves(sup, store, result.run_id)


def test_12b_network_on(store):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        with sup_of(store, limits(network=True)) as sup:
            require(sup.limits, "network")
            result, got = outcome(sup, NET_CODE.format(tcp=listener.getsockname()[1], udp=9))
            assert got["tcp"] == ["ok", "'connected'"]
            listener.settimeout(10)  # the connection is in the backlog already
            conn, _ = listener.accept()
            conn.close()
            still_serves(sup, store, result.run_id)


# ---- 13-15: control sockets -----------------------------------------------------------------
def test_13_other_supervisors_control_socket(tmp_path):
    store1, store2 = f"sqlite:///{tmp_path}/1.db", f"sqlite:///{tmp_path}/2.db"
    with (
        sup_of(store1) as sup1,
        sup_of(store2, limits(fs_write=[str(tmp_path)])) as sup2,
    ):
        require(sup1.limits, "files")
        victim, go = _blocked_sibling(sup2, tmp_path)
        path = sup2._engine.control.path
        result, got = outcome(
            sup1,
            "import socket\nfrom brood.protocol import CtlCancel, encode\n"
            "def cancel():\n"
            "    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
            "    s.settimeout(10)\n"
            f"    s.connect({path!r})\n"
            f"    s.sendall(encode(CtlCancel(req_id=1, run_id={victim.id!r})))\n"
            "    return s.recv(100)\n"
            "tr('cancel', cancel)\n"
            f"tr('key', lambda: open({key_path(path)!r}).read())",
        )
        # Connected or not, it got no reply: the connection was closed unanswered.
        assert got["cancel"] == ["ok", "b''"] or got["cancel"][0] in (
            "PermissionError",
            "ConnectionRefusedError",
            "ConnectionResetError",
        ), got
        refused(got["key"])
        assert victim.status() == "running"
        go.open()
        assert victim.wait() == "sibling done"
        still_serves(sup1, store1, result.run_id)
        still_serves(sup2, store2, victim.id)


def _unanswered(path: str, *frames: bytes) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(path)
        s.sendall(b"".join(frames))
        return s.recv(100)


def test_14_control_socket_needs_the_secret(store, tmp_path):
    with sup_of(store, limits(fs_write=[str(tmp_path)])) as sup:
        victim, _go = _blocked_sibling(sup, tmp_path)
        path = sup._engine.control.path
        cancel = encode(CtlCancel(req_id=1, run_id=victim.id))
        assert _unanswered(path, cancel) == b""
        assert _unanswered(path, encode(CtlAuth("not-the-secret")), cancel) == b""
        assert _unanswered(path, b"\x00\x00\x00\x03abc") == b""
        assert victim.status() == "running"
        assert control_request(path, CtlCancel(req_id=2, run_id=victim.id), timeout=30) == (
            "cancelled"
        )
        assert victim.status() == "cancelled"
        still_serves(sup, store, victim.id)


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def _bound_unix_sockets(pids: list[int]) -> list[tuple[int, str]]:
    """(flags, path) of the path-bound unix sockets that `pids` hold, read in each of their
    network namespaces (workers and the zygote may be in a private one)."""
    held = set().union(*(_socket_inodes(p) for p in pids))
    out = set()
    for pid in pids:
        with open(f"/proc/{pid}/net/unix") as f:
            next(f)
            for line in f:
                fields = line.split()
                if len(fields) > 7 and int(fields[6]) in held:
                    out.add((int(fields[3], 16), fields[7]))
    return sorted(out)


def test_15_only_control_sockets_are_path_bound(store, tmp_path):
    listening = 0x10000  # __SO_ACCEPTCON
    with (
        sup_of(store, limits(fs_write=[str(tmp_path)])) as sup,
        sup_of(f"sqlite:///{tmp_path}/other.db") as other,
    ):
        sibling, go = _blocked_sibling(sup, tmp_path)
        brood_pids = [os.getpid()]
        for s in (sup, other):
            zygote = psutil.Process(s._engine.backend._zygote.pid)
            brood_pids += [zygote.pid, *(c.pid for c in zygote.children(recursive=True))]
        assert sup._engine.core.runs[sibling.id].rec.pid in brood_pids
        bound = _bound_unix_sockets(brood_pids)
        listeners = {path for flags, path in bound if flags & listening}
        assert listeners == {sup._engine.control.path, other._engine.control.path}, bound
        # Accepted connections show their listener's path; none is anything but ctl.sock.
        assert all(os.path.basename(path) == "ctl.sock" for _, path in bound), bound
        go.open()
        assert sibling.wait() == "sibling done"
        still_serves(sup, store, sibling.id)


# ---- 16-20: the worker's channel ------------------------------------------------------------
@pytest.mark.parametrize(
    "forged",
    [
        "CtlCancel(req_id=1, run_id='r-00000000')",
        "Start(run_id='r-x', depth=0, prompt='p', context=None, limits={})",
        "Exec(req_id=1, code='print(1)')",
    ],
)
def test_16_forged_frame_type(store, forged):
    with sup_of(store) as sup:
        code = (
            CHANNEL + "from brood.protocol import CtlCancel, Start, Exec\n"
            f"link.chan.send({forged})\nFINAL('forged frame accepted')"
        )
        result = sup.run(task(code))
        assert result.state == "failed", result
        assert result.error.startswith("protocol violation"), result.error
        still_serves(sup, store, result.run_id)


@pytest.mark.parametrize(
    "forged",
    [
        {"type": "SpawnReq", "req_id": -5, "prompts": ["x"]},
        {"type": "ModelReq", "req_id": 1, "kind": "shell", "messages": []},
        {"type": "Blocked", "req_id": 2**60, "blocked": True},
        {"type": "FlowReq", "req_id": 1, "op": "run", "timeout": -1.0},
        {"type": "CancelReq", "req_id": 1, "child_id": "c" * 5000},
    ],
    ids=["negative-req", "bad-kind", "huge-req", "negative-timeout", "long-id"],
)
def test_17_forged_value(store, forged):
    with sup_of(store) as sup:
        code = CHANNEL + f"frame({forged!r})\nFINAL('forged value accepted')"
        result = sup.run(task(code))
        assert result.state == "failed", result
        assert result.error.startswith("protocol violation"), result.error
        still_serves(sup, store, result.run_id)


def test_17b_repeated_unblocks_do_not_take_more_slots(store, tmp_path):
    # A worker gives up its compute slot, then asks for it back 50 times while another
    # run holds the only one (valid frames, hostile use), then ends. None of its queued
    # asks may take the slot later, or the supervisor would never start anything again.
    go, other_go = Gate(tmp_path, "go"), Gate(tmp_path, "other")
    with sup_of(store, limits(max_concurrency=1, fs_write=[str(tmp_path)])) as sup:
        code = (
            CHANNEL
            + go.wait_code
            + "\nframe({'type': 'Blocked', 'req_id': 0, 'blocked': True})\n"
            + "for i in range(50):\n"
            + "    frame({'type': 'Blocked', 'req_id': 10**6 + i, 'blocked': False})\n"
            + "FINAL('asked 50 times')"
        )
        attacker = sup.spawn(task(code))
        other = sup.spawn(task(other_go.wait_code + "\nR['ok'] = 1"))
        go.open()  # the other run is queued behind the attacker by now
        assert attacker.wait_result(timeout=60).state == "completed"
        other_go.open()
        assert other.wait_result(timeout=60).state == "completed"
        after = sup.spawn(task("R['after'] = 1")).wait_result(timeout=60)
        assert after.state == "completed", after
        assert sup.statistics()["free_slots"] == 1
        still_serves(sup, store, attacker.id, other.id)


def test_18_oversized_frame(store):
    with sup_of(store) as sup:
        code = CHANNEL + "raw(struct.pack('>I', 2**30) + b'abcd')\nFINAL('oversized accepted')"
        before = psutil.Process().memory_info().rss  # this pytest process's, tests before
        handle = sup.spawn(task(code))
        result = handle.wait_result(timeout=60)  # a hang guard only
        assert result.state == "failed", result
        assert result.error.startswith("protocol violation"), result.error
        assert str(MAX_WORKER_FRAME) in result.error and "bound" in result.error
        # The 1 GiB the frame announced was never allocated.
        assert psutil.Process().memory_info().rss - before < 256 * 2**20
        still_serves(sup, store, result.run_id)


@pytest.mark.parametrize(
    "garbage",
    [b"\x00\x00\x00\x08\xff\xfe\xfd\xfc\xc1\xc1\xc1\xc1", b"\x00\x00\x00\x02\x90\x90"],
    ids=["undecodable", "not-a-message"],
)
def test_19_garbage_on_the_channel(store, garbage):
    with sup_of(store) as sup:
        result = sup.run(task(CHANNEL + f"raw({garbage!r})\nFINAL('garbage accepted')"))
        assert result.state == "failed", result
        assert result.error.startswith("protocol violation"), result.error
        still_serves(sup, store, result.run_id)


class Metered(brood.Model):
    """`coder` with usage: every call reports 50 input tokens."""

    name = "metered"

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def complete(self, messages, model=None):
        with self._lock:
            self.calls += 1
        return brood.Completion(coder(messages), input_tokens=50)


FORGE_USAGE = """usage = {'model_calls': -100, 'input_tokens': -10**9, 'output_tokens': -10**9,
         'cost': -1e6, 'tokens': -10**9}
def forge():
    frame({'type': 'Reply', 'req_id': 10**6, 'value': {'usage': usage}})
    frame({'type': 'Blocked', 'req_id': 10**6 + 1, 'blocked': False, 'usage': usage})
"""


def test_20a_forged_usage_does_not_count(store):
    model = Metered()
    with brood.Supervisor(model, limits=limits(), store=store) as sup:
        code = (
            CHANNEL
            + FORGE_USAGE
            + (
                "forge()\nr1 = llm_query('q1')\nforge()\nr2 = llm_query('q2')\nforge()\n"
                "FINAL(r1 + r2)"
            )
        )
        result = sup.run(task(code))
        assert (result.state, result.answer) == ("completed", "plainplain"), result
        # One turn and two plain calls, as the gateway counted them, 50 tokens each.
        assert model.calls == 3
        assert result.usage == {
            "model_calls": 3,
            "input_tokens": 150,
            "output_tokens": 0,
            "cost": None,  # a model named "metered" has no known price
            "unpriced_calls": 3,
        }, result.usage
        still_serves(sup, store, result.run_id)
        with brood.journal.Journal(store) as journal:
            assert journal.run(result.run_id)["usage"]["input_tokens"] == 150


def test_20b_token_budget_holds_whatever_the_code_does(store):
    model = Metered()
    with brood.Supervisor(model, limits=limits(token_budget=120), store=store) as sup:
        code = (
            CHANNEL
            + FORGE_USAGE
            + (
                "for i in range(20):\n    forge()\n    try:\n        llm_query(f'q{i}')\n"
                "    except Exception:\n        pass\nFINAL('outspent the budget')"
            )
        )
        result = sup.run(task(code))
        assert result.state == "cancelled", result
        assert "budget" in result.error
        assert model.calls == 3  # 150 tokens > 120 after the third call
        assert result.usage["input_tokens"] == 150
        still_serves(sup, store, result.run_id)
        assert model.calls == 3  # the trivial run used `coder`, not this model


# ---- 21-27: processes and resources ---------------------------------------------------------
ESCAPES = {
    "shell-setsid-empty-env": (
        "import subprocess\n"
        "p = subprocess.Popen(['/bin/sh', '-c', \"setsid sh -c 'sleep 1000 & echo $!'\"], "
        "env={}, stdout=subprocess.PIPE, text=True)\n"
        "FINAL(p.stdout.readline().strip())"
    ),
    "python-double-fork-setsid": (
        "import os, signal\nr, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        os.write(w, str(os.getpid()).encode())\n"
        "        os.close(w)\n"
        "        while True:\n            signal.pause()\n"
        "    os._exit(0)\n"
        "os.close(w)\nFINAL(os.read(r, 32).decode())"
    ),
}


@pytest.mark.parametrize("code", list(ESCAPES.values()), ids=list(ESCAPES))
def test_21_a_process_that_left_its_worker_is_gone_with_the_run(store, code):
    with sup_of(store) as sup:
        result = sup.run(task(code))
        assert result.state == "completed", result
        escaped = int(result.answer)  # its pid, which the code printed
        assert not pid_alive(escaped)
        still_serves(sup, store, result.run_id)
    assert not pid_alive(escaped)


def test_22a_huge_print_is_truncated_in_a_step(store):
    with brood.Session(brood.ScriptedModel([]), limits=limits(), store=store) as env:
        env.reset("print a lot")
        obs = env.step('print("x" * 300_000_000)')
        assert obs.error is None, obs.error
        assert len(obs.stdout) <= CAPTURE_LIMIT + 200
        assert "characters of output dropped" in obs.stdout
        obs = env.step("FINAL('still here')")
        assert obs.done and obs.answer == "still here"
        still_serves(env._engine, store, env.run_id)


def test_22b_huge_print_is_truncated_for_the_model(store):
    seen: list[str] = []

    def recording(messages):
        seen.append(messages[-1]["content"])
        return coder(messages)

    lim = limits(output_limit=1000)
    with brood.Supervisor(recording, limits=lim, store=store) as sup:
        result = sup.run(task('print("x" * 300_000_000)'))
        assert (result.state, result.answer) == ("completed", NO_FINAL), result
        shown = seen[1]  # the turn after the step: what the model was shown of its output
        assert len(shown) < 5000 and "output truncated" in shown, shown
        still_serves(sup, store, result.run_id)


def test_23_answer_over_answer_limit_fails(store):
    with sup_of(store, limits(answer_limit=1000)) as sup:
        result = sup.run(task("FINAL('y' * 2000)"))
        assert result.state == "failed", result
        assert "answer_limit" in result.error
        still_serves(sup, store, result.run_id)


def test_24_fork_bomb_is_bounded(store):
    lim = limits(worker_processes=20)
    require(lim, "processes")
    with sup_of(store, lim) as sup:
        # Bounded here too, so a machine where the limit failed is not fork-bombed.
        code = (
            "import os, signal\npids = []\nerr = None\n"
            "for _ in range(400):\n"
            "    try:\n        pid = os.fork()\n"
            "    except OSError as e:\n        err = repr(e)\n        break\n"
            "    if pid == 0:\n"
            "        try:\n            while True:\n                signal.pause()\n"
            "        finally:\n            os._exit(0)\n"
            "    pids.append(pid)\n"
            "FINAL(json.dumps([pids, err]))"
        )
        result = sup.run(task("import json\n" + code))
        assert result.state == "completed", result
        pids, err = json.loads(result.answer)
        assert err is not None, f"forked {len(pids)} processes without a refusal"
        assert 1 <= len(pids) <= 20 + CGROUP_HEADROOM, (len(pids), err)
        assert not [p for p in pids if pid_alive(p)]
        still_serves(sup, store, result.run_id)


def test_25_worker_memory(store):
    with brood.Session(
        brood.ScriptedModel([]), limits=limits(worker_memory=512 * 2**20), store=store
    ) as env:
        env.reset("allocate")
        obs = env.step("b = bytearray(1024 * 2**20)")
        assert obs.error is not None and "MemoryError" in obs.error, obs
        obs = env.step("small = bytearray(2**20)\nFINAL(str(len(small)))")
        assert obs.done and obs.answer == str(2**20)
        still_serves(env._engine, store, env.run_id)


def test_26a_worker_cpu_seconds(store):
    with sup_of(store, limits(worker_cpu_seconds=1, step_timeout=None)) as sup:
        result = sup.run(task("while True:\n    pass"))
        assert result.state == "failed", result
        assert "worker_cpu_seconds" in result.error, result.error
        still_serves(sup, store, result.run_id)


def test_26b_worker_cpu_seconds_when_sigxcpu_is_ignored(store):
    # The kernel then sends SIGKILL at the hard limit; the CPU time read at the reap names it.
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    with sup_of(store, limits(worker_cpu_seconds=1, step_timeout=None)) as sup:
        result = sup.run(task(code))
        assert result.state == "failed", result
        assert "signal 9" in result.error and "worker_cpu_seconds" in result.error, result.error
        still_serves(sup, store, result.run_id)


def test_27_worker_file_size(store):
    with sup_of(store, limits(worker_file_size=1_000_000)) as sup:
        result, got = outcome(
            sup,
            "def big():\n    with open('big.bin', 'wb') as f:\n"
            "        f.write(b'x' * 10_000_000)\n"
            "tr('big', big)\ntr('small', lambda: open('small.bin', 'wb').write(b'x' * 1000))",
        )
        refused(got["big"], "OSError")
        assert got["big"][1] == 27, got  # EFBIG
        assert got["small"] == ["ok", "1000"]
        still_serves(sup, store, result.run_id)


# ---- 28-29: guidance and trusted mode -------------------------------------------------------
def test_28a_blocked_builtins_pi_rlm(store):
    with brood.Session(
        brood.ScriptedModel([]), limits=limits(blocked_builtins="pi-rlm"), store=store
    ) as env:
        env.reset("builtins")
        for call in ('eval("1")', 'exec("x = 1")', 'compile("1", "f", "eval")', "globals()"):
            obs = env.step(call)
            assert obs.error is not None and "PermissionError" in obs.error, (call, obs)
            assert "turned off for this run" in obs.error, obs.error
        obs = env.step("def f():\n    return locals()\nf()")
        assert obs.error is not None and "turned off for this run" in obs.error, obs
        obs = env.step("FINAL('ok')")
        assert obs.done and obs.answer == "ok"
        still_serves(env._engine, store, env.run_id)


def test_28b_read_only(store):
    lim = limits(read_only=True)
    with brood.Session(brood.ScriptedModel([]), limits=lim, store=store) as env:
        env.reset("read only")
        obs = env.step('open("x", "w")')
        assert obs.error is not None and "PermissionError" in obs.error, obs
        assert "read_only" in obs.error, obs.error
        require(lim, "files")
        obs = env.step(
            probe_code("tr('os_open', lambda: os.open('y', os.O_WRONLY | os.O_CREAT, 0o600))")
        )
        got = json.loads(obs.answer)
        refused(got["os_open"])
        still_serves(env._engine, store, env.run_id)


def test_29_confine_false_is_trusted_and_loud(store, tmp_path, caplog):
    target = "/etc/shadow"
    if not os.access(target, os.R_OK):  # not root: a file only confinement keeps out
        target = str(tmp_path / "private.txt")
        (tmp_path / "private.txt").write_text("private")
    with caplog.at_level(logging.WARNING, logger="brood"):
        sup = sup_of(store, limits(confine=False))
    with sup:
        warnings = [r.getMessage() for r in caplog.records if r.name == "brood"]
        assert any("confinement is off" in m for m in warnings), warnings
        result, got = outcome(sup, f"tr('read', lambda: len(open({target!r}).read()))")
        assert got["read"][0] == "ok", got
        still_serves(sup, store, result.run_id)


# ---- 30-31: the supervisor's side -----------------------------------------------------------
def test_30_chat_fn_that_never_returns(store):
    entered, release = threading.Event(), threading.Event()

    def stuck(messages):
        entered.set()
        release.wait()
        return "never used"

    try:
        sup = brood.Supervisor(stuck, limits=limits(), store=store)
        with sup:
            handle = sup.spawn("hang in the model")
            entered.wait()
            assert handle.cancel() == "cancelled"
            result = sup.run("trivial task", model=coder)
            assert result.answer == "alive"
        # close() returned with the call still blocked
        assert not release.is_set()
    finally:
        release.set()


@pytest.mark.parametrize("keep", [False, True])
def test_31_scratch_dir_lifetime(store, keep):
    with sup_of(store, keep_scratch=keep) as sup:
        result = sup.run(task("import os\nopen('f', 'w').write('x')\nFINAL(os.getcwd())"))
        scratch = result.answer
        assert "brood-scratch" in scratch
        try:
            assert os.path.exists(os.path.join(scratch, "f")) is keep
            still_serves(sup, store, result.run_id)
            sup.close()
            assert os.path.exists(os.path.join(scratch, "f")) is keep
        finally:
            if keep:
                shutil.rmtree(os.path.dirname(scratch), ignore_errors=True)
