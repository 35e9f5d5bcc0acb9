"""Executors: run a plain function over a list of jobs (one per shard or partition), in job order.

`local` (the default; needs no Ray): in-process for one worker, else a process pool on this machine.
`ray`: one Ray task per job on a Ray cluster (`run.ray_address`; "" starts a local one sized to the
workers or the machine, in the background: the driver runs jobs itself until it is up). Both retry a
failing job `max_retries` times (Ray also retries a task whose worker died) and, when a job fails on
every attempt, raise `JobFailed` naming the job and the exception; the jobs that finished keep their
outputs (every stage writes atomically), so a rerun resumes. The stage functions
are the same for both: an executor only decides where they run.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any, Callable, Literal, Protocol, Sequence

from tqdm import tqdm

from glm5.core.config import ConfigError

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class ExecutorConfig:
    executor: Literal["local", "ray"] = "local"  # where shard jobs run
    ray_address: str = ""  # executor=ray: "" = start a local Ray cluster sized to num_workers/the machine
    num_workers: int = 0  # parallel jobs; 0 = all cores (local) / all cluster CPUs (ray), 1 = in-process (local)
    max_retries: int = 2  # attempts after the first for a failing job (a killed Ray worker included)


class JobFailed(RuntimeError):
    """A job failed on every attempt; its message names the job and the last exception (the CLI prints it
    as one line, exit 2; `--debug` shows the chained traceback)."""


class Executor(Protocol):
    def map(self, fn: Callable[..., Any], jobs: Sequence[tuple], names: Sequence[str], desc: str) -> list: ...

    def close(self) -> None: ...


def _attempt(fn: Callable[..., Any], job: tuple, name: str, retries: int) -> Any:
    for attempt in range(retries + 1):
        try:
            return fn(*job)
        except Exception as e:  # noqa: BLE001 (retried, then reported with the job's name)
            if attempt == retries:
                raise JobFailed(f"{name} failed after {retries + 1} attempts: {type(e).__name__}: {e}") from e
    raise AssertionError("unreachable")


def _call(args):
    i, fn, job, name, retries = args
    return i, _attempt(fn, job, name, retries)


class LocalExecutor:
    """A process pool on this machine (fork where available: the workers run no torch or OpenMP code, so
    threads the parent may hold cannot deadlock them); one worker runs jobs in-process."""

    def __init__(self, cfg: ExecutorConfig, progress: bool = False):
        self.cfg, self.progress = cfg, progress

    def map(self, fn, jobs, names, desc):
        workers = min(self.cfg.num_workers or os.cpu_count() or 1, len(jobs))
        bar = dict(desc=desc, total=len(jobs), unit="job", disable=not self.progress)
        if workers <= 1:
            return [_attempt(fn, job, n, self.cfg.max_retries) for job, n in tqdm(list(zip(jobs, names)), **bar)]
        method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
        out: list = [None] * len(jobs)
        args = [(i, fn, job, n, self.cfg.max_retries) for i, (job, n) in enumerate(zip(jobs, names))]
        with multiprocessing.get_context(method).Pool(workers) as pool:
            for i, result in tqdm(pool.imap_unordered(_call, args), **bar):
                out[i] = result
        return out

    def close(self) -> None:
        pass


def _run_job(fn, job):
    return fn(*job)


def check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """A `host:port` (or `ray://host:port`) address must accept a TCP connection, else ConfigError."""
    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError(f"run.ray_address={address!r}: expected host:port, ray://host:port or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ConfigError(f"cannot reach the Ray cluster at run.ray_address={address!r}: {e}") from None


class RayExecutor:
    """One Ray task per job, at most `num_workers` in flight (0 = as many as the cluster has CPUs).

    Joins a running Ray session (`ray.init` done by the caller), else connects to `ray_address`, else
    starts a local cluster; it shuts down only a session it started. Tasks read and write the run's
    output directory, so on a multi-node cluster that directory must be on a shared filesystem.

    A local cluster (`ray_address` "") starts in a background thread (its daemons take seconds to come
    up); until it is up, `map` runs jobs here in the driver, one at a time in a thread, as the local
    executor does with one worker (same functions, same retries); once it is up the rest go to Ray, the
    driver's job in progress counting as one of the `num_workers` running until it ends. It is started without the
    autoscaler monitor (nothing to scale on one machine; stopping it also held `ray.shutdown` for a second)
    and without the log monitor (worker logs are not sent to the driver)."""

    def __init__(self, cfg: ExecutorConfig, progress: bool = False):
        try:
            import ray
        except ImportError:
            raise ConfigError("run.executor=ray needs Ray: pip install -c constraints.txt -e '.[cluster]'") from None
        self.ray, self.cfg, self.progress, self.started = ray, cfg, progress, False
        self.node: Any = None  # the local cluster this executor started (ray._private.node.Node)
        self.local: threading.Thread | None = None  # starts that cluster, then holds it until `close`
        self.up, self.stop = threading.Event(), threading.Event()
        self.boot_error: BaseException | None = None
        self.connected = False
        if not ray.is_initialized():
            if cfg.ray_address and cfg.ray_address != "auto":
                check_reachable(cfg.ray_address)
            if cfg.ray_address:
                # Workers import glm5 the way this process does (a source checkout on PYTHONPATH included).
                # A local cluster's workers inherit this environment; a runtime_env there would only make
                # Ray start fresh workers instead of the ones it prestarted.
                env = {"env_vars": {"PYTHONPATH": os.environ["PYTHONPATH"]}} if os.environ.get("PYTHONPATH") else None
                ray.init(address=cfg.ray_address, runtime_env=env, log_to_driver=False)
                self.connected = True
            else:
                self.local = threading.Thread(target=self._local_cluster, name="ray-local-cluster", daemon=True)
                self.local.start()
            self.started = True
        self.task = ray.remote(num_cpus=1, max_retries=cfg.max_retries, retry_exceptions=True)(_run_job)

    def _local_cluster(self) -> None:
        """Start a one-node cluster sized to `num_workers` (the machine's cores if 0): what `ray.init()`
        starts less the autoscaler and log monitors; then hold it until `close` and stop it. One thread does
        both: Ray ties its daemons' lives to the thread that started them (Linux PR_SET_PDEATHSIG), so
        they also die with this process if `close` never runs."""
        try:
            from ray._private.node import Node
            from ray._private.parameter import RayParams

            params = RayParams(num_cpus=self.cfg.num_workers or os.cpu_count(), include_dashboard=False,
                               no_monitor=True, include_log_monitor=False)
            self.node = Node(params, head=True, shutdown_at_exit=False, spawn_reaper=True, ray_init_cluster=True)
        except BaseException as e:  # noqa: BLE001 (raised in the driver by `_connect`)
            self.boot_error = e
            return
        finally:
            self.up.set()
        self.stop.wait()
        self.node.kill_all_processes(check_alive=False, allow_graceful=True)

    def _connect(self) -> None:
        """Connect the driver to the local cluster once it is up (a no-op for any other session)."""
        if self.local is None or self.connected:
            return
        self.up.wait()
        if isinstance(self.boot_error, (ImportError, AttributeError, TypeError)):
            # the node API this start uses is Ray's private one (as of the pinned 2.60.0): another Ray
            # release starts its local cluster the public way, autoscaler and log monitor included
            log.warning("starting the local Ray cluster through ray.init (%s: %s)", type(self.boot_error).__name__,
                        self.boot_error)
            self.ray.init(num_cpus=self.cfg.num_workers or os.cpu_count(), include_dashboard=False,
                          log_to_driver=False)
            self.connected = True
            return
        if self.boot_error is not None:
            raise RuntimeError(f"could not start a local Ray cluster: {self.boot_error}") from self.boot_error
        if not self.node.remaining_processes_alive():
            raise RuntimeError(f"the local Ray cluster died while starting (logs: {self.node.get_logs_dir_path()})")
        self.ray.init(address=self.node.address, log_to_driver=False)
        self.connected = True

    def map(self, fn, jobs, names, desc):
        ray = self.ray
        out: list = [None] * len(jobs)
        pending: dict = {}  # Ray task -> job index
        todo = list(enumerate(jobs))[::-1]
        here: Future | None = None  # a job the driver runs in its thread while the cluster starts
        here_at = -1
        with tqdm(desc=desc, total=len(jobs), unit="job", disable=not self.progress) as bar, \
                ThreadPoolExecutor(1, thread_name_prefix="ray-driver-job") as driver:

            def finish_here() -> None:
                nonlocal here
                out[here_at] = here.result()  # JobFailed after its retries
                here = None
                bar.update()

            # Until the local cluster is up, the driver runs jobs one at a time in a thread, and the cluster
            # takes the rest as soon as it is up, while the driver's job still runs (it holds one of the
            # `num_workers` slots until it ends).
            while self.local is not None and not self.up.is_set() and (todo or here is not None):
                if here is None:
                    here_at, job = todo.pop()
                    here = driver.submit(_attempt, fn, job, names[here_at], self.cfg.max_retries)
                wait([here], timeout=0.02)
                if here.done():
                    finish_here()
            if not todo and here is None:
                return out
            try:
                if todo:
                    self._connect()
                    limit = self.cfg.num_workers or max(1, int(ray.cluster_resources().get("CPU", 1)))
                    fn_ref = ray.put(fn)
                while todo or pending:
                    if here is not None and here.done():
                        finish_here()
                    while todo and len(pending) + (here is not None) < limit:
                        i, job = todo.pop()
                        pending[self.task.options(name=names[i]).remote(fn_ref, job)] = i  # named in Ray's dashboard
                    if not pending:
                        wait([here])
                        continue
                    done, _ = ray.wait(list(pending), num_returns=1, timeout=0.02 if here is not None else None)
                    if not done:
                        continue
                    i = pending.pop(done[0])
                    try:
                        out[i] = ray.get(done[0])
                    except Exception as e:  # noqa: BLE001 (RayTaskError wraps the job's exception; WorkerCrashedError, ...)
                        for ref in pending:
                            ray.cancel(ref)
                        cause = e.cause if isinstance(e, ray.exceptions.RayTaskError) else e
                        lines = str(cause).strip().splitlines() or [""]
                        raise JobFailed(f"{names[i]} failed after {self.cfg.max_retries + 1} attempts: "
                                        f"{type(cause).__name__}: {lines[-1]}") from e
                    bar.update()
                if here is not None:
                    finish_here()
            finally:
                if here is not None:
                    wait([here])  # a failure elsewhere: the driver's job still ends before the error is raised
        return out

    def close(self) -> None:
        if not self.started:
            return
        self.started = False
        if self.connected:
            self.ray.shutdown()
            self.connected = False
        if self.local is not None:
            self.stop.set()
            self.local.join()
            self.local = None


def make_executor(cfg: ExecutorConfig, progress: bool = False) -> Executor:
    return RayExecutor(cfg, progress) if cfg.executor == "ray" else LocalExecutor(cfg, progress)
