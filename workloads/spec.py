"""Workload generator specs and the deterministic generator.

A spec mixes request classes by weight. Each class draws its new user text and its output
length from length distributions and may add images, audio, a shared prefix (one of a few
templates) and multi-turn sessions. The arrival process gives one start time per session
(a single request is a one-turn session).

Content keys carry the seed (``s{seed}/...``), so another seed gives other token ids and
another digest, and they are equal exactly where content is shared:

- prefix template ``i`` of class ``c``: ``s{seed}/prefix/{c}/{i}``;
- request or session started ``k``-th: ``s{seed}/req/{k}/...`` or ``s{seed}/session/{k}/...``;
- in a session, turn ``t``'s user text ``.../in/{t}`` and answer ``.../out/{t}``.

Turn ``t + 1``'s prompt is turn ``t``'s prompt, then its answer (``output_tokens`` long), then
the new user text, so it starts with exactly turn ``t``'s prompt ids. Turns are open-loop:
turn ``t + 1`` arrives an exponential think time after turn ``t`` *arrived* (a workload is
fixed before any engine runs, so completion times are unknown).
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from kvbench.errors import KvbenchError

from .arrivals import ArrivalProcess, OfflineArrivals
from .distributions import LengthDist
from .modalities import (
    WHISPER_TOKENS_PER_S,
    audio_token_count,
    check_image_rule,
    image_token_count,
)
from .model import Request, Segment, Workload
from .validation import validation_message

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _min_at_least_one(what: str, dist: Any) -> Any:
    if dist.min < 1:
        raise ValueError(f"{what} must be at least 1 (set min >= 1, got min = {dist.min})")
    return dist


class ImageSpec(_Strict):
    """Images at the start of the prompt (after any shared prefix)."""

    count: LengthDist = Field(description="images per request (set min = 0 to allow none)")
    sizes: list[tuple[int, int]] = Field(
        min_length=1, description="(height, width) px choices, drawn uniformly per image"
    )
    rule: str = Field(description="image token rule, see modalities.IMAGE_RULES")

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
    think_time_s: float = Field(ge=0, description="mean gap between turn arrivals (exponential)")

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
    n: int = Field(1, ge=1, description="parallel samples per request")

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


def parse_spec(data: dict[str, Any], where: str) -> WorkloadSpec:
    """Validate a spec table; errors become a ``KvbenchError`` naming ``where``."""
    try:
        return WorkloadSpec.model_validate(data)
    except ValidationError as e:
        raise KvbenchError(f"{where}: invalid workload spec: {validation_message(e)}") from e


def _session_turns(
    spec: WorkloadSpec, cls_idx: np.ndarray, rng: np.random.Generator, total: int
) -> np.ndarray:
    """Turns per start, cut after the start that reaches exactly ``total`` requests."""
    turns = np.ones(len(cls_idx), dtype=np.int64)
    for c, rc in enumerate(spec.classes):
        sel = np.flatnonzero(cls_idx == c)
        if rc.session is not None and len(sel):
            turns[sel] = rc.session.turns.sample(rng, len(sel))
    ends = np.cumsum(turns)
    used = int(np.searchsorted(ends, total)) + 1  # every start gives >= 1 request
    turns = turns[:used]
    turns[-1] -= int(ends[used - 1]) - total
    return turns


class _ClassDraws:
    """Everything random about one class's requests, drawn in bulk and consumed in order."""

    def __init__(self, rc: RequestClass, starts: int, requests: int, rng: np.random.Generator):
        self.prompt = iter(rc.prompt.sample(rng, requests).tolist())
        self.output = iter(rc.output.sample(rng, requests).tolist())
        think_s = rc.session.think_time_s if rc.session else 0.0
        self.think = iter(rng.exponential(think_s, size=requests).tolist())
        self.image_counts = iter([])
        self.image_sizes = iter([])
        if rc.images:
            counts = rc.images.count.sample(rng, starts)
            self.image_counts = iter(counts.tolist())
            self.image_sizes = iter(
                rng.integers(0, len(rc.images.sizes), size=int(counts.sum())).tolist()
            )
        self.audio_s = iter(rc.audio.seconds.sample(rng, starts).tolist() if rc.audio else [])
        self.template = iter(
            rng.integers(0, rc.prefix.templates, size=starts).tolist() if rc.prefix else []
        )


