"""A real redis-server (Debian's package) on 127.0.0.1 for the fleet tests; stopped afterwards."""
from __future__ import annotations

import os
import shutil
import subprocess
import time

import pytest
from harness import free_port  # noqa: F401 - re-exported for the fleet tests


def require(binary: str) -> str:
    path = shutil.which(binary)
    if path:
        return path
    if os.environ.get("CI"):
        pytest.fail(f"{binary} is missing: scripts/install_system_deps.sh installs it")
    pytest.skip(f"{binary} not installed (run scripts/install_system_deps.sh)")


class RedisServer:
    def __init__(self, workdir):
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [require("redis-server"), "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(workdir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        import redis
        self.client = redis.Redis(host="127.0.0.1", port=self.port)
        deadline = time.monotonic() + 20
        while True:
            try:
                if self.client.ping():
                    break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError("redis-server did not start")
                time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
