"""A run's model call, around the gateway: the checks before it (a model the tree may use,
the journal's bytes), the tree's budget it waits for, and its accounting after (the run's
usage, the tree's spend, the journaled `model_call` event with its system prompt by
reference). The call itself is the gateway's (gateway.py); this room decides whether it
may be made and counts what it cost.

It owns each tree's spend and the waiters for its budget (in the tree's record, `Tree`),
and `budget_of` (what `budget_remaining()` reports). It ends a tree over its budget only
through the kernel's `finish`.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from typing import Any

from brood.errors import BroodError, InvalidArgument, ModelError, RateLimited
from brood.lifecycle import RunState, add_cost
from brood.models.base import Completion, Model, is_spec, resolve_model, spec_without_url
from brood.models.prices import Pricing
from brood.protocol import BUDGET_MARK, ModelReq, clip, history_size
from brood.supervisor import frames
from brood.supervisor.gateway import ModelGateway
from brood.supervisor.kernel import Kernel
from brood.supervisor.runs import COST_UNKNOWN, FLOW_MODEL, RUN, Run, Tree


class Budget:
    def __init__(self, kernel: Kernel, pricing: Pricing | None = None) -> None:
        self.kernel = kernel
        self.gateway = ModelGateway()
        # The models of the specs in Limits.models that model code has named, built once:
        # one client (one connection pool) per spec for the supervisor's life.
        self.by_spec: dict[str, Model] = {}
        self.pricing = pricing or Pricing()
        self._last_prompt: tuple[str, str] | None = None  # (system prompt, its ref)

    async def model_call(self, run: Run, msg: ModelReq) -> str:
        """Make a worker's model call in the gateway; measure it and journal it here."""
        done: Completion | None = None
        try:
            done = await self._model_call_checked(run, msg)
            return done.text
        finally:
            run.model_requests -= 1
            if msg.kind == "turn":
                tokens = max(0, int(done.input_tokens)) if done else 0
                run.convo.answered(done.text if done else None, tokens)
            elif msg.kind == "compact":
                self._compacted(run, msg, done)
            self.kernel.waits_changed(run)

    def _compacted(self, run: Run, msg: ModelReq, done: Completion | None) -> None:
        """A compaction's summary call ended: its summary now stands for the run's replies
        so far (`frames.Conversation`), and a `compacted` event says how much it saved."""
        asked = run.convo.compacting
        run.convo.compacted(done.text if done else None)
        if done is None or asked is None:
            return  # it failed: the run fails (its worker says why), its journal whole
        size, unit = asked
        before = msg.messages[:-1]
        kept = [*before[:2], {"content": done.text}]
        self.kernel.event(
            run,
            "compacted",
            {
                "turn": run.convo.turns,
                "unit": unit,
                "before": size,
                "chars_before": history_size(0, before)[0],
                "chars_after": history_size(0, kept)[0],
                "tokens_before": run.convo.prompt_tokens or None,
                "replies_folded": len(before) // 2,
            },
        )

    async def _model_call_checked(self, run: Run, msg: ModelReq) -> Completion:
        k = self.kernel
        if run.ending is not None or run.rec.state is not RUN:
            raise BroodError(f"run {run.id} is {run.rec.state.value} and ending; no model call")
        model, name = self.model_for(run, msg.model)
        if msg.model is None and msg.kind == "llm_query" and run.sub_model is not None:
            model = run.sub_model  # the root's own turns and their summaries stay its model's
        request = msg.messages[msg.new_from :]
        if not k.charge(run, frames.weight(request)):
            raise BroodError(f"run {run.id} is over its journal bytes; it makes no model call")
        task = asyncio.current_task()
        assert task is not None
        run.calls.add(task)
        root = k.top(run)
        tree = root.tree  # counted in until it ends, even if its top is grafted meanwhile
        # Below a spread child the tree's budget is kept by the root's node: asked there.
        far = root.guest and self._budgeted()
        try:
            if far:
                assert k.spreader is not None
                await k.spreader.budget_enter(root)
            elif not self._budget_covers(root):  # else no coroutine to make: the common case
                await self._budget_admits(root)
        except BaseException:
            run.calls.discard(task)  # ended while it waited: no call was made
            raise
        tree.calls_in_flight += 1
        span = k.tracing.model_call(run, model, msg.model or model.name, msg.kind)
        started = time.perf_counter()
        done: Completion | None = None
        error: str | None = None
        try:
            done = await self.gateway.complete(model, msg.messages, name)
            run.rate_limited = False
            return done
        except asyncio.CancelledError:
            error = "abandoned: the run ended while the call was under way"
            raise
        except ModelError as exc:
            error = f"ModelError: {exc}"
            # What the gateway answered, which the run's failure kind is decided by.
            run.rate_limited = isinstance(exc, RateLimited)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            run.rate_limited = False
            raise ModelError(
                f"model {model.describe()!r} raised {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            run.calls.discard(task)
            tree.calls_in_flight -= 1
            self._account(
                run,
                kind=msg.kind,
                model=msg.model or model.name,
                priced=(model.provider, name or model.name),
                latency=time.perf_counter() - started,
                done=done,
                error=error,
                request=request,
                far=far,
                span=span,
            )
            _wake_budget(tree)

    def check_model(self, run: Run, name: str | None) -> None:
        """A model name model code passed (`llm_query` / `rlm_query` with model=): its own
        run's, or one of `allowed_models`; else InvalidArgument listing them. A spec's
        model is built here, so a spec that cannot be (a missing extra or key) is refused
        at the call that names it."""
        self.model_for(run, name)

    def model_for(self, run: Run, name: str | None) -> tuple[Model, str | None]:
        """The model a call that model code named `name` is made with, and the name it is
        given: the run's own for no name; for the spec of a provider that Limits.models
        lists, by its full spec or by the spec without its URL (`anthropic:MODEL`), that
        spec's model (built once); for any other allowed name, the run's model with that
        name (another model of the same endpoint). InvalidArgument for a name not allowed:
        model code never adds a model, nor an address to call."""
        if name is None:
            return run.model, None
        allowed = self.allowed_models(run)
        spec = next((s for s in allowed if is_spec(s) and name in (s, spec_without_url(s))), None)
        if spec is not None:
            model = self.by_spec.get(spec)
            if model is None:
                model = self.by_spec[spec] = _built(spec, name)
            return model, None
        if name == run.model_name or name in allowed:
            return run.model, name
        shown = [spec_without_url(s) if is_spec(s) else s for s in allowed]
        raise InvalidArgument(
            f"model {clip(name, 100)!r} is not one this tree may use (Limits.models: "
            f"{', '.join(map(repr, dict.fromkeys(shown))) or 'none'}); name one of them, or "
            "pass no model for this run's own. The user lists more with Limits(models=[...])"
        )

    def allowed_models(self, run: Run) -> list[str]:
        """Limits.models; by default the supervisor's model and the one its tree's root was
        given. Model code never adds to it, nor names an address to call."""
        k = self.kernel
        if k.limits.models is not None:
            return list(k.limits.models)
        names = [k.model_name, k.top(run).rec.model]
        return [n for n in dict.fromkeys(names) if n is not None and n != FLOW_MODEL]

    # ---- the tree's budget ----------------------------------------------------------------
    def _budgeted(self) -> bool:
        lim = self.kernel.limits
        return lim.token_budget is not None or lim.cost_budget is not None

    async def budget_enter(self, root_id: str) -> None:
        """A model call below a spread child of tree `root_id` waits for the tree's budget
        here, as one of this node's own calls does."""
        root = self.kernel.tree_root(root_id)
        await self._budget_admits(root)
        root.tree.calls_in_flight += 1

    def budget_leave(self, root_id: str, tokens: int, cost: float, answered: bool) -> None:
        """That call ended, having spent `tokens` and `cost`."""
        root = self.kernel.runs.get(root_id)
        if root is None:
            return
        root.tree.calls_in_flight -= 1
        self._spend(root, tokens, cost, answered)
        _wake_budget(root.tree)

    async def _budget_admits(self, root: Run) -> None:
        """Wait until the tree's budget left covers this call on top of those in flight,
        each estimated by the largest call seen so far, so a budget is overshot by one call
        at most, not by as many as run at once. Until a call has been seen, one at a time."""
        while not self._budget_covers(root):
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            root.tree.budget_waiters.append(fut)
            await fut

    def _budget_covers(self, root: Run) -> bool:
        if not self._budgeted():
            return True
        tree = root.tree
        if self._over_budget(tree, 0) or root.ending is not None:
            return False  # spent: the tree is being cancelled, this call waits for that
        if tree.calls_in_flight == 0:
            return True  # the one call a budget may be overshot by
        if tree.calls_seen == 0:
            return False  # nothing to estimate by yet
        return not self._over_budget(tree, tree.calls_in_flight + 1)

    def _over_budget(self, tree: Tree, calls: int) -> str | None:
        """Which budget the tree's usage breaks with `calls` more of its largest call."""
        lim, t = self.kernel.limits, tree.usage
        if (
            lim.token_budget is not None
            and t.get("tokens", 0) + calls * tree.largest_tokens > lim.token_budget
        ):
            return "tokens"
        if (
            lim.cost_budget is not None
            and t.get("cost", 0.0) + calls * tree.largest_cost > lim.cost_budget
        ):
            return "cost"
        return None

    # ---- accounting ------------------------------------------------------------------------
    def _account(
        self,
        run: Run,
        *,
        kind: str,
        model: str | None,
        priced: tuple[str | None, str | None],
        latency: float,
        done: Completion | None,
        error: str | None,
        request: list[dict[str, Any]],
        far: bool = False,
        span: object = None,
    ) -> None:
        """Journal a model call (`model`: the name the run's code gave, or its model's) and
        add it up; `priced`: the provider and model name its price is looked up by (a
        spec's model is its provider's, `anthropic:M` is priced as anthropic's `M`)."""
        k = self.kernel
        if done is not None:  # journaled whatever the limit says: the call was made
            k.charge(run, len(done.text))
        # A model's own count is trusted (it is the user's code), but never negative.
        tokens_in = max(0, int(done.input_tokens)) if done else 0
        tokens_out = max(0, int(done.output_tokens)) if done else 0
        cost: float | None = 0.0  # a call that failed is not billed by its tokens
        if done is not None:
            cost = self.pricing.cost(*priced, tokens_in, tokens_out, done.cost)
        k.tracing.model_call_done(
            span, input_tokens=tokens_in, output_tokens=tokens_out, cost=cost, error=error
        )
        u = run.rec.usage
        u["model_calls"] = u.get("model_calls", 0) + 1
        u["input_tokens"] = u.get("input_tokens", 0) + tokens_in
        u["output_tokens"] = u.get("output_tokens", 0) + tokens_out
        u["cost"] = add_cost(u.get("cost"), cost)
        u["unpriced_calls"] = u.get("unpriced_calls", 0) + (cost is None)
        if cost is None and model not in run.unpriced:
            run.unpriced.add(model)
            k.event(run, COST_UNKNOWN, self._unknown(*priced))
        k.event(
            run,
            "model_call",
            {
                "kind": kind,
                "model": model,
                "latency": latency,
                "input_tokens": tokens_in,
                "output_tokens": tokens_out,
                "cost": cost,
                "error": error,
                "request": self._by_ref(run, request),
                "response": done.text if done else None,
            },
        )
        root = k.top(run)
        spent = cost or 0.0  # what cost_budget counts: priced calls only (see _unknown)
        self._spend(root, tokens_in + tokens_out, spent, done is not None)
        if far:  # the tree's own count is its root's node's
            assert k.spreader is not None
            k.task(k.spreader.budget_leave(root, tokens_in + tokens_out, spent, done is not None))
        k.progress(run)

    def _unknown(self, provider: str | None, model: str | None) -> dict[str, Any]:
        """What the journal says, once per run and model, of a model nobody prices: its
        calls' cost is null, and a cost_budget cannot count them."""
        where = (
            f"genai-prices has no price for {provider!r} model {model!r}"
            if provider is not None and model
            else f"model {model!r} names no provider whose prices genai-prices knows"
        )
        budget = self.kernel.limits.cost_budget
        return {
            "model": model,
            "provider": provider,
            "why": where,
            "fix": "give its price: Supervisor(prices={MODEL: brood.Price(IN, OUT)}) or "
            "brood run --price IN,OUT (dollars per million tokens)",
            "cost_budget": None
            if budget is None
            else f"{budget:g} counts only priced calls: this model's calls are not counted",
        }

    def _spend(self, root: Run, tokens: int, cost: float, answered: bool) -> None:
        """A call of the tree under `root` spent `tokens` and `cost`: a tree over its budget
        is cancelled whole."""
        tree = root.tree
        t = tree.usage
        t["tokens"] = t.get("tokens", 0) + tokens
        t["cost"] = t.get("cost", 0.0) + cost
        if answered:
            tree.calls_seen += 1
            tree.largest_tokens = max(tree.largest_tokens, tokens)
            tree.largest_cost = max(tree.largest_cost, cost)
        over = self._over_budget(tree, 0)
        if over and root.ending is None and not root.guest:
            k = self.kernel
            k.end(root, RunState.CANCELLED, f"budget: {over}")

    def _by_ref(self, run: Run, request: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The request as journaled: a system prompt (several KB, the same for most runs of
        a tree) is journaled once per tree, as a `prompt` event of the root, and a request
        refers to it by hash, with its run-specific end (from BUDGET_MARK) inline as
        `suffix` (`Journal.export` puts them together again)."""
        if not request or request[0].get("role") != "system":
            return request
        text, mark, rest = str(request[0].get("content", "")).partition(BUDGET_MARK)
        ref = self._prompt_ref(text)
        if ref not in run.tree.prompts:
            run.tree.prompts.add(ref)
            self.kernel.event(self.kernel.top(run), "prompt", {"ref": ref, "content": text})
        head: dict[str, Any] = {"role": "system", "prompt_ref": ref}
        if mark:
            head["suffix"] = mark + rest
        return [head, *request[1:]]

    def _prompt_ref(self, text: str) -> str:
        """A system prompt's ref (its hash's head). Most calls carry the prompt the call
        before carried (every run of a tree has the same): compared, not hashed again."""
        last = self._last_prompt
        if last is not None and last[0] == text:
            return last[1]
        ref = hashlib.sha256(text.encode()).hexdigest()[:16]
        self._last_prompt = (text, ref)
        return ref

    def budget_of(self, run: Run) -> dict[str, Any]:
        """A run's place in the tree and the budgets left now (budget_remaining())."""
        k = self.kernel
        lim = k.limits
        tree = run.tree
        tokens = tree.usage.get("tokens", 0)
        cost = tree.usage.get("cost", 0.0)
        return {
            "depth": run.rec.depth,
            "max_depth": lim.max_depth,
            "children_left": max(0, lim.max_children - tree.children),
            "children_left_for_this_run": max(0, lim.max_children_per_run - k.children_of(run)),
            "tokens_left": None if lim.token_budget is None else max(0, lim.token_budget - tokens),
            "cost_left": None if lim.cost_budget is None else max(0.0, lim.cost_budget - cost),
            "tokens_used": int(tokens),
        }


def _built(spec: str, name: str) -> Model:
    """The model of a spec of Limits.models, or InvalidArgument for model code saying why
    it cannot be built (a missing extra or key): the run that named it goes on."""
    try:
        return resolve_model(spec)
    except InvalidArgument as exc:
        raise InvalidArgument(f"model {name!r} of Limits.models cannot be used: {exc}") from None
    except Exception as exc:  # the user's spec, not the run's fault: said, never a crash
        raise InvalidArgument(
            f"model {name!r} of Limits.models cannot be used: {type(exc).__name__}: {exc}"
        ) from None


def _wake_budget(tree: Tree) -> None:
    waiting, tree.budget_waiters = tree.budget_waiters, []
    for fut in waiting:  # the budget left and the calls in flight have changed
        if not fut.done():
            fut.set_result(None)


__all__ = ["Budget"]
