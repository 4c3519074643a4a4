"""`serve --pd P:D`: prefill and decode instances and the router from one command, as child processes or Ray actors.

The oracle is one plain server on the same checkpoint, asked through the openai SDK: greedy outputs through the
launched router must be its outputs exactly; the decode instance's counters must show it loaded the prompts; after
SIGTERM no instance's pid may be left. `--pd auto` is checked against a brute-force split of the planner's rates.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from fractions import Fraction

import httpx
import openai
import psutil
import pytest
from server_utils import MAX_LEN, MODEL, ServerThread, free_port, metric, wait_healthy

from infertune.cli import main
from infertune.router import launch

FLAGS = ["--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--block-size", "4"]
FLAGS += ["--max-num-seqs", "16", "--kv-cache-memory-bytes", str(2**20)]
PROMPTS = ["The cat sat on", "def add(a, b):", "Once upon a time", "hello"]


def _completions(url: str) -> list[list[str]]:
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    out = []
    for p in PROMPTS:
        r = client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, logprobs=1)
        out.append(r.choices[0].logprobs.tokens)
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0
    )
    out.append([chat.choices[0].message.content])
    return out


class Launched:
    """`infertune serve ... --pd P:D` in its own process; its instances' URLs and pids read from its log line."""

    def __init__(self, model, *flags: str, startup: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile(mode="w+")
        cmd = [sys.executable, "-m", "infertune.cli", "serve", "--model", str(model), *FLAGS, *flags]
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT)
        try:
            wait_healthy(self.url, startup, self.proc)
        except RuntimeError:
            self.stop()
            raise RuntimeError(f"serve --pd did not start:\n{self.text()[-4000:]}") from None
        line = next(x for x in self.text().splitlines() if "instances up" in x)
        self.instances = {n: (u, int(p)) for n, u, p in re.findall(r"(\w+-\d+) (http://\S+) \(pid (\d+)\)", line)}
        self.line = line

    def text(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _check_pd(launched: Launched, expected) -> None:
    assert set(launched.instances) == {"prefill-0", "decode-0"}
    assert _completions(launched.url) == expected
    decode = launched.instances["decode-0"][0]
    # the decode instance computed one token of each prompt and loaded the rest from the prefill instance's KV
    assert metric(decode, "infertune_kv_transfer_tokens_loaded_total") > 0
    assert metric(decode, "infertune_prefill_tokens_computed_total") == len(PROMPTS) + 1
    assert metric(decode, "infertune_kv_transfer_load_failures_total") == 0
    assert metric(launched.instances["prefill-0"][0], "infertune_kv_transfer_granted_total") == len(PROMPTS) + 1


@pytest.fixture(scope="module")
def expected(tiny_llama):
    with ServerThread(tiny_llama, kv_cache_memory_bytes=2**20) as s:
        return _completions(s.url)


def test_serve_pd_one_to_one_gives_one_servers_tokens_and_stops_every_child(tiny_llama, expected):
    launched = Launched(tiny_llama, "--pd", "1:1")
    try:
        _check_pd(launched, expected)
        assert "1 thread each (child processes)" in launched.line or "OMP_NUM_THREADS" in os.environ
        pids = [pid for _, pid in launched.instances.values()]
        kv_dir = re.search(r"KV connector local under (\S+)", launched.text()).group(1)
        assert os.path.isdir(kv_dir)
    finally:
        code = launched.stop()
    assert code == 0, launched.text()[-3000:]
    assert all(_gone(pid) for pid in pids)  # no orphaned server
    assert not os.path.exists(kv_dir)  # its own KV directory is removed
    text = launched.text()
    assert "[prefill-0]" in text and "[decode-0]" in text  # each instance's output, named


def test_serve_data_parallel_runs_two_replicas_behind_the_router(tiny_llama, expected):
    """`serve --data-parallel-size 2`: two plain replicas and the router in one command; the outputs are one server's,
    every request reached a replica (their request counters add up), and every child is gone after SIGTERM."""
    launched = Launched(tiny_llama, "--data-parallel-size", "2")
    try:
        assert set(launched.instances) == {"replica-0", "replica-1"}
        assert _completions(launched.url) == expected
        served = [metric(url, "infertune_requests_total") for url, _ in launched.instances.values()]
        assert sum(served) == len(PROMPTS) + 1, served
        for url, _ in launched.instances.values():
            assert httpx.get(url + "/kv_transfer").json()["kv_role"] is None
        pids = [pid for _, pid in launched.instances.values()]
    finally:
        code = launched.stop()
    assert code == 0, launched.text()[-3000:]
    assert all(_gone(pid) for pid in pids)


def test_an_instance_that_dies_at_start_is_named_with_its_log_tail(capsys, caplog):
    with pytest.raises(RuntimeError, match=r"(prefill|decode)-0 \(http://127.0.0.1:\d+\) exited with code 2") as e:
        launch.serve_pd(["--no-such-flag"], (1, 1), "127.0.0.1", free_port())
    assert "unrecognized arguments: --no-such-flag" in str(e.value)  # the instance's own last lines
    # (no router yet: the start's error says it all; the instance's reader ended before it was raised)
    assert "the router routes around it" not in caplog.text
    pids = [int(p) for p in re.findall(r"pid (\d+)", capsys.readouterr().err)]
    assert all(_gone(pid) for pid in pids)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--pd", "1:1", "--data-parallel-size", "2"], "--pd and --data-parallel-size"),
        (["--pd", "2"], "give PREFILL:DECODE instance counts"),
        (["--pd", "one:two"], "give PREFILL:DECODE instance counts"),
        (["--pd", "0:2"], "at least 1 prefill and 1 decode"),
        (["--pd", "1:0"], "at least 1 prefill and 1 decode"),
        (["--pd", "auto:1"], "auto:N needs N >= 2"),
        (["--pd", "1:1", "--kv-role", "producer"], "--pd sets each instance's kv_role"),
        (["--placement", "ray"], "--placement places the instances of --pd or --data-parallel-size"),
    ],
)
def test_bad_pd_arguments_are_clear_errors(argv, message, capsys):
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--data-parallel-size", "0"], "--data-parallel-size 0: give 1 (one server) or more"),
        (["--data-parallel-size", "-2"], "--data-parallel-size -2: give 1 (one server) or more"),
        (["--pd-device", "910b"], "--pd-device is the device that --pd auto[:N] splits"),
        (["--pd", "1:1", "--pd-device", "910b"], "--pd-device is the device that --pd auto[:N] splits"),
        (["--data-parallel-size", "2", "--pd-device", "910b"], "without --pd auto it would be ignored"),
    ],
)
def test_scale_out_flags_that_nothing_would_read_are_errors_not_ignored(argv, message, capsys, monkeypatch):
    """These started a server (a plain one, or the replicas / P:D instances) with the value silently ignored."""
    import infertune.serve.launcher

    def started(*args, **kwargs):
        raise AssertionError(f"a server was started for serve {argv}")

    for module, name in ((infertune.serve.launcher, "serve"), (launch, "serve_pd"), (launch, "serve_data_parallel")):
        monkeypatch.setattr(module, name, started)
    assert main(["serve", *argv]) == 2
    assert message in capsys.readouterr().err


