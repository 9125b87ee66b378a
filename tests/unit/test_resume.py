"""A request outliving its draft replica: the ingress's resume loop, with hand-made streams that
die where a replica would (before its header, mid-stream, every time) and a consumer that leaves."""

import asyncio

import pytest
from ray.exceptions import RayActorError

from config import SamplingParams
from deployments.protocol import Accepted, Chunk, Done, GenerateRequest, Refused
from deployments.resume import MAX_RESUMES, resuming

HEADER = Accepted(5)


class Stream:
    """A replica's stream: its items in order, then `fail` raised (if given) in place of item
    number `at`. Records whether it was cancelled."""

    def __init__(self, items: list, fail: BaseException | None = None, at: int | None = None):
        self.items, self.fail, self.at = list(items), fail, len(items) if at is None else at
        self.i, self.cancelled = 0, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail is not None and self.i == self.at:
            raise self.fail
        if self.i == len(self.items):
            raise StopAsyncIteration
        self.i += 1
        return self.items[self.i - 1]

    def cancel(self):
        self.cancelled = True


def tok(*ids: int) -> Chunk:
    return Chunk("".join(f"<{i}>" for i in ids), list(ids))


END = Done("length", {"completion_tokens": 5})


def run(first: Stream, replacements: list[Stream], **kw):
    """Everything `resuming` yields for a request whose first stream's header was read, the
    requests it reopened with, the resumes it reported, or the error it ended with."""
    gen = GenerateRequest("cmpl-1", SamplingParams(max_tokens=5))
    first.i = 1  # the caller read the header
    opened, resumes, out = [], [], []
    spare = iter(replacements)

    def reopen(again):
        opened.append(again)
        return next(spare)

    async def consume():
        async for item in resuming(first, gen, reopen, lambda n, e: resumes.append((n, type(e).__name__)), **kw):
            out.append(item)

    try:
        asyncio.run(consume())
        error = None
    except Exception as e:  # noqa: BLE001 - the test looks at which
        error = e
    return out, opened, resumes, error


def test_a_stream_that_never_fails_passes_through_untouched():
    first = Stream([HEADER, tok(1), tok(2, 3), END])
    out, opened, resumes, error = run(first, [])
    assert (out, opened, resumes, error) == ([tok(1), tok(2, 3), END], [], [], None)


def test_a_replica_dying_mid_stream_goes_on_elsewhere_from_the_tokens_sent():
    first = Stream([HEADER, tok(1), tok(2, 3), tok(4)], RayActorError(), at=3)
    second = Stream([HEADER, tok(4), tok(5), END])
    out, opened, resumes, error = run(first, [second])
    assert error is None
    assert out == [tok(1), tok(2, 3), tok(4), tok(5), END]  # the replacement's header is not passed on
    assert [(g.request_id, g.resume) for g in opened] == [("cmpl-1-r1", [1, 2, 3])]
    assert opened[0].params == SamplingParams(max_tokens=5)
    assert resumes == [(3, "RayActorError")]


def test_a_replacement_dead_before_its_header_is_replaced_again_from_the_same_tokens():
    """All replicas killed at once: the first replacement picked may be dying too, and fails on
    its very first item. The request goes on on the next one, from the same tokens."""
    first = Stream([HEADER, tok(7), tok(8)], RayActorError(), at=2)
    dead = Stream([HEADER], RayActorError(), at=0)
    third = Stream([HEADER, tok(9), END])
    out, opened, resumes, error = run(first, [dead, third])
    assert error is None
    assert out == [tok(7), tok(9), END]
    assert [(g.request_id, g.resume) for g in opened] == [("cmpl-1-r1", [7]), ("cmpl-1-r2", [7])]
    assert resumes == [(1, "RayActorError"), (1, "RayActorError")]


def test_tokens_sent_by_a_replacement_count_when_it_dies_in_turn():
    first = Stream([HEADER, tok(1)], RayActorError(), at=2)
    second = Stream([HEADER, tok(2), tok(3)], RayActorError(), at=3)
    third = Stream([HEADER, END])
    out, opened, resumes, error = run(first, [second, third])
    assert error is None and out == [tok(1), tok(2), tok(3), END]
    assert [g.resume for g in opened] == [[1], [1, 2, 3]]
    assert [g.request_id for g in opened] == ["cmpl-1-r1", "cmpl-1-r2"]  # ids from the original, not chained
    assert [n for n, _ in resumes] == [1, 3]


@pytest.mark.parametrize("limit", [0, 1, MAX_RESUMES])
def test_past_the_resume_limit_the_replica_error_ends_the_request(limit):
    streams = [Stream([HEADER, tok(i)], RayActorError(), at=2) for i in range(limit + 1)]
    out, opened, resumes, error = run(streams[0], streams[1:], max_resumes=limit)
    assert isinstance(error, RayActorError)
    assert len(opened) == len(resumes) == limit
    assert out == [tok(i) for i in range(limit + 1)]


def test_a_replacement_that_refuses_the_request_ends_it_with_its_error():
    first = Stream([HEADER, tok(1)], RayActorError(), at=2)
    refusing = Stream([Refused("draft 'd:x' cannot be loaded")])
    out, opened, resumes, error = run(first, [refusing])
    assert isinstance(error, RuntimeError) and "cannot be loaded" in str(error)
    assert out == [tok(1)] and len(resumes) == 1


def test_an_error_that_is_not_a_lost_replica_is_not_resumed():
    first = Stream([HEADER, tok(1)], ValueError("bad request"), at=2)
    out, opened, resumes, error = run(first, [Stream([HEADER, END])])
    assert isinstance(error, ValueError)
    assert opened == [] and resumes == [] and out == [tok(1)]


@pytest.mark.parametrize("resumed", [False, True])
def test_a_client_that_leaves_cancels_the_stream_it_was_reading(resumed):
    first = Stream([HEADER, tok(1), tok(2), END], RayActorError() if resumed else None, at=2)
    second = Stream([HEADER, tok(2), tok(3), END])
    gen = GenerateRequest("cmpl-1", SamplingParams(max_tokens=5))
    first.i = 1

    async def leave_after_one():
        it = resuming(first, gen, lambda again: second, lambda n, e: None)
        got = [await it.__anext__()]
        if resumed:
            got.append(await it.__anext__())  # the replacement's first item
        await it.aclose()
        return got

    got = asyncio.run(leave_after_one())
    assert got == ([tok(1), tok(2)] if resumed else [tok(1)])
    assert (first.cancelled, second.cancelled) == ((False, True) if resumed else (True, False))
