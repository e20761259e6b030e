"""A SkyPilot admin policy for tests against the real API server: it holds up a launch whose
task sets MERIDIAN_TEST_STALL_S (in the server's `/validate`, which `sky.launch` waits on,
and again while the server runs the launch request), so a test can make the launch overrun
a time limit and see what is left behind. MERIDIAN_TEST_LAUNCH_STALL_S, where set, is the
hold while the launch runs instead (so a test can hold the run long without holding up
`/validate`). Tasks without either variable pass unchanged.

Registered in the throwaway SkyPilot config of tests/provisioning/test_skypilot_server.py as
`admin_policy: tests.provisioning.skypilot_stall_policy.StallPolicy`.
"""

from __future__ import annotations

import time

import sky

STALL_ENV = "MERIDIAN_TEST_STALL_S"
LAUNCH_STALL_ENV = "MERIDIAN_TEST_LAUNCH_STALL_S"
STALLED_REQUESTS = ("validate", "launch")


class StallPolicy(sky.AdminPolicy):
    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        envs = user_request.task.envs or {}
        name = getattr(user_request.request_name, "value", user_request.request_name)
        stall = envs.get(STALL_ENV)
        if name == "launch" and LAUNCH_STALL_ENV in envs:
            stall = envs[LAUNCH_STALL_ENV]
        if stall and not user_request.at_client_side and name in STALLED_REQUESTS:
            time.sleep(float(stall))
        return sky.MutatedUserRequest(task=user_request.task,
                                      skypilot_config=user_request.skypilot_config)