def test_kv_role_or_another_connector_given_by_hand_is_refused_by_the_launcher_too():
    with pytest.raises(ValueError, match="drop --kv-role"):
        launch.serve_pd(["--kv-role=consumer"], (1, 1), "127.0.0.1", 0)
    with pytest.raises(ValueError, match="the local KV connector, not --kv-connector p2p"):
        launch.serve_pd(["--kv-connector", "p2p"], (1, 1), "127.0.0.1", 0)


def test_replica_argv_drops_the_launchers_own_flags():
    argv = ["--model", "m", "--pd", "1:2", "--placement=ray", "--pd-device", "910b", "--dtype", "float32"]
    assert launch.replica_argv(argv) == ["--model", "m", "--dtype", "float32"]


def test_pd_auto_splits_by_the_planners_rates_and_plan_prints_that_command(tiny_llama, monkeypatch, capsys, caplog):
    from infertune.plan.pd import choose_pd, workload

    choice = choose_pd(str(tiny_llama), 8, "910b", MAX_LEN, 16)
    pd = choice.pd_split
    rp, rd = Fraction(pd["prefill_requests_per_s_per_instance"]), Fraction(pd["decode_requests_per_s_per_instance"])
    served = {n: min(n * rp, (8 - n) * rd) for n in range(1, 8)}
    best = max(served.values())
    n = min(k for k, v in served.items() if v == best)  # (ties: more decode instances)
    assert choice.split == (n, 8 - n) and pd["decode_batch"] == 16
    assert f"P/D {n}:{8 - n} of 8 instances" in choice.reason and "910b" in choice.reason
    assert workload(MAX_LEN) == (48, 16) and "48-token prompts, 16-token outputs" in choice.reason

    # serve --pd auto:8 launches that split (the launch itself is the test above)
    launched = {}

    def serve_pd(argv, split, *args):
        launched["split"] = split
        return 0

    monkeypatch.setattr(launch, "serve_pd", serve_pd)
    caplog.set_level("INFO", "infertune.plan")
    argv = ["serve", "--model", str(tiny_llama), "--pd", "auto:8", "--pd-device", "910b", *FLAGS]
    assert main(argv) == 0 and launched["split"] == choice.split
    assert any("--pd auto: P/D" in r.message for r in caplog.records)  # one line: what and why
    assert main(["serve", "--model", str(tiny_llama), "--pd", "auto", *FLAGS]) == 0 and launched["split"] == (1, 1)

    # plan --pd prints the serve command for the same split
    inp, out = workload(MAX_LEN)
    plan = ["plan", "--model", str(tiny_llama), "--device", "910b", "--cards", "8", "--batch", "16", "--pd"]
    assert main([*plan, "--input-len", str(inp), "--output-len", str(out)]) == 0
    assert f"infertune serve --model {tiny_llama} --pd {n}:{8 - n}" in capsys.readouterr().out


