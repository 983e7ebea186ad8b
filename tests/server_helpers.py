"""A real ``python -m mlx_mla.server`` process for the tests: started on a free port of
127.0.0.1 (``--port 0``; the port is read from its start line), its log in a file, stopped
with SIGTERM; and raw HTTP requests for what an OpenAI client would not send."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple, Union

START_LINE = re.compile(r"serving .* at http://127\.0\.0\.1:(\d+)/v1")


class ServerProcess:
    """``python -m mlx_mla.server --port 0 ARGS`` with its stderr and stdout in ``log_path``;
    ``env``: extra environment variables (a rank's); ``wait``: for the start line (which
    only rank 0 prints).

    Raises:
        RuntimeError: it exits or does not print its start line within ``timeout`` s.
    """

    def __init__(self, args, log_path: Path, timeout: float = 120.0, env=None, wait=True):
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_mla.server", "--port", "0", *map(str, args)],
            stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        if not wait:
            return
        deadline = time.monotonic() + timeout
        while (m := START_LINE.search(self.log())) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not start:\n{self.log()[-3000:]}")
            time.sleep(0.1)
        self.port = int(m.group(1))
        self.base_url = f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def request(self, method: str, path: str, body: Union[bytes, dict, None] = None,
                timeout: float = 120.0) -> Tuple[int, Union[dict, str]]:
        """(status, JSON body or text) of one request; a dict body is sent as JSON."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        data = json.dumps(body).encode() if isinstance(body, dict) else body
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        text = resp.read().decode()
        conn.close()
        try:
            return resp.status, json.loads(text)
        except json.JSONDecodeError:
            return resp.status, text

    def stop(self) -> int:
        """SIGTERM, then its exit status (killed after 30 s)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode
