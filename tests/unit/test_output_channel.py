"""The output channel (workers/output_channel.py) over real local sockets, and the ingress's side
of it in WorkerCalls (deploy/pools/worker_calls.py) against stand-in worker calls: a step's
chunks leave in one frame, a worker that cannot reach the sink streams on the call instead,
a broken channel fails the requests using it, and the call's end and the channel's chunks race
without losing the last chunk or hanging."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import ray

from deploy.args import Mode
from deploy.pools import worker_calls
from deploy.pools.worker_calls import WorkerCalls
from tests.unit.test_decode_migration import SCRIPT, FakeIndex, FakePools
from workers.output_channel import OutputChannelError, OutputSender, OutputSink
from workers.protocol import GenerateRequest, TokenChunk

HOST = "127.0.0.1"


def chunk(request_id: str, token: int, last: bool = False) -> TokenChunk:
    return TokenChunk(request_id, (token,), finish_reason="length" if last else None)


async def free_address() -> str:
    """An address nothing listens on: a port the kernel just gave a server that is now closed."""
    server = await asyncio.start_server(lambda r, w: None, HOST, 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return f"{HOST}:{port}"


@contextlib.asynccontextmanager
async def channel():
    """A sink on this host and a worker's sender, closed afterwards: (sink, its address, sender)."""
    sink = OutputSink()
    address = await sink.start(HOST)
    sender = OutputSender("w0")
    try:
        yield sink, address, sender
    finally:
        await sender.close()
        await sink.stop()


async def until(condition, timeout_s: float = 10.0) -> None:
    """Wait for ``condition()`` (an event another task causes), failing after ``timeout_s``."""
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def test_the_chunks_of_one_step_leave_in_one_frame():
    async def main():
        async with channel() as (sink, address, sender):
            queues = {rid: sink.open(rid) for rid in ("a", "b", "c")}
            step = asyncio.Event()

            async def request(rid: str) -> None:  # a request's stream, woken by the step's outputs
                link = await sender.link(address)
                await step.wait()
                await link.send(chunk(rid, ord(rid)))

            tasks = [asyncio.create_task(request(rid)) for rid in queues]
            await asyncio.sleep(0.05)  # every request waits for the step
            step.set()  # one step's outputs wake all three in the same loop iteration
            await asyncio.gather(*tasks)
            got = {rid: await asyncio.wait_for(q.get(), 10) for rid, q in queues.items()}
            assert got == {rid: chunk(rid, ord(rid)) for rid in queues}
            assert sink.frames == 1 and sink.chunks == 3 and sender.stats()["frames"] == 1
            # a request nobody listens for any more (cancelled, migrated): its chunks are dropped
            sink.close("a")
            await (await sender.link(address)).send(chunk("a", 1))
            await until(lambda: sink.dropped == 1)
            assert sink.stats()["listening"] == 2

    asyncio.run(main())


def test_stream_sends_everything_to_the_sink_and_yields_nothing():
    async def main():
        async with channel() as (sink, address, sender):
            queue = sink.open("r")

            async def chunks():
                for i in range(5):
                    yield chunk("r", i, last=i == 4)

            yielded = [c async for c in sender.stream(address, chunks())]
            assert yielded == []
            received = [await asyncio.wait_for(queue.get(), 10) for _ in range(5)]
            assert [c.token_ids[0] for c in received] == list(range(5)) and received[-1].finish_reason == "length"
            assert sender.fallbacks == 0

    asyncio.run(main())


def test_an_unreachable_sink_or_no_address_streams_on_the_call():
    async def main():
        sender = OutputSender("w0", connect_timeout_s=2.0)

        async def chunks():
            for i in range(3):
                yield chunk("r", i, last=i == 2)

        address = await free_address()
        unreachable = [c async for c in sender.stream(address, chunks())]
        assert [c.token_ids[0] for c in unreachable] == [0, 1, 2] and sender.fallbacks == 1
        again = [c async for c in sender.stream(address, chunks())]  # remembered: no second connect
        assert [c.token_ids[0] for c in again] == [0, 1, 2] and sender.fallbacks == 2
        plain = [c async for c in sender.stream(None, chunks())]
        assert [c.token_ids[0] for c in plain] == [0, 1, 2] and sender.fallbacks == 2

    asyncio.run(main())


def test_a_closed_sink_fails_the_requests_sending_to_it_and_the_next_connects_again():
    async def main():
        sink = OutputSink()
        address = await sink.start(HOST)
        sender = OutputSender("w0")
        link = await sender.link(address)
        await link.send(chunk("r", 1))
        await sink.stop()  # the ingress replica went away
        await until(lambda: link.error is not None)
        with pytest.raises(OutputChannelError):
            await link.send(chunk("r", 2))
        # a new sink at another address: a fresh link, unaffected
        other = OutputSink()
        queue = other.open("s")
        fresh = await sender.link(await other.start(HOST))
        assert fresh is not link
        await fresh.send(chunk("s", 3))
        assert (await asyncio.wait_for(queue.get(), 10)).token_ids == (3,)
        await sender.close()
        await other.stop()

    asyncio.run(main())


def test_a_malformed_frame_closes_only_its_connection():
    async def main():
        async with channel() as (sink, address, sender):
            host, _, port = address.rpartition(":")
            reader, writer = await asyncio.open_connection(host, int(port))
            writer.write(b"\x00\x00\x00\x05hello")  # not an OutputFrame
            await writer.drain()
            assert await asyncio.wait_for(reader.read(1), 10) == b""  # the sink closed it
            writer.close()
            huge = await asyncio.open_connection(host, int(port))
            huge[1].write(b"\xff\xff\xff\xff")  # a length over the limit: refused before reading it
            await huge[1].drain()
            assert await asyncio.wait_for(huge[0].read(1), 10) == b""
            huge[1].close()
            queue = sink.open("r")
            await (await sender.link(address)).send(chunk("r", 7))
            assert (await asyncio.wait_for(queue.get(), 10)).token_ids == (7,)

    asyncio.run(main())


