"""A request that outlives its draft replica: when the replica streaming it dies, the request
goes on on another replica from the output tokens already sent. Greedy and seeded output is
unchanged, since the continuation is the one the target would have made (the engine's resume)."""

import asyncio
from dataclasses import replace
from typing import AsyncIterator, Callable

from ray.exceptions import ActorUnavailableError, RayActorError

from .protocol import Chunk, Refused

#: a request whose draft replica dies goes on on another one, this many times at most
MAX_RESUMES = 2
#: what a handle raises when the replica behind a stream died or cannot be reached
REPLICA_GONE = (RayActorError, ActorUnavailableError)


async def resuming(stream, gen, reopen: Callable[[object], object], on_resume: Callable[[int, BaseException], None],
                   max_resumes: int = MAX_RESUMES) -> AsyncIterator[object]:
    """The items of one request's stream, whose header item the caller has read already.

    If the stream fails with `REPLICA_GONE`, `on_resume(tokens sent, error)` is called and
    `reopen(gen with resume=tokens sent)` opens a stream on another replica; its header is read
    here (an error in it ends the request), then its items follow. A replacement that is itself
    gone before or while it streams is replaced again, up to `max_resumes` replacements in all.
    A consumer that stops iterating cancels the stream it is reading."""
    sent: list[int] = []
    for attempt in range(max_resumes + 1):
        try:
            if attempt:  # a replacement: its header says whether it took the request
                first = await stream.__anext__()
                if isinstance(first, Refused):
                    raise RuntimeError(first.error)
            async for item in stream:
                if isinstance(item, Chunk):
                    sent.extend(item.tokens)
                yield item
            return
        except (GeneratorExit, asyncio.CancelledError):  # the client left: stop the decoding too
            stream.cancel()
            raise
        except REPLICA_GONE as e:
            if attempt == max_resumes:
                raise
            on_resume(len(sent), e)
            # (the prompt's log-probabilities came with the first header: not computed again)
            stream = reopen(replace(gen, request_id=f"{gen.request_id}-r{attempt + 1}", resume=list(sent),
                                    prompt_logprobs=None))
