"""`python -m enginesim --port P --model NAME [...]`: serve one simulated vLLM engine.

The flags that share a name with `vllm serve`'s mean the same thing; a flag left out takes
the profile's value (see enginesim.profiles).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from aiohttp import web

from enginesim.faults import MODES, FaultError, parse_faults
from enginesim.profiles import DEFAULT, load_profiles
from enginesim.server import build_app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m enginesim", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", required=True, help="model id, as given to vllm serve")
    parser.add_argument("--served-model-name", nargs="+",
                        help="name(s) clients use; the first is reported (default: --model)")
    parser.add_argument("--profile", default=DEFAULT, help=f"timing profile (default {DEFAULT})")
    parser.add_argument("--profile-file", type=Path,
                        help="JSON list of extra profiles (or $ENGINESIM_PROFILE_FILE)")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--kv-cache-tokens", type=int, help="KV cache capacity in tokens")
    parser.add_argument("--seed", type=int, default=0, help="fixes the generated text")
    parser.add_argument("--api-key", nargs="+",
                        help="bearer key(s) the /v1 endpoints require (or $VLLM_API_KEY)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="report usage.prompt_tokens_details (cached_tokens), as vLLM does "
                             "only with this flag")
    parser.add_argument("--enable-scale-out", action="store_true",
                        help="serve /v1/chat/completions/render and /v1/completions/render")
    parser.add_argument("--fault", choices=[m for m in MODES if m != "die"], default="none",
                        help="start with a fault injected (change it with POST /sim/faults)")
    parser.add_argument("--fault-status", type=int, default=503)
    parser.add_argument("--fault-factor", type=float, default=1.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parser_error = argparse.ArgumentParser(prog="python -m enginesim").error
    try:
        profiles = load_profiles(args.profile_file)
    except ValueError as exc:
        parser_error(f"--profile-file: {exc}")
    if args.profile not in profiles:
        parser_error(f"--profile: unknown {args.profile!r}; known: {', '.join(sorted(profiles))}")
    for flag in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_tokens"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser_error(f"--{flag.replace('_', '-')}: must be >= 1, not {value}")
    try:
        faults = parse_faults({"mode": args.fault, "status": args.fault_status,
                               "factor": args.fault_factor})
    except FaultError as exc:
        parser_error(f"--fault: {exc}")
    profile = profiles[args.profile]
    try:
        app = build_app(profile, args.model, args.served_model_name or [args.model],
                        args.max_model_len, args.max_num_seqs, args.kv_cache_tokens, args.seed,
                        max_num_batched_tokens=args.max_num_batched_tokens, faults=faults,
                        api_keys=[k for k in args.api_key or [os.environ.get("VLLM_API_KEY", "")]
                                  if k],
                        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
                        enable_scale_out=args.enable_scale_out)
    except ValueError as exc:
        parser_error(str(exc))
    import gc

    import uvloop

    # Everything built so far (modules, the corpus, the app) lives as long as the process;
    # moving it out of the collector's reach keeps full collections short under load.
    gc.freeze()
    print(f"enginesim: serving {(args.served_model_name or [args.model])[0]} on "
          f"http://{args.host}:{args.port} (profile {profile.name})", file=sys.stderr,
          flush=True)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None,
                handler_cancellation=True, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