def test_placement_ray_without_ray_is_a_clear_error(monkeypatch):
    from infertune.router.ray_instances import RayPlacement

    monkeypatch.setitem(sys.modules, "ray", None)  # (what `import ray` finds where Ray is not installed)
    with pytest.raises(ValueError, match=r"--placement ray needs Ray: pip install 'infertune\[ray\]'"):
        RayPlacement(2)


@pytest.mark.skipif(
    importlib.util.find_spec("ray") is None, reason="Ray is not installed (pip install 'infertune[ray]')"
)
def test_placement_ray_runs_one_to_one_on_one_node(tiny_llama, expected, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the launcher starts a local cluster and stops it at the end
    launched = Launched(tiny_llama, "--pd", "1:1", "--placement", "ray")
    try:
        assert "Ray actors on one node" in launched.line
        _check_pd(launched, expected)
        pids = [pid for _, pid in launched.instances.values()]
        # an instance's server killed from outside while the router serves: the launcher names it (its server runs
        # in a Ray actor's process, out of the launcher's sight: it had said nothing)
        url, pid = launched.instances["decode-0"]
        os.kill(pid, signal.SIGKILL)
        said = f"decode-0 ({url}, pid {pid}) exited with code -9"
        deadline = time.time() + 20
        while said not in launched.text() and time.time() < deadline:
            time.sleep(0.2)
        assert said in launched.text(), launched.text()[-3000:]
    finally:
        code = launched.stop()
    assert code == 0, launched.text()[-3000:]
    assert "prefill-0 (" not in launched.text().split("instances up")[1]  # (stopped on purpose: no news)
    deadline = time.time() + 30
    while time.time() < deadline and not all(_gone(pid) for pid in pids):
        time.sleep(0.2)
    assert all(_gone(pid) for pid in pids)


def test_a_ray_instance_that_dies_while_serving_is_logged_once_by_name(caplog):
    """RayInstance's watcher (the launcher's handle on a Ray actor's server): an exit while serving is logged as a
    child process's is, once; one stopped on purpose (terminate / kill) is no news. Ray stood in for by a fake that
    answers poll as the actor would."""
    import logging

    from infertune.router.ray_instances import RayInstance

    class Ref:
        def __init__(self, value):
            self.value = value

    class FakeRay:
        class exceptions:
            class GetTimeoutError(Exception):
                pass

            class RayActorError(Exception):
                pass

        @staticmethod
        def get(ref, timeout=None):
            return ref.value

        @staticmethod
        def kill(actor, no_restart=True):
            actor.code = -9

    class Method:
        def __init__(self, fn):
            self.remote = lambda *a: Ref(fn(*a))

    class Actor:
        def __init__(self):
            self.code = None
            self.poll = Method(lambda: self.code)
            self.stop = Method(lambda grace: 0)

    caplog.set_level(logging.ERROR, logger="infertune.router")
    monkey = pytest.MonkeyPatch()
    monkey.setattr(RayInstance, "WATCH_S", 0.02)
    try:
        dying, stopped, killed = (
            RayInstance(FakeRay, Actor(), f"replica-{i}", f"http://h:{i}", 100 + i) for i in range(3)
        )
        for inst in (dying, stopped, killed):
            inst.serving = True
        stopped.terminate()
        killed.kill()
        dying._actor.code = -11  # (its server crashed inside the actor)
        deadline = time.time() + 5
        while "replica-0" not in caplog.text and time.time() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)
    finally:
        monkey.undo()
    assert caplog.text.count("replica-0 (http://h:0, pid 100) exited with code -11") == 1, caplog.text
    assert "replica-1" not in caplog.text and "replica-2" not in caplog.text


