"""The deterministic generator: a spec and a seed give the same requests and digest.

A spec mixes request classes by weight. Each class draws its new user text and its output
length from length distributions and may add images, audio, a shared prefix (one of a few
templates) and multi-turn sessions. The arrival process gives one start time per session
(a single request is a one-turn session).

Content keys carry the seed (``s{seed}/...``), so another seed gives other token ids and
another digest, and they are equal exactly where content is shared:

- prefix template ``i`` of class ``c``: ``s{seed}/prefix/{c}/{i}``;
- catalogue image ``i`` of class ``c`` (an image ``pool``): ``s{seed}/image-pool/{c}/{i}``;
- request or session started ``k``-th: ``s{seed}/req/{k}/...`` or ``s{seed}/session/{k}/...``;
- in a session, turn ``t``'s user text ``.../in/{t}`` and answer ``.../out/{t}``.

Turn ``t + 1``'s prompt is turn ``t``'s prompt, then its answer (``output_tokens`` long), then
the new user text, so it starts with exactly turn ``t``'s prompt ids. Turns are open-loop:
turn ``t + 1`` arrives an exponential think time after turn ``t`` *arrived* (a workload is
fixed before any engine runs, so completion times are unknown).

Everything random is drawn in bulk with numpy and laid out per request before any Python
object is made; the only objects built per request are its ``Request`` and new ``Segment``s
(a shared prefix is one Segment for all its requests). That keeps a million requests to a
few seconds and a few hundred MB.
"""

from __future__ import annotations

import numpy as np

from kvbench.errors import KvbenchError
from kvbench.workloads.bulk import collector_paused, new_request, new_segment, text_segment
from kvbench.workloads.limits import (
    MAX_ARRIVAL_S,
    MAX_SEQUENCE_TOKENS,
    check_generation_memory,
    request_problem,
)
from kvbench.workloads.modalities import audio_token_count, image_token_count
from kvbench.workloads.model import Request, Segment, Workload
from kvbench.workloads.spec import RequestClass, WorkloadSpec


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


class _Layout:
    """Where each start's requests sit in generation order (all turns of a start in a row)."""

    def __init__(self, turns: np.ndarray) -> None:
        self.turns = turns
        self.first = np.cumsum(turns) - turns  # index of each start's first request
        self.start = np.repeat(np.arange(len(turns)), turns)  # start of each request
        self.turn = np.arange(int(turns.sum())) - self.first[self.start]

    def arrivals(self, start_s: np.ndarray, think_s: np.ndarray) -> np.ndarray:
        """Turn 0 at its start time; turn t at turn t - 1 plus its think time.

        One pass per turn number, each a float64 add per session, the same additions a
        request-by-request loop makes.
        """
        arrival = np.empty(len(self.start))
        arrival[self.first] = start_s
        for t in range(1, int(self.turns.max(initial=1))):
            at = self.first[self.turns > t] + t
            arrival[at] = arrival[at - 1] + think_s[at]
        return arrival


class _StartDraws:
    """What opens each start of one class (prefix template, images, audio), drawn in bulk."""

    def __init__(self, rc: RequestClass, starts: int, rng: np.random.Generator) -> None:
        self.image_counts: list[int] = []
        self.image_choices: list[int] = []  # a size choice, or a catalogue image of a pool
        if rc.images:
            counts = rc.images.count.sample(rng, starts)
            self.image_counts = counts.tolist()
            choices = rc.images.pool or len(rc.images.sizes)
            self.image_choices = rng.integers(0, choices, size=int(counts.sum())).tolist()
        self.audio_s = rc.audio.seconds.sample(rng, starts).tolist() if rc.audio else []
        self.template = (
            rng.integers(0, rc.prefix.templates, size=starts).tolist() if rc.prefix else []
        )
        self.next_start = 0
        self.next_image = 0


