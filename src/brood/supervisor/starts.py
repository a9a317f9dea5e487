"""Starting runs: new roots, the children a run's code asks for (with the adoption of the
children a resumed parent's replay asks for again, by key), and the runs the supervisor's
own code drives (a flow's run and its instances). Each start is admitted against the
tree's limits, journaled (or forgotten, if the journal refuses it), then queued.

It owns no state of its own: the counters it checks are the tree's (`Tree`), the queues
admission's. It ends runs only through ending.py's attempts and the kernel's `finish`.
"""

from __future__ import annotations

import asyncio

from brood.errors import BroodError, InvalidArgument, LimitExceeded, ReplayDiverged
from brood.models.base import Model
from brood.protocol import MAX_CONTEXT_BYTES, SpawnReq
from brood.supervisor.admission import Admission
from brood.supervisor.budget import Budget
from brood.supervisor.conversations import CONVERSATION
from brood.supervisor.ending import Ending
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import FLOW_MODEL, RUN, Run, Turns, child_update, flow_key
from brood.supervisor.spread import Spread


def _clip(text: str, n: int = 80) -> str:
    return repr(text if len(text) <= n else text[: n - 3] + "...")


class Starts:
    def __init__(
        self,
        kernel: Kernel,
        admission: Admission,
        budget: Budget,
        ending: Ending,
        spread: Spread,
    ) -> None:
        self.kernel = kernel
        self.admission = admission
        self.budget = budget
        self.ending = ending
        self.spread = spread

    async def create_root(
        self,
        prompt: str,
        *,
        context_blob: bytes | None,
        model: Model | None = None,
        sub_model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        driven: bool = False,
        pool: str | None = None,
        run_id: str | None = None,
        conversation: bool = False,
    ) -> Run:
        """A new root run. `run_id` is chosen by the caller (a cluster, which must know a
        tree's id before the node starting it could be lost); by default one is drawn.
        A `conversation` root (conversations.py) takes its user turns one by one."""
        k = self.kernel
        k.check_open()
        if not isinstance(prompt, str) or not prompt.strip():
            raise InvalidArgument("prompt must be a non-empty str")
        if context_blob is not None and len(context_blob) > MAX_CONTEXT_BYTES:
            raise InvalidArgument(
                f"context is {len(context_blob):,} bytes pickled, over the "
                f"{MAX_CONTEXT_BYTES:,}-byte bound of a run's context; pass less, or let the "
                "run read it from a file (Limits(fs_read=[PATH]))"
            )
        k.limits.check_pool(pool)
        if driven and pool is not None:
            raise InvalidArgument(
                "pool=... does not apply to a Session root (it holds no slot); give the "
                "pool to the runs it starts"
            )
        rec = k.root_record(prompt, model_name or k.model_name, run_id)
        rec.pool = pool
        # A root's model_name only labels the journal row; the model object is the choice.
        run = Run(
            rec=rec,
            model=model or k.model,
            sub_model=sub_model,
            context_blob=context_blob,
            timeout=timeout,
            driven=driven,
            turns=Turns() if conversation else None,
        )
        await k.journal_or_forget([run])
        if conversation:
            k.event(run, CONVERSATION, {})
        if k.unenforced:  # said in the journal of every tree this supervisor runs
            k.event(run, "confinement", {"unenforced": k.unenforced})
        self.admission.admit(run)
        return run

    async def spawn_children(self, parent: Run, msg: SpawnReq) -> list[str]:
        """The children `parent`'s code asks for (rlm_query): their ids, in its order."""
        k = self.kernel
        if k.closing or parent.rec.state is not RUN or parent.ending is not None:
            raise BroodError(
                f"run {parent.id} is {parent.rec.state.value} and ending; it cannot start children"
            )
        if parent.turns is not None and parent.turns.between:  # its spawned work, after FINAL
            raise BroodError(
                f"conversation {parent.id} is between user turns; it starts children only "
                "during a turn"
            )
        if not k.limits.can_start_child(parent.rec.depth):
            raise LimitExceeded("max_depth", parent.rec.depth + 2, k.limits.max_depth)
        if not msg.prompts:
            return []
        k.limits.check_pool(msg.pool)
        self.budget.check_model(parent, msg.model)
        keys = []
        for _ in msg.prompts:
            seq = parent.seq.get(msg.step, 0)
            parent.seq[msg.step] = seq + 1
            keys.append(f"{msg.step}:{seq}")
        adopted = self._adopt(parent, msg, keys)
        fresh = [(key, p) for key, p in zip(keys, msg.prompts, strict=True) if key not in adopted]
        await k.admit_to_tree(parent, len(fresh), k.children_of(parent))
        # Each child's row holds its prompt and its own copy of the context.
        size = sum(len(p) + len(msg.context or b"") for _, p in fresh)
        if fresh and not k.charge(parent, size):
            raise BroodError(f"run {parent.id} is over its journal bytes; it starts no children")
        parent.tree.children += len(fresh)
        spread = msg.placement == "spread" and k.spreader is not None
        timeout = msg.timeout if msg.timeout is not None else k.limits.child_timeout
        children = []
        for key, prompt in fresh:
            below = parent.sub_model.name if parent.sub_model is not None else None
            rec = k.child_record(parent, key, prompt, msg.model or below or parent.rec.model)
            rec.pool = msg.pool
            child = Run(
                rec=rec,
                model=parent.sub_model or parent.model,
                sub_model=parent.sub_model,
                context_blob=msg.context,
                model_name=msg.model or parent.model_name,
                timeout=timeout,
                parent=parent,
            )
            child.retries_left = msg.retries
            parent.children.append(child)
            children.append(child)
        await k.journal_or_forget(children, parent, len(fresh))
        queue = self.admission.start_queue
        if spread:
            for child in children:
                child.spreading = k.task(self.spread.spread(child))
        else:
            queue.extend(children)
        queue.extend(c for c in adopted.values() if c.launchable)
        self.admission.grant()
        ended = []
        for c in adopted.values():  # each the latest attempt of its key
            c.retries_left = max(0, msg.retries - c.rec.attempt)
            if not c.rec.state.terminal:
                continue
            if self.ending.retries(c, c.rec.state):  # it failed, and the crash beat its retry
                c.retrying = True
                k.task(self.ending.next_attempt(c))
            else:
                ended.append(c)
        # Children that ended before the crash: tell the parent once it has their ids.
        if ended:
            asyncio.get_running_loop().call_soon(_announce, parent, ended)
        by_key = {c.rec.key: c for c in children} | adopted
        return [by_key[key].id for key in keys]

    def _adopt(self, parent: Run, msg: SpawnReq, keys: list[str]) -> dict[str, Run]:
        """The journaled children a resumed parent's replay asks for again, by key.

        A key the journal holds must come with the same prompt; while the parent replays a
        journaled step, every child it starts must be in the journal. Anything else is a
        divergence, and nothing is started.
        """
        adopted: dict[str, Run] = {}
        for key, prompt in zip(keys, msg.prompts, strict=True):
            child = parent.by_key.get(key)
            if child is None:
                if msg.replaying:
                    raise ReplayDiverged(
                        f"run {parent.id} step {msg.step}: the replay started a child under "
                        f"key {key} ({_clip(prompt)}), but the journal holds no child there"
                    )
                continue
            if child.rec.prompt != prompt:
                raise ReplayDiverged(
                    f"run {parent.id} step {msg.step}: the journal holds child {child.id} "
                    f"under key {key} with prompt {_clip(child.rec.prompt)}, the replay "
                    f"asked for {_clip(prompt)}"
                )
            adopted[key] = child
        for key in adopted:
            del parent.by_key[key]  # adopted once
        return adopted

    # ---- runs the supervisor's own code drives (flows) ----------------------------------
    async def create_controller(
        self, prompt: str, parent: Run | None = None, run_id: str | None = None
    ) -> Run:
        """A run with no worker of its own, driven by code in the supervisor (a flow's
        control loop): a root (under `run_id`, if the caller chose it), or a child of
        `parent` (a flow a run's code started). It is `running` at once; its children
        come from `start_child`."""
        k = self.kernel
        k.check_open()
        if parent is None:
            rec = k.root_record(prompt, FLOW_MODEL, run_id)
        else:
            await self._admit_for_flow(parent)
            rec = k.child_record(parent, flow_key(parent), prompt, FLOW_MODEL)
            # A flow's run holds no worker and is no level of the tree: it is recorded at
            # its parent's depth, so its instances are at the depth of the parent's own
            # children, where every check of depth (admission, the worker's Start,
            # budget_remaining, a resume) reads it from the record.
            rec.depth = parent.rec.depth
            parent.flows_started += 1
        run = Run(rec=rec, model=k.model, parent=parent)
        if parent is not None:
            parent.children.append(run)
        await k.journal_or_forget([run], parent, 0 if parent is None else 1)
        await k.move(run, RUN)
        run.started.set()
        return run

    async def start_child(
        self,
        parent: Run,
        prompt: str,
        *,
        key: str,
        context_blob: bytes | None = None,
        model: Model | None = None,
        model_name: str | None = None,
        timeout: float | None = None,
        pool: str | None = None,
    ) -> Run:
        """Start a child of a controller run. Its outcome is awaited on `child.done`.
        The instances of a flow the user started are bounded by the flow's own settings;
        those of a flow a run's code started are that run's children for every tree limit
        (LimitExceeded when one would pass)."""
        k = self.kernel
        if k.closing or parent.ending is not None or parent.rec.state is not RUN:
            raise BroodError(f"run {parent.id} is {parent.rec.state.value}; it starts no children")
        k.limits.check_pool(pool)
        if parent.parent is not None:  # counted by the admission
            await self._admit_for_flow(parent.parent)
        else:
            parent.tree.children += 1
        rec = k.child_record(parent, key, prompt, model_name or k.model_name)
        rec.pool = pool
        child = Run(
            rec=rec,
            model=model or parent.model,
            context_blob=context_blob,
            model_name=model_name,
            timeout=timeout if timeout is not None else k.limits.child_timeout,
            parent=parent,
        )
        parent.children.append(child)
        await k.journal_or_forget([child], parent, 1)
        self.admission.queue(child)
        return child

    async def _admit_for_flow(self, starter: Run) -> None:
        """One more run for a flow `starter`'s code started (the flow's own run, or one of
        its instances), admitted and counted as a child of `starter` (DESIGN.md section
        14): refused with LimitExceeded unless `starter` may start children (max_depth)
        and one more child fits max_children (the tree) and max_children_per_run."""
        k = self.kernel
        if not k.limits.can_start_child(starter.rec.depth):
            raise LimitExceeded("max_depth", starter.rec.depth + 2, k.limits.max_depth)
        await k.admit_to_tree(starter, 1, k.children_of(starter))
        starter.tree.children += 1

    def children_left(self, flow: Run) -> int | None:
        """How many more runs the tree limits leave to the flow whose run is `flow`: None
        for a flow the user started (its own settings bound it)."""
        k = self.kernel
        starter = flow.parent
        if starter is None:
            return None
        if not k.limits.can_start_child(starter.rec.depth):
            return 0
        lim = k.limits
        tree = lim.max_children - starter.tree.children
        return max(0, min(tree, lim.max_children_per_run - k.children_of(starter)))

    def adopt_child(
        self, parent: Run, key: str, timeout: float | None = None, *, launch: bool = True
    ) -> Run | None:
        """The journaled child of a resumed controller run under `key`, once (None when the
        journal holds none). An unfinished one is queued to resume, unless `launch` is
        False (its flow is ending and will cancel it)."""
        child = parent.by_key.pop(key, None)
        if child is None:
            return None
        if timeout is not None:
            child.timeout = timeout
        if launch and child.launchable:
            self.admission.queue(child)
        return child

    def adopt_flow(self, parent: Run) -> Run | None:
        """The journaled flow a resumed run's replay starts again (the next flow:N key)."""
        child = parent.by_key.pop(flow_key(parent), None)
        if child is not None:
            parent.flows_started += 1
        return child


def _announce(parent: Run, children: list[Run]) -> None:
    if parent.conn is None:
        return
    for c in children:
        parent.conn.send(child_update(c))


__all__ = ["Starts"]