# --------------------------------------------------------------------- the ingress's relay
class _ChannelStream:
    """A worker call that sends ``tokens`` over the output channel (as a worker replica does),
    then ends as told: cleanly, or with ``error`` raised on the call."""

    def __init__(self, choice: GenerateRequest, tokens, error=None, send=True, last=True, delay_s=0.0):
        self.choice, self.tokens, self.error = choice, tokens, error
        self.send, self.last, self.delay_s, self.cancelled = send, last, delay_s, False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        sender = OutputSender("w")
        link = await sender.link(self.choice.output_address) if self.send else None

        async def later(chunks):
            await asyncio.sleep(self.delay_s)
            for c in chunks:
                await link.send(c)

        chunks = [
            TokenChunk(
                self.choice.request_id,
                (t,),
                finish_reason="length" if self.last and i == len(self.tokens) - 1 else None,
            )
            for i, t in enumerate(self.tokens)
        ]
        if link is None:
            for c in chunks:
                yield c  # the worker's fallback: the call's own stream
        elif self.delay_s:  # the call ends first; its chunks follow on the channel
            asyncio.get_running_loop().create_task(later(chunks))
        else:
            for c in chunks:
                await link.send(c)
        if self.error is not None:
            raise self.error

    def cancel(self):
        self.cancelled = True


def relay(calls: WorkerCalls, make_stream) -> list[TokenChunk]:
    async def main():
        address = await calls._output_address()
        choice = GenerateRequest("r-0", (1, 2), {"max_tokens": 4}, output_address=address)
        out = []
        try:
            async for c in calls._relay(make_stream(choice), choice):
                out.append(c)
        finally:
            assert calls.sink is not None and calls.sink.stats()["listening"] == 0
            await calls.stop()
        return out

    return asyncio.run(main())


def colocated_calls() -> WorkerCalls:
    return WorkerCalls(Mode.COLOCATED, sink_host=HOST)


@pytest.mark.parametrize("delay_s", [0.0, 0.3], ids=["chunks-first", "call-ends-first"])
def test_the_relay_yields_the_channels_chunks_up_to_the_last(delay_s):
    out = relay(colocated_calls(), lambda choice: _ChannelStream(choice, [5, 6, 7], delay_s=delay_s))
    assert [c.token_ids[0] for c in out] == [5, 6, 7] and out[-1].finish_reason == "length"


def test_the_relay_takes_a_workers_fallback_chunks_from_the_call():
    out = relay(colocated_calls(), lambda choice: _ChannelStream(choice, [5, 6], send=False))
    assert [c.token_ids[0] for c in out] == [5, 6]


def test_a_last_chunk_that_never_comes_fails_the_stream_instead_of_hanging(monkeypatch):
    monkeypatch.setattr(worker_calls, "END_GRACE_S", 0.5)
    with pytest.raises(OutputChannelError, match="did not arrive"):
        relay(colocated_calls(), lambda choice: _ChannelStream(choice, [5, 6], last=False))


def test_an_error_on_the_call_ends_the_relay_with_it():
    with pytest.raises(ray.exceptions.ActorDiedError):
        relay(colocated_calls(), lambda choice: _ChannelStream(choice, [5], error=ray.exceptions.ActorDiedError()))


# ------------------------------------------------------------ migration over the channel
class ChannelPools(FakePools):
    """FakePools whose decode replicas send their chunks over the output channel; the first
    call's replica fails as ``first`` says after ``die_after[0]`` tokens."""

    def __init__(self, die_after, first: BaseException):
        super().__init__(SCRIPT, die_after)
        self.first = first
        self.streams: list[_ChannelStream] = []

    def _decode(self, choice, result):
        plain = super()._decode(choice, result)
        attempt = len(self.streams)
        stream = _ChannelStream(choice, list(plain.tokens), last=not plain.die)
        if plain.die:
            stream.error = self.first if attempt == 0 else ray.exceptions.ActorDiedError()
        self.streams.append(stream)
        return stream


@pytest.mark.parametrize(
    "first",
    [
        pytest.param(ray.exceptions.ActorDiedError(), id="replica-died"),
        pytest.param(OutputChannelError("output channel to the ingress broke"), id="channel-broke"),
    ],
)
def test_a_stream_over_the_channel_migrates_without_a_gap_or_duplicate(first):
    pools = ChannelPools([4], first)
    calls = WorkerCalls(
        Mode.DISAGGREGATED,
        prefill=pools.prefill,
        decode=pools.decode,
        index=FakeIndex(2),
        rehash=lambda ids, salt: (),
        max_migrations=2,
        sink_host=HOST,
    )
    choice = GenerateRequest("cmpl-x-0", (1, 2, 3), {"max_tokens": 20, "seed": 1}, None, ())

    async def main():
        try:
            return [c async for c in calls.generate(choice)]
        finally:
            with contextlib.suppress(Exception):
                await calls.stop()

    chunks = asyncio.run(main())
    # the first replica's 4 chunks went out over the channel before it failed: the continuation
    # resumes after whichever of them the client got, so the stream has no gap and no repeat
    assert [t for c in chunks for t in c.token_ids] == SCRIPT[:20]
    assert calls.migrations == 1 and chunks[-1].finish_reason == "length"
    assert all(s.choice.output_address == calls.sink.address for s in pools.streams)
