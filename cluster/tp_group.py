"""A tensor-parallel worker group on Ray.

    process that owns the engine (rank 0)          Ray actors, one per rank >= 1
    scheduler, block manager, its shard  --broadcast step tensors-->  kvstrata-worker-<id>-rank-<r>
                  <---------------- all-reduce per layer (gloo on CPU, NCCL on GPU) ---------------->

All ranks share one placement group (STRICT_PACK, one bundle per rank: a GPU each, or a CPU each
without GPUs); bundle 0 is rank 0's, held for the owning process. The ranks join one
torch.distributed group. Each follower runs a loop that receives a step and runs its forward pass
until rank 0 sends STOP. A follower that dies ends its loop's Ray task with an error, which rank 0
checks before every step and after a failed collective, so the engine fails with an error naming the
rank within seconds instead of hanging. `close()` stops the loops and frees the actors and the
placement group; a new `WorkerGroup` restarts the group.
"""

from __future__ import annotations

import logging
import os
import socket
import uuid
from dataclasses import dataclass
from typing import Any

import torch

from kvstrata.cluster.engine_service import first_line
from kvstrata.worker.tensor_parallel import STOP, SYNC, TPComm, plan_shard, rank_directory, shard_layout_tag

log = logging.getLogger(__name__)

ACTOR_NAME = "kvstrata-worker-{worker}-rank-{rank}"
DEFAULT_TIMEOUT_S = 60.0  # joining the process group, and any one collective, at most


class WorkerGroupError(RuntimeError):
    """A rank of the group died or a collective failed; the group must be restarted."""


class RankWorker:
    """Rank r >= 1 of a group: its shard of the model and of the KV cache, driven by rank 0's steps."""

    def __init__(self, rank: int, size: int):
        self.rank = rank
        self.size = size
        self.runner = None
        self.comm: TPComm | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def pid(self) -> int:
        return os.getpid()

    def setup(self, backend: str, init_method: str, timeout_s: float, model: str, dtype: str, device: str,
              num_blocks: int, block_size: int, num_threads: int, num_host_blocks: int = 0,
              kv_dtype: str = "auto", nvme: dict[str, Any] | None = None) -> dict[str, Any]:
        from kvstrata.worker.loader import load_model
        from kvstrata.worker.model_runner import ModelRunner

        torch.set_num_threads(num_threads)
        TPComm.init(backend, init_method, self.rank, self.size, timeout_s)
        self.comm = TPComm(self.rank, self.size, torch.device(device))
        from kvstrata.worker.loader import load_config

        shard = plan_shard(load_config(model), self.size, self.rank)
        loaded = load_model(model, dtype=dtype, device=device, shard=shard, all_reduce=self.comm.all_reduce)
        self.runner = ModelRunner(loaded.model, num_blocks, block_size, kv_dtype)
        self.runner.comm = self.comm  # for the NVMe loads' read statuses (ModelRunner._agree_on_loads)
        kv = self.runner.kv_cache
        if num_host_blocks:  # rank 0's tiers decide; this rank keeps its share of the same blocks
            from kvstrata.tiering.rank_mirror import RankTiers

            tier = None
            if nvme is not None:
                from kvstrata.tiering.block_copy import block_shape
                from kvstrata.tiering.nvme import NvmeTier

                tier = NvmeTier(rank_directory(nvme["directory"], self.rank), nvme["capacity_bytes"],
                                block_shape(kv), kv.dtype, layout_tag=shard_layout_tag(nvme["layout_tag"], shard))
            self.runner.rank_tiers = RankTiers(kv, num_host_blocks, tier, self.runner.cpu_kernels)
        return {"rank": self.rank, "pid": os.getpid(), "kv_heads": list(shard.kv_heads),
                "kv_cache_bytes": kv.numel() * kv.element_size()}

    def run(self) -> int:
        """Follow rank 0's steps until STOP; returns how many steps ran."""
        import torch.distributed as dist

        steps = 0
        try:
            while True:
                kind, fields = self.comm.receive()
                if kind == STOP:
                    break
                if kind == SYNC:
                    self.runner.follow_sync(fields)
                    continue
                self.runner.follow(fields)
                steps += 1
        finally:
            if self.runner.rank_tiers is not None:
                self.runner.rank_tiers.close()
        dist.destroy_process_group()
        return steps


