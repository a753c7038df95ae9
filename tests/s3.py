"""A real S3 server for the artifact store's tests: ``moto_server`` as its own process on 127.0.0.1
(nothing mocked inside the tested process), reached through an Airflow ``aws`` connection whose
extra holds its ``endpoint_url``, as a user points Airflow at any S3-compatible store.

The connection travels as ``AIRFLOW_CONN_<ID>`` in the environment: the in-process tests and every
``airflow dags test`` they start (which inherit the environment) see the same server.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator

CONN_ID = "hvd_s3"
BUCKET = "hvd-artifacts"
START_TIMEOUT_S = 30.0
# moto accepts any signed request; the keys only have to be well-formed
ACCESS_KEY, SECRET_KEY, REGION = "hvd-test-key", "hvd-test-secret", "us-east-1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Server:
    """``moto_server`` on 127.0.0.1: ``start()``, ``stop()`` (a store gone mid-commit), ``close()``."""

    def __init__(self, port: int | None = None, nice: int = 0) -> None:
        self.port = port or free_port()
        self.nice = nice  # a benchmark's stand-in for a remote store takes only the CPU the training leaves
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def start(self) -> S3Server:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=(lambda: os.nice(self.nice)) if self.nice else None)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2):
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("moto_server did not start on 127.0.0.1:%d" % self.port)
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=ACCESS_KEY,
                            aws_secret_access_key=SECRET_KEY, region_name=REGION)

    def connection(self) -> str:
        """The Airflow connection (``AIRFLOW_CONN_<ID>`` JSON) that reaches this server."""
        return json.dumps({"conn_type": "aws", "login": ACCESS_KEY, "password": SECRET_KEY,
                           "extra": {"endpoint_url": self.endpoint, "region_name": REGION}})

    def new_bucket(self, name: str | None = None) -> str:
        name = name or "%s-%s" % (BUCKET, uuid.uuid4().hex[:8])
        self.client().create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return sorted(o["Key"] for page in pages for o in page.get("Contents", ()))


@contextlib.contextmanager
def serving(conn_id: str = CONN_ID, nice: int = 0) -> Iterator[S3Server]:
    """A running server, its connection in this process's environment (and its children's) as ``conn_id``."""
    server = S3Server(nice=nice).start()
    name = "AIRFLOW_CONN_%s" % conn_id.upper()
    before = os.environ.get(name)
    os.environ[name] = server.connection()
    try:
        yield server
    finally:
        server.stop()
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def uri(bucket: str, prefix: str = "", conn_id: str = CONN_ID) -> str:
    """``s3://<conn_id>@<bucket>/<prefix>``: an artifact root through the connection."""
    return "s3://%s@%s/%s" % (conn_id, bucket, prefix.strip("/"))


class Gate:
    """A TCP proxy on 127.0.0.1 in front of an ``S3Server``, through which a store can fail mid-commit
    for real: once a request names ``cut_at`` (a key, as it appears in the request line), every
    connection through the gate is cut and new ones are reset, until ``reopen()`` (the store is down).
    ``deny``, instead, resets the connection of every request that names it and lets the others pass
    (the store fails at that one key, as a full disk fails at one file)."""

    def __init__(self, upstream: S3Server) -> None:
        self.upstream = upstream
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        # Airflow caches a connection's file system by its id for the life of the process: a gate's
        # own id keeps a test from reaching an earlier test's closed gate through that cache
        self.conn_id = "hvd_s3_gate_%d" % self.port
        self.cut_at: bytes | None = None
        self.deny: bytes | None = None
        self.cut = threading.Event()
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return "http://127.0.0.1:%d" % self.port

    def connection(self) -> str:
        """As ``S3Server.connection``, through the gate, with one attempt per request (botocore's
        retries would only wait)."""
        return json.dumps({"conn_type": "aws", "login": ACCESS_KEY, "password": SECRET_KEY,
                           "extra": {"endpoint_url": self.endpoint, "region_name": REGION,
                                     "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2,
                                                       "read_timeout": 10}}})

    def environment(self) -> dict[str, str]:
        """``AIRFLOW_CONN_<conn_id>``: the gate's connection, for this process and the ones it starts."""
        return {"AIRFLOW_CONN_%s" % self.conn_id.upper(): self.connection()}

    def reopen(self) -> None:
        self.cut.clear()
        self.cut_at = None

    def close(self) -> None:
        self.listener.close()
        self._cut_all()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut.is_set():
                _reset(client)  # the store is unreachable
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream.port), 5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, server]
            threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        tail = b""
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                if requests and _requested(self.cut_at, tail, chunk):
                    self.cut.set()
                    self._cut_all()
                    return
                if requests and _requested(self.deny, tail, chunk):
                    _reset(src, dst)
                    return
                tail = chunk[-512:]
                dst.sendall(chunk)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def _cut_all(self) -> None:
        with self._lock:
            conns, self._open = self._open, []
        _reset(*conns)


def _requested(key: bytes | None, tail: bytes, chunk: bytes) -> bool:
    """Whether a request line in ``chunk`` (a request starts it, or a line after ``tail``, the end of
    the chunk before) names ``key``; a body that quotes it (a marker listing what failed) does not count."""
    if key is None:
        return False
    line = rb"[A-Z]+ /[^ \r\n]*" + re.escape(key)
    return re.match(line, chunk) is not None or re.search(rb"\n" + line, tail + chunk) is not None


def _reset(*conns: socket.socket) -> None:
    """Close with a TCP reset (no FIN): the peer sees the connection fail, not end."""
    for s in conns:
        with contextlib.suppress(OSError):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