def _first_turn(
    rc: RequestClass, draws: _ClassDraws, base: str, seed: int, prefix_lens: list[int]
) -> tuple[list[Segment], str | None]:
    """Prefix, images and audio that open a session (or a single request), and its prefix group."""
    segs: list[Segment] = []
    group = None
    if rc.prefix:
        i = next(draws.template)
        group = f"{rc.name}/{i}"
        segs.append(Segment("text", prefix_lens[i], f"s{seed}/prefix/{group}"))
    if rc.images:
        rule = rc.images.rule
        for j in range(next(draws.image_counts)):
            h, w = rc.images.sizes[next(draws.image_sizes)]
            tokens = image_token_count(rule, h, w)
            segs.append(Segment("image", tokens, f"{base}/image/{j}", height=h, width=w, rule=rule))
    if rc.audio:
        secs = float(next(draws.audio_s))
        tokens = audio_token_count(secs, rc.audio.tokens_per_s)
        segs.append(Segment("audio", tokens, f"{base}/audio", seconds=secs))
    return segs, group


def generate(
    spec: WorkloadSpec,
    num_requests: int | None = None,
    seed: int = 0,
    name: str = "custom",
    source: str = "generator",
) -> Workload:
    """The workload a spec gives for a seed: same spec and seed, same requests and digest.

    Requests are sorted by arrival (ties keep generation order) and numbered ``r0, r1, …`` in
    that order.
    """
    total = spec.num_requests if num_requests is None else num_requests
    if total < 1:
        raise KvbenchError(f"num_requests must be >= 1 (got {total})")
    arrival_rng, class_rng, turns_rng, template_rng, content_rng = (
        np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)
    )
    weights = np.array([c.weight for c in spec.classes])
    cls_idx = class_rng.choice(len(spec.classes), size=total, p=weights / weights.sum())
    turns = _session_turns(spec, cls_idx, turns_rng, total)
    cls_idx = cls_idx[: len(turns)]
    start_s = spec.arrival.times(arrival_rng, len(turns))

    prefix_lens = [
        rc.prefix.tokens.sample(template_rng, rc.prefix.templates).tolist() if rc.prefix else []
        for rc in spec.classes
    ]
    draws = [
        _ClassDraws(rc, int((cls_idx == c).sum()), int(turns[cls_idx == c].sum()), content_rng)
        for c, rc in enumerate(spec.classes)
    ]

    made: list[Request] = []
    for k, (c, n_turns, t0) in enumerate(
        zip(cls_idx.tolist(), turns.tolist(), start_s.tolist(), strict=True)
    ):
        rc, d = spec.classes[c], draws[c]
        session_id = f"session-{k}" if rc.session else None
        base = f"s{seed}/session/{k}" if rc.session else f"s{seed}/req/{k}"
        context, group = _first_turn(rc, d, base, seed, prefix_lens[c])
        arrival = t0
        for t in range(n_turns):
            if t > 0:
                arrival += next(d.think)
                answer = made[-1].output_tokens
                context.append(Segment("text", answer, f"{base}/out/{t - 1}"))
            text_key = f"{base}/in/{t}" if rc.session else f"{base}/text"
            context.append(Segment("text", next(d.prompt), text_key))
            made.append(
                Request(
                    id="", arrival_s=arrival, segments=tuple(context),
                    output_tokens=next(d.output), prefix_group=group, session_id=session_id,
                    n=rc.n,
                )
            )
    made.sort(key=lambda r: r.arrival_s)  # stable: ties keep generation order
    return Workload(
        name=name,
        requests=[replace(r, id=f"r{i}") for i, r in enumerate(made)],
        seed=seed,
        spec=spec.model_dump(mode="json"),
        source=source,
    )