def test_free_ports_are_never_handed_out_twice(monkeypatch):
    """The launcher asks for several ports before any is bound (each instance's HTTP port, a P2P store's); the system
    may offer the same free port twice in that window, and free_port must then ask again rather than hand it out a
    second time (seen in CI: a producer's KV store took the port its own uvicorn was then refused)."""
    import socket

    from infertune.router import instances

    offered = iter([47001, 47001, 47001, 47002])

    class FakeSocket:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def bind(self, addr):
            self.port = next(offered)

        def getsockname(self):
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(instances, "_HANDED_OUT", set())
    monkeypatch.setattr(socket, "socket", lambda *a, **k: FakeSocket())
    assert [instances.free_port(), instances.free_port()] == [47001, 47002]


def test_a_port_in_use_is_said_before_anything_loads(tmp_path, monkeypatch):
    """serve and the launcher of --pd / --data-parallel-size bind their port first (vLLM's order): one in use is a
    clear error before the model loads (the model path here does not exist, so loading first would fail on it) or
    before any instance starts; a free one is then held while they load."""
    import socket

    from infertune.serve.launcher import serve

    started = []
    monkeypatch.setattr(launch, "_start", lambda *a: started.append(a))
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            serve(str(tmp_path / "no-model-here"), port=port)
        spec = launch.InstanceSpec("replica-0", ("--model", str(tmp_path / "no-model-here")))
        with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{port}"):
            launch.run_behind_router([spec], "local", "127.0.0.1", port, replicas=["replica-0"])
    assert started == []
    with pytest.raises(ValueError, match="--host 'no such host': not an address"):
        serve(str(tmp_path / "no-model-here"), host="no such host", port=0)


def test_an_instance_killed_after_start_is_logged_by_name(tiny_llama, caplog):
    """A replica or P/D instance that dies while the router serves: the launcher's log names it with its exit code
    (it said nothing; the router's health checks only routed around it). One stopped on purpose is no news."""
    import logging
    import time

    from infertune.router.instances import ServeProcess, stop

    caplog.set_level(logging.ERROR, logger="infertune.router")
    killed = ServeProcess("replica-0", ["--model", str(tiny_llama), *FLAGS], threads=1)
    stopped = ServeProcess("replica-1", ["--model", str(tiny_llama), *FLAGS], threads=1)
    try:
        for inst in (killed, stopped):
            wait_healthy(inst.url, 120, inst.proc)
            inst.serving = True  # (as the launcher marks them once the router runs)
        killed.proc.kill()  # (from outside: the OOM killer, a user)
        stop([stopped])
        deadline = time.monotonic() + 10
        while "replica-0" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.1)
        assert f"replica-0 ({killed.url}, pid {killed.pid}) exited with code -9" in caplog.text
        assert "replica-1" not in caplog.text
    finally:
        stop([killed, stopped])
