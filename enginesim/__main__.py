"""`python -m enginesim --port P --model NAME [...]`: serve one simulated engine."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from aiohttp import web

from enginesim.profiles import DEFAULT, load_profiles
from enginesim.server import build_app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m enginesim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="model id, as given to vllm serve")
    parser.add_argument("--served-model-name", help="name clients use (default: --model)")
    parser.add_argument("--profile", default=DEFAULT, help="timing profile name")
    parser.add_argument("--profile-file", type=Path, help="JSON list of extra profiles")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--kv-cache-tokens", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fault", choices=("none", "fail", "hang", "slow"), default="none",
                        help="start with a fault injected (change it at POST /sim/faults)")
    args = parser.parse_args(argv)
    profiles = load_profiles(args.profile_file)
    if args.profile not in profiles:
        parser.error(f"--profile: unknown {args.profile!r}; known: {', '.join(sorted(profiles))}")
    profile = profiles[args.profile]
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    app = build_app(
        profile, args.model, args.served_model_name or args.model,
        args.max_model_len or profile.max_model_len, args.max_num_seqs, args.kv_cache_tokens,
        args.seed,
    )
    if args.fault != "none":
        from enginesim.server import ENGINE_KEY, FAULTS_KEY

        app[FAULTS_KEY].set({"mode": args.fault})
        app[ENGINE_KEY].paused = args.fault == "hang"
    logging.basicConfig(level=logging.WARNING)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None)


if __name__ == "__main__":
    main()
