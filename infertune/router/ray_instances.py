"""`serve --pd P:D --placement ray` (and --data-parallel-size): each instance a Ray actor, all on one node.

The cluster is the one ray.init() finds (RAY_ADDRESS, or the one `ray start` began on this machine), or a local one
started here (executor/ray_executor.py's helpers, as for tensor parallel). One placement group with a bundle of CPUs
per instance, STRICT_PACK: every instance on one node, because the local KV connector is a shared-memory file and a
consumer tells a live producer by its pid. Each actor runs its instance's `infertune serve` as its child process
(a server needs its process's main thread for its signals and its own OMP threads), bound to the node's address,
and answers for it: its URL and pid, whether it still runs, its last lines, stop. Killing an actor kills its
server too (the child dies with its parent).
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time

log = logging.getLogger("infertune.router")


class _ServeActor:
    """One instance on a Ray node: `infertune serve` as this actor's child process."""

    def __init__(self) -> None:
        self.instance = None

    def start(self, name: str, argv: list[str], threads: int) -> tuple[str, int]:
        import ray

        from infertune.router.instances import ServeProcess

        self.instance = ServeProcess(name, argv, threads, host=ray.util.get_node_ip_address())
        return self.instance.url, self.instance.pid

    def poll(self) -> int | None:
        return self.instance.poll()

    def tail(self) -> str:
        return self.instance.tail()

    def stop(self, grace: float) -> int:
        from infertune.router.instances import stop

        stop([self.instance], grace)
        return self.instance.returncode


class RayInstance:
    """The launcher's handle on one actor's instance; poll / terminate / kill / wait as a Popen (for launch.stop)."""

    WATCH_S = 1.0  # how often a serving instance is asked whether it still runs

    def __init__(self, ray, actor, name: str, url: str, pid: int) -> None:
        self._ray, self._actor, self.name, self.url, self.pid = ray, actor, name, url, pid
        self.returncode: int | None = None
        self._stopping = None
        self._killed = False
        self._serving = False

    @property
    def serving(self) -> bool:
        return self._serving

    @serving.setter
    def serving(self, on: bool) -> None:
        """Set once the router serves in front of it (launch.run_behind_router): from then on its exit is news, logged
        by a watcher thread as a ServeProcess logs it (its server runs in the actor's process, out of sight)."""
        started, self._serving = self._serving, on
        if on and not started:
            threading.Thread(target=self._watch, name=f"watch-{self.name}", daemon=True).start()

    def _watch(self) -> None:
        from infertune.router.instances import log_exit

        while self._serving and self._stopping is None and not self._killed:
            try:
                code = self.poll()
            except subprocess.TimeoutExpired:  # (a busy actor: asked again)
                code = None
            if code is not None:
                if code != 0 and self._stopping is None and not self._killed:  # (stopped on purpose: no news)
                    log_exit(self, code)
                return
            time.sleep(self.WATCH_S)

    def _get(self, ref, timeout: float):
        try:
            return self._ray.get(ref, timeout=timeout)
        except self._ray.exceptions.GetTimeoutError:
            raise subprocess.TimeoutExpired(f"Ray actor {self.name}", timeout) from None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = self._get(self._actor.poll.remote(), 30)
            except self._ray.exceptions.RayActorError:
                self.returncode = -9  # the actor (and with it its server) is gone
        return self.returncode

    def tail(self) -> str:
        try:
            return self._get(self._actor.tail.remote(), 30)
        except (self._ray.exceptions.RayError, subprocess.TimeoutExpired) as e:
            return f"(its Ray actor does not answer: {e})"

    def terminate(self) -> None:
        self._stopping = self._actor.stop.remote(10.0)

    def wait(self, timeout: float | None = None) -> int | None:
        if self._stopping is not None and self.returncode is None:
            try:
                self.returncode = self._get(self._stopping, timeout or 60)
            except self._ray.exceptions.RayActorError:
                self.returncode = -9
        return self.returncode

    def kill(self) -> None:
        self._killed = True
        self._ray.kill(self._actor, no_restart=True)
        self.returncode = -9


class RayPlacement:
    """A STRICT_PACK placement group of `n` instances' CPUs on one node of the Ray cluster, and their actors."""

    def __init__(self, n: int) -> None:
        from infertune.executor.ray_executor import import_ray, init_ray

        ray = self._ray = import_ray("--placement ray", "use --placement local, the default")
        from ray.util.placement_group import placement_group

        self._connected = init_ray(ray)
        self.n, self.actors, self._pg = n, [], None
        nodes = [node for node in ray.nodes() if node.get("Alive")]
        node_cpus = max((int(node.get("Resources", {}).get("CPU", 0)) for node in nodes), default=0)
        self.threads = max(1, node_cpus // n)
        self._pg = placement_group([{"CPU": self.threads}] * n, strategy="STRICT_PACK")
        try:
            ray.get(self._pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            self.close()
            raise RuntimeError(
                f"Ray could not place {n} instances of {self.threads} CPU(s) on one node within 120 s (the largest "
                f"node has {node_cpus} CPUs; the local KV connector needs every instance on one host)"
            ) from None

    def start(self, specs) -> list[RayInstance]:
        ray = self._ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = ray.remote(_ServeActor)
        for i, _ in enumerate(specs):
            strategy = PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i)
            self.actors.append(actor.options(num_cpus=self.threads, scheduling_strategy=strategy).remote())
        started = ray.get([a.start.remote(s.name, list(s.argv), self.threads) for a, s in zip(self.actors, specs)])
        return [RayInstance(ray, a, s.name, url, pid) for a, s, (url, pid) in zip(self.actors, specs, started)]

    def close(self) -> None:
        ray = self._ray
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self._pg is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None
        if self._connected and ray.is_initialized():
            ray.shutdown()
            self._connected = False
