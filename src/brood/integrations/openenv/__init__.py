"""brood as an OpenEnv environment (DESIGN.md section 16), on openenv-core's `Environment`
API and served by openenv-core's own HTTP server: `brood openenv serve` or
`python -m brood.integrations.openenv`. Needs the optional extra
[openenv] extra (`pip install -e '.[openenv]'` in brood's clone).

An action is code for the episode's root REPL, as in OpenEnv's repl_env; an observation
carries what it printed, its error, whether the episode is done, the answer, the reward and
the root's child runs. Every episode is a brood tree of its own: confined workers, limits,
a journal, children that outlive a step and end, exit confirmed, at `reset` and `close`.
"""

from brood.errors import install_hint

try:
    import openenv.core.env_server  # noqa: F401  (the extra: its absence is said here)
except ModuleNotFoundError as exc:
    raise ModuleNotFoundError(
        f"brood.integrations.openenv needs the [openenv] extra, openenv-core ({exc.name} is "
        f"missing): {install_hint('openenv')}",
        name=exc.name,
    ) from exc

from brood.integrations.openenv.client import BroodEnv
from brood.integrations.openenv.environment import (
    BroodAction,
    BroodEnvironment,
    BroodEnvironmentFactory,
    BroodObservation,
    BroodState,
    RewardFn,
    load_rubric,
)
from brood.integrations.openenv.server import DEFAULT_MAX_ENVS, make_app, serve, served_limits

__all__ = [
    "DEFAULT_MAX_ENVS",
    "BroodAction",
    "BroodEnv",
    "BroodEnvironment",
    "BroodEnvironmentFactory",
    "BroodObservation",
    "BroodState",
    "RewardFn",
    "load_rubric",
    "make_app",
    "serve",
    "served_limits",
]
