"""`AsyncEngine`: drives a synchronous `LLMEngine` from one background thread for the asyncio server.

The engine is touched only by that thread: requests, aborts and expert swaps reach it through a command
queue and run between two `engine.step()` calls, so a swap is atomic with respect to every step.
Outputs go back to per-request asyncio queues with `call_soon_threadsafe`.

There is one admission queue, the engine scheduler's: a request reaches it as soon as the engine thread
reads its command. On top of it:
- admission control: `max_waiting_requests` (ServerConfig) queued or on their way -> `Overloaded` (the
  app answers 503);
- dynamic batching: every step passes the engine's `Batching` policy (`EngineConfig.max_batch_size`,
  `preferred_batch_size`, `batch_timeout_ms`, `batch_by_length`; glm5/infer/scheduler.py), and while the
  engine has nothing running this thread waits `engine.batch_wait()` before the first step;
- hot swap without draining: the swap (or a rollback) runs between two steps as soon as it arrives;
  running requests finish on the version they started on (the engine holds the swapped experts' old
  weights for them: glm5/infer/hot_swap.py), new ones run on the new version, each reporting the version it ran on;
- shutdown: `drain(grace_s)` stops admitting at once, lets running requests finish for the grace period,
  then ends the rest with `EngineDead` (streams end with an error chunk and `[DONE]`);
- faults: a request the engine aborted on a failure gets `RequestFailed`, everyone else carries on; if
  `engine.step()` itself raises (a fault no single request explains) the loop stops, every waiting
  client gets `EngineDead("engine failed ...")`, and `on_failure` is called (the CLI exits non-zero so a
  supervisor restarts the server);
- gauges: engine stats are refreshed after every step and whenever the engine goes idle.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from glm5.data.infilling import InfillLayout
from glm5.infer.engine import LLMEngine
from glm5.infer.outputs import RequestOutput
from glm5.infer.sampling import SamplingParams
from glm5.infer.scheduler import Batching
from glm5.serve.metrics import ServerMetrics

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """Too many requests are waiting; retry later."""


class EngineDead(Exception):
    """The engine loop stopped (shutdown or an engine error)."""


class RequestFailed(Exception):
    """The engine aborted this request on a failure attributable to it; other requests are unaffected."""


@dataclass
class _Pending:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    out: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    infill: InfillLayout | None = None  # the layout of a GLM blank-infilling request
    lora: str | None = None  # the loaded adapter this request runs with (None = the base model)
    arrival: float = field(default_factory=time.monotonic)
    admitted: float = 0.0
    last_token_time: float = 0.0
    num_tokens: int = 0
    done: bool = False


class AsyncEngine:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, *, max_waiting_requests: int,
                 on_failure: Callable[[BaseException], None] | None = None):
        self.engine = engine
        self.metrics = metrics
        self.on_failure = on_failure  # called from the engine thread once the loop died of an engine fault
        self.batching = Batching.from_config(engine.config)
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.Queue = queue.Queue()
        self._active: dict[str, _Pending] = {}  # handed to the engine (in its queue or running)
        self._swaps: collections.deque[tuple[tuple[dict | None, dict], Future]] = collections.deque()
        self._num_submitted = 0  # submitted but not yet handed to the engine
        self._count_lock = threading.Lock()
        self._stats: dict = {}
        self._stopping = False
        self._stop_timeout: float | None = None
        self._dead: BaseException | None = None
        self.versions: list[dict] = [{"version": self.model_version, "time": time.time(), "experts": []}]
        # adapters the engine serves (name -> directory); changed only on the engine thread, between steps
        self.loras: dict[str, str] = dict(engine.list_loras())
        self._thread = threading.Thread(target=self._run, name="glm5-engine", daemon=True)

    # ---- asyncio side -------------------------------------------------------------------------------
    @property
    def model_version(self) -> int:
        return self.engine.model_version

    def start(self) -> None:
        self._thread.start()

    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self._thread.is_alive()

    def unavailable_reason(self) -> str | None:
        """Why new requests are refused ("engine failed: ..." or "the server is shutting down"), or None."""
        if self._dead is not None:
            return f"engine failed ({type(self._dead).__name__}: {self._dead}); the server must be restarted"
        if self._stopping or not self._thread.is_alive():
            return "the server is shutting down"
        return None

    def num_queued(self) -> int:
        """Requests submitted and not yet in the engine's queue (the engine thread reads them between steps)."""
        return self._num_submitted

    def num_waiting(self) -> int:
        """Requests not running yet: on their way to the engine or in its queue (as of the last refresh)."""
        return self._num_submitted + int(self._stats.get("num_waiting", 0))

    def stats(self) -> dict:
        return dict(self._stats)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       infill: InfillLayout | None = None, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the engine's `RequestOutput`s for one request; abort it if the consumer goes away.
        `infill`: the GLM blank-infilling layout of the prompt (see `LLMEngine.add_request`); `lora`: the
        name of a loaded adapter to run it with."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineDead(reason)
        if self.num_waiting() >= self.max_waiting_requests:
            raise Overloaded(f"{self.num_waiting()} requests are waiting")
        p = _Pending(request_id, prompt_token_ids, params, asyncio.Queue(), asyncio.get_running_loop(), infill,
                     lora)
        with self._count_lock:
            self._num_submitted += 1
        self._commands.put(("add", p))
        try:
            while True:
                item = await p.out.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not p.done:
                self._commands.put(("abort", request_id))

    async def swap_experts(self, updates: dict | None, info: dict) -> int:
        """Run `engine.swap_experts(updates)` (None: `engine.rollback_experts()`) between two steps; the
        new model version."""
        fut: Future = Future()
        self._commands.put(("swap", (updates, info, fut)))
        return await asyncio.wrap_future(fut)

    async def lora_op(self, op: str, name: str, path: str | None = None) -> None:
        """`engine.load_lora(name, path)` ("load") or `engine.unload_lora(name)` ("unload") on the engine
        thread, between two steps (running requests keep going); the engine's ValueError comes back."""
        fut: Future = Future()
        self._commands.put(("lora", (op, name, path, fut)))
        await asyncio.wrap_future(fut)

    def drain(self, grace_s: float) -> None:
        """Stop admitting now; requests still running after `grace_s` seconds are ended (non-blocking,
        callable from any thread; the first call's deadline holds)."""
        self._stopping = True  # new requests are refused from this moment, not from the next loop turn
        self._commands.put(("stop", grace_s))

    async def shutdown(self, timeout_s: float) -> None:
        self.drain(timeout_s)
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join, timeout_s + 30)

    # ---- engine thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # an engine bug must not leave clients hanging
            self._dead = e
            dead = EngineDead(self.unavailable_reason())
            for p in self._active.values():
                self._send(p, dead)
            self._drain_commands(block=False, fail=e)
            while self._swaps:
                self._swaps.popleft()[1].set_exception(dead)
            log.exception("engine loop stopped: every request is refused until the server restarts")
            if self.on_failure is not None:
                self.on_failure(e)

    def _gathering(self) -> float | None:
        """Seconds to keep gathering before the first step from idle (None: go now)."""
        return self.engine.batch_wait(self.batching) if self._active else None

    def _loop(self) -> None:
        deadline = None  # shutdown drain deadline
        while True:
            block = not self._active and not self._swaps and not self._stopping
            if self._drain_commands(block=block, timeout=self._gathering()) or not self._active:
                self._refresh_stats()  # the queue changed, or idle: gauges must not keep older values
            if self._stop_timeout is not None:  # draining (`_stopping` may be set before the command lands)
                deadline = deadline or time.monotonic() + self._stop_timeout
                if time.monotonic() > deadline or not self._active:
                    break
            if self._gathering() and not self._swaps and not self._stopping:
                continue  # dynamic batching: keep gathering
            self._maybe_swap()
            if self._active:
                self._step()
        cut = EngineDead(f"the server shut down; the request did not finish within the {self._stop_timeout:g} s "
                         "shutdown grace period")
        for rid in list(self._active):
            self.engine.abort_request(rid)
            self._send(self._active.pop(rid), cut)
        self._refresh_stats()
        while self._swaps:
            self._swaps.popleft()[1].set_exception(EngineDead("the server shut down before the swap ran"))

    def _drain_commands(self, block: bool, timeout: float | None = None, fail: BaseException | None = None) -> int:
        """Handle the queued commands (waiting for one when `block`, or up to `timeout` s); -> how many."""
        try:
            cmd = self._commands.get(block=block or timeout is not None, timeout=timeout)
        except queue.Empty:
            return 0
        n = 0
        while True:
            self._handle(cmd, fail)
            n += 1
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return n

    def _handle(self, cmd, fail: BaseException | None) -> None:
        kind, arg = cmd
        if kind == "add":
            if fail is not None or self._stopping:
                self._send(arg, EngineDead(self.unavailable_reason() or "the server is shutting down"))
            else:
                self._add(arg)
            with self._count_lock:  # after the add: a request is counted as submitted or in the engine's queue
                self._num_submitted -= 1
        elif kind == "abort":
            self._abort(arg)
        elif kind == "swap":
            updates, info, fut = arg
            if fail is not None:
                fut.set_exception(EngineDead(self.unavailable_reason()))
            else:
                self._swaps.append(((updates, info), fut))
        elif kind == "lora":
            self._lora(*arg, fail=fail)
        elif kind == "stop" and self._stop_timeout is None:  # the first drain's grace period holds
            self._stopping, self._stop_timeout = True, float(arg)

    def _lora(self, op: str, name: str, path: str | None, fut: Future, fail: BaseException | None) -> None:
        if fail is not None:
            fut.set_exception(EngineDead(self.unavailable_reason()))
            return
        try:
            if op == "load":
                self.engine.load_lora(name, path)
                self.loras[name] = str(path)
            else:
                self.engine.unload_lora(name)
                self.loras.pop(name, None)
        except Exception as e:  # noqa: BLE001 - the engine validated before changing anything
            fut.set_exception(e)
            return
        fut.set_result(None)

    def _abort(self, request_id: str) -> None:
        p = self._active.pop(request_id, None)
        if p is not None:
            self.engine.abort_request(request_id)
            p.done = True
            self.metrics.inc("vllm:request_success_total", 1.0, "abort")

    def _maybe_swap(self) -> None:
        """Run pending swaps / rollbacks now, between two steps, without waiting for running requests."""
        while self._swaps:
            (updates, info), fut = self._swaps.popleft()
            try:
                if updates is None:
                    self.engine.rollback_experts()
                else:
                    self.engine.swap_experts(updates)
            except Exception as e:  # validation happened before; keep serving on the current weights
                fut.set_exception(e)
                continue
            self.versions.append({"version": self.model_version, "time": time.time(), **info})
            fut.set_result(self.model_version)

    def _add(self, p: _Pending) -> None:
        """Hand a request to the engine's queue (between two steps)."""
        try:
            lora = {"lora_name": p.lora} if p.lora is not None else {}
            self.engine.add_request(p.request_id, prompt_token_ids=p.prompt_token_ids, params=p.params,
                                    infill=p.infill, **lora)
        except (ValueError, TypeError) as e:  # the engine rejected this request: the client's 400
            self._send(p, e)
            return
        except Exception as e:  # noqa: BLE001 - fail this request only, keep serving the others
            self._send(p, RuntimeError(f"engine could not add the request: {type(e).__name__}: {e}"))
            return
        p.admitted = time.monotonic()
        self._active[p.request_id] = p

    def _step(self) -> None:
        outputs = self.engine.step(self.batching)
        self._refresh_stats()  # before any client hears of this step, so gauges never lag behind it
        now = time.monotonic()
        for out in outputs:
            p = self._active.get(out.request_id)
            if p is None:
                continue  # aborted meanwhile
            if out.error is not None:  # the engine aborted this request on a failure; the rest go on
                del self._active[out.request_id]
                self.metrics.inc("vllm:request_success_total", 1.0, "error")
                self._send(p, RequestFailed(out.error))
                continue
            self._observe(p, out, now)
            if out.finished:
                del self._active[out.request_id]
            self._send(p, out)

    def _refresh_stats(self) -> None:
        self._stats = self.engine.get_stats()

    def _observe(self, p: _Pending, out: RequestOutput, now: float) -> None:
        n = sum(len(c.token_ids) for c in out.outputs)
        new = n - p.num_tokens
        if new > 0:
            if p.num_tokens == 0:
                self.metrics.observe("vllm:time_to_first_token_seconds", now - p.arrival)
                self.metrics.observe("vllm:request_queue_time_seconds", self._queue_time(p, out))
                self.metrics.inc("vllm:prompt_tokens_total", len(p.prompt_token_ids))
            else:
                for _ in range(new):
                    self.metrics.observe("vllm:inter_token_latency_seconds", (now - p.last_token_time) / new)
            self.metrics.inc("vllm:generation_tokens_total", new)
            p.num_tokens, p.last_token_time = n, now
        if out.finished:
            self.metrics.observe("vllm:e2e_request_latency_seconds", now - p.arrival)
            reason = out.outputs[0].finish_reason if out.outputs else None
            self.metrics.inc("vllm:request_success_total", 1.0, str(reason or "stop"))
            if p.lora is not None:
                self.metrics.count_lora_request(p.lora)

    @staticmethod
    def _queue_time(p: _Pending, out: RequestOutput) -> float:
        """Until the engine thread took the request + the engine's queue (dynamic batching, max_batch_size,
        until first scheduled)."""
        m = out.metrics
        engine_wait = 0.0
        if m is not None and m.first_scheduled_time is not None:
            engine_wait = max(0.0, m.first_scheduled_time - m.arrival_time)
        return (p.admitted - p.arrival) + engine_wait

    def _send(self, p: _Pending, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException) or item.finished:
            p.done = True
        try:
            p.loop.call_soon_threadsafe(p.out.put_nowait, item)
        except RuntimeError:  # the client's event loop is closed
            pass
