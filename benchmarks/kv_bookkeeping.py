"""KV bookkeeping cost per page: every policy's allocate, grow and free, timed directly.

A churn keeps ``live`` sequences in a pool sized for them; each round admits a new sequence
with its first page, grows it one page (16 tokens) at a time to ``pages`` pages, committing
after every growth as a step would, and frees the oldest live sequence. Background work,
copies and mapping calls are drained after every growth, as the engine does each step. The
figure is seconds per page handed out; O(1) amortised bookkeeping means it stays flat as
the pool (``live``) and the sequences (``pages``) grow.

``python benchmarks/kv_bookkeeping.py`` prints a table over engines, live sequences and
sequence lengths (medians of repeats, engines alternated within each repeat);
``asv_bench.KVBookkeeping`` times one churn per engine.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvbench.engines.builtin.scheduler import SchedulerConfig
from kvbench.engines.config import EngineSettings, engine_config
from kvbench.engines.kv.base import KVManager
from kvbench.engines.model.presets import get_preset
from kvbench.engines.registry import NAMED_ENGINES
from kvbench.engines.sequence import Sequence
from kvbench.run.devices import parse_device
from kvbench.workloads.model import Request, Segment

PAGE = 16  # tokens a page of growth (paged's block)
POLICIES = ["paged", "paged-lfu", "contiguous", "contiguous-defrag", "paged-mixed",
            "paged-mixed-migrate", "segmented", "vattention", "vattention-64k",
            "vattention-prewarm"]


def manager(engine: str, live: int, pages: int) -> KVManager:
    """``engine``'s manager for Llama-3-8B on a simulated A100-80GB, its pool 1.25x what
    ``live`` sequences of ``pages`` pages hold at max_model_len (contiguous's reservation),
    or at vAttention's 1024-token page groups when those are longer."""
    preset = get_preset("llama-3-8b")
    max_len = pages * PAGE + PAGE
    settings = EngineSettings(
        preset=preset, device=parse_device("sim:a100-80gb"),
        kv_bytes=int(1.25 * (live + 1) * max(max_len, 1024)) * preset.kv_bytes_per_token,
        block_size=PAGE, prefix_caching=True,
        scheduler=SchedulerConfig(max_len, live + 1, 8192, True),
    )
    config = engine_config(engine, NAMED_ENGINES[engine], settings)
    return config.section.manager(config)


def _drain(kv: KVManager) -> None:
    kv.background()
    kv.take_copies()
    kv.take_map_ops()


def sequences(n: int, pages: int) -> list[Sequence]:
    """``n`` sequences of ``pages`` pages of distinct prompt tokens (built before timing:
    generating token ids is the workload's cost, not the KV manager's)."""
    out = []
    for i in range(n):
        request = Request(f"b{i}", 0.0, (Segment("text", pages * PAGE, f"own/{i}"),), 1)
        out.append(Sequence(i, request, request.prompt_token_ids(32000)))
    return out


def churn(kv: KVManager, seqs: list[Sequence], live: int, pages: int) -> int:
    """Run the churn over ``seqs`` (``live`` of them at once); returns the pages handed
    out (growth steps included)."""
    ids = iter(seqs)
    running: list[Sequence] = []
    handed = 0

    def admit_and_grow() -> None:
        nonlocal handed
        seq = next(ids)
        i = seq.seq_id
        kv.arrive(seq)
        if not kv.allocate(seq, kv.lookup_prefix(seq), PAGE):
            raise RuntimeError(f"{kv.describe()}: no room for sequence {i}")
        seq.num_computed_tokens += PAGE
        kv.commit(seq)
        _drain(kv)
        for _ in range(pages - 1):
            if not kv.grow(seq, PAGE):
                raise RuntimeError(f"{kv.describe()}: sequence {i} cannot grow")
            seq.num_computed_tokens += PAGE
            kv.commit(seq)
            _drain(kv)
        handed += pages
        running.append(seq)

    for _ in range(live):
        admit_and_grow()
    for _ in range(len(seqs) - live):
        kv.free(running.pop(0))
        admit_and_grow()
    for seq in running:
        kv.free(seq)
    return handed


def seconds_per_page(engine: str, live: int, pages: int, rounds: int) -> float:
    kv, seqs = manager(engine, live, pages), sequences(live + rounds, pages)
    t0 = time.perf_counter()
    handed = churn(kv, seqs, live, pages)
    return (time.perf_counter() - t0) / handed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default=",".join(POLICIES))
    parser.add_argument("--live", default="16,256", help="live sequences, comma-separated")
    parser.add_argument("--pages", default="8,128", help="pages a sequence, comma-separated")
    parser.add_argument("--rounds", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    engines = args.engines.split(",")
    cases = [(int(a), int(b)) for a in args.live.split(",") for b in args.pages.split(",")]
    times: dict[tuple[str, int, int], list[float]] = {}
    for _ in range(args.repeat):
        for live, pages in cases:
            for engine in engines:  # alternated within each repeat
                times.setdefault((engine, live, pages), []).append(
                    seconds_per_page(engine, live, pages, args.rounds))
    head = " | ".join(f"{live} live x {pages} pages" for live, pages in cases)
    print(f"| engine | {head} |")
    print("|---|" + "---:|" * len(cases))
    for engine in engines:
        cells = []
        for live, pages in cases:
            t = times[(engine, live, pages)]
            cells.append(f"{statistics.median(t) * 1e6:.2f} ({min(t) * 1e6:.2f}-"
                         f"{max(t) * 1e6:.2f})")
        print(f"| {engine} | " + " | ".join(cells) + " |")
    print("\nmicroseconds per page handed out: median (min-max) of", args.repeat, "repeats")


if __name__ == "__main__":
    main()
