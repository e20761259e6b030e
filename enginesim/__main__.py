"""`python -m enginesim --port P --model NAME [...]`: serve one simulated vLLM engine.

The flags that share a name with `vllm serve`'s mean the same thing; a flag left out takes
the profile's value (see enginesim.profiles).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import ssl
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
    # vLLM's TLS flags, with its meanings (uvicorn's): a key and certificate make it HTTPS;
    # --ssl-ca-certs is the CA client certificates must chain to; --ssl-cert-reqs is the
    # ssl module's CERT_NONE (0), CERT_OPTIONAL (1) or CERT_REQUIRED (2).
    parser.add_argument("--ssl-keyfile")
    parser.add_argument("--ssl-certfile")
    parser.add_argument("--ssl-ca-certs")
    parser.add_argument("--ssl-cert-reqs", type=int, default=int(ssl.CERT_NONE))
    parser.add_argument("--enable-ssl-refresh", action="store_true",
                        help="reload the certificate files when they change")
    return parser.parse_args(argv)


TLS_REFRESH = web.AppKey("tls_refresh", asyncio.Task)


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The server context vLLM (uvicorn) builds from the same flags; ValueError naming the
    flag at fault."""
    if not args.ssl_keyfile and not args.ssl_certfile:
        if args.ssl_ca_certs or args.ssl_cert_reqs:
            raise ValueError("--ssl-ca-certs/--ssl-cert-reqs need --ssl-keyfile and "
                             "--ssl-certfile")
        return None
    if not args.ssl_keyfile or not args.ssl_certfile:
        raise ValueError("--ssl-keyfile and --ssl-certfile go together")
    if args.ssl_cert_reqs not in (0, 1, 2):
        raise ValueError(f"--ssl-cert-reqs must be 0, 1 or 2, not {args.ssl_cert_reqs}")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
        context.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
        if args.ssl_ca_certs:
            context.load_verify_locations(args.ssl_ca_certs)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile/--ssl-ca-certs: {exc}") from None
    return context


async def refresh_tls(context: ssl.SSLContext, args: argparse.Namespace) -> None:
    """--enable-ssl-refresh: new handshakes get the new pair once the files change."""
    def stamp() -> tuple[float, ...]:
        return tuple(os.stat(f).st_mtime for f in (args.ssl_certfile, args.ssl_keyfile)
                     if f)
    seen = stamp()
    while True:
        await asyncio.sleep(1.0)
        try:
            now = stamp()
            if now != seen:
                context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
                seen = now
        except (OSError, ssl.SSLError) as exc:
            print(f"enginesim: keeping the previous certificate: {exc}", file=sys.stderr)


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
    try:
        tls = tls_context(args)
    except ValueError as exc:
        parser_error(str(exc))
    if tls is not None and args.enable_ssl_refresh:
        async def start_refresh(app: web.Application) -> None:
            app[TLS_REFRESH] = asyncio.get_running_loop().create_task(refresh_tls(tls, args))
        app.on_startup.append(start_refresh)
    import gc

    import uvloop

    # Everything built so far (modules, the corpus, the app) lives as long as the process;
    # moving it out of the collector's reach keeps full collections short under load.
    gc.freeze()
    print(f"enginesim: serving {(args.served_model_name or [args.model])[0]} on "
          f"{'https' if tls else 'http'}://{args.host}:{args.port} (profile {profile.name})",
          file=sys.stderr, flush=True)
    web.run_app(app, host=args.host, port=args.port, access_log=None, print=None,
                ssl_context=tls,
                handler_cancellation=True, loop=uvloop.new_event_loop())


if __name__ == "__main__":
    main()
