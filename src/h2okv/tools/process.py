"""``h2okv serve`` as a real child process on 127.0.0.1 (drain tests, the soak run): start it on a
free port, wait until it is healthy, read its resident memory, stop it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

_CLI = "import sys; from h2okv.cli import main; sys.exit(main())"


def free_port() -> int:
    """A port the OS just reported free on 127.0.0.1 (another process could take it before we do,
    which the caller sees as a server that fails to start)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def save_tiny_model(path: Path, **kwargs) -> Path:
    """The tiny test model + byte-level tokenizer as a checkpoint directory ``h2okv serve --model`` loads."""
    from h2okv.tools.tiny_chat import tiny_chat_model

    model, tok = tiny_chat_model(**kwargs)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


class ServerProcess:
    def __init__(self, args: list[str], port: int | None = None, env: dict | None = None, log_path: Path | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        child_env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), **(env or {})}
        src = str(Path(__file__).resolve().parents[2])  # this source tree wins over an installed copy
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (src, child_env.get("PYTHONPATH")) if p)
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL  # noqa: SIM115 - closed in wait()
        command = [sys.executable, "-c", _CLI, "serve", "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(command, env=child_env, stdout=self._log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = 120.0, headers: dict | None = None) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before becoming healthy")
            try:
                if httpx.get(self.url + "/health", timeout=2, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"the server was not healthy within {timeout} s")

    def rss_bytes(self) -> int:
        """Resident set size of the server process (Linux /proc)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS in /proc status")

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self._log is not subprocess.DEVNULL:
                self._log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()
