"""The built-in engine: scheduler + KV manager + executor behind the Engine protocol."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import numpy as np

from kvbench.engines.base import (
    MAX_DECODE_RUN,
    BatchShape,
    Engine,
    FastPath,
    Finished,
    KVStats,
    StepReport,
    causal_pairs,
    keys_read,
    output_digest,
)
from kvbench.engines.builtin.executor import Executor, ScheduledBatch
from kvbench.engines.builtin.scheduler import Scheduler, SchedulerConfig
from kvbench.engines.builtin.sim_executor import SimExecutor
from kvbench.engines.config import EngineConfig
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.modality import MODALITIES, ModalityAccount, below_precision
from kvbench.engines.kv.oracle import PrefixOracle
from kvbench.engines.model.presets import ModelPreset
from kvbench.engines.sim.device_memory import DeviceMemoryModel
from kvbench.engines.sim.replay import event_replay, replay_blocker
from kvbench.workloads.model import Request

if TYPE_CHECKING:
    from kvbench.engines.sim.costmodel import CostModel


@dataclass(slots=True)
class DecodeRun:
    """The next steps, each decoding one token of the same ``num_seqs`` sequences, that the
    engine can take in one go: at most ``max_steps``, step ``j`` reading ``context[j]`` KV
    positions in ``pairs[j]`` query x key pairs (the cost model's inputs)."""

    num_seqs: int
    max_steps: int
    context: np.ndarray
    pairs: np.ndarray


@dataclass(slots=True)
class DecodeSteps:
    """What ``steps`` decode steps taken in one go report, as one step after another would:
    every step emits ``tokens`` (by request) with the same queue sizes; ``kv`` and
    ``device`` hold each step's values of the KVStats fields (``modality:<m>``: the used
    bytes of modality ``m``; ``offload:<kind>``: the bytes an offload tier holds;
    ``class:<name>_<figure>``: a page class's bytes; int64
    arrays, or lists where some are None) and device-memory
    components; ``last_kv`` is the last step's snapshot; ``ends`` the clock before the first
    step and at each step's end."""

    steps: int
    tokens: dict[str, int]
    num_running: int
    num_waiting: int
    kv: dict[str, np.ndarray | list[int | None]]
    device: dict[str, np.ndarray]
    device_ranks: int
    last_kv: KVStats
    ends: np.ndarray = field(default_factory=lambda: np.zeros(1))


class BuiltinEngine(Engine):
    def __init__(
        self,
        name: str,
        preset: ModelPreset,
        kv: KVManager,
        scheduler_config: SchedulerConfig,
        executor: Executor,
    ) -> None:
        self.name = name
        self.preset = preset
        self.kv = kv
        self.scheduler = Scheduler(scheduler_config, kv)
        self.executor = executor
        executor.bind(kv)
        self._rejected: list[Finished] = []
        self._decode: tuple[list, int | None, set[int] | None, int] | None = None
        self._short_rooms = 0  # decode runs in a row the KV policy cut below two steps
        self._skip_plans = 0  # plans to answer None without looking
        self._bytes_per_token = kv.bytes_per_token
        pool_classes = getattr(kv, "pool_classes", None)
        self._modalities = ModalityAccount(pool_classes() if pool_classes else None, kv.spec,
                                           preset.dtype)
        # Tokens counted twice through shared blocks, and the running set they were for.
        self._shared: tuple[frozenset[int] | None, tuple[int, int, int]] = (None, (0, 0, 0))

    @classmethod
    def from_config(cls, config: EngineConfig, kv: KVManager) -> BuiltinEngine:
        """``kv`` backed by the executor of ``config``'s device: the cost model's sim, or real
        compute with torch."""
        executor: Executor
        if config.device.kind == "sim":
            executor = SimExecutor(config.preset.vocab_size, config.device.label,
                                   _device_memory_model(config))
        else:
            from kvbench.engines.builtin.torch_executor import TorchExecutor

            executor = TorchExecutor(
                config.preset, device=config.device.torch_device or "cpu",
                weights=config.weights, seed=config.seed, attention=config.attention,
            )
        return cls(config.name, config.preset, kv, config.scheduler, executor)

    def add(self, request: Request) -> None:
        reason = self.scheduler.rejection(request)
        if reason is not None:
            self._rejected.append(Finished(request.id, rejected=reason))
            return
        self.scheduler.add(request, request.prompt_token_ids(self.preset.vocab_size))

    def has_unfinished(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def below_full_precision(self) -> dict[str, str]:
        """The modalities whose KV this engine stores below the model's dtype, with their
        dtype (empty: all at full precision)."""
        return below_precision(self._modalities.storage, self.preset.dtype)

    def step(self) -> StepReport:
        sched = self.scheduler
        batch, preempted, first = sched.schedule()
        shape = batch_shape(batch, self._bytes_per_token, self.preset.sliding_window,
                            self.preset.split_window)
        sampled = self.executor.execute(batch, self.kv) if batch.items or batch.copies else []
        device = self.executor.step_memory()
        outcome = sched.update(batch, sampled)
        finished = self._rejected
        self._rejected = []
        for state in outcome.finished:
            digest = None
            if self.executor.device != "sim":
                digest = output_digest([s.output_ids for s in state.samples])
            finished.append(
                Finished(
                    state.request.id,
                    output_digest=digest,
                    cached_tokens=state.samples[0].num_cached_tokens,
                )
            )
        return StepReport(
            tokens=outcome.tokens,
            first_token=outcome.first_token,
            scheduled_first=first,
            finished=finished,
            num_running=sched.num_running_requests,
            num_waiting=len(sched.waiting),
            num_preempted=len(preempted),
            preempted_ids=[s.request.id for s in preempted],
            kv=self._stats(),
            batch=shape,
            device=device,
        )

    # --- decode fast-forward -----------------------------------------------------------------

    def fast_path(self, cost: CostModel, requests: list[Request], waves: int,
                  arrivals_known: bool) -> FastPath:
        """Whole waves by event replay where the engine's policy and the requests allow it;
        else runs of decode-only steps taken in one go; else why not."""
        # Whatever the replay takes can also jump, so this reason covers both.
        reason = self.fast_forward_blocker()
        if reason is not None:
            return FastPath(f"unsupported: {reason}")
        if replay_blocker(self, requests) is None:
            return FastPath("on", replay=event_replay(self, cost, requests, waves))
        return FastPath("on", jump=partial(self.jump, cost))

    def fast_forward_blocker(self) -> str | None:
        """Why this engine cannot take decode steps in bulk (None: it can)."""
        executor = self.executor
        if not isinstance(executor, SimExecutor):
            return "real compute runs every step"
        if executor.memory.on_demand:
            return "on-demand KV tensors grow every step"
        return self.kv.fast_forward_blocker()

    def jump(self, cost: CostModel, now_s: float, due_s: float) -> DecodeSteps | None:
        """Take the next run of decode-only steps from ``now_s`` in one go, ending at the step
        after which ``due_s`` (the next arrival) has come; None when the next step runs on
        its own. Each step's time is ``cost``'s for its batch, accumulated one step after
        another, so clock times equal step-by-step replay's bit for bit."""
        plan = self.plan_decode()
        if plan is None:
            return None
        dts = cost.decode_step_times(plan.num_seqs, plan.context, plan.pairs)
        if dts is None:
            return None
        ends = np.cumsum(np.concatenate(([now_s], dts)))
        k = plan.max_steps
        if due_s != math.inf:
            # The first step ending at or after the arrival is the last one before it is added.
            k = min(k, int(np.searchsorted(ends[1:], due_s, side="left")) + 1)
        out = self.advance_decode(k)
        if out is not None:
            out.ends = ends[: out.steps + 1]
        return out

    def plan_decode(self, max_steps: int = MAX_DECODE_RUN) -> DecodeRun | None:
        """The run of decode-only steps the engine could take next (see :class:`DecodeRun`),
        or None when the next step must run on its own (an admission, a prefill chunk, a
        finishing sequence, a block that may not be there, ...). Call only when
        :meth:`fast_forward_blocker` is None."""
        if self._rejected:
            return None
        if self._skip_plans:
            self._skip_plans -= 1
            return None
        found = self.scheduler.decode_only()
        if found is None:
            return None
        seqs, need, avoid = found
        # The step that samples a sequence's last token finishes it: an event.
        cap = min(max_steps, min(s.request.output_tokens - len(s.output_ids) for s in seqs) - 1)
        k = self.kv.decode_room(seqs, cap, keep_cached=need is not None)
        if k < 2 <= cap:
            # Small pages in a large batch end a run within a step: looking at every step
            # would cost more than it saves, so look less often while that lasts.
            self._short_rooms += 1
            self._skip_plans = min(self._short_rooms, _MAX_SKIPPED_PLANS)
            return None
        self._short_rooms = 0
        if k < 1:
            return None
        n = len(seqs)
        starts = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, n)
        steps = np.arange(k, dtype=np.int64)
        window = self.preset.sliding_window
        if window is None:
            context = int(starts.sum()) + n + n * steps
        else:
            # A decode at position p reads min(p + 1, window) keys.
            context = np.minimum(starts[None, :] + 1 + steps[:, None], window).sum(axis=1)
        self._decode = (seqs, need, avoid, int(starts.max()) + 1)
        return DecodeRun(n, k, context, context)

    def advance_decode(self, steps: int) -> DecodeSteps | None:
        """Take ``steps`` (at most the planned run) decode steps in one go, exactly as that
        many :meth:`step` calls would; fewer when a step must run on its own after all
        (device memory, or a prefix-cache key the waiting request could hit); None when
        none could be taken."""
        seqs, need, avoid, longest = self._decode
        self._decode = None
        executor = self.executor
        assert isinstance(executor, SimExecutor)
        kv, memory = self.kv, executor.memory
        lengths = [len(s.output_ids) for s in seqs]
        executor.decode_tokens(seqs, steps)
        if avoid:
            steps = kv.decode_stop(seqs, steps, avoid)
        device: dict[str, np.ndarray] = {}
        reserved = 0
        if steps:
            memory.begin_decode()
            steps, by_step, reserved = memory.decode_steps(len(seqs), longest, steps)
            device = {name: v if isinstance(v, np.ndarray) else _steady(v, steps)
                      for name, v in by_step.items()}
        for seq, length in zip(seqs, lengths, strict=True):
            del seq.output_ids[length + steps :]
        if not steps:
            return None
        columns = kv.advance_decode(seqs, steps)
        memory.end_decode(reserved)
        self.scheduler.advance_decode(seqs, steps)
        last = self.kv.stats()
        kv_cols = self._modality_columns(last, len(seqs), steps, columns.get("used_bytes"))
        encoder = device.get("encoder")
        last.encoder_cache_bytes = (int(encoder[-1]) if encoder is not None else
                                    executor.encoder_cache_bytes())
        for name in _KV_COLUMNS:
            col = columns.get(name)
            kv_cols[name] = col if col is not None else _steady(getattr(last, name), steps)
        kv_cols.update((k, v) for k, v in columns.items() if k.startswith(("offload:", "class:")))
        if need is None:
            zeros = np.zeros(steps, dtype=np.int64)
            kv_cols["refused_bytes"] = zeros
            kv_cols["refused_free_bytes"] = zeros
            kv_cols["refused_largest_free_bytes"] = zeros
            last.refused_bytes = last.refused_free_bytes = last.refused_largest_free_bytes = 0
        else:
            kv_cols["refused_bytes"] = _steady(need, steps)
            kv_cols["refused_free_bytes"] = kv_cols["free_bytes"]
            kv_cols["refused_largest_free_bytes"] = kv_cols["largest_free_bytes"]
            last.refused_bytes = need
            last.refused_free_bytes = last.free_bytes
            last.refused_largest_free_bytes = last.largest_free_bytes
        tokens: dict[str, int] = {}
        for seq in seqs:
            rid = seq.request.id
            tokens[rid] = tokens.get(rid, 0) + 1
        sched = self.scheduler
        return DecodeSteps(
            steps, tokens, sched.num_running_requests, len(sched.waiting), kv_cols, device,
            memory.tp, last,
        )

    def _modality_columns(self, last: KVStats, num_seqs: int, steps: int, used: np.ndarray | None
                          ) -> dict[str, np.ndarray | list[int | None]]:
        """Per-step used bytes of each modality over ``steps`` decode steps of ``num_seqs``
        sequences ending at ``last`` (whose ``modalities`` this fills): each step adds one
        text token per sequence; a step whose tokens do not account for its used bytes gets
        None."""
        text, image, audio = self._modality_tokens(last)
        bpt = {m: self._modalities.storage[m]["bytes_per_token"] for m in MODALITIES}
        if last.modalities is None:
            return {f"modality:{m}": [None] * steps for m in MODALITIES}
        t = text - num_seqs * np.arange(steps - 1, -1, -1, dtype=np.int64)
        if used is None:
            known = np.zeros(steps, dtype=bool)
            known[-1] = True
        else:
            known = t * bpt["text"] + image * bpt["image"] + audio * bpt["audio"] == used
        out: dict[str, np.ndarray | list[int | None]] = {}
        every = bool(known.all())
        for m, n in (("text", t), ("image", image), ("audio", audio)):
            col = np.full(steps, n * bpt[m], dtype=np.int64)
            out[f"modality:{m}"] = col if every else [
                v if k else None for v, k in zip(col.tolist(), known.tolist(), strict=True)]
        return out

    def _modality_tokens(self, stats: KVStats) -> tuple[int, int, int]:
        """The tokens of each modality the live sequences hold, and ``stats.modalities``
        from them: summed per sequence, less what blocks shared between sequences count
        twice (from a paged pool's block tables and reference counts)."""
        account, running = self._modalities, self.scheduler.running
        tokens = account.tokens(running)
        stats.modalities = account.figures(tokens, stats)
        kv = self.kv
        if stats.modalities is None and hasattr(kv, "block_refs"):
            # Sharing changes only as sequences come, go or fork (copy-on-write of a forked
            # sample's last block): reuse the last count while the running set is the same.
            key = (None if any(s.sample_index for s in running)
                   else frozenset(s.seq_id for s in running))
            if key is None or self._shared[0] != key:
                self._shared = (key, account.shared_tokens(
                    running, kv.block_table, kv.block_refs, kv.spec.page_tokens))
            dup = self._shared[1]
            tokens = (tokens[0] - dup[0], tokens[1] - dup[1], tokens[2] - dup[2])
            stats.modalities = account.figures(tokens, stats)
        elif stats.modalities is None and hasattr(kv, "modality_tokens"):
            # Page classes that share pages: the manager counts each page once.
            tokens = kv.modality_tokens(running)
            stats.modalities = account.figures(tokens, stats)
        return tokens

    def _stats(self) -> KVStats:
        stats = self.kv.stats()
        self._modality_tokens(stats)
        refusal = self.scheduler.refusal
        stats.refused_bytes = refusal.need_bytes
        stats.refused_free_bytes = refusal.free_bytes
        stats.refused_largest_free_bytes = refusal.largest_free_bytes
        stats.encoder_cache_bytes = self.executor.encoder_cache_bytes()
        return stats

    def close(self) -> None:
        self.executor.close()

    def trace_prefix_accesses(self, on: bool) -> None:
        self.kv.trace_prefix_accesses(on)

    def prefix_oracle(self) -> PrefixOracle | None:
        return self.kv.prefix_oracle()

    def describe(self) -> dict[str, Any]:
        return {
            "engine": "builtin",
            "kv_manager": self.kv.describe(),
            "scheduler": self.scheduler.config.to_json(),
            "executor": self.executor.describe(),
        }


# The most steps the engine runs one at a time before looking for a decode run again, after
# the KV policy cut runs short again and again.
_MAX_SKIPPED_PLANS = 16

# The KVStats fields a step log keeps, refusals aside.
_KV_COLUMNS = (
    "capacity_bytes", "reserved_bytes", "used_bytes", "reserved_ahead_bytes", "free_bytes",
    "largest_free_bytes", "shared_bytes", "prefix_hit_tokens", "block_allocs", "block_frees",
    "copied_bytes", "page_table_entries",
)


def _steady(value: int | None, steps: int) -> np.ndarray | list[int | None]:
    """A KVStats field that stays ``value`` over ``steps`` decode steps, as a column."""
    return [None] * steps if value is None else np.full(steps, value, dtype=np.int64)


def batch_shape(
    batch: ScheduledBatch, bytes_per_token: int, window: int | None = None,
    split_window: int | None = None,
) -> BatchShape:
    """What the cost model needs to know about ``batch`` (attention limited to the model's
    sliding ``window``, if it has one; the ``window_*`` counts within ``split_window``, that
    of its sliding-window layers where others read their whole context)."""
    decode = prefill = context = pairs = decode_pairs = 0
    w_context = w_pairs = w_decode_pairs = 0
    for item in batch.items:
        n, start = item.num_tokens, item.start
        if window is None:
            context += start + n
            item_pairs = causal_pairs(start, n)
        else:
            context += keys_read(start, n, window)
            item_pairs = causal_pairs(start, n, window)
        pairs += item_pairs
        is_decode = n == 1 and bool(item.seq.output_ids)
        if split_window is not None:
            w_context += keys_read(start, n, split_window)
            w_item = causal_pairs(start, n, split_window)
            w_pairs += w_item
            w_decode_pairs += w_item if is_decode else 0
        if is_decode:
            decode += 1
            decode_pairs += item_pairs
        else:
            prefill += n
    copied = sum(c.num_slots for c in batch.copies) * bytes_per_token if batch.copies else 0
    return BatchShape(
        num_seqs=len(batch.items), prefill_tokens=prefill, decode_tokens=decode,
        context_tokens=context, attn_pairs=pairs, decode_pairs=decode_pairs,
        window_context_tokens=w_context, window_pairs=w_pairs,
        window_decode_pairs=w_decode_pairs, copied_bytes=copied, map_ops=batch.map_ops,
        load_s=batch.load_s, load_layerwise=batch.load_layerwise,
    )



def _device_memory_model(config: EngineConfig) -> DeviceMemoryModel:
    """The memory model of ``config``'s simulated device, one rank of ``device.tp``."""
    sched = config.scheduler
    return DeviceMemoryModel(
        config.preset, config.device.hardware.memory_bytes, config.device.tp, config.memory,
        sched.max_num_batched_tokens, sched.max_num_seqs,
    )
