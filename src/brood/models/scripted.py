"""A model that answers from a script: for tests, demos and RL environments.

The script maps a key to the replies of one run, in order. A run's key is the longest
script key found in its first user message (its task); the turn is the number of assistant
messages so far. A plain `llm_query` is a run of one turn whose task is its prompt. Because
the reply depends only on the messages, each worker can hold its own copy.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from brood.errors import InvalidArgument, ModelError
from brood.models.base import Completion, Messages, Model

Reply = str | Callable[[Messages], str]


class ScriptedModel(Model):
    """Replies from a script.

    `script` is a list of replies (one run) or a mapping `{key: [reply, ...]}`. A reply is a
    string or a callable `(messages) -> str`. `default` answers runs that match no key.
    Every call is appended to `log_path` (JSON lines with key, turn and pid) when given.
    """

    name = "scripted"

    def __init__(
        self,
        script: Sequence[Reply] | Mapping[str, Sequence[Reply]],
        *,
        default: Sequence[Reply] | None = None,
        log_path: str | os.PathLike[str] | None = None,
        tokens_per_call: tuple[int, int] = (0, 0),
    ) -> None:
        if isinstance(script, Mapping):
            self.script = {str(k): list(v) for k, v in script.items()}
        elif isinstance(script, Sequence) and not isinstance(script, str):
            self.script = {"": list(script)}
        else:
            raise InvalidArgument(
                "ScriptedModel(script=...) takes a list of replies or a {key: [replies]} mapping"
            )
        self.default = list(default) if default is not None else None
        self.log_path = os.fspath(log_path) if log_path is not None else None
        self.tokens_per_call = tokens_per_call
        # Text replies only and no log to write: answered on the supervisor's loop. A
        # callable reply is the user's code, which may block: it runs in the gateway's
        # threads, as a chat_fn does.
        replies = [r for rs in self.script.values() for r in rs] + list(self.default or ())
        self.instant = self.log_path is None and not any(callable(r) for r in replies)

    def complete(self, messages: Messages, model: str | None = None) -> Completion:
        """The script's next reply for this run's key and turn (ModelError past its end)."""
        task = next((str(m.get("content", "")) for m in messages if m.get("role") == "user"), "")
        turn = sum(1 for m in messages if m.get("role") == "assistant")
        keys = [k for k in self.script if k in task]
        key = max(keys, key=len) if keys else None
        replies = self.script[key] if key is not None else self.default
        if replies is None:
            raise ModelError(f"ScriptedModel has no script key found in the task {task[:80]!r}")
        if turn >= len(replies):
            raise ModelError(
                f"ScriptedModel has no reply #{turn + 1} for key {key!r} "
                f"(the script has {len(replies)})"
            )
        reply = replies[turn]
        text = reply(messages) if callable(reply) else reply
        if self.log_path:
            line = json.dumps({"key": key, "turn": turn, "pid": os.getpid()})
            with open(self.log_path, "a") as f:
                f.write(line + "\n")
        return Completion(text, *self.tokens_per_call)


def read_log(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The calls a ScriptedModel with `log_path` made, in order."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def from_spec(rest: str) -> ScriptedModel:
    """The model a `scripted:` spec names: only `demo`, the script of `brood demo`."""
    if rest != "demo":
        raise InvalidArgument(
            f"model spec 'scripted:{rest}' names no script brood has; write scripted:demo"
        )
    return demo_model()


def demo_model() -> ScriptedModel:
    from brood.models.demo import DEMO_SCRIPT

    return ScriptedModel(DEMO_SCRIPT, tokens_per_call=(120, 40))