class _Opener:
    """Builds the segments that open a start of one class: prefix, images, audio."""

    def __init__(
        self,
        rc: RequestClass,
        draws: _StartDraws,
        prefixes: list[Segment],
        pool: list[Segment],
        seed: int,
    ) -> None:
        self.rc = rc
        self.draws = draws
        self.prefixes = prefixes
        self.pool = pool
        self.session_base = f"s{seed}/session/" if rc.session else f"s{seed}/req/"
        # One turn of new text only: the common case, which the generator builds inline.
        self.text_only = not (rc.session or rc.prefix or rc.images or rc.audio)
        images = rc.images
        # Token counts per size choice, computed once instead of once per image.
        self.image_tokens = (
            [image_token_count(images.rule, h, w) for h, w in images.sizes] if images else []
        )

    def open(self, k: int) -> tuple[str, list[Segment], str | None]:
        """The key base, opening segments and prefix group of start ``k``."""
        rc, d = self.rc, self.draws
        j = d.next_start
        d.next_start += 1
        base = f"{self.session_base}{k}"
        segs: list[Segment] = []
        group = None
        if rc.prefix:
            i = d.template[j]
            group = f"{rc.name}/{i}"
            segs.append(self.prefixes[i])
        if rc.images:
            rule = rc.images.rule
            for n in range(d.image_counts[j]):
                choice = d.image_choices[d.next_image]
                d.next_image += 1
                if self.pool:
                    segs.append(self.pool[choice])
                    continue
                h, w = rc.images.sizes[choice]
                segs.append(new_segment(
                    "image", self.image_tokens[choice], f"{base}/image/{n}", h, w, None, rule
                ))
        if rc.audio:
            secs = float(d.audio_s[j])
            tokens = audio_token_count(secs, rc.audio.tokens_per_s)
            segs.append(new_segment("audio", tokens, f"{base}/audio", None, None, secs, None))
        return base, segs, group


def _prefix_segments(rc: RequestClass, rng: np.random.Generator, seed: int) -> list[Segment]:
    """One Segment per prefix template of a class, shared by all requests that use it."""
    if not rc.prefix:
        return []
    lengths = rc.prefix.tokens.sample(rng, rc.prefix.templates).tolist()
    return [
        text_segment(n, f"s{seed}/prefix/{rc.name}/{i}") for i, n in enumerate(lengths)
    ]


class _Draws:
    """Everything random about a workload, as lists in generation order (numpy freed)."""

    def __init__(self, spec: WorkloadSpec, total: int, seed: int, what: str) -> None:
        arrival_rng, class_rng, turns_rng, template_rng, content_rng = (
            np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(5)
        )
        classes = spec.classes
        weights = np.array([c.weight for c in classes])
        cls_idx = class_rng.choice(len(classes), size=total, p=weights / weights.sum())
        turns = _session_turns(spec, cls_idx, turns_rng, total)
        cls_idx = cls_idx[: len(turns)]
        start_s = spec.arrival.times(arrival_rng, len(turns))
        prefixes = [_prefix_segments(rc, template_rng, seed) for rc in classes]
        pools = [_pool_segments(rc, template_rng, seed) for rc in classes]

        # Per-request lengths and think times in generation order; each class consumes its
        # own draws in that order.
        layout = _Layout(turns)
        req_cls = cls_idx[layout.start]
        prompt = np.empty(total, dtype=np.int64)
        output = np.empty(total, dtype=np.int64)
        think = np.zeros(total)
        self.openers: list[_Opener] = []
        opening = np.zeros(len(turns), dtype=np.int64)  # segments that open each start
        shared = sum(map(len, prefixes)) + sum(map(len, pools))  # Segments built once
        reused = 0  # opening segments that are a shared prefix or catalogue image
        for c, rc in enumerate(classes):
            mine = req_cls == c
            count = int(mine.sum())
            prompt[mine] = rc.prompt.sample(content_rng, count)
            output[mine] = rc.output.sample(content_rng, count)
            drawn = content_rng.exponential(rc.session.think_time_s if rc.session else 0.0, count)
            later = mine & (layout.turn > 0)
            think[later] = drawn[: int(later.sum())]
            starts = cls_idx == c
            draws = _StartDraws(rc, int(starts.sum()), content_rng)
            images = np.asarray(draws.image_counts, dtype=np.int64) if rc.images else 0
            opening[starts] = int(rc.prefix is not None) + int(rc.audio is not None) + images
            reused += int(starts.sum()) * int(rc.prefix is not None)
            reused += int(np.sum(images)) if pools[c] else 0
            self.openers.append(_Opener(rc, draws, prefixes[c], pools[c], seed))
        # Turn t holds the opening segments and 2t + 1 text segments; turns 0..T-1 hold
        # T * opening + T^2 in all. New segments: the openers' own media and two per turn
        # but the first.
        media = int(opening.sum()) - reused + shared
        refs = int((turns * opening + turns * turns).sum())
        check_generation_memory(total, 2 * total - len(turns) + media, refs, what)

        arrival = layout.arrivals(start_s, think)
        last_s = float(arrival.max())
        if last_s > MAX_ARRIVAL_S:
            raise KvbenchError(
                f"{what}: arrivals reach {last_s:,.0f} s, past the {MAX_ARRIVAL_S / 86_400:.0f}"
                " days a workload may span; raise the arrival rate, shorten think times or ask"
                " for fewer requests"
            )
        self.what = what
        rank = np.empty(total, dtype=np.int64)
        rank[np.argsort(arrival, kind="stable")] = np.arange(total)  # stable: ties keep order
        # Memoryviews give Python ints and floats one at a time, as the requests take them,
        # instead of lists holding a million of each at once.
        self.classes = memoryview(cls_idx.astype(np.int64))
        self.turns = memoryview(turns)
        self.arrival = memoryview(arrival)
        self.prompt = memoryview(prompt)
        self.output = memoryview(output)
        self.rank = memoryview(rank)


