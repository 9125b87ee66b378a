"""The draft pool's hop to the target when the target replica dies (Ray's own exceptions, raised
by a stand-in for the handle: what is tested is the waiting and the error, not Ray)."""

from __future__ import annotations

import asyncio
import time

import pytest
from ray.exceptions import ActorUnavailableError

from deployments.drafts import RemoteVerifier
from deployments.ingress import _target_gone
from deployments.protocol import TargetUnavailable


class _Method:
    def __init__(self, answers):
        self.answers = list(answers)
        self.calls = 0

    def remote(self, call):
        self.calls += 1
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]

        async def run():
            if isinstance(answer, BaseException):
                raise answer
            return answer
        return run()


class _Handle:
    def __init__(self, *answers):
        self.verify = _Method(answers)


GONE = ActorUnavailableError("replica gone", None)


def test_a_lost_target_is_waited_for_and_the_call_goes_on_with_the_replacement():
    h = _Handle(GONE, GONE, None)  # the replacement has no cache for the sequence: None
    assert asyncio.run(RemoteVerifier(h, wait_s=10).verify("call")) is None
    assert h.verify.calls == 3


def test_a_target_that_does_not_come_back_in_time_is_a_retryable_error():
    h = _Handle(GONE)
    t0 = time.monotonic()
    with pytest.raises(TargetUnavailable, match="retry") as e:
        asyncio.run(RemoteVerifier(h, wait_s=1.2).verify("call"))
    assert 1.2 <= time.monotonic() - t0 < 3 and h.verify.calls >= 2
    assert _target_gone(e.value)

    class Wrapped(Exception):  # how Ray hands the pool's exception to the ingress
        cause = e.value
    assert _target_gone(Wrapped()) and not _target_gone(RuntimeError("other"))
