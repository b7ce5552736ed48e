"""Model-written code is contained: each hostile program scores 0 and leaves the machine as it was."""
import os
import socket
import threading

import pytest

from rewards.sandbox import extract_code, run_tests

TEST = ["assert f() == 1"]


@pytest.fixture
def listener():
    """A real TCP server on 127.0.0.1 that records whether anyone connected."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.2)
    hits = []

    def serve():
        try:
            conn, _ = srv.accept()
            hits.append(1)
            conn.close()
        except OSError:
            pass

    t = threading.Thread(target=serve)
    t.start()
    yield srv.getsockname()[1], hits
    t.join()
    srv.close()


def test_good_code_passes():
    assert run_tests("def f():\n    return 1\n", TEST + ["assert f() == 2"]) == 1


def test_reading_a_file_outside_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    assert run_tests(f"data = open({str(secret)!r}).read()\ndef f():\n    return 1\n", TEST) == 0


def test_socket_to_localhost_is_refused(listener):
    port, hits = listener
    code = (f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            "def f():\n    return 1\n")
    assert run_tests(code, TEST) == 0
    assert hits == []


def test_fork_loop_is_contained():
    before = len(os.listdir("/proc"))
    assert run_tests("import os\nwhile True:\n    os.fork()\n", TEST, timeout_s=3) == 0
    assert len(os.listdir("/proc")) < before + 20  # no process explosion left behind


def test_unbounded_memory_is_contained():
    code = "x = []\nwhile True:\n    x.append(bytearray(10**7))\n"
    assert run_tests(code, TEST, timeout_s=3, memory_mb=256) == 0


def test_infinite_loop_is_killed():
    assert run_tests("while True:\n    pass\n", TEST, timeout_s=1) == 0


def test_huge_file_is_contained(tmp_path):
    code = "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 10**6)\n"
    assert run_tests(code, TEST, timeout_s=3) == 0
    assert not list(tmp_path.iterdir())


def test_writing_outside_its_directory_is_refused(tmp_path):
    target = tmp_path / "pwned"
    os.chmod(tmp_path, 0o777)
    code = f"open({str(target)!r}, 'w').write('x')\ndef f():\n    return 1\n"
    assert run_tests(code, TEST) == 0
    assert not target.exists()


def test_extract_code():
    assert extract_code("x\n```python\na = 1\n```\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("plain = 1") == "plain = 1"
