"""A real ``ggmoe serve`` process on a free loopback port (the serve tier's helpers; a module of its own name so
that no other tier's conftest shadows it)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

API_KEY = "test-key-7a20"  # the server fixture's --api-key
MAX_QUEUE = 2  # the server fixture's --max-queue
N_CTX = 512  # the server fixture's --n-ctx (tokens)
START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Server:
    url: str  # http://127.0.0.1:PORT
    proc: subprocess.Popen
    log: str  # path of the server's combined stdout/stderr

    def client(self, key: str | None = API_KEY, **kw) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60.0, **kw)

    def rss_bytes(self) -> int:
        """The server process's resident memory (bytes), from /proc."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(tmp_dir, *args: str) -> Server:
    port = free_port()
    log = str(tmp_dir / f"serve-{port}.log")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("GGMOE_API_KEY", None)
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "ggmoe", "serve", "--port", str(port), *args],
                                stdout=out, stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", proc, log)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ggmoe serve exited with {proc.returncode}:\n{open(log).read()}")
        try:
            if httpx.get(server.url + "/health", timeout=2.0).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    stop_server(server)
    raise RuntimeError(f"ggmoe serve did not answer /health in {START_TIMEOUT_S} s:\n{open(log).read()}")


def stop_server(server: Server) -> int:
    server.proc.terminate()
    try:
        return server.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        server.proc.kill()
        return server.proc.wait()
