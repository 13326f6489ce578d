"""A real `mlflow server` on loopback, as a user's tracking server: a SQLite store and an
artifact folder under the test's tmp_path, served by MLflow's own server process."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MLFLOW = Path(sys.executable).with_name("mlflow")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def mlflow_server(folder: Path, timeout: float = 120) -> Iterator[str]:
    """Serve a fresh MLflow tracking store from `folder`; yield its URI, stop it at the end."""
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    log = (folder / "server.log").open("w")
    proc = subprocess.Popen(
        [str(MLFLOW), "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
         "--backend-store-uri", f"sqlite:///{folder / 'store.db'}",
         "--artifacts-destination", str(folder / "artifacts")],
        stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(f"{uri}/health", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start:\n{(folder / 'server.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        yield uri
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the server and the workers it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()
