"""Service-level objectives for goodput: per-request latency limits in milliseconds."""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field

from kvbench.errors import KvbenchError

SLO_METRICS = ("ttft", "tpot", "e2el")


class SLO(BaseModel):
    """A request meets the SLO when it completed and each given limit holds (TPOT only for
    requests with more than one output token, where it is defined)."""

    model_config = ConfigDict(extra="forbid")
    ttft_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    tpot_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    e2el_ms: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    def label(self) -> str:
        return ",".join(
            f"{m}:{v:g}" for m in SLO_METRICS if (v := getattr(self, f"{m}_ms")) is not None
        )


def parse_slo(text: str) -> SLO:
    """``ttft:MS,tpot:MS[,e2el:MS]`` (the form of ``vllm bench serve --goodput``)."""
    limits: dict[str, float] = {}
    for part in (p.strip() for p in text.split(",")):
        name, sep, value = part.partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise KvbenchError(
                f"cannot read SLO {part!r}: write e.g. --slo ttft:500,tpot:50 "
                f"(limits in ms for {', '.join(SLO_METRICS)})"
            )
        try:
            ms = float(value)
        except ValueError:
            raise KvbenchError(f"SLO {name}: {value!r} is not a number of milliseconds") from None
        if not math.isfinite(ms) or ms <= 0:
            raise KvbenchError(
                f"SLO {name}: the limit must be a positive number of ms, not {value.strip()!r}"
            )
        if f"{name}_ms" in limits:
            raise KvbenchError(f"SLO {name} is given twice in {text!r}: give each limit once")
        limits[f"{name}_ms"] = ms
    return SLO(**limits)
