"""`AsyncClient` and `AsyncSession` against a real server: every endpoint, and streams as async iterators."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest

from adaptlm_client import (
    AsyncClient,
    AsyncGenerateStream,
    AsyncSession,
    Client,
    NotFoundError,
    UnprocessableEntityError,
)
from tests.clients.conftest import LiveServer

T = TypeVar("T")
TEXT = "It is a truth universally acknowledged, that a single man in possession of a good fortune."
MORE = " However little known the feelings or views of such a man may be."


def run(live: LiveServer, body: Callable[[AsyncClient], Awaitable[T]]) -> T:
    async def main() -> T:
        async with AsyncClient(live.url, timeout=60) as client:
            return await body(client)
    return asyncio.run(main())


def test_probes_models_score_and_generate(live: LiveServer) -> None:
    async def body(client: AsyncClient) -> None:
        assert (await client.health()).status == "ok"
        model = (await client.ready()).model
        assert [m.id for m in (await client.models()).data] == [model]
        scored = await client.score(TEXT, logprobs=True)
        assert scored.bytes == len(TEXT.encode()) and scored.logprobs is not None
        whole = await client.generate("The ", max_tokens=25, seed=5)
        assert whole.finish_reason == "length" and whole.usage.completion_tokens == 25
        stream = client.generate_stream("The ", max_tokens=25, seed=5)
        assert isinstance(stream, AsyncGenerateStream)
        async with stream:
            chunks = [chunk async for chunk in stream]
        assert "".join(chunks) == stream.text == whole.text and len(chunks) > 1
        assert stream.result.usage == whole.usage and stream.result.finish_reason == "length"
        assert stream.result.timings.total_seconds > 0

    run(live, body)


def test_streams_without_a_block_and_left_early(live: LiveServer) -> None:
    async def body(client: AsyncClient) -> None:
        stream = client.generate_stream("The ", max_tokens=15, seed=9)
        text = "".join([chunk async for chunk in stream])
        assert text == (await client.generate("The ", max_tokens=15, seed=9)).text and stream.done
        async with client.generate_stream("The ", max_tokens=2000) as long:
            async for _ in long:
                break
        assert not long.done and [chunk async for chunk in long] == []
        assert (await client.health()).status == "ok"

    run(live, body)


def test_stream_errors_before_the_start_are_raised_on_entry(live: LiveServer) -> None:
    async def body(client: AsyncClient) -> None:
        with pytest.raises(NotFoundError):
            async with client.generate_stream("x", session_id="no-such-session-0123456789"):
                pytest.fail("entered")
        with pytest.raises(UnprocessableEntityError) as e:
            async for _ in client.generate_stream("x", top_p=2.0):
                pytest.fail("iterated")
        assert e.value.param == "top_p"

    run(live, body)


def test_sessions(live: LiveServer) -> None:
    async def body(client: AsyncClient) -> None:
        session = await client.create_session(TEXT, ttl_s=300, lr=0.001, decay=0.01)
        assert isinstance(session, AsyncSession) and session.info is not None
        assert session.info.adaptation.lr == pytest.approx(0.001) and session.info.observed is not None
        observed = await session.observe(MORE)
        assert observed.bytes == len(MORE.encode())
        assert (await session.get()).stats.bytes_observed == len((TEXT + MORE).encode())
        assert (await session.score("a wife")).session_id == session.id
        assert (await session.score("a wife", adapt=True)).bytes == 6
        generated = await session.generate("Yours ", max_tokens=8, seed=4)
        async with session.generate_stream("Yours ", max_tokens=8, seed=4) as stream:
            assert "".join([c async for c in stream]) == generated.text
        assert (await client.observe(session.id, "more")).updates >= 1
        assert (await client.score("x", session_id=session.id)).session_id == session.id
        assert (await client.generate("x", max_tokens=2, session_id=session.id)).usage.completion_tokens == 2

        blob = await session.export()
        copy = await client.import_state("async-imported-session-01", blob)
        assert copy.info is not None and copy.info.stats == (await session.get()).stats
        assert await copy.observe(MORE) == await session.observe(MORE)
        again = await client.import_state("async-imported-session-02", await client.export_state(copy.id))
        assert again.info is not None and again.info.stats == (await copy.get()).stats

        assert (await session.reset()).stats.bytes_observed == 0
        assert (await client.reset_session(copy.id)).stats.bytes_observed == 0
        assert (await client.session(copy.id).get()).id == copy.id
        assert (await client.get_session(copy.id)).id == copy.id
        await session.delete()
        await client.delete_session(copy.id)
        for sid in (session.id, copy.id):
            with pytest.raises(NotFoundError) as e:
                await client.get_session(sid)
            assert e.value.status == 404 and e.value.param == "session_id"

    run(live, body)


def test_sync_and_async_sessions_are_the_same_resource(live: LiveServer) -> None:
    with Client(live.url) as sync:
        sid = sync.create_session(TEXT).id

    async def body(client: AsyncClient) -> int:
        return (await client.get_session(sid)).stats.bytes_observed

    assert run(live, body) == len(TEXT.encode())


def test_async_suggest(live: LiveServer) -> None:
    async def body(client: AsyncClient) -> None:
        session = await client.create_session(TEXT)
        s = await session.suggest("It is a tr", k=2)
        assert s.prefix == "tr" and 1 <= len(s.completions) <= 2
        assert s == await client.suggest(session.id, "It is a tr", k=2)

    run(live, body)
