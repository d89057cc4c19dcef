"""A real S3-compatible server for tests: ``python -m moto.server`` on 127.0.0.1, a free port, one bucket."""
import contextlib
import os
import socket
import subprocess
import sys
import time

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket="raysgd-test", timeout_s=60):
    """Start moto's server, create ``bucket``; yields ``(uri_prefix, query)`` e.g. ``("s3://raysgd-test", "?...")``.

    Sets the AWS_* variables in ``os.environ`` while it runs. Skips (pytest) when moto is not installed.
    """
    import pytest

    pytest.importorskip("moto.server", reason="needs moto[server] (the test extra)")
    import pyarrow.fs as pafs

    port = _free_port()
    saved = {key: os.environ.get(key) for key in CREDENTIALS}
    os.environ.update(CREDENTIALS)
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            with socket.socket() as sock:
                if sock.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moto.server did not start on port {port} within {timeout_s} s "
                                   f"(exit code {proc.poll()})")
            time.sleep(0.1)
        query = f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        fs = pafs.S3FileSystem(endpoint_override=f"127.0.0.1:{port}", scheme="http", region="us-east-1",
                               allow_bucket_creation=True)
        fs.create_dir(bucket)
        yield f"s3://{bucket}", query
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
