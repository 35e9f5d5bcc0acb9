"""The code sandbox holds against the usual escapes: writing outside its directory, fork bombs, sockets,
reading the caller's environment, sleeping forever, eating memory; and it reports pass/fail/error/timeout.
The namespace checks skip where `unshare` is unavailable (there the limits are documented as weaker)."""

import os
import socket
import sys
import time

import pytest

from glm5.eval import sandbox
from glm5.eval.sandbox import Limits, isolation, run_program

FAST = Limits(cpu_s=2, wall_s=4)
namespaces = pytest.mark.skipif(isolation() != "namespaces", reason="unshare cannot make namespaces here")


def test_outcomes():
    assert run_program("assert sum([1, 2]) == 3", FAST).status == "pass"
    r = run_program("assert 1 == 2, 'nope'", FAST)
    assert r.status == "fail" and "AssertionError: nope" in r.stderr
    assert run_program("import sys; sys.exit(3)", FAST).status == "error"
    assert run_program("def f(:\n", FAST).status == "error"
    assert run_program("print('x' * 10)", FAST).stdout == "x" * 10 + "\n"


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
def test_world_writable_directories_are_read_only():
    target = f"/tmp/glm5-sandbox-escape-{os.getpid()}"
    r = run_program(f"open({target!r}, 'w').write('x')", FAST)
    assert r.status == "error" and "Read-only file system" in r.stderr and not os.path.exists(target)


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
    assert run_program("import time\ntime.sleep(60)", Limits(cpu_s=1, wall_s=2)).status == "timeout"
    monkeypatch.setenv("GLM5_TEST_SECRET", "s3cr3t-value")
    r = run_program("import os\nprint(dict(os.environ))", FAST)
    assert "s3cr3t" not in r.stdout
    if os.geteuid() == 0:  # as root the program runs as nobody: root's directories are closed to it
        target = tmp_path / "escaped.txt"
        assert run_program(f"open({str(target)!r}, 'w').write('x')", FAST).status == "error"
        assert not target.exists()
    assert sys.executable  # the harness interpreter is untouched
