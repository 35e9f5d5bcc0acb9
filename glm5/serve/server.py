"""Run the app under uvicorn with the engine's lifecycle tied in (used by `glm5 serve` and the tests).

- Shutdown (SIGTERM, SIGINT or `should_exit`): the engine stops admitting at once and gives running
  requests `ServerConfig.shutdown_timeout_s` to finish; what is still running then ends with an error
  chunk and `[DONE]` (streams) or a 503 error object, and only then do connections close. uvicorn's own
  connection timeout is set a few seconds past that, so it never cuts a stream first.
- Engine fault (the loop died of an error no single request explains): the server shuts down and
  `run()` reports it, so `glm5 serve` exits non-zero and a supervisor restarts it instead of a process
  answering 503 forever.
"""

from __future__ import annotations

import uvicorn
from fastapi import FastAPI

CUT_SLACK_S = 5  # uvicorn waits this much longer than the drain before it closes connections itself


class GracefulServer(uvicorn.Server):
    def __init__(self, app: FastAPI, host: str, port: int, grace_s: float, log_level: str = "info"):
        self.async_engine = app.state.serve.async_engine
        self.grace_s = grace_s
        self.engine_failure: BaseException | None = None
        super().__init__(uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                                        timeout_graceful_shutdown=int(grace_s) + CUT_SLACK_S))

    def engine_failed(self, error: BaseException) -> None:
        """`create_app(on_engine_failure=...)` hook: shut the server down; `run()`'s caller exits non-zero."""
        self.engine_failure = error
        self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.async_engine.drain(self.grace_s)  # before uvicorn starts waiting for open connections
        await super().shutdown(sockets)
