"""Runs inside the sandbox (stdlib only; executed by path, never imported by glm5): lock the process in,
then run the program and map its outcome to an exit code.

    python -I sandbox_child.py SPEC_JSON

SPEC_JSON: {"dir", "program", "python", "limits": {...}, "isolate": bool, "drop_uid": int|null}.
With `isolate` (we are root inside fresh mount/PID/network namespaces made by `unshare`), every mount
except the private directory is remounted read-only. Then resource limits are set, privileges dropped
to `drop_uid` when given, and the program runs under `python` through RUNNER.
Exit codes: 0 pass, 1 fail (AssertionError), 2 error (any other exception), 3 sandbox setup failed,
124 killed by the CPU limit (SIGXCPU / SIGKILL), 125 killed by another signal.
"""

import ctypes
import json
import os
import resource
import signal
import sys

MS_RDONLY, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 32, 4096, 16384, 1 << 18

# the program's own exceptions decide pass/fail/error; SystemExit keeps its code (0 = pass)
RUNNER = r"""
import sys, traceback
src = open(sys.argv[1], encoding="utf-8").read()
sys.argv = sys.argv[1:]
try:
    exec(compile(src, sys.argv[0], "exec"), {"__name__": "__main__"})
except AssertionError:
    traceback.print_exc(); sys.exit(1)
except SystemExit as e:
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    sys.exit(0 if code == 0 else (1 if code == 1 else 2))
except BaseException:
    traceback.print_exc(); sys.exit(2)
"""


def _mount(libc, source, target, flags):
    if libc.mount(source, target.encode(), None, flags, None) != 0:
        raise OSError(ctypes.get_errno(), f"mount {target}")


def _mount_points() -> list[str]:
    """Mount points of this namespace, parents first (field 5 of /proc/self/mountinfo)."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].replace("\\040", " ") for line in f]
    return sorted(set(points), key=lambda p: p.count("/"))


def read_only_except(directory: str) -> None:
    """Make every mount read-only except `directory` (bind-mounted onto itself first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    _mount(libc, None, "/", MS_REC | MS_PRIVATE)  # nothing we do here propagates to the host
    _mount(libc, directory.encode(), directory, MS_BIND)
    for mp in _mount_points():
        if mp == directory:
            continue
        try:
            _mount(libc, None, mp, MS_REMOUNT | MS_BIND | MS_RDONLY)
        except OSError:
            if mp == "/":  # the root must be read-only; a nested mount we cannot touch is tolerated
                raise


def set_limits(limits: dict) -> None:
    cpu, mem, fsize, nofile = limits["cpu_s"], limits["memory_mb"] << 20, limits["file_mb"] << 20, limits["nofile"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    spec = json.loads(sys.argv[1])
    directory, uid = spec["dir"], spec["drop_uid"]
    try:
        if spec["isolate"]:
            read_only_except(directory)
        os.chdir(directory)
        if uid is not None:
            os.chown(directory, uid, uid)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        set_limits(spec["limits"])
    except OSError as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return 3
    python = spec["python"]
    pid = os.fork()
    if pid == 0:
        # the process limit counts every process of the sandbox user on the machine (other sandboxes too),
        # so it is set only here: our own fork above must not fail because another sandbox is busy
        nproc = spec["limits"]["nproc"]  # not enforced for uid 0: see drop_uid
        resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
        os.execv(python, [python, "-I", "-c", RUNNER, spec["program"]])
    # wait here so that a death by signal keeps its meaning through `unshare`, which reports it as 1
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 124 if os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) else 125
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
