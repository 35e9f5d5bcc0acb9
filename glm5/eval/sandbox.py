"""Run untrusted generated code (HumanEval completions) in a locked-down child process.

    result = run_program("assert 1 + 1 == 2", Limits(cpu_s=5, wall_s=10))
    result.status  # "pass" | "fail" | "timeout" | "error"

Layers, strongest available first (`isolation()` says which one this machine gets):
- always: a private temporary working directory (removed afterwards), an empty environment (PATH,
  HOME/TMPDIR = the directory, LANG), no stdin, resource limits (CPU seconds, address space, size of
  one file, processes, open files, no core dumps), a wall-clock timeout that kills the whole process
  group;
- "namespaces" (the `unshare` tool works here): fresh network namespace (no interfaces: every socket
  connect fails, abstract Unix sockets of the host are out of reach), PID namespace with its own /proc
  (the caller's processes and their environments are invisible; killing its init kills every
  descendant), IPC namespace (no System V IPC or POSIX message queue of the host), and a mount
  namespace in which the program sees a minimal root instead of the host's (sandbox_child.py lists it):
  read-only system directories and interpreter, its own /proc, /dev and /tmp, no host /tmp, /run, home
  or any other directory, so no Unix socket file of the host; the only writable place is a tmpfs of
  `Limits.disk_mb` holding its directory, /tmp and /dev/shm, which bounds everything it writes;
- as root, the program runs as `nobody` (so the process limit applies: the kernel never enforces it
  for uid 0, and nobody cannot read root's files) with an interpreter `nobody` may execute.
Without namespaces ("rlimits"), the network is NOT isolated, the program sees the host's file system
(writable where its user may write, the total written bounded only by what RLIMIT_FSIZE allows per
file), and a program running as the caller's own (non-root) user can read that user's files and /proc;
see docs/eval.md.

Status: pass = the program ran to its end and the harness said so (a nonce only the runner holds,
written to a pipe after exec() returned, see sandbox_child.py) and the process then exited 0; fail = an
AssertionError, SystemExit of any code (sys.exit(0) included), or an exit with status 0 or 1 without
that report (os._exit(0)); error = any other exception, a crash, or a sandbox setup failure; timeout =
the wall clock or the CPU limit ran out.
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

CHILD = Path(__file__).with_name("sandbox_child.py")
NOBODY = 65534
UNSHARE = ["unshare", "--net", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc", "--mount"]
Status = Literal["pass", "fail", "timeout", "error"]


@dataclass(frozen=True, kw_only=True)
class Limits:
    cpu_s: int = 10  # CPU seconds (SIGXCPU, then SIGKILL one second later)
    wall_s: float = 15.0  # wall-clock seconds before the process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file the program may write (also caps its captured output)
    disk_mb: int = 64  # all it may write, /tmp and /dev/shm included ("namespaces" only: a tmpfs this size)
    nproc: int = 32  # processes of the sandbox user (RLIMIT_NPROC; stops fork bombs)
    nofile: int = 64  # open file descriptors
    output_chars: int = 20_000  # stdout/stderr kept in the result (each, the head)
    python: str | None = None  # interpreter for the program; None = pick one the sandbox user can run


@dataclass
class SandboxResult:
    status: Status
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    isolation: str  # "namespaces" or "rlimits"


@functools.cache
def isolation() -> str:
    """"namespaces" when `unshare` can make the namespaces we use on this machine, else "rlimits"."""
    if shutil.which("unshare") is None:
        return "rlimits"
    try:
        ok = subprocess.run(_unshare_prefix() + ["true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        ok = False
    return "namespaces" if ok else "rlimits"


def _unshare_prefix() -> list[str]:
    # unprivileged users need a user namespace to make the others (their mounts are then allowed too)
    return UNSHARE[:1] + (["--user", "--map-root-user"] if os.geteuid() != 0 else []) + UNSHARE[1:]


def _world_executable(path: str) -> bool:
    """Can `nobody` run this interpreter (every ancestor directory traversable by others)?"""
    real = Path(os.path.realpath(path))
    if not real.is_file() or not real.stat().st_mode & stat.S_IXOTH:
        return False
    return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)


def _interpreter(limits: Limits) -> tuple[str, int | None]:
    """(python, uid to drop to): as root, `nobody` with a python it can run; else our own user."""
    python = limits.python or sys.executable
    if os.geteuid() != 0:
        return python, None
    for candidate in ([limits.python] if limits.python else [sys.executable, "/usr/bin/python3"]):
        if _world_executable(candidate):
            return candidate, NOBODY
    return python, None  # documented weaker mode: root without the process limit


@functools.cache
def _interpreter_dirs(python: str) -> tuple[str, ...]:
    """Where `python` runs from (its prefixes: stdlib, site-packages; and its own directory), to be
    bound read-only into the jail; () if it cannot even start (the program then fails to, and says why)."""
    query = "import sys; print(*{sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}, sep='\\n')"
    try:
        out = subprocess.run([python, "-I", "-c", query], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return ()
    return (os.path.dirname(os.path.abspath(python)), *out.stdout.splitlines())


def _command(host_dir: Path, limits: Limits, key_fd: int, verdict_fd: int) -> list[str]:
    python, uid = _interpreter(limits)
    isolate = isolation() == "namespaces"
    jail = {"root": str(host_dir / "root"), "expose": list(_interpreter_dirs(python))} if isolate else None
    spec = {"work": str(host_dir / "work"), "python": python, "drop_uid": uid, "jail": jail,
            "key_fd": key_fd, "verdict_fd": verdict_fd, "limits": asdict(limits)}
    cmd = [sys.executable, "-I", str(CHILD), json.dumps(spec)]
    return _unshare_prefix() + cmd if isolate else cmd


def _classify(returncode: int | None, timed_out: bool, reported: bool) -> Status:
    if timed_out or returncode in (124, -signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    if returncode == 0:
        return "pass" if reported else "fail"  # exit 0 without the runner's report: os._exit(0) or the like
    return "fail" if returncode == 1 else "error"


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit * 4).decode("utf-8", "replace")[:limit]


def _read_verdict(fd: int) -> bytes:
    """What the sandbox wrote to the verdict pipe, without waiting: a program of the "rlimits" mode may
    have left a process behind that still holds the pipe open."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 256)
    except BlockingIOError:
        return b""


