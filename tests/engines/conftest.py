"""Fixtures for the engine tests: the vLLM venv, a tiny model, engine processes, clusters.

The venv comes from ``scripts/engines/vllm-env.sh`` (built once, ~3 min, cached outside the repo;
needs PyPI the first time: without it the build fails, and says so). Each engine is a separate
process (``vllm_driver.py`` under the venv's Python) talking JSON lines.
"""

from __future__ import annotations

import json
import queue
import subprocess
import threading
import time
from pathlib import Path

import pytest
from kvpool.tools.cluster import LocalCluster

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
ENV_BUILD_TIMEOUT_S = 1500
ENGINE_START_TIMEOUT_S = 240


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The Python of the vLLM-on-CPU venv, with this checkout's kvpool installed in it."""
    try:
        r = subprocess.run(["bash", str(REPO / "scripts/engines/vllm-env.sh")], cwd=REPO,
                           capture_output=True, text=True, timeout=ENV_BUILD_TIMEOUT_S,
                           check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"scripts/engines/vllm-env.sh ran over {ENV_BUILD_TIMEOUT_S} s")
    if r.returncode != 0:
        pytest.fail("scripts/engines/vllm-env.sh failed (building the vLLM venv needs PyPI the "
                    f"first time):\n{r.stderr[-3000:]}")
    return r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="session")
def tiny_model(vllm_python, tmp_path_factory) -> str:
    """A random 2-layer Llama with an offline tokenizer, built once per session."""
    out = tmp_path_factory.mktemp("tiny-llama")
    r = subprocess.run([vllm_python, str(REPO / "scripts/engines/make_tiny_llama.py"), str(out)],
                       capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return str(out)


class Engine:
    """One ``vllm_driver.py`` process: ``generate(prompt)`` returns the driver's answer with
    ``logs`` (the engine's log lines for that request) added."""

    def __init__(self, python: str, model: str, log_path: Path, *, master: str | None = None,
                 verify: bool = True, prefix_caching: bool = True,
                 transports: str | None = None, kv_events: str | None = None,
                 extra: tuple[str, ...] = ()):
        argv = [python, str(HERE / "vllm_driver.py"), "--model", model,
                "--verify", "on" if verify else "off",
                "--prefix-caching", "on" if prefix_caching else "off"]
        if master:
            argv += ["--master", master]
        if transports:
            argv += ["--transports", transports]
        if kv_events:
            argv += ["--kv-events", kv_events]
        argv += extra   # more vllm_driver.py flags (--key-scheme, --layerwise)
        self.log_path = log_path
        self._log = open(log_path, "a")   # noqa: SIM115  (closed by kill())
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, bufsize=1)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready = self._answer(ENGINE_START_TIMEOUT_S)

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self._lines.put(line.rstrip("\n"))
        self._lines.put(None)

    def _answer(self, timeout_s: float) -> dict:
        logs: list[str] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"engine silent for {timeout_s} s; log: {self.log_path}")
            if line is None:
                raise AssertionError(f"engine exited ({self.proc.wait()}); log tail:\n"
                                     + self.log_path.read_text()[-4000:])
            if line.startswith("DRIVER "):
                # The answer is the line's first JSON value; anything after it is a log line
                # that another thread of the engine wrote into the same line.
                answer, end = json.JSONDecoder().raw_decode(line, len("DRIVER "))
                if line[end:].strip():
                    logs.append(line[end:])
                answer["logs"] = logs
                return answer
            logs.append(line)

    def _ask(self, request: dict, timeout_s: float = 120) -> dict:
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self._answer(timeout_s)

    def generate(self, prompt: list[int], max_tokens: int = 8) -> dict:
        return self._ask({"prompt": prompt, "max_tokens": max_tokens})

    def keys(self, prompt: list[int]) -> list[str]:
        return self._ask({"keys": prompt})["keys"]

    def metrics(self, name: str, **labels: str) -> float:
        """The value of the connector's sample ``name`` with ``labels`` (0 if absent)."""
        return sum(v for n, ls, v in self._ask({"metrics": True})["metrics"]
                   if n == name and ls == labels)

    def close(self, timeout_s: float = 120) -> dict:
        """Shut the engine down (the connector flushes its saves); the driver's goodbye, with
        the log lines of the shutdown. Asserts a clean exit."""
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            bye = self._answer(timeout_s)
            assert self.proc.wait(timeout_s) == 0, f"engine exit code; log: {self.log_path}"
            return bye
        finally:
            self.kill()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


@pytest.fixture
def engine(vllm_python, tiny_model, tmp_path):
    """``engine(master=..., verify=..., ...)`` starts an engine process; all are killed after
    the test."""
    started: list[Engine] = []

    def start(python: str | None = None, **kw) -> Engine:
        e = Engine(python or vllm_python, tiny_model, tmp_path / f"engine{len(started)}.log",
                   **kw)
        started.append(e)
        return e

    yield start
    for e in started:
        e.kill()


@pytest.fixture
def kv_cluster(tmp_path):
    """``kv_cluster(nodes=1, master_args=..., segment_size=...)``: a real master and store
    nodes, stopped after the test, which fails if any of them logged a traceback."""
    made: list[LocalCluster] = []

    def start(nodes: int = 1, master_args=(), segment_size: str = "64MiB") -> LocalCluster:
        c = LocalCluster(nodes=nodes, segment_size=segment_size, master_args=list(master_args),
                         node_args=["--heartbeat-interval", "200ms"],
                         log_dir=tmp_path / f"cluster{len(made)}")
        made.append(c)
        c.start()
        return c

    yield start
    for c in made:
        c.stop()
    for log in tmp_path.glob("cluster*/*.log"):   # as tests/integration's run_cluster checks
        assert "Traceback" not in log.read_text(), f"traceback in {log.name}"


@pytest.fixture(scope="session")
def cold(vllm_python, tiny_model, tmp_path_factory):
    """``cold(prompt)``: the greedy answer for ``prompt`` from an engine without a connector
    and without vLLM's own prefix cache (every token computed); one engine per session,
    answers memoised. Its first request (a warm-up) is not timed with the others."""
    log = tmp_path_factory.mktemp("cold") / "engine.log"
    e = Engine(vllm_python, tiny_model, log, prefix_caching=False)
    e.generate([3 + i for i in range(96)])
    answers: dict[tuple[int, ...], dict] = {}

    def answer(prompt: list[int]) -> dict:
        key = tuple(prompt)
        if key not in answers:
            answers[key] = e.generate(prompt)
        return answers[key]

    yield answer
    e.close()
