"""Running an app with uvicorn's programmatic server: in the foreground (``h2okv serve``) or in a
background thread on a free localhost port (tests, ``serve-bench``).

In the foreground, SIGTERM (or Ctrl-C) drains: the engine stops admitting (new requests get 503,
``/health`` too, so a load balancer stops routing here), what was submitted runs to its end or, after
``drain_timeout`` seconds, ends with a final error event; then uvicorn closes and the process exits 0.
A second signal exits at once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from h2okv.errors import H2OError

log = logging.getLogger("h2okv.serve")


class DrainingServer(uvicorn.Server):
    """A uvicorn server whose first exit signal drains the app's engine before closing."""

    def __init__(self, config: uvicorn.Config, engine, drain_timeout: float = 30.0):
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self._drain_thread: threading.Thread | None = None

    def handle_exit(self, sig, frame) -> None:
        # uvicorn's own handler records the signal and re-raises it after shutdown, which would end the
        # process with the signal's status instead of 0: a handled signal is not recorded here.
        if self._drain_thread is not None:  # the second signal: no more waiting
            self.should_exit = self.force_exit = True
            return
        log.warning("received signal %s: draining (a second signal exits at once)", sig)
        self.engine.drain()
        self._drain_thread = threading.Thread(target=self._drain, name="h2okv-drain", daemon=True)
        self._drain_thread.start()

    def _drain(self) -> None:
        deadline = time.monotonic() + self.drain_timeout
        while not self.engine.idle() and time.monotonic() < deadline and not self.should_exit:
            time.sleep(0.05)
        if not self.engine.idle():
            log.warning("drain timeout: ending the requests still running")
        self.engine.stop()  # what is left gets its final event; a drained engine has nothing left
        time.sleep(0.2)  # let the streams send their last events before uvicorn closes connections
        self.should_exit = True


def serve_forever(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
                  drain_timeout: float = 30.0, on_server=None) -> None:
    """Serve until a signal ends it (see the module docstring). ``on_server(server)`` is called before
    serving starts: a caller that must stop the server from another thread (``tp.py``, when the
    tensor-parallel group breaks) keeps it and sets ``server.should_exit``."""
    # idle keep-alive connections close after 5 s and a request head may not pass 16 KiB (h11); a
    # client that trickles its head is not timed out by uvicorn: put a reverse proxy in front
    # (nginx: client_header_timeout) when clients are not trusted. Bodies: limits.py.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            timeout_keep_alive=5, h11_max_incomplete_event_size=16 * 1024)
    server = DrainingServer(config, app.state.engine, drain_timeout)
    if on_server is not None:
        on_server(server)
    try:
        server.run()
    except OSError as exc:
        raise H2OError(f"cannot listen on {host}:{port}: {exc}") from None


@contextlib.contextmanager
def running_server(app, log_level: str = "warning", startup_timeout: float = 60.0) -> Iterator[str]:
    """Serve ``app`` on 127.0.0.1 at a free port in a thread; yields the base URL (``http://127.0.0.1:N``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))  # the OS picks a free port; uvicorn serves on this very socket
    port = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=2, lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="h2okv-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + startup_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            sock.close()
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=15)
        sock.close()
