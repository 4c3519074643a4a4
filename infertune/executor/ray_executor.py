"""Ray executor: the tensor-parallel ranks as Ray actors, on any nodes of a Ray cluster (distributed_executor_backend
"ray"; `pip install 'infertune[ray]'`).

It joins the cluster that ray.init() finds (RAY_ADDRESS, or the one `ray start` began on this machine) or starts a
local one, places one actor per rank in a placement group packed onto as few nodes as hold them, and forms the
torch.distributed group (gloo on CPU) at rank 0's node address. Each step's SchedulerOutput goes to every actor and
rank 0's SamplerOutput comes back, as with the multiprocess executor; an actor that dies is a WorkerError naming its
rank, and any failure stops the group. Ranks that share one node sum small activations through shared memory.
"""

from __future__ import annotations

import logging
import os
import socket

from infertune.config import EngineConfig
from infertune.executor.base import Executor
from infertune.executor.multiproc import WorkerError
from infertune.runner.model_runner import KVCacheInfo
from infertune.runner.sampler import SamplerOutput
from infertune.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

# While the engine is idle, how often every actor is asked whether it is alive (check_health: an actor that died
# between requests is found without waiting for the next step).
HEALTH_PING_S = 1.0


class _RankActor:
    """One rank: a ModelRunner in a Ray actor process."""

    def __init__(self, config: EngineConfig, show_progress: bool) -> None:
        self.config, self.show_progress, self.rank, self.runner = config, show_progress, 0, None

    def where(self) -> tuple[str, str]:
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    def free_port(self, host: str) -> int:
        from infertune.executor.worker import free_port

        return free_port(host)

    def start(self, rank: int, size: int, init_method: str, one_host: bool):
        import ray
        import torch

        from infertune.executor.worker import start_worker

        self.rank = rank
        cpus = int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)) or 1
        torch.set_num_threads(cpus)
        self.runner, describe = start_worker(
            self.config, self.show_progress, rank, size, init_method, one_host=one_host, bind=False
        )
        return self.runner.kv_info, f"{describe}, {cpus} thread{'s' * (cpus > 1)}"

    def execute_model(self, scheduler_output: SchedulerOutput):
        from infertune.executor.worker import run_step

        out = run_step(self.runner, scheduler_output)
        return out if self.rank == 0 else None  # the other ranks computed the same

    def comm_stats(self) -> dict:
        from infertune.executor.worker import take_comm_stats

        return take_comm_stats()


def _cause(e: BaseException) -> BaseException:
    """A Ray error -> what the driver raises: a user's ValueError / TypeError as itself, else a WorkerError."""
    import ray.exceptions as rex

    if isinstance(e, rex.RayTaskError):
        inner = getattr(e, "cause", None)
        if isinstance(inner, (ValueError, TypeError, MemoryError)) and type(inner).__module__ == "builtins":
            return inner
    return WorkerError(f"a Ray tensor-parallel worker failed: {e}")


def import_ray(what: str, otherwise: str):
    """The ray module, or a ValueError saying that `what` needs it (and `otherwise`: what to use instead)."""
    try:
        import ray
        import ray.util.placement_group  # noqa: F401
        import ray.util.scheduling_strategies  # noqa: F401
    except ImportError:
        raise ValueError(f"{what} needs Ray: pip install 'infertune[ray]' (or {otherwise})") from None
    return ray


def init_ray(ray) -> bool:
    """Join the cluster ray.init() finds (RAY_ADDRESS, or the one `ray start` began here) or start a local one;
    whether this call connected (then the caller's ray.shutdown() disconnects)."""
    if ray.is_initialized():
        return False
    address = os.environ.get("RAY_ADDRESS", "")
    host, sep, port = address.rpartition(":")
    if sep and host and port.isdigit() and "://" not in address and not _answers(address, timeout=5):
        # (Ray itself retries such an address for minutes)
        raise RuntimeError(
            f"RAY_ADDRESS={address}: no Ray cluster answers there; start one (`ray start --head`) or unset "
            "RAY_ADDRESS to start a local one"
        )
    kwargs = {}
    if not address:  # Ray joins the cluster its address file names (the last `ray start` here), even a dead one
        last = _last_cluster_address()
        if last is not None and not _answers(last):
            log.warning("the Ray cluster last started here (%s) is gone; starting a local one", last)
            kwargs["address"] = "local"
    try:
        ray.init(log_to_driver=True, include_dashboard=False, **kwargs)
    except ConnectionError as e:  # (RAY_ADDRESS=auto with no cluster running here)
        raise RuntimeError(
            f"Ray found no cluster to join ({str(e).splitlines()[0]}): start one (`ray start --head`), or unset "
            "RAY_ADDRESS to start a local one"
        ) from None
    return True