def _too_long(d: _Draws, rc: RequestClass, prompt: int, output: int) -> KvbenchError:
    return KvbenchError(
        f"{d.what}: class {rc.name!r} makes a request whose {request_problem(prompt, output)};"
        " lower the bounds of its length distributions (or its turns)"
    )


def _build(d: _Draws) -> list[Request]:
    """The requests, each placed at its rank by arrival."""
    requests: list[Request] = [None] * len(d.rank)  # type: ignore[list-item]  # all filled
    arrival, prompt, output, rank = d.arrival, d.prompt, d.output, d.rank
    i = 0
    with collector_paused():
        for k, (c, n_turns) in enumerate(zip(d.classes, d.turns, strict=True)):
            opener = d.openers[c]
            rc = opener.rc
            if opener.text_only:
                if prompt[i] + output[i] > MAX_SEQUENCE_TOKENS:
                    raise _too_long(d, rc, prompt[i], output[i])
                r = rank[i]
                segment = text_segment(prompt[i], f"{opener.session_base}{k}/text")
                requests[r] = new_request(
                    f"r{r}", arrival[i], (segment,), output[i], None, None, rc.n
                )
                i += 1
                continue
            base, context, group = opener.open(k)
            session_id = f"session-{k}" if rc.session else None
            tokens = sum(s.tokens for s in context)
            for t in range(n_turns):
                if t > 0:
                    context.append(text_segment(output[i - 1], f"{base}/out/{t - 1}"))
                    tokens += output[i - 1]
                text_key = f"{base}/in/{t}" if rc.session else f"{base}/text"
                context.append(text_segment(prompt[i], text_key))
                tokens += prompt[i]
                if tokens + output[i] > MAX_SEQUENCE_TOKENS:
                    raise _too_long(d, rc, tokens, output[i])
                r = rank[i]
                requests[r] = new_request(
                    f"r{r}", arrival[i], tuple(context), output[i], group, session_id, rc.n
                )
                i += 1
    return requests


def _pool_segments(rc: RequestClass, rng: np.random.Generator, seed: int) -> list[Segment]:
    """A class's catalogue images, each with one size drawn once, shared by every use."""
    images = rc.images
    if images is None or images.pool is None:
        return []
    sizes = rng.integers(0, len(images.sizes), size=images.pool).tolist()
    out = []
    for i, choice in enumerate(sizes):
        h, w = images.sizes[choice]
        tokens = image_token_count(images.rule, h, w)
        key = f"s{seed}/image-pool/{rc.name}/{i}"
        out.append(new_segment("image", tokens, key, h, w, None, images.rule))
    return out


def generate(
    spec: WorkloadSpec,
    num_requests: int | None = None,
    seed: int = 0,
    name: str = "custom",
    source: str = "generator",
) -> Workload:
    """The workload a spec gives for a seed: same spec and seed, same requests and digest.

    Requests are sorted by arrival (ties keep generation order) and numbered ``r0, r1, …`` in
    that order. A workload too large for this machine's memory is refused before it is
    built (``limits.check_generation_memory``).
    """
    total = spec.num_requests if num_requests is None else num_requests
    if total < 1:
        raise KvbenchError(f"num_requests must be >= 1 (got {total})")
    # Every request holds at least one new Segment: refuse the impossible before drawing.
    check_generation_memory(total, total, total, name)
    return Workload(
        name=name,
        requests=_build(_Draws(spec, total, seed, name)),
        seed=seed,
        spec=spec.model_dump(mode="json"),
        source=source,
    )
