"""Run untrusted generated code (HumanEval completions) in a locked-down child process.

    result = run_program("assert 1 + 1 == 2", Limits(cpu_s=5, wall_s=10))
    result.status  # "pass" | "fail" | "timeout" | "error"

Layers, strongest available first (`isolation()` says which one this machine gets):
- always: a private temporary directory (the working directory, removed afterwards), an empty
  environment (PATH, HOME/TMPDIR = the directory, LANG), no stdin, resource limits (CPU seconds,
  address space, file size, processes, open files, no core dumps), a wall-clock timeout that kills the
  whole process group;
- "namespaces" (the `unshare` tool works here): fresh network namespace (no interfaces: every socket
  connect fails), PID namespace with its own /proc (the caller's processes and their environments are
  invisible; killing its init kills every descendant), mount namespace with every mount read-only
  except the private directory;
- as root, the program runs as `nobody` (so the process limit applies: the kernel never enforces it
  for uid 0, and nobody cannot read root's files) with an interpreter `nobody` may execute.
Without namespaces ("rlimits"), the network is NOT isolated and a program running as the caller's own
(non-root) user can read that user's files and /proc; see docs/eval.md.

Exit status of the program: pass = exit 0; fail = an AssertionError (or exit 1); error = any other
exception, a crash, or a sandbox setup failure; timeout = the wall clock or the CPU limit ran out.
"""

from __future__ import annotations

import functools
import json
import os
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
UNSHARE = ["unshare", "--net", "--pid", "--fork", "--kill-child", "--mount-proc", "--mount"]
Status = Literal["pass", "fail", "timeout", "error"]


@dataclass(frozen=True, kw_only=True)
class Limits:
    cpu_s: int = 10  # CPU seconds (SIGXCPU, then SIGKILL one second later)
    wall_s: float = 15.0  # wall-clock seconds before the process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file the program may write (also caps its captured output)
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


def _command(directory: str, limits: Limits) -> list[str]:
    python, uid = _interpreter(limits)
    isolate = isolation() == "namespaces"
    spec = {"dir": directory, "program": "program.py", "python": python, "drop_uid": uid,
            "isolate": isolate, "limits": asdict(limits)}
    cmd = [sys.executable, "-I", str(CHILD), json.dumps(spec)]
    return _unshare_prefix() + cmd if isolate else cmd


def _classify(returncode: int | None, timed_out: bool) -> Status:
    if timed_out or returncode in (124, -signal.SIGXCPU, -signal.SIGKILL):
        return "timeout"
    return {0: "pass", 1: "fail"}.get(returncode, "error")


def _read_head(path: Path, limit: int) -> str:
    with open(path, "rb") as f:
        return f.read(limit * 4).decode("utf-8", "replace")[:limit]


def run_program(source: str, limits: Limits | None = None) -> SandboxResult:
    """Run Python `source` in the sandbox and say how it ended (see the module docstring)."""
    limits = limits or Limits()
    with tempfile.TemporaryDirectory(prefix="glm5-sandbox-") as host_dir:
        os.chmod(host_dir, 0o711)  # the sandbox user may reach work/ by path, not list our files
        work = Path(host_dir) / "work"  # the program's directory; outputs stay outside it
        work.mkdir(mode=0o700)
        (work / "program.py").write_text(source, encoding="utf-8")
        out, err = Path(host_dir) / "stdout", Path(host_dir) / "stderr"
        env = {"PATH": "/usr/bin:/bin", "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
        start = time.monotonic()
        with open(out, "wb") as fo, open(err, "wb") as fe:
            proc = subprocess.Popen(_command(str(work), limits), stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                    env=env, cwd=str(work), start_new_session=True)
            timed_out = False
            try:
                proc.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc)
        wall = time.monotonic() - start
        return SandboxResult(_classify(proc.returncode, timed_out), proc.returncode,
                             _read_head(out, limits.output_chars), _read_head(err, limits.output_chars),
                             wall, isolation())


def _kill_group(proc: subprocess.Popen) -> None:
    """Kill the child's whole process group (descendants that stayed in it) and reap the child."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
