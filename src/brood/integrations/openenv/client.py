"""`BroodEnv`: openenv-core's WebSocket client, typed for brood's server (as repl_env's
`REPLEnv` is for its own). openenv-core's `GenericEnvClient` drives the same server with
plain dicts."""

from __future__ import annotations

from typing import Any

from openenv.core.client_types import StepResult
from openenv.core.env_client import EnvClient
from websockets.asyncio.client import connect as ws_connect

from brood.integrations.openenv.environment import BroodAction, BroodObservation, BroodState

__all__ = ["BroodEnv"]


class BroodEnv(EnvClient[BroodAction, BroodObservation, BroodState]):
    """An async client of one environment session (`.sync()` gives the blocking form):
    `await env.reset(prompt=..., context=...)`, `await env.execute(code)`,
    `await env.submit_final_answer(answer)`, `await env.state()`, `await env.close()`.

    `token` is sent as `Authorization: Bearer TOKEN`, for a server started with one; the
    other arguments are `EnvClient`'s."""

    _ws: Any  # openenv-core's connection (a websockets ClientConnection), typed there in a comment

    def __init__(self, base_url: str, *, token: str | None = None, **kwargs: Any) -> None:
        super().__init__(base_url, **kwargs)
        self._token = token

    async def connect(self) -> BroodEnv:
        if self._token is None or self._ws is not None:
            await super().connect()
            return self
        try:
            self._ws = await ws_connect(
                self._ws_url,
                open_timeout=self._connect_timeout,
                max_size=self._max_message_size,
                additional_headers={"Authorization": f"Bearer {self._token}"},
            )
        except Exception as exc:
            raise ConnectionError(f"Failed to connect to {self._ws_url}: {exc}") from exc
        return self

    def _step_payload(self, action: BroodAction) -> dict[str, Any]:
        return action.model_dump(exclude_unset=True)

    def _parse_result(self, payload: dict[str, Any]) -> StepResult[BroodObservation]:
        obs = BroodObservation.model_validate(
            {
                **payload.get("observation", {}),
                "done": payload.get("done", False),
                "reward": payload.get("reward"),
            }
        )
        return StepResult(observation=obs, reward=obs.reward, done=obs.done)

    def _parse_state(self, payload: dict[str, Any]) -> BroodState:
        return BroodState.model_validate(payload)

    async def execute(self, code: str) -> StepResult[BroodObservation]:
        """Run `code` in the episode's root REPL."""
        return await self.step(BroodAction(code=code))

    async def submit_final_answer(self, answer: str) -> StepResult[BroodObservation]:
        """End the episode with `answer` (as FINAL(answer) would)."""
        return await self.step(BroodAction(is_final=True, final_answer=answer))
