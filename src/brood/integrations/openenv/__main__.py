"""`python -m brood.integrations.openenv --model SPEC [--port N] ...`: the same server as
`brood openenv serve`, for images and trainers that start environments as modules."""

from __future__ import annotations

import argparse
import os
import sys

LIMIT_FLAGS = {
    "max_depth": (int, "run levels including the root"),
    "max_children": (int, "child runs in one episode's tree"),
    "max_concurrency": (
        int,
        "workers computing at once, all episodes together (default: 8 for each of --max-envs)",
    ),
    "max_iterations": (int, "model turns per child run"),
    "child_timeout": (float, "seconds per child run"),
    "step_timeout": (float, "seconds of one step's own compute"),
    "token_budget": (int, "tokens for one episode's tree"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m brood.integrations.openenv",
        description="Serve brood as an OpenEnv environment (openenv-core's HTTP and "
        "WebSocket server): each session's episodes are brood trees.",
    )
    p.add_argument("--model", help="model spec of the episodes' children (or BROOD_MODEL)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback)")
    p.add_argument("--port", type=int, default=8000, help="port (0: a free one)")
    p.add_argument("--store", help="journal URL (default: BROOD_STORE or .brood)")
    p.add_argument(
        "--rubric",
        metavar="MODULE:FUNCTION",
        help="the reward: a function reward(answer, trajectory) or an openenv-core Rubric",
    )
    p.add_argument(
        "--token",
        default=os.environ.get("BROOD_TOKEN") or None,
        help="every request must send Authorization: Bearer TOKEN (or BROOD_TOKEN)",
    )
    p.add_argument("--max-envs", type=int, default=None, help="sessions at once (default 64)")
    for name, (kind, text) in LIMIT_FLAGS.items():
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=None, help=text)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        from brood.errors import BroodError
        from brood.integrations.openenv import DEFAULT_MAX_ENVS, load_rubric, serve, served_limits
        from brood.journal import default_store_url
    except ModuleNotFoundError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    envs = DEFAULT_MAX_ENVS if args.max_envs is None else args.max_envs
    try:
        given = {n: getattr(args, n) for n in LIMIT_FLAGS if getattr(args, n) is not None}
        serve(
            args.model,
            host=args.host,
            port=args.port,
            token=args.token,
            rubric=load_rubric(args.rubric) if args.rubric else None,
            limits=served_limits(envs, **given),
            store=args.store or default_store_url(),
            max_concurrent_envs=envs,
        )
    except BroodError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
