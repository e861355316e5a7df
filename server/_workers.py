"""`adaptlm serve` with ADAPTLM_WORKERS=N: the engine in this process, N uvicorn worker processes in front of it.

This process loads the checkpoint (a bad one is still the CLI's one line and status 2), serves the engine to the
workers over ZeroMQ (`EngineHost`, on a Unix socket in a private directory) and supervises the workers with
uvicorn's own supervisor, which binds the port once, hands the socket to each worker, and replaces a worker that
dies. Each worker runs the app with a `RemoteEngine`: the HTTP parsing, checks and answers of all the workers run
beside the engine, not on its thread's GIL. SIGTERM (or Ctrl-C): each worker drains its requests (whose engine work
finishes), then the engine finishes what is queued and the store closes, as with one process.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import uvicorn
from uvicorn.supervisors import Multiprocess

from server import request_id
from server._admission import SharedDoor, shared_places
from server._slow_clients import head_deadline_protocol
from server.engine import EngineHost, RemoteEngine
from server.metrics import MULTIPROCESS_VARIABLE
from server.settings import Settings

__all__ = ["serve_workers"]

log = logging.getLogger(__name__)


class WorkerConfig(uvicorn.Config):
    """A worker's uvicorn configuration. It crosses to the worker pickled (uvicorn starts its workers with
    multiprocessing's spawn), so it carries the settings and the engine's address, and builds the app, its
    RemoteEngine and the HTTP protocol class there, in `load`."""

    def __init__(self, settings: Settings, address: str, places: Any, **kwargs: Any) -> None:
        super().__init__("server._workers:app", **kwargs)  # never imported: `load` builds the app
        self.settings, self.address, self.places = settings, address, places

    def load(self) -> None:
        from server.app import create_app  # in the worker

        request_id.install(self.settings.log_format)
        door = SharedDoor(self.settings.max_queue, self.places)
        self.app = create_app(self.settings, engine=RemoteEngine(self.address), door=door)
        self.http = head_deadline_protocol(self.settings.client_timeout_s)
        super().load()


def serve_workers(settings: Settings) -> int:
    """`server.app.serve` for settings.workers >= 1 -> the exit status (0 after a clean drain, 3 if the port could
    not be bound). Raises CheckpointError on a bad checkpoint, before any worker starts."""
    from server.app import rate_limiter, start_engine, uvicorn_options

    engine = start_engine(settings)
    try:
        with tempfile.TemporaryDirectory(prefix="adaptlm-") as private:  # mode 0700: this user's alone
            address = f"ipc://{private}/engine"
            metrics = Path(private, "metrics")
            metrics.mkdir()
            os.environ[MULTIPROCESS_VARIABLE] = str(metrics)  # the workers inherit it
            host = EngineHost(engine, address, take_rate=rate_limiter(settings).take)
            host.start()
            try:
                options = uvicorn_options(settings)
                options.pop("http")  # a class made here: the worker makes its own (`WorkerConfig.load`)
                # a worker answers the supervisor's health checks once it has imported the app (torch with the
                # engine's types: over 10 s on a loaded 2-core machine, where uvicorn's 5 s killed each in a loop)
                config = WorkerConfig(settings, address, shared_places(settings.workers), host=settings.host,
                                      port=settings.port, workers=settings.workers, timeout_worker_healthcheck=120,
                                      log_level=settings.log_level,
                                      log_config=request_id.uvicorn_log_config(settings.log_format), **options)
                try:
                    sock = config.bind_socket()
                except SystemExit:  # uvicorn's way of saying the port is taken (it has logged why)
                    return 3
                Multiprocess(config, sockets=[sock]).run()
                sock.close()
            finally:
                host.stop()
    finally:
        engine.stop()
        engine.store.close()
    return 0
