"""Running an app with uvicorn's programmatic server: in the foreground (``h2okv serve``) or in a
background thread on a free localhost port (tests, ``serve-bench``)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import uvicorn

from ..errors import H2OError


def serve_forever(app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
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