def run_program(source: str, limits: Limits | None = None) -> SandboxResult:
    """Run Python `source` in the sandbox and say how it ended (see the module docstring)."""
    limits = limits or Limits()
    nonce = secrets.token_hex(16).encode()  # fresh per run; reaches the runner only through key_r
    key_r, key_w = os.pipe()
    verdict_r, verdict_w = os.pipe()
    try:
        os.write(key_w, nonce)  # fits in the pipe buffer: the runner reads it when it starts
        with tempfile.TemporaryDirectory(prefix="glm5-sandbox-") as host_dir:
            os.chmod(host_dir, 0o711)  # the sandbox user may reach work/ by path, not list our files
            work = Path(host_dir) / "work"  # the program's directory; outputs stay outside it
            work.mkdir(mode=0o700)
            (work / "program.py").write_text(source, encoding="utf-8")
            (Path(host_dir) / "root").mkdir()  # where the jail's root is mounted ("namespaces")
            out, err = Path(host_dir) / "stdout", Path(host_dir) / "stderr"
            start = time.monotonic()
            with open(out, "wb") as fo, open(err, "wb") as fe:
                proc = subprocess.Popen(_command(Path(host_dir), limits, key_r, verdict_w), stdin=subprocess.DEVNULL,
                                        stdout=fo, stderr=fe, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                        cwd=str(work), start_new_session=True, pass_fds=(key_r, verdict_w))
                timed_out = False
                try:
                    proc.wait(timeout=limits.wall_s)
                except subprocess.TimeoutExpired:
                    timed_out = True
                finally:
                    _kill_group(proc)
            wall = time.monotonic() - start
            reported = _read_verdict(verdict_r) == nonce
            return SandboxResult(_classify(proc.returncode, timed_out, reported), proc.returncode,
                                 _read_head(out, limits.output_chars), _read_head(err, limits.output_chars),
                                 wall, isolation())
    finally:
        for fd in (key_r, key_w, verdict_r, verdict_w):
            os.close(fd)


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (descendants that stayed in it) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
