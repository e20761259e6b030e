"""A SkyPilot admin policy for tests against the real API server: it holds up a launch whose
task sets MERIDIAN_TEST_STALL_S (in the server's `/validate`, which `sky.launch` waits on,
and again while the server runs the launch request), so a test can make the launch overrun
a time limit and see what is left behind. Tasks without that variable pass unchanged.

Registered in the throwaway SkyPilot config of tests/provisioning/test_skypilot_server.py as
`admin_policy: tests.provisioning.skypilot_stall_policy.StallPolicy`.
"""

from __future__ import annotations

import time

import sky

STALL_ENV = "MERIDIAN_TEST_STALL_S"
STALLED_REQUESTS = ("validate", "launch")


class StallPolicy(sky.AdminPolicy):
    @classmethod
    def validate_and_mutate(cls, user_request: sky.UserRequest) -> sky.MutatedUserRequest:
        stall = (user_request.task.envs or {}).get(STALL_ENV)
        name = getattr(user_request.request_name, "value", user_request.request_name)
        if stall and not user_request.at_client_side and name in STALLED_REQUESTS:
            time.sleep(float(stall))
        return sky.MutatedUserRequest(task=user_request.task,
                                      skypilot_config=user_request.skypilot_config)
