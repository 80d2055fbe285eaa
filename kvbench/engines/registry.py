"""The engine kinds, by name: every KV policy of the built-in engine (its section, manager
and attention layout) and every external engine, and how each kind's engine is built. A new
policy is one module in ``kvbench/engines/kv/`` plus one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import Field, TypeAdapter, ValidationError

from kvbench.engines.base import Engine
from kvbench.engines.builtin.engine import BuiltinEngine
from kvbench.engines.config import EngineConfig, EngineSection, KVPolicy
from kvbench.engines.external.openai import OpenAISection
from kvbench.engines.external.vllm import VllmSection, build_vllm
from kvbench.engines.kv.base import KVManager
from kvbench.engines.kv.contiguous import ContiguousKVManager, ContiguousPolicy
from kvbench.engines.kv.hybrid import HybridKVManager, HybridPolicy
from kvbench.engines.kv.modal import ModalKVManager, ModalPolicy
from kvbench.engines.kv.paged import PagedKVManager, PagedPolicy
from kvbench.engines.kv.paged_mixed import PagedMixedKVManager, PagedMixedPolicy
from kvbench.engines.kv.segmented import SegmentedKVManager, SegmentedPolicy
from kvbench.engines.kv.vattention import VAttentionKVManager, VAttentionPolicy
from kvbench.errors import KvbenchError
from kvbench.kernels.layouts import BlockTables, Extents
from kvbench.workloads.validation import validation_message


def build_builtin(config: EngineConfig) -> Engine:
    """A KV policy's engine: the built-in engine over a fresh manager of the policy."""
    section = config.section
    assert isinstance(section, KVPolicy)
    return BuiltinEngine.from_config(config, section.manager(config))


def build_openai(config: EngineConfig) -> Engine:
    """The engine of an ``openai`` section: a client of the server it names."""
    # The HTTP client (aiohttp, an optional extra) loads only when a run needs it.
    from kvbench.engines.external.openai.engine import OpenAIEngine

    section = config.section
    assert isinstance(section, OpenAISection)
    return OpenAIEngine(config, section, section.discover(config))


@dataclass(frozen=True, slots=True)
class Kind:
    """A registered engine kind: a KV policy has a manager class and an attention layout and
    runs in the built-in engine; an external engine has neither and its own ``build``."""

    section: type[EngineSection]
    manager: type[KVManager] | None = None
    layout: type | None = None
    build: Callable[[EngineConfig], Engine] = build_builtin

    @property
    def name(self) -> str:
        return self.section.model_fields["kind"].default

    @property
    def is_policy(self) -> bool:
        return self.manager is not None


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(PagedPolicy, PagedKVManager, BlockTables),
        Kind(ContiguousPolicy, ContiguousKVManager, Extents),
        Kind(PagedMixedPolicy, PagedMixedKVManager, BlockTables),
        Kind(SegmentedPolicy, SegmentedKVManager, BlockTables),
        Kind(VAttentionPolicy, VAttentionKVManager, BlockTables),
        Kind(ModalPolicy, ModalKVManager, BlockTables),
        Kind(HybridPolicy, HybridKVManager, BlockTables),
        Kind(VllmSection, build=build_vllm),
        Kind(OpenAISection, build=build_openai),
    )
}

# A suite's [engines.NAME] table: validated by its kind's model.
AnyEngineSection = Annotated[
    PagedPolicy | ContiguousPolicy | PagedMixedPolicy | SegmentedPolicy | VAttentionPolicy
    | ModalPolicy | HybridPolicy | VllmSection | OpenAISection,
    Field(discriminator="kind"),
]
_SECTION = TypeAdapter(AnyEngineSection)

# Engine variants every suite can name without defining them.
NAMED_ENGINES: dict[str, EngineSection] = {
    "paged": PagedPolicy(),
    "paged-lfu": PagedPolicy(eviction="lfu"),
    # Finished sequences' blocks are never recycled: the fault soak runs must catch.
    "paged-leaky": PagedPolicy(leak_finished=True),
    "contiguous": ContiguousPolicy(reservation="max_model_len"),
    "contiguous-request": ContiguousPolicy(reservation="request"),
    "contiguous-pow2": ContiguousPolicy(reservation="pow2"),
    "contiguous-compact": ContiguousPolicy(reservation="request", compaction=True),
    # Compacts whenever the fragmentation index drops below the reports' "healthy" 0.7.
    "contiguous-defrag": ContiguousPolicy(reservation="request", auto_defrag=0.7),
    "paged-mixed": PagedMixedPolicy(),
    "paged-mixed-migrate": PagedMixedPolicy(migrate=True),
    "segmented": SegmentedPolicy(),
    "vattention": VAttentionPolicy(),
    "vattention-64k": VAttentionPolicy(page_bytes=64 * 1024),
    # vAttention's latency hiding: pages mapped ahead in the background, finished ranges
    # kept mapped for the next sequences.
    "vattention-prewarm": VAttentionPolicy(prewarm_pages=64),
    # Modality-aware KV (P7, P8): vision KV in int8 at the text block size; vision in its
    # own 512-token pages sharing one pool with text, or in a pool of its own.
    "modal-int8": ModalPolicy(kv_dtype={"image": "int8", "audio": "int8"}),
    "modal-fp8": ModalPolicy(kv_dtype={"image": "fp8_e4m3", "audio": "fp8_e4m3"}),
    "modal-pages": ModalPolicy(vision_page_tokens=512),
    "modal-pages-split": ModalPolicy(vision_page_tokens=512, pools="split"),
    "modal-pages-int8": ModalPolicy(vision_page_tokens=512,
                                    kv_dtype={"image": "int8", "audio": "int8"}),
    # KV per layer group (models mixing sliding-window, global and recurrent layers):
    # vLLM's one pool of a common page size, one pool per group under one budget, or every
    # token in every attention layer.
    "hybrid": HybridPolicy(),
    "hybrid-per-group": HybridPolicy(layout="per-group"),
    "hybrid-uniform": HybridPolicy(layout="uniform"),
    "vllm": VllmSection(),
    # A server on this machine at vLLM's default port; suites name others.
    "openai": OpenAISection(),
}


def parse_section(data: dict[str, Any], where: str) -> EngineSection:
    """An engine section from suite data; ``where`` names it in errors."""
    try:
        return _SECTION.validate_python(data)
    except ValidationError as exc:
        raise KvbenchError(
            f"{where}: {validation_message(exc)} (kinds: {', '.join(KINDS)})"
        ) from None


def build_engine(config: EngineConfig) -> Engine:
    """The engine ``config`` describes, started."""
    return KINDS[config.section.kind].build(config)
