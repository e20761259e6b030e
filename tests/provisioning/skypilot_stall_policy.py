"""A SkyPilot admin policy for tests against the real API server.

- A task that sets MERIDIAN_TEST_STALL_S is held that long in the server's `/validate`, which
  `sky.launch` waits on before the server hands out a request id: a launch that must overrun
  a client's time limit (the hold is longer than the limit).
- A task that sets MERIDIAN_TEST_HOLD_LAUNCH is held, once the server runs its launch request,
  until that request is cancelled (SkyPilot's cancel interrupts the worker) or the test's
  server releases every hold (the file named by MERIDIAN_TEST_RELEASE_FILE in the server's
  environment appears, which ApiServer.stop does first). No clock decides how such a launch
  ends: a cancel that the server runs late still finds it running.

Tasks with neither variable pass unchanged. Registered in the throwaway SkyPilot config of
tests/provisioning/test_skypilot_server.py as
`admin_policy: tests.provisioning.skypilot_stall_policy.StallPolicy`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import sky

STALL_ENV = "MERIDIAN_TEST_STALL_S"
HOLD_ENV = "MERIDIAN_TEST_HOLD_LAUNCH"
RELEASE_ENV = "MERIDIAN_TEST_RELEASE_FILE"
HOLD_BACKSTOP_S = 600.0  # a hold nobody ends still ends, long after any test gave up


def hold_until_released() -> None:
    release = Path(os.environ.get(RELEASE_ENV, "/nonexistent/release"))
    deadline = time.monotonic() + HOLD_BACKSTOP_S
    while not release.exists() and time.monotonic() < deadline:
        time.sleep(0.1)


class StallPolicy(sky.AdminPolicy):
    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        envs = user_request.task.envs or {}
        name = getattr(user_request.request_name, "value", user_request.request_name)
        if not user_request.at_client_side:
            if name == "validate" and envs.get(STALL_ENV):
                time.sleep(float(envs[STALL_ENV]))
            if name == "launch" and envs.get(HOLD_ENV):
                hold_until_released()
        return sky.MutatedUserRequest(task=user_request.task,
                                      skypilot_config=user_request.skypilot_config)
