"""Run the app on a real loopback socket in a background thread (tests and `bench/serve.py`).

`with serve_in_thread(app) as base_url:` starts uvicorn on 127.0.0.1 and a free port, waits until it
accepts connections, and shuts it down (running the app's graceful shutdown) on exit.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time

from glm5.serve.server import GracefulServer


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app, host: str = "127.0.0.1", port: int | None = None, timeout_s: float = 60.0,
                    grace_s: float | None = None):
    """Yields the base URL; `grace_s` (default: the app's `shutdown_timeout_s`) bounds the drain on exit."""
    port = port or free_port()
    grace = app.state.serve.config.shutdown_timeout_s if grace_s is None else grace_s
    server = GracefulServer(app, host, port, grace, log_level="warning")
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
