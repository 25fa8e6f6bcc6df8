"""Front: the relays (HTTP, gRPC, metrics) on one asyncio event loop in a background thread.

`Front(config).start()` binds the public ports and returns once they listen; `stop()` closes
them and every open connection. `abort_inference(message)` ends every forwarded inference call
in progress (for when the entry model's stub died and Triton will never answer them).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import resource
import threading

from avspec.serving.front import openai, playground
from avspec.serving.front.config import FrontConfig
from avspec.serving.front.grpc_relay import GrpcRelay
from avspec.serving.front.http_relay import HttpRelay
from avspec.serving.front.inflight import InFlight
from avspec.serving.front.metrics_relay import MetricsRelay

_log = logging.getLogger(__name__)

_ABORT_WAIT_S = 10.0  # abort_inference from another thread: how long to wait for the loop


class Front:
    """The HTTP and gRPC front, running on one event loop in a background thread."""

    def __init__(self, config: FrontConfig) -> None:
        self.config = config
        self._inflight = InFlight()
        self._http = HttpRelay(config, self._inflight)
        openai.install(self._http)
        playground.install(self._http)
        self._grpc = GrpcRelay(config, self._inflight)
        self._metrics = MetricsRelay(config) if config.upstream_metrics is not None else None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._stopped = False

    @property
    def http_port(self) -> int:
        return self._http.port

    @property
    def grpc_port(self) -> int:
        return self._grpc.port

    @property
    def metrics_port(self) -> int:
        """The public metrics port (0 when the front serves no metrics)."""
        return self._metrics.port if self._metrics is not None else 0

    def start(self) -> Front:
        """Bind both ports and serve in the background; return once listening."""
        _raise_file_limit(self.config.max_connections)
        with self._lock:
            if self._thread is not None:
                raise RuntimeError("front already started")
            loop = asyncio.new_event_loop()
            started: concurrent.futures.Future[None] = concurrent.futures.Future()
            self._loop = loop
            self._thread = threading.Thread(
                target=self._run, args=(loop, started), name="avspec-front", daemon=True
            )
            self._thread.start()
        try:
            started.result()
        except BaseException:
            self._thread.join()
            raise
        return self

    def stop(self) -> None:
        """Close both listeners and every open connection; safe to call more than once."""
        with self._lock:
            if self._stopped or self._loop is None or self._thread is None:
                self._stopped = True
                return
            self._stopped = True
            loop, thread = self._loop, self._thread
        if thread.is_alive():
            try:
                asyncio.run_coroutine_threadsafe(self._close(), loop).result(timeout=30)
            except Exception as err:  # stopping the loop below cancels whatever is left
                _log.warning("front: closing did not finish cleanly: %r", err)
            with contextlib.suppress(RuntimeError):  # the loop may have ended on its own
                loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=30)

    def abort_inference(self, message: str) -> int:
        """End every forwarded inference call in progress with `message`; return how many.

        HTTP: 503 `{"error": message}` before the response head, else a last SSE event
        `data: {"error": message}` ending the event stream (the connection is closed only when
        the body was cut where no clean end exists; /v1 routes answer OpenAI error objects);
        gRPC ModelInfer / ModelStreamInfer: UNAVAILABLE with the message. Their upstream calls
        are closed, which makes Triton cancel them. Calls that start afterwards are not affected.
        Thread-safe; callable from any thread, the front's own included. 0 when not running.
        """
        with self._lock:
            if self._stopped or self._loop is None or self._thread is None:
                return 0
            loop, thread = self._loop, self._thread
        if threading.current_thread() is thread:
            return self._inflight.abort_all(message)
        result: concurrent.futures.Future[int] = concurrent.futures.Future()

        def run() -> None:
            if result.set_running_or_notify_cancel():
                try:
                    result.set_result(self._inflight.abort_all(message))
                except BaseException as err:
                    result.set_exception(err)

        try:
            loop.call_soon_threadsafe(run)
            return result.result(timeout=_ABORT_WAIT_S)
        except (RuntimeError, TimeoutError):  # the loop closed meanwhile
            result.cancel()
            return 0

    def reconnect_upstream(self) -> None:
        """Renew the gRPC channel to Triton after tritonserver was started again (thread-safe;
        nothing when the front is not running)."""
        with self._lock:
            if self._stopped or self._loop is None:
                return
            loop = self._loop
        future = asyncio.run_coroutine_threadsafe(self._grpc.reconnect(), loop)
        future.result(timeout=_ABORT_WAIT_S)

    def __enter__(self) -> Front:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self, loop: asyncio.AbstractEventLoop, started: concurrent.futures.Future) -> None:
        asyncio.set_event_loop(loop)
        try:
            try:
                loop.run_until_complete(self._open())
            except BaseException as err:
                loop.run_until_complete(self._close())
                started.set_exception(err)
                return
            started.set_result(None)
            loop.run_forever()
        finally:
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())  # config.ready's threads
            loop.close()

    async def _open(self) -> None:
        await self._http.open()
        await self._grpc.open()
        if self._metrics is not None:
            await self._metrics.open()

    async def _close(self) -> None:
        if self._metrics is not None:
            await self._metrics.close()
        await self._grpc.close()
        await self._http.close()


def _raise_file_limit(connections: int) -> None:
    """Let the process open a descriptor per connection and per upstream connection (with
    room for the rest): the soft limit (often 1,024) raised toward the hard one. If the hard
    limit is lower, the caps cannot all be reached; said once in the log."""
    need = 2 * connections + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(need, hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < need:
            _log.warning(
                "front: open files limited to %d; %d connections need about %d", soft,
                connections, need,
            )  # fmt: skip
