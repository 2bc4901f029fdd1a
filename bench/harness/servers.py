"""Starting and stopping the processes the harness runs, each in its own process group
(recorded in STATE/pgids for run.sh's trap), and small helpers to wait for them."""

from __future__ import annotations

import http.client
import os
import re
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from .config import ROOT
from .errors import HarnessError


@dataclass
class Server:
    name: str
    argv: list[str]
    popen: subprocess.Popen
    log: Path


class Servers:
    """Every process this harness starts, each in its own process group."""

    def __init__(self, state: Path):
        self.state = state
        self.running: list[Server] = []
        self.ports: set[int] = set()  # every port handed out, so none is handed out twice

    def free_port(self) -> int:
        """A free loopback port this run has not handed out before."""
        while True:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            if port not in self.ports:
                self.ports.add(port)
                return port

    def start(self, name: str, argv: list[str], env: dict | None = None) -> Server:
        log = self.state / f"{name}.log"
        popen = subprocess.Popen(
            argv,
            cwd=ROOT,
            env={**os.environ, **(env or {})},
            stdin=subprocess.DEVNULL,
            stdout=log.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        with (self.state / "pgids").open("a") as f:
            f.write(f"{popen.pid}\n")
        server = Server(name, argv, popen, log)
        self.running.append(server)
        return server

    def stop(self, server: Server) -> None:
        if server.popen.poll() is None:
            try:
                os.killpg(server.popen.pid, signal.SIGTERM)
                server.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                os.killpg(server.popen.pid, signal.SIGKILL)
                server.popen.wait(timeout=5)
            except ProcessLookupError:
                pass
        # Children a process group leader left behind (nginx or node workers).
        try:
            os.killpg(server.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        if server in self.running:
            self.running.remove(server)

    def stop_all(self) -> None:
        for server in reversed(list(self.running)):
            self.stop(server)


def render(template: Path, out: Path, **values) -> Path:
    text = template.read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", str(value))
    left = re.findall(r"@[A-Z_]+@", text)
    if left:
        raise HarnessError(f"{template}: no value for {', '.join(sorted(set(left)))}")
    out.write_text(text)
    return out


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def http_get(port: int, path: str = "/", headers: dict | None = None, timeout: float = 2.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def wait_until(what: str, check, server: Server, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.popen.poll() is not None:
            raise HarnessError(
                f"{what} exited with {server.popen.returncode}:\n{log_tail(server.log)}"
            )
        try:
            if check():
                return
        except (OSError, http.client.HTTPException):
            pass
        time.sleep(0.1)
    raise HarnessError(f"{what} not ready after {timeout:.0f} s:\n{log_tail(server.log)}")