@dataclass(frozen=True)
class GroupSpec:
    model: str
    tp: int
    dtype: str  # a torch dtype name, e.g. "float32"
    device_type: str  # "cpu" or "cuda"
    num_blocks: int
    block_size: int
    worker_id: str = ""
    timeout_s: float = DEFAULT_TIMEOUT_S
    num_host_blocks: int = 0  # each rank's DRAM tier, in blocks (its share of each)
    kv_dtype: str = "auto"
    # each rank's NVMe tier: {"directory", "capacity_bytes", "layout_tag"} (rank_directory and
    # shard_layout_tag make them the rank's own); None without one
    nvme: dict[str, Any] | None = None


def rank_bundles(tp: int, gpu: bool) -> list[dict[str, float]]:
    """One bundle per rank, rank r in bundle r: a CPU, and a GPU on GPU nodes."""
    return [{"CPU": 1, "GPU": 1} if gpu else {"CPU": 1} for _ in range(tp)]


class WorkerGroup:
    """Ranks 1..tp-1 as Ray actors and the process group joining them to this process (rank 0).

    Construct, then load rank 0's own shard with `comm.all_reduce`, then `wait_ready()`."""

    def __init__(self, spec: GroupSpec):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            from kvstrata.cluster.cluster_actors import NAMESPACE

            ray.init(include_dashboard=False, namespace=NAMESPACE)
        self.spec = spec
        self.worker_id = spec.worker_id or uuid.uuid4().hex[:8]
        self.failed: WorkerGroupError | None = None
        self._closed = False
        gpu = spec.device_type == "cuda"
        # A cluster worker actor (rank 0) already runs in bundle 0 of its group's placement group
        # (cluster_service.worker_placement), so the ranks join it there, on the same node. A bare
        # process makes its own, and bundle 0 keeps rank 0's device reserved in Ray's accounting.
        current = ray.util.get_current_placement_group()
        self._own_placement_group = current is None or len(current.bundle_specs) != spec.tp
        if not self._own_placement_group:
            self.placement_group = current
        else:
            self.placement_group = placement_group(rank_bundles(spec.tp, gpu), strategy="STRICT_PACK")
            try:
                ray.get(self.placement_group.ready(), timeout=spec.timeout_s)
            except ray.exceptions.GetTimeoutError:
                ray.util.remove_placement_group(self.placement_group)
                need = f"{spec.tp} {'GPUs' if gpu else 'CPUs'} on one node"
                raise WorkerGroupError(f"tensor_parallel_size {spec.tp}: Ray could not place the group "
                                       f"({need}) within {spec.timeout_s:.0f} s") from None
        actor_cls = ray.remote(RankWorker)
        self.actors = []
        self.names = []
        for rank in range(1, spec.tp):
            name = ACTOR_NAME.format(worker=self.worker_id, rank=rank)
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.placement_group,
                                                        placement_group_bundle_index=rank)
            self.actors.append(actor_cls.options(name=name, num_cpus=1, num_gpus=1 if gpu else 0,
                                                 max_concurrency=2, scheduling_strategy=strategy)
                               .remote(rank, spec.tp))
            self.names.append(name)
        self.backend = "nccl" if gpu else "gloo"
        self.init_method = f"tcp://{self._address()}"
        num_threads = max(1, (os.cpu_count() or 1) // spec.tp)
        self._setups = [a.setup.remote(self.backend, self.init_method, spec.timeout_s, spec.model, spec.dtype,
                                       spec.device_type, spec.num_blocks, spec.block_size, num_threads,
                                       spec.num_host_blocks, spec.kv_dtype, spec.nvme)
                        for a in self.actors]
        try:
            TPComm.init(self.backend, self.init_method, 0, spec.tp, spec.timeout_s)
        except Exception as e:
            self._teardown()
            raise self.failure(e) from e
        self.comm = TPComm(0, spec.tp, torch.device(spec.device_type))
        self.loops: list = []
        self.ranks: list[dict[str, Any]] = []

    def _address(self) -> str:
        """host:port for the process group: this node's address and a port free right now."""
        import ray

        host = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((host, 0))
            return f"{host}:{s.getsockname()[1]}"

    def wait_ready(self) -> None:
        """Wait for every follower to load its shard, then start their step loops."""
        import ray

        try:
            self.ranks = ray.get(self._setups, timeout=max(self.spec.timeout_s, 600))
        except Exception as e:
            self._teardown()
            raise self.failure(e) from e
        self.loops = [a.run.remote() for a in self.actors]

    # -- health -----------------------------------------------------------------------------------
    def check(self) -> None:
        """Raise if a rank is gone (its step loop ended): called by rank 0 before every step."""
        import ray

        if self.failed is not None:
            raise self.failed
        if self.loops:
            ended, _ = ray.wait(self.loops, num_returns=len(self.loops), timeout=0)
            if ended:
                raise self._fail(self._loop_error(ended[0]))

    def failure(self, cause: BaseException) -> WorkerGroupError:
        """The error to raise for a failed collective: which rank died, if one did within seconds."""
        import ray

        if self.failed is not None:
            return self.failed
        ended = []
        if self.loops:
            ended, _ = ray.wait(self.loops, num_returns=1, timeout=5)
        if ended:
            return self._fail(self._loop_error(ended[0]))
        dead = self._dead_actor()
        if dead is not None:
            return self._fail(f"tensor-parallel rank {dead + 1} ({self.names[dead]}) died")
        return self._fail(f"tensor-parallel group failed: {cause}")

    def _loop_error(self, ref) -> str:
        import ray

        rank = self.loops.index(ref) + 1
        try:
            ray.get(ref)
            return f"tensor-parallel rank {rank} ({self.names[rank - 1]}) stopped unexpectedly"
        except Exception as e:  # RayActorError when the process died; the rank's own traceback in full
            log.error("tensor-parallel rank %d (%s) failed: %s", rank, self.names[rank - 1], e)
            return f"tensor-parallel rank {rank} ({self.names[rank - 1]}) died: {type(e).__name__}: {first_line(e)}"

    def _dead_actor(self) -> int | None:
        import ray

        for i, actor in enumerate(self.actors):
            try:
                ray.get(actor.pid.remote(), timeout=2)
            except Exception:  # noqa: BLE001 - dead or unresponsive: either way this rank is gone
                return i
        return None

    def _fail(self, message: str) -> WorkerGroupError:
        self.failed = WorkerGroupError(message + "; restart the worker group")
        log.error("%s", message)
        return self.failed

    # -- shutdown ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the followers' loops (when the group is healthy), then free every resource."""
        import ray

        if self._closed:
            return
        if self.failed is None and self.loops:
            try:
                self.comm.send(STOP, [])
                ray.get(self.loops, timeout=10)
            except Exception:  # noqa: BLE001 - tearing down anyway
                pass
        self._teardown()

    def _teardown(self) -> None:
        import ray
        import torch.distributed as dist

        self._closed = True
        if dist.is_initialized():
            dist.destroy_process_group()
        for actor in self.actors:
            ray.kill(actor)
        if self._own_placement_group:
            ray.util.remove_placement_group(self.placement_group)

    def stats(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "backend": self.backend, "ranks": self.ranks,
                "failed": str(self.failed) if self.failed else None}

