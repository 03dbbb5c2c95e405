"""``vtoken serve`` as a child process on 127.0.0.1: started on a free port, waited for, scraped, and stopped.

Used by the serving-load question (``q9_serving_load``) and the real-server tests (``tests/test_vllm_serve.py``).
The server runs in its own process group (the API server, vLLM's engine core and its worker), so ``stop``
leaves nothing running whatever happened: SIGTERM to the group, a moment for the engine to exit, then SIGKILL.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

MODEL = str(Path(__file__).resolve().parents[1] / "vllm" / "models" / "byte-llama")
# the configuration docs/staging.md verifies: fp32 (vLLM's CPU default is bf16), eager; as ``vllm.LLM`` keywords,
# so an in-process engine can be started with the same options
ENGINE = {"dtype": "float32", "block_size": 32, "max_model_len": 1024, "seed": 0, "enforce_eager": True}


def engine_args(engine: dict) -> list[str]:
    """``vllm serve`` options of ``vllm.LLM`` keywords (True: a bare flag)."""
    return [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in engine.items()]
START_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_gone(pgid: int, within_s: float) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.2)
    return False


class ServerProcess:
    """One ``vtoken serve MODEL`` with ``vtoken`` as its ``additional_config["vtoken"]`` (None: vtoken off), its
    output in ``log_path``. A context manager: entering waits for ``/health``, leaving stops the group."""

    def __init__(self, vtoken: dict | None, log_path: Path, extra_args: tuple[str, ...] = (),
                 env: dict | None = None, request_timeout_s: float = 60) -> None:
        import httpx
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(log_path)
        self.cmd = [str(Path(sys.executable).with_name("vtoken")), "serve", MODEL, "--host", "127.0.0.1",
                    "--port", str(self.port), *engine_args(ENGINE), *extra_args]
        if vtoken is not None:
            self.cmd += ["--additional-config", json.dumps({"vtoken": vtoken})]
        self.env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", **(env or {}))
        self.client = httpx.Client(base_url=self.base, timeout=request_timeout_s)
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        import httpx
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"vtoken serve exited ({self.proc.returncode}): {self.tail()}")
            try:
                if self.client.get("/health", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vtoken serve: no /health within {START_TIMEOUT_S} s: {self.tail()}")
            time.sleep(0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text()[-n:]

    def metrics(self) -> dict[str, float]:
        """Every ``vllm:`` sample of ``/metrics`` by name (this engine's labels dropped; no ``_created``)."""
        out = {}
        for line in self.client.get("/metrics").text.splitlines():
            if line.startswith("vllm:") and "_created" not in line:
                out[line.split("{")[0].split(" ")[0]] = float(line.rsplit(" ", 1)[1])
        return out

    def stop(self) -> None:
        self.client.close()
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        self._log.close()
        # the engine core and its worker exit after the API server: a moment for them, then SIGKILL the rest
        if not group_gone(self.proc.pid, within_s=15):
            os.killpg(self.proc.pid, signal.SIGKILL)
            if not group_gone(self.proc.pid, within_s=15):
                raise RuntimeError(f"process group {self.proc.pid} of vtoken serve outlived SIGKILL")
