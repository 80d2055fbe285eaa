"""Workload generator specs: request classes, their distributions, media, prefixes, sessions.

``parse_spec`` validates a spec table (from a spec file or a suite) into a ``WorkloadSpec``;
``generator.generate`` turns a spec and a seed into requests.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbench.errors import KvbenchError
from kvbench.workloads.arrivals import ArrivalProcess, OfflineArrivals
from kvbench.workloads.distributions import LengthDist
from kvbench.workloads.limits import MAX_ARRIVAL_S, MAX_SAMPLES
from kvbench.workloads.modalities import WHISPER_TOKENS_PER_S, check_image_rule, image_token_count
from kvbench.workloads.validation import validation_message

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _min_at_least_one(what: str, dist: Any) -> Any:
    if dist.min < 1:
        raise ValueError(f"{what} must be at least 1 (set min >= 1, got min = {dist.min})")
    return dist


class ImageSpec(_Strict):
    """Images at the start of the prompt (after any shared prefix).

    Without ``pool`` every image is new content. With ``pool = P`` the class has a catalogue
    of ``P`` images (each given one size from ``sizes`` once) and every image is one of them,
    drawn uniformly: a reused image has the same key, size and token ids wherever it appears,
    so prefix caching and encoder caches can reuse it.
    """

    count: LengthDist = Field(description="images per request (set min = 0 to allow none)")
    sizes: list[tuple[int, int]] = Field(
        min_length=1, description="(height, width) px choices, drawn uniformly per image"
    )
    rule: str = Field(description="image token rule, see modalities.IMAGE_RULES")
    pool: int | None = Field(None, ge=1, description="shared catalogue images; None: all new")

    @model_validator(mode="after")
    def _countable(self) -> ImageSpec:
        try:
            check_image_rule(self.rule)
            for h, w in self.sizes:
                image_token_count(self.rule, h, w)
        except KvbenchError as e:
            raise ValueError(str(e)) from e
        return self


class AudioSpec(_Strict):
    """One audio clip after the images."""

    seconds: LengthDist = Field(description="clip length in whole seconds")
    tokens_per_s: float = Field(WHISPER_TOKENS_PER_S, gt=0)

    _seconds = field_validator("seconds")(lambda d: _min_at_least_one("audio seconds", d))


class PrefixSpec(_Strict):
    """A shared prefix (system prompt, few-shot examples): one of ``templates`` per session."""

    templates: int = Field(ge=1, description="distinct prefixes, chosen uniformly")
    tokens: LengthDist = Field(description="prefix length, drawn once per template")

    _tokens = field_validator("tokens")(lambda d: _min_at_least_one("prefix tokens", d))


class SessionSpec(_Strict):
    """Multi-turn conversations."""

    turns: LengthDist = Field(description="turns per session")
    think_time_s: float = Field(
        ge=0, le=MAX_ARRIVAL_S, description="mean gap between turn arrivals (exponential)"
    )

    _turns = field_validator("turns")(lambda d: _min_at_least_one("turns", d))


class RequestClass(_Strict):
    """One kind of request; ``prompt`` is the new user text only (not prefix, media, history)."""

    name: str
    weight: float = Field(1.0, gt=0)
    prompt: LengthDist
    output: LengthDist
    images: ImageSpec | None = None
    audio: AudioSpec | None = None
    prefix: PrefixSpec | None = None
    session: SessionSpec | None = None
    n: int = Field(1, ge=1, le=MAX_SAMPLES, description="parallel samples per request")

    @field_validator("name")
    @classmethod
    def _key_safe(cls, v: str) -> str:
        if not _NAME.match(v):
            raise ValueError(f"class name {v!r} may hold only letters, digits, '_', '.', '-'")
        return v

    _prompt = field_validator("prompt")(lambda d: _min_at_least_one("prompt tokens", d))
    _output = field_validator("output")(lambda d: _min_at_least_one("output tokens", d))


class WorkloadSpec(_Strict):
    """Request classes mixed by weight, an arrival process and a default request count."""

    classes: list[RequestClass] = Field(min_length=1)
    arrival: ArrivalProcess = OfflineArrivals()
    num_requests: int = Field(100, ge=1)

    @field_validator("classes")
    @classmethod
    def _unique_names(cls, v: list[RequestClass]) -> list[RequestClass]:
        names = [c.name for c in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"class names must be unique; repeated: {', '.join(dupes)}")
        return v


def parse_spec(data: Any, where: str) -> WorkloadSpec:
    """Validate a spec table (a spec file's content or a suite's inline ``[workload.spec]``).

    Errors become a ``KvbenchError`` that starts with ``where`` (a file, or e.g.
    ``suite.toml [workload.spec]``) and names each bad key by its path in the table,
    e.g. ``classes[0].prompt.median``.
    """
    if not isinstance(data, dict):
        raise KvbenchError(
            f"{where}: a workload spec must be a table with 'classes' (got {type(data).__name__})"
        )
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as e:
        raise KvbenchError(f"{where}: invalid workload spec: {validation_message(e, data)}") from e
