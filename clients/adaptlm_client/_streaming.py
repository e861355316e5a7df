"""Streamed generation: an iterator (or async iterator) of text chunks, then the final result."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Generator, Iterator
from types import TracebackType
from typing import NoReturn, Self

import httpx

from adaptlm_client._calls import SSEDecoder, parse_generate_event
from adaptlm_client._errors import AdaptlmError, error_from_transport
from adaptlm_client.protocol import GenerateDone

__all__ = ["AsyncGenerateStream", "GenerateStream"]

_UNFINISHED = "the stream has not finished: read it to the end first"
_CUT = "the stream ended before its last event (the connection closed early)"


class _StreamState:
    """What both streams keep (the text so far, the final event, the answer being read) and how they read it, without
    I/O: each stream's loop hands it the answer's lines, yields the chunks it gives back, and has it raise what went
    wrong."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._result: GenerateDone | None = None
        self._decoder = SSEDecoder()
        self._response: httpx.Response | None = None
        self._closed = False

    @property
    def text(self) -> str:
        """The text received so far (all of it once the stream is done)."""
        return "".join(self._parts)

    @property
    def done(self) -> bool:
        return self._result is not None

    @property
    def result(self) -> GenerateDone:
        """The last event: `finish_reason`, `usage` and `timings`. RuntimeError before the stream is read."""
        if self._result is None:
            raise RuntimeError(_UNFINISHED)
        return self._result

    def _take(self, data: str) -> str | None:
        event = parse_generate_event(data)
        if isinstance(event, GenerateDone):
            self._result = event
            return None
        self._parts.append(event.text)
        return event.text

    def _read(self, line: str | None) -> str | None:
        """The text of the event that `line` completes (None: the answer has ended), if it is a chunk."""
        data = self._decoder.feed(line) if line is not None else self._decoder.flush()
        return self._take(data) if data is not None else None

    def _finish(self) -> None:
        """The answer has ended (its last chunk, if any, yielded): it must have ended with the final event."""
        if not self.done:
            raise AdaptlmError(_CUT)

    @staticmethod
    def _failed(exc: AdaptlmError | httpx.RequestError, response: httpx.Response) -> NoReturn:
        """`exc`, raised from a stream's reading as the SDK's error."""
        if isinstance(exc, AdaptlmError):  # an error event, or a cut stream: the answer's ID, for the server's log
            exc.request_id = exc.request_id or response.headers.get("X-Request-ID")
            raise exc
        raise error_from_transport(exc) from None


class GenerateStream(_StreamState):
    """A generation as it happens (`Client.generate_stream`): iterate for the text chunks; afterwards `result`
    has the finish reason, usage and timings, and `text` the whole text.

        with client.generate_stream("It was a dark", max_tokens=100) as stream:
            for chunk in stream:
                print(chunk, end="", flush=True)
        print(stream.result.finish_reason, stream.result.usage.completion_tokens)

    The request is sent when the block is entered (or at the first iteration), so errors found before the
    stream starts (404, 422, 429 after the retries) are raised there; an error event at the end of the stream
    is raised from the iteration as its exception. Leaving the block closes the connection, which stops the
    generation on the server; without a block, read the stream to its end (or call `close`).
    """

    def __init__(self, open_stream: Callable[[], httpx.Response]) -> None:
        super().__init__()
        self._open_stream = open_stream
        self._chunks: Generator[str, None, None] | None = None

    def _iterate(self) -> Generator[str, None, None]:
        if self._response is None:
            self._response = self._open_stream()
        try:
            for line in self._response.iter_lines():
                if chunk := self._read(line):
                    yield chunk
                if self.done:
                    return
            if chunk := self._read(None):
                yield chunk
            self._finish()
        except (AdaptlmError, httpx.RequestError) as e:
            self._failed(e, self._response)
        finally:
            self._response.close()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        if self._closed:
            raise StopIteration
        if self._chunks is None:
            self._chunks = self._iterate()
        return next(self._chunks)

    def __enter__(self) -> Self:
        if self._response is None and not self._closed:
            self._response = self._open_stream()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading; the server cancels the generation when the connection closes."""
        self._closed = True
        if self._chunks is not None:
            self._chunks.close()
        if self._response is not None:
            self._response.close()


class AsyncGenerateStream(_StreamState):
    """The async `GenerateStream` (`AsyncClient.generate_stream`).

        async with client.generate_stream("It was a dark", max_tokens=100) as stream:
            async for chunk in stream:
                print(chunk, end="", flush=True)
        print(stream.result.finish_reason)
    """

    def __init__(self, open_stream: Callable[[], Awaitable[httpx.Response]]) -> None:
        super().__init__()
        self._open_stream = open_stream
        self._chunks: AsyncGenerator[str, None] | None = None

    async def _iterate(self) -> AsyncGenerator[str, None]:
        if self._response is None:
            self._response = await self._open_stream()
        try:
            async for line in self._response.aiter_lines():
                if chunk := self._read(line):
                    yield chunk
                if self.done:
                    return
            if chunk := self._read(None):
                yield chunk
            self._finish()
        except (AdaptlmError, httpx.RequestError) as e:
            self._failed(e, self._response)
        finally:
            await self._response.aclose()

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        if self._closed:
            raise StopAsyncIteration
        if self._chunks is None:
            self._chunks = self._iterate()
        return await anext(self._chunks)

    async def __aenter__(self) -> Self:
        if self._response is None and not self._closed:
            self._response = await self._open_stream()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop reading; the server cancels the generation when the connection closes."""
        self._closed = True
        if self._chunks is not None:
            await self._chunks.aclose()
        if self._response is not None:
            await self._response.aclose()
