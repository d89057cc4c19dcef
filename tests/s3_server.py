"""A real S3-compatible server for tests: ``python -m moto.server`` on 127.0.0.1, a free port, one bucket; and a
proxy in front of it that holds one upload in progress (:class:`HoldingProxy`)."""
import contextlib
import os
import socket
import subprocess
import sys
import time

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def free_port():
    """A TCP port of 127.0.0.1 that is free now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def moto_s3(bucket="raysgd-test", timeout_s=60):
    """Start moto's server, create ``bucket``; yields ``(uri_prefix, query)`` e.g. ``("s3://raysgd-test", "?...")``
    (the query names the server's port: ``endpoint_override=127.0.0.1:PORT``).

    Sets the AWS_* variables in ``os.environ`` while it runs. Skips (pytest) when moto is not installed.
    """
    import pytest

    pytest.importorskip("moto.server", reason="needs moto[server] (the test extra)")
    import pyarrow.fs as pafs

    port = free_port()
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


class HoldingProxy:
    """A TCP proxy in front of the S3 server that holds an upload: the requests whose opening bytes hold ``PUT``
    and ``hold`` (e.g. ``b"/trainer.checkpoint"``) pass until ``skip`` of them did; from then on, until
    :meth:`release`, they are never forwarded and never answered (the S3 client's retries neither), so the
    client's write stays in progress. ``holding`` is set once one arrived, ``held`` is its request line; every
    other request passes through. Use as a context manager; ``port`` is where clients connect.

    Example: ``with HoldingProxy(s3_port, b"/trainer.checkpoint", skip=1) as proxy: ...`` (holds the 2nd upload)
    """

    def __init__(self, target_port, hold, skip=0):
        import threading

        self.target_port, self.hold, self._skip = target_port, hold, skip
        self.held, self._lock = None, threading.Lock()
        self.holding, self._stop, self._released = threading.Event(), threading.Event(), threading.Event()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self._threads = []

    def __enter__(self):
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._listener.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def release(self):
        """Let every later request through; the held ones are dropped (the client sees its connection close)."""
        self._released.set()

    def _spawn(self, target, *args):
        import threading

        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self):
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except (socket.timeout, OSError):
                continue
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._spawn(self._pump, client, server, True)
            self._spawn(self._pump, server, client, False)

    def _holds(self, chunk):
        if self._released.is_set() or b"PUT " not in chunk[:4096] or self.hold not in chunk[:4096]:
            return False
        with self._lock:
            if self._skip > 0:
                self._skip -= 1
                return False
            if self.held is None:
                self.held = chunk.split(b"\r\n")[0].decode(errors="replace")
            self.holding.set()
            return True

    def _pump(self, source, sink, upstream):
        source.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    chunk = source.recv(1 << 16)
                except socket.timeout:
                    continue
                if not chunk:
                    break
                if upstream and self._holds(chunk):  # this upload stays in progress until release() or the end
                    while not self._stop.is_set() and not self._released.is_set():
                        try:
                            if not source.recv(1 << 16):
                                break
                        except socket.timeout:
                            continue
                    break
                sink.sendall(chunk)
        except OSError:
            pass
        finally:
            for sock in (source, sink):
                try:
                    sock.close()
                except OSError:
                    pass
