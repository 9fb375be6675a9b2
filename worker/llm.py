"""`LLM`: the in-process engine, for scripts, tests and benchmarks. Needs neither Ray nor a server,
except with tensor_parallel_size > 1, whose other ranks are Ray actors (`kvstrata.cluster.tp_group`)."""

from __future__ import annotations

import itertools
import os
from typing import Any, Sequence

import torch

from kvstrata.worker.engine import LLMEngine
from kvstrata.worker.kv_cache_manager import KVCacheManager
from kvstrata.worker.kv_dtypes import KV_DTYPE_NAMES
from kvstrata.worker.loader import load_model
from kvstrata.worker.model_runner import ModelRunner
from kvstrata.worker.outputs import RequestOutput
from kvstrata.worker.sampling_params import SamplingParams
from kvstrata.worker.scheduler import SchedulerConfig
from kvstrata.worker.tensor_parallel import rank_directory, shard_layout_tag
from kvstrata.worker.token_eviction import KEEP_ALL, EvictionPolicy, resolve_eviction

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB of host memory for KV when no block count is given
DEFAULT_GPU_KV_FRACTION = 0.85  # of the device memory still free after loading the weights


class LLM:
    def __init__(self, model: str = "smollm2-135m", block_size: int = 16, num_gpu_blocks: int | None = None,
                 max_model_len: int | None = None, dtype: str | None = None, device: str | None = None,
                 seed: int = 0, enable_prefix_caching: bool = True, max_num_batched_tokens: int | None = None,
                 max_num_seqs: int = 128, kv_cache_bytes: int | None = None, cpu_kv_bytes: int | None = None,
                 nvme_kv_dir: str | None = None, nvme_kv_bytes: int | None = None,
                 pin_quota_bytes: int | None = None, nvme_admission: str = "reuse",
                 tensor_parallel_size: int = 1, worker_id: str = "", kv_dtype: str = "auto",
                 kv_eviction: EvictionPolicy | str | None = None, scheduling: str = "fcfs",
                 offline_step_rows: int | None = None, speculative_tokens: int = 0,
                 speculative_step_tokens: int | None = None):
        """cpu_kv_bytes adds a DRAM tier under the device pool, and nvme_kv_dir (with nvme_kv_bytes)
        an NVMe tier under that: blocks the pool evicts are kept there and promoted back on a hit.
        pin_quota_bytes caps one tenant's prompt-cache pins (default: all pins' limit, half the lowest tier).
        nvme_admission: "reuse" (a full NVMe tier takes only blocks asked for twice, and pins) or "all".
        tensor_parallel_size > 1 runs the model on that many ranks: this process is rank 0 (the
        scheduler and its shard), the others are Ray actors (a local Ray starts if none is running).
        KV block counts are then per rank, each rank holding its share of the KV heads; the rank
        actors are named kvstrata-worker-<worker_id>-rank-<r> (worker_id: random when empty).
        kv_dtype stores the KV cache in another format: "fp16", "bf16", "fp8_e4m3", "fp8_e5m2",
        "int8" or "int4" (lossy; scales are kept in each block), or "auto", the model's dtype.
        kv_eviction: a token eviction policy (lossy) for every request that names none in its
        SamplingParams, e.g. "streaming(sinks=4, window=252)" (see worker/token_eviction.py).
        max_num_batched_tokens: a step's token budget, which is also the largest prefill chunk;
        by default 512 on CPU, where a step of 512 tokens is already compute-bound, and 2048 on GPU.
        scheduling: "fcfs" (first come, first served within a priority) or "offline", for batch jobs
        judged by their total time: the longest max_tokens is admitted first, and prompt tokens ride
        in decode steps, spread evenly over the decode steps the job must run anyway, with at least
        offline_step_rows rows a step (default 12 on CPU, where a step of that many rows still costs
        about what its weight reads cost, and 128 on GPU); see worker/scheduler.py.
        speculative_tokens > 0 turns on speculative decoding by n-gram lookup (greedy or sampled): up
        to that many tokens a step are drafted from the request's own prompt and output and checked
        by the model in the same step, while a step holds at most speculative_step_tokens tokens
        (default 8 on CPU, where such a step costs little more than one of a single row, and 256
        on GPU); see worker/speculative.py."""
        _check_positive("block_size", block_size)
        if num_gpu_blocks is not None:
            _check_positive("num_gpu_blocks", num_gpu_blocks)
        if max_model_len is not None:
            _check_positive("max_model_len", max_model_len)
        if max_num_batched_tokens is not None:
            _check_positive("max_num_batched_tokens", max_num_batched_tokens)
        _check_positive("max_num_seqs", max_num_seqs)
        if offline_step_rows is not None:
            _check_positive("offline_step_rows", offline_step_rows)
        # ValueError naming the field, before the model loads
        SchedulerConfig(policy=scheduling, speculative_tokens=speculative_tokens,
                        speculative_step_tokens=1 if speculative_step_tokens is None else speculative_step_tokens)
        _check_tier_args(cpu_kv_bytes, nvme_kv_dir, nvme_kv_bytes)
        kv_eviction = resolve_eviction(kv_eviction, "kv_eviction")
        if kv_eviction is KEEP_ALL:
            kv_eviction = None
        if kv_eviction is not None and tensor_parallel_size != 1:
            raise ValueError("kv_eviction: token eviction does not work with tensor_parallel_size > 1 yet")
        if kv_dtype not in KV_DTYPE_NAMES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_NAMES)}; got {kv_dtype!r}")
        from kvstrata.tiering.admission import AdmissionPolicy

        admission = AdmissionPolicy(nvme_admission)  # ValueError naming nvme_admission
        if pin_quota_bytes is not None:
            _check_positive("pin_quota_bytes", pin_quota_bytes)
            if cpu_kv_bytes is None:
                raise ValueError("pin_quota_bytes needs cpu_kv_bytes: pins live in the KV tiers")
        shard = None
        if tensor_parallel_size != 1:
            shard = _check_tp(model, tensor_parallel_size)
        loaded = load_model(model, dtype=dtype, device=device, shard=shard)
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_id = loaded.source.model_id
        limit = self.config.max_position_embeddings
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len ({max_model_len}) exceeds the model's maximum ({limit})")
        self.kv_dtype = kv_dtype  # hashed into every block's identity, as given: routers hash it the same way
        block_bytes = ModelRunner.kv_bytes_per_block(loaded.model, block_size, kv_dtype)
        if num_gpu_blocks is None:
            num_gpu_blocks = max(1, _kv_budget(loaded.model.device, kv_cache_bytes) // block_bytes)
        runner = ModelRunner(loaded.model, num_gpu_blocks, block_size, kv_dtype)
        layout_tag = f"{self.model_id}/{loaded.model.dtype}/{kv_dtype}/bs{block_size}"
        self.group = None
        if shard is not None:
            num_host_blocks = cpu_kv_bytes // block_bytes if cpu_kv_bytes is not None else 0
            nvme = None
            if nvme_kv_dir is not None:  # every rank keeps its share of each block in a directory of its own
                nvme = {"directory": str(nvme_kv_dir), "capacity_bytes": nvme_kv_bytes, "layout_tag": layout_tag}
                nvme_kv_dir, layout_tag = rank_directory(str(nvme_kv_dir), 0), shard_layout_tag(layout_tag, shard)
            self._tp = (model, tensor_parallel_size, num_gpu_blocks, block_size, worker_id, num_host_blocks, kv_dtype,
                        nvme)
            self.group = _start_group(runner, *self._tp)
        kv = KVCacheManager(num_gpu_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = 512 if loaded.model.device.type == "cpu" else 2048
        sched = SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len or limit,
            policy=scheduling,
            offline_step_rows=offline_step_rows or (12 if loaded.model.device.type == "cpu" else 128),
            speculative_tokens=speculative_tokens,
            speculative_step_tokens=(speculative_step_tokens if speculative_step_tokens is not None
                                     else 8 if loaded.model.device.type == "cpu" else 256),
        )
        if cpu_kv_bytes is not None:
            tiers = _build_tiers(runner, block_bytes, cpu_kv_bytes, nvme_kv_dir, nvme_kv_bytes, layout_tag, admission)
            if pin_quota_bytes is not None:
                tiers.pins.quota_blocks = min(max(1, pin_quota_bytes // block_bytes), tiers.pins.max_blocks)
            kv.attach_tiers(tiers)
            if shard is not None:  # the other ranks repeat every tier op on their shards (tiering/rank_mirror.py)
                tiers.copy_log = []
                tiers.group_reads = {}
                tiers.sync_group = runner.sync_tiers
                runner.tiers = tiers
        self.engine = LLMEngine(runner, self.tokenizer, kv, sched, self.model_id, seed=seed, kv_dtype=kv_dtype,
                                kv_eviction=kv_eviction)
        self._ids = itertools.count()

    # -- generation ------------------------------------------------------------------------
    def generate(self, prompts: str | Sequence[str] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 cache_salt: str = "") -> list[RequestOutput]:
        """Outputs in the order of `prompts` (strings, or lists of token ids)."""
        if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        if not isinstance(prompts, Sequence) or len(prompts) == 0:
            raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
        params = self._params_list(sampling_params, len(prompts))
        encoded = []
        for i, p in enumerate(prompts):
            field = f"prompts[{i}]"
            if isinstance(p, str):
                if not p:
                    raise ValueError(f"{field} is empty")
                ids, text = self.tokenizer.encode(p), p
            elif isinstance(p, Sequence):
                ids, text = list(p), None
            else:
                raise ValueError(f"{field} must be a string or a list of token ids")
            self.engine.validate_prompt(ids, params[i], field)
            encoded.append((ids, text))
        return self._run([(ids, text, sp) for (ids, text), sp in zip(encoded, params)], cache_salt)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             add_generation_prompt: bool = True, cache_salt: str = "") -> list[RequestOutput]:
        """One conversation (a list of messages) or a list of conversations."""
        if isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages = [messages]
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a conversation or a non-empty list of conversations")
        texts = [self.tokenizer.apply_chat_template(c, add_generation_prompt) for c in messages]
        prompt_ids = [self.tokenizer.encode(t, add_special_tokens=False) for t in texts]
        params = self._params_list(sampling_params, len(texts))
        for i, ids in enumerate(prompt_ids):
            self.engine.validate_prompt(ids, params[i], f"messages[{i}]")
        return self._run(list(zip(prompt_ids, texts, params)), cache_salt)

    def _params_list(self, sp: Any, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams()] * n
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n or not all(isinstance(p, SamplingParams) for p in sp):
            raise ValueError(f"sampling_params must be one SamplingParams or a list of {n}")
        return sp

    def _run(self, items: list[tuple[list[int], str | None, SamplingParams]], cache_salt: str) -> list[RequestOutput]:
        ids = [str(next(self._ids)) for _ in items]
        try:
            for rid, (prompt_ids, text, sp) in zip(ids, items):
                self.engine.add_request(rid, prompt_ids, sp, prompt=text, cache_salt=cache_salt)
            done: dict[str, RequestOutput] = {}
            while len(done) < len(ids):
                for out in self.engine.step():
                    done[out.request_id] = out
        except BaseException:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return [done[rid] for rid in ids]

    # -- introspection ---------------------------------------------------------------------
    def cache_stats(self) -> dict[str, Any]:
        return self.engine.cache_stats()

    def check_integrity(self) -> None:
        self.engine.check_integrity()

    def reset_prefix_cache(self) -> int:
        """Drop every cached block that no request holds, in every tier; returns how many."""
        return self.engine.kv.reset_prefix_cache()

    def close(self) -> None:
        """Finish pending tier writes and stop the tiers' IO threads; stop a tensor-parallel group."""
        if self.engine.kv.tiers is not None:
            self.engine.kv.tiers.close()
        if self.group is not None:
            self.group.close()

    def recover(self, error: Exception) -> None:
        """After a step failed with `error`: restart the tensor-parallel ranks if one of them died."""
        if self.group is not None and self.group.failed is not None:
            self.restart_workers()

    def restart_workers(self) -> None:
        """After a tensor-parallel rank died: abort every request (their KV is gone with it), drop the
        prefix cache, and start the other ranks again."""
        if self.group is None:
            raise ValueError("restart_workers needs tensor_parallel_size > 1")
        self.group.close()
        for rid in list(self.engine.groups):
            self.engine.abort(rid)
        self.engine.kv.reset_prefix_cache()
        if self.engine.kv.tiers is not None:
            self.engine.kv.tiers.drain_copy_log()  # copies for the old ranks; the new ones start empty
        self.group = _start_group(self.engine.runner, *self._tp)


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_tier_args(cpu_kv_bytes: int | None, nvme_kv_dir: str | None, nvme_kv_bytes: int | None) -> None:
    if cpu_kv_bytes is not None:
        _check_positive("cpu_kv_bytes", cpu_kv_bytes)
    if nvme_kv_dir is None:
        if nvme_kv_bytes is not None:
            raise ValueError("nvme_kv_bytes needs nvme_kv_dir")
        return
    if not isinstance(nvme_kv_dir, (str, os.PathLike)) or not str(nvme_kv_dir):
        raise ValueError(f"nvme_kv_dir must be a directory path, got {nvme_kv_dir!r}")
    if cpu_kv_bytes is None:
        raise ValueError("nvme_kv_dir needs cpu_kv_bytes: blocks come back from NVMe through the DRAM tier")
    if nvme_kv_bytes is None:
        raise ValueError("nvme_kv_dir needs nvme_kv_bytes, the tier's capacity")
    _check_positive("nvme_kv_bytes", nvme_kv_bytes)


def _build_tiers(runner: ModelRunner, block_bytes: int, cpu_kv_bytes: int, nvme_kv_dir: str | None,
                 nvme_kv_bytes: int | None, layout_tag: str, admission):
    from kvstrata.tiering.block_copy import block_shape
    from kvstrata.tiering.host import HostTier
    from kvstrata.tiering.manager import TierManager

    num_host_blocks = cpu_kv_bytes // block_bytes
    if num_host_blocks < 1:
        raise ValueError(f"cpu_kv_bytes ({cpu_kv_bytes}) holds no block; one block is {block_bytes} bytes")
    shape, dtype = block_shape(runner.kv_cache), runner.kv_cache.dtype
    host = HostTier(num_host_blocks, shape, dtype, pin=runner.device.type == "cuda")
    nvme = None
    if nvme_kv_dir is not None:
        from kvstrata.tiering.nvme import NvmeTier

        nvme = NvmeTier(nvme_kv_dir, nvme_kv_bytes, shape, dtype, layout_tag=layout_tag)
    return TierManager(runner.kv_cache, host, nvme, admission=admission)


def _check_tp(model: str, tp: int):
    """Rank 0's shard; ValueError naming tensor_parallel_size for a size the model cannot take."""
    from kvstrata.worker.loader import load_config
    from kvstrata.worker.tensor_parallel import plan_shard

    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}")
    return plan_shard(load_config(model), tp, 0)


def _start_group(runner: ModelRunner, model: str, tp: int, num_blocks: int, block_size: int, worker_id: str,
                 num_host_blocks: int, kv_dtype: str, nvme: dict | None):
    """The other ranks, joined to this process (rank 0), with the same number of KV blocks."""
    from kvstrata.cluster.tp_group import GroupSpec, WorkerGroup

    m = runner.model
    group = WorkerGroup(GroupSpec(model, tp, str(m.dtype).removeprefix("torch."), m.device.type,
                                  num_blocks, block_size, worker_id, num_host_blocks=num_host_blocks,
                                  kv_dtype=kv_dtype, nvme=nvme))
    m.all_reduce = group.comm.all_reduce
    runner.comm, runner.group = group.comm, group
    group.wait_ready()
    return group


def _kv_budget(device: torch.device, kv_cache_bytes: int | None) -> int:
    if kv_cache_bytes is not None:
        _check_positive("kv_cache_bytes", kv_cache_bytes)
        return kv_cache_bytes
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * DEFAULT_GPU_KV_FRACTION)
    return DEFAULT_CPU_KV_BYTES