def _last_cluster_address() -> str | None:
    """The address in Ray's file of the cluster last started on this machine (<temp dir>/ray_current_cluster)."""
    path = os.path.join(os.environ.get("RAY_TMPDIR", "/tmp"), "ray", "ray_current_cluster")
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something listens at host:port (a Ray cluster's GCS address)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
        return True
    except (OSError, ValueError):
        return False


def rank_bundle(device: str, cpus: int) -> tuple[dict, dict]:
    """(the placement-group bundle of one rank, its actor's device options): CPUs, plus one GPU / NPU where the
    backend runs on one (Ray then makes that device the only one the actor sees). The CPU backend asks CPUs only."""
    from infertune.backends import get_backend

    resource = get_backend(device).ray_resource  # (as this, the driver's, node resolves "auto")
    if resource is None:
        return {"CPU": cpus}, {}
    return {"CPU": cpus, resource: 1}, ({"num_gpus": 1} if resource == "GPU" else {"resources": {resource: 1}})


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        ray = import_ray("distributed_executor_backend='ray'", "use 'mp' on one host")
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.size = size = config.parallel.tensor_parallel_size
        config.model.arch.for_tensor_parallel(
            size, config.parallel.enable_expert_parallel
        )  # a shape that does not split: its error before any actor
        self._ray = ray
        self._connected = init_ray(ray)
        total = ray.cluster_resources()
        cpus = int(total.get("CPU", 1))
        # a rank a whole share of the cluster's CPUs; more ranks than CPUs share them (as the mp executor's do)
        per_rank = max(1, cpus // size) if cpus >= size else round(cpus / size, 4)
        bundle, device = rank_bundle(config.device.device, per_rank)
        short = [f"{k} ({size} x {v} > {total.get(k, 0):g})" for k, v in bundle.items() if size * v > total.get(k, 0)]
        if short:
            self._close_ray()
            raise RuntimeError(
                f"Ray cannot place {size} ranks of {bundle}: the cluster has too little {', '.join(short)}; lower "
                "tensor_parallel_size or add nodes"
            )
        self._pg = placement_group([bundle] * size, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=120)
        except ray.exceptions.GetTimeoutError:
            free = dict(ray.available_resources())
            ray.util.remove_placement_group(self._pg)
            self._close_ray()
            raise RuntimeError(
                f"Ray could not place {size} ranks of {bundle} within 120 s: other work holds the cluster's "
                f"resources (free now: {free})"
            ) from None
        actor = ray.remote(_RankActor)
        self._actors = [
            actor.options(
                num_cpus=per_rank,
                **device,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=rank),
            ).remote(config, show_progress)
            for rank in range(size)
        ]
        self._failed: BaseException | None = None
        try:
            places = ray.get([a.where.remote() for a in self._actors])
            host = places[0][1]
            init = f"tcp://{host}:{ray.get(self._actors[0].free_port.remote(host))}"
            one_host = len({node for node, _ in places}) == 1
            answers = self._gather([a.start.remote(r, size, init, one_host) for r, a in enumerate(self._actors)])
        except BaseException:
            self.shutdown()
            raise
        self._kv_info, self._describe = answers[0]
        self._nodes = len({node for node, _ in places})
        self._pings: dict = {}  # ref of an actor's liveness ping -> its rank (check_health)
        self._next_ping = 0.0

    def check_health(self) -> None:
        """Never waits: collects the answers to the last pings that came back and sends new ones every
        HEALTH_PING_S (each queued behind nothing: the engine is idle)."""
        import time

        ray = self._ray
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an earlier failure: {self._failed}")
        if self._pings:
            ready, _ = ray.wait(list(self._pings), num_returns=len(self._pings), timeout=0)
            for ref in ready:
                rank = self._pings.pop(ref)
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as e:
                    self._fail(WorkerError(f"tensor-parallel rank {rank} (Ray actor) died: {e}"))
                except ray.exceptions.RayError as e:
                    self._fail(_cause(e))
        elif time.monotonic() >= self._next_ping:
            self._next_ping = time.monotonic() + HEALTH_PING_S
            self._pings = {a.where.remote(): rank for rank, a in enumerate(self._actors)}

    def _gather(self, refs: list) -> list:
        """Every rank's answer; the first failure (in completion order) stops the group and is raised."""
        ray = self._ray
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an earlier failure: {self._failed}")
        rank_of = {ref: r for r, ref in enumerate(refs)}
        answers: list = [None] * len(refs)
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of[ready[0]]
            try:
                answers[rank] = ray.get(ready[0])
            except ray.exceptions.RayActorError as e:
                self._fail(WorkerError(f"tensor-parallel rank {rank} (Ray actor) died: {e}"))
            except ray.exceptions.RayError as e:
                self._fail(_cause(e))
        return answers

    def _fail(self, error: BaseException):
        self._failed = error
        log.error("stopping the tensor-parallel group: %s", error)
        for a in self._actors:
            self._ray.kill(a, no_restart=True)
        raise error

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self._kv_info

    def describe(self) -> str:
        return f"{self._describe}, tensor parallel over {self.size} Ray actors on {self._nodes} node(s)"

    @property
    def runner(self):
        raise AttributeError(
            "the model runner lives in the Ray actors; the tools that read it (profile, eval, quantize, "
            "debug-layers, tune) need distributed_executor_backend='uni'"
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        return self._gather([a.execute_model.remote(scheduler_output) for a in self._actors])[0]

    def comm_stats(self) -> list[dict]:
        """Each rank's step time and collectives since the last call (CommStats.take), rank order."""
        return self._gather([a.comm_stats.remote() for a in self._actors])

    def _close_ray(self) -> None:
        """Disconnect where this executor connected (a refused start leaves no Ray client behind)."""
        if self._connected and self._ray.is_initialized():
            self._ray.shutdown()
            self._connected = False

    def shutdown(self) -> None:
        ray = self._ray
        for a in getattr(self, "_actors", []):
            ray.kill(a, no_restart=True)
        self._actors = []
        if getattr(self, "_pg", None) is not None:
            ray.util.remove_placement_group(self._pg)
            self._pg = None
        if self._connected and ray.is_initialized():
            ray.shutdown()  # (disconnects; stops the cluster only where this executor started it)
            self._connected = False
