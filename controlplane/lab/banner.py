"""What the lab prints once it is up: where each part listens, how to log in, and a request
to try on each face."""

from __future__ import annotations

from pathlib import Path

from controlplane.lab.fleet import FLEETS, LabEdge
from controlplane.lab.processes import quiet_broken_output
from controlplane.lab.seed import LabCredentials


def banner(up_line: str, base: str, creds: LabCredentials, log_dir: Path,
           edges: list[LabEdge], engine: str) -> str:
    return f"""
  {up_line}
    Dashboard   {base}/            (login: {creds.username} / {creds.password})
    Admin       {base}/admin/
    API docs    {base}/api/docs/
    API token   {creds.api_token}
    Demo key    {creds.demo_api_key}   (tenant 'demo', for the edges)
    Logs        {log_dir}/
    Edges       {" ".join(f"{e.name}={e.url}" for e in edges) or "(none: --no-fleet)"}

  Try:
    curl -s -H "Authorization: Bearer {creds.api_token}" {base}/api/v1/status/
    curl -s -H "Authorization: Bearer {creds.api_token}" "{base}/api/v1/offers/?gpu=H100&jurisdiction=EU&ordering=on_demand_usd_h"

{_edge_curl(edges, creds.demo_api_key, engine)}
  Ctrl-C stops everything.
"""


def print_banner(text: str) -> None:
    try:
        print(text, flush=True)
    except (OSError, ValueError):
        quiet_broken_output()


def _edge_curl(edges: list[LabEdge], key: str, engine: str) -> str:
    if not edges:
        return ""
    model = FLEETS[engine].served_model_name
    body = (f'{{"model": "{model}", "stream": true, '
            '"messages": [{"role": "user", "content": "Where are you served from?"}]}')
    return (f"    curl -N {edges[0].url}/v1/chat/completions -H 'Authorization: Bearer {key}' "
            f"-H 'Content-Type: application/json' -d '{body}'\n")
