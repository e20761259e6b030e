"""Meridian's edge: the data-plane proxy that carries every client request to a replica.

It is plain asyncio (uvloop when present) and never imports Django. It serves the
OpenAI-compatible client API from a signed routing table that the control plane pushes to
it (or that it pulls), and keeps serving from its last-known-good table on disk when the
control plane is away. `python -m edge --help` starts one.

The modules a request passes through run compiled (mypyc) when `make setup` could build
them and their sources have not changed since; otherwise from source (`edge.native`).
"""

from edge.native import activate as _activate

BUILD = _activate()
