"""Command line: `python -m edge --name NAME --region CLOUD:REGION --listen HOST:PORT
--admin-listen [HOST]:PORT --state-dir DIR --public-key FILE --admin-secret-file FILE
[--control-plane URL]`.

The admin listener binds loopback when its host is left out, and needs the edge's admin
secret (from `--admin-secret-file` or `$MERIDIAN_EDGE_ADMIN_SECRET`); the edge does not
start without one."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import ssl
import sys
from pathlib import Path

from edge.admin_auth import read_secret
from edge.keys import KeyFormatError, load_public_key_file
from edge.logs import configure
from edge.server import Edge, EdgeConfig
from edge.upstream_tls import TlsFilesError, UpstreamTLS

log = logging.getLogger("meridian.edge")


def host_port(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {value!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def admin_host_port(value: str) -> tuple[str, int]:
    """Like host_port, but a left-out host is loopback: the admin API is private."""
    host, port = host_port(value)
    return ("127.0.0.1" if not value.rpartition(":")[0].strip("[]") else host), port


def region(value: str) -> str:
    cloud, sep, code = value.partition(":")
    if not sep or not cloud or not code:
        raise argparse.ArgumentTypeError(f"expected CLOUD:REGION, got {value!r}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m edge", description=__doc__)
    p.add_argument("--name", required=True, help="this edge's name in the control plane")
    p.add_argument("--region", required=True, type=region, help="CLOUD:REGION it runs in")
    p.add_argument("--listen", required=True, type=host_port, help="client API HOST:PORT")
    p.add_argument("--admin-listen", required=True, type=admin_host_port,
                   help="admin API [HOST]:PORT (tables, metrics); loopback when HOST is left "
                        "out; keep it private")
    p.add_argument("--admin-secret-file", type=Path,
                   help="this edge's admin secret, which the control plane's HMAC of every "
                        "admin request is checked with (default: $MERIDIAN_EDGE_ADMIN_SECRET)")
    p.add_argument("--admin-max-body-bytes", type=int, default=64 * 1024 * 1024,
                   help="largest admin request body (a table); larger ones get 413 unread")
    p.add_argument("--state-dir", required=True, type=Path,
                   help="where the last-known-good table is kept")
    p.add_argument("--public-key", required=True, action="append", type=Path,
                   help="the control plane's Ed25519 public key (PEM or base64); repeat to "
                        "trust a second key during a rotation")
    p.add_argument("--control-plane", help="base URL to pull tables from, as a fallback")
    p.add_argument("--control-plane-token-file", type=Path,
                   help="bearer token for the pull (default: $MERIDIAN_EDGE_TOKEN)")
    p.add_argument("--pull-interval", type=float, default=15.0, metavar="SECONDS")
    p.add_argument("--probe-interval", type=float, default=1.0, metavar="SECONDS")
    p.add_argument("--no-probes", action="store_true", help="no active /health probes")
    p.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024)
    p.add_argument("--client-request-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="a request must arrive whole within this (a late body gets 408); an "
                        "upload, within this plus --upload-min-rate")
    p.add_argument("--upload-min-rate", type=int, default=64 * 1024, metavar="BYTES_PER_S",
                   help="after --client-request-timeout, an upload streamed to the control "
                        "plane must average this rate or get 408 (a slow-loris trickle); 0: off")
    p.add_argument("--max-queue", type=int, default=512,
                   help="requests that may wait for capacity before the rest get 429")
    p.add_argument("--connect-timeout", type=float, default=3.0, metavar="SECONDS")
    p.add_argument("--dead-peer-timeout", type=float, default=5.0, metavar="SECONDS",
                   help="close an upstream connection whose replica acknowledges nothing "
                        "for this long (a partition: no reset comes); 0: off")
    p.add_argument("--upstream-timeout", type=float, default=600.0, metavar="SECONDS",
                   help="longest silence from a replica during a request")
    p.add_argument("--prefix-index-blocks", type=int, default=100_000,
                   help="prompt blocks (64 bytes each) remembered for prefix affinity")
    p.add_argument("--drain", type=float, default=10.0, metavar="SECONDS",
                   help="how long in-flight requests may finish on shutdown")
    p.add_argument("--upstream-cert", type=Path,
                   help="this edge's client certificate for replicas (PEM, from the control "
                        "plane's engine CA; re-read when it changes)")
    p.add_argument("--upstream-key", type=Path, help="its key (PEM)")
    p.add_argument("--upstream-ca", type=Path,
                   help="the engine CA's certificate, which replicas' certificates must chain to")
    p.add_argument("--plain-upstream", action="store_true",
                   help="TESTS ONLY: no mTLS to replicas (http:// replicas are plain); "
                        "without it the three --upstream-* files are required")
    p.add_argument("--tls-cert", type=Path, help="serve the client API over HTTPS")
    p.add_argument("--tls-key", type=Path)
    p.add_argument("--access-log", default="-", help="'-' (stdout), a file, or 'off'")
    p.add_argument("--log-level", default="INFO")
    return p


def config_from(args: argparse.Namespace) -> EdgeConfig:
    try:
        keys = [load_public_key_file(path) for path in args.public_key]
    except (OSError, KeyFormatError) as exc:
        raise SystemExit(f"--public-key: {exc}") from None
    try:
        if args.admin_secret_file:
            admin_secret = read_secret(args.admin_secret_file.read_text(),
                                       f"--admin-secret-file {args.admin_secret_file}")
        elif os.environ.get("MERIDIAN_EDGE_ADMIN_SECRET"):
            admin_secret = read_secret(os.environ["MERIDIAN_EDGE_ADMIN_SECRET"],
                                       "MERIDIAN_EDGE_ADMIN_SECRET")
        else:
            raise ValueError("the admin API needs a secret: pass --admin-secret-file or set "
                             "MERIDIAN_EDGE_ADMIN_SECRET (the control plane prints an edge's "
                             "with `manage.py edge_admin_secret NAME`)")
    except (OSError, ValueError) as exc:
        raise SystemExit(f"edge: {exc}") from None
    upstream_tls = upstream_tls_from(args)
    token = os.environ.get("MERIDIAN_EDGE_TOKEN")
    if args.control_plane_token_file:
        token = args.control_plane_token_file.read_text().strip()
    return EdgeConfig(
        name=args.name, region=args.region, state_dir=args.state_dir, public_keys=keys,
        control_plane=args.control_plane, control_plane_token=token,
        admin_secret=admin_secret, admin_max_body_bytes=args.admin_max_body_bytes,
        pull_interval_s=args.pull_interval, probe_interval_s=args.probe_interval,
        probes=not args.no_probes, max_body_bytes=args.max_body_bytes,
        client_request_timeout_s=args.client_request_timeout,
        upload_min_bytes_per_s=args.upload_min_rate,
        max_queue=args.max_queue, connect_timeout_s=args.connect_timeout,
        dead_peer_timeout_s=args.dead_peer_timeout,
        upstream_timeout_s=args.upstream_timeout, prefix_index_blocks=args.prefix_index_blocks,
        upstream_tls=upstream_tls,
    )


def upstream_tls_from(args: argparse.Namespace) -> UpstreamTLS | None:
    """mTLS to replicas from the three files, or none with --plain-upstream (tests only);
    never a silent choice between them."""
    files = (args.upstream_cert, args.upstream_key, args.upstream_ca)
    if args.plain_upstream:
        if any(files):
            raise SystemExit("edge: --plain-upstream and --upstream-* exclude each other")
        log.warning("--plain-upstream: replicas are reached without mTLS (tests only)")
        return None
    if not all(files):
        raise SystemExit("edge: replicas are reached over mTLS: pass --upstream-cert, "
                         "--upstream-key and --upstream-ca (`manage.py issue_certificate "
                         "--subject edge:NAME --out DIR` writes them), or --plain-upstream "
                         "in tests")
    try:
        return UpstreamTLS(args.upstream_cert, args.upstream_key, args.upstream_ca)
    except TlsFilesError as exc:
        raise SystemExit(f"edge: {exc}") from None


async def serve(args: argparse.Namespace) -> None:
    tls = None
    if args.tls_cert:
        tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        tls.load_cert_chain(args.tls_cert, args.tls_key)
    edge = Edge(config_from(args))
    await edge.start(args.listen, args.admin_listen, tls)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: draining in-flight requests for up to %.0fs", args.drain)
    await edge.stop(args.drain)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure(args.log_level, args.access_log)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency; plain asyncio still works
        asyncio.run(serve(args))
    else:
        uvloop.run(serve(args))
    logging.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
