"""KV bytes by the modality of the tokens held (text, image, audio), for any KV policy.

Each KV position belongs to the modality of its prompt segment; generated tokens are text.
A live sequence holds its written positions ``[0, num_computed_tokens)``, so the tokens of
each modality held are counted from the live sequences, and each modality's bytes are

    used_bytes[m] = tokens[m] x bytes_per_token[m]

where ``bytes_per_token[m]`` is that of the page class storing ``m`` (one flat pool: the
pool's; a modality-aware pool: its class's codes at the class dtype). A quantised class's
float32 scales are a fixed side table sized for every slot the class can address, held from
the start, so they do not grow with the tokens held: they are stated, per class, in
``KVStats.classes`` (``scale_bytes``) and per modality as ``scale_bytes_per_token`` (the
table's share per slot), not added to ``used_bytes``.

Summed over live sequences, the count is exact where every live sequence holds its
positions in slots of its own. Where blocks are shared (prefix-cache hits, forked samples),
a paged pool's block tables and reference counts say which: the positions of a block ``r``
sequences hold are then taken off ``r - 1`` times (:meth:`ModalityAccount.shared_tokens`;
sharing changes only when sequences come, go or fork, so it is recomputed only then). The
count is checked against the manager's own used figures (the pool's ``used_bytes``; each
page class's ``used_tokens``); where they differ -- leading blocks released outside a
sliding window, sharing in a pool that keeps no reference counts -- the modality of the
bytes is not known and the figures are None.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from kvbench.engines.base import KVStats
from kvbench.engines.kv.page_classes import KV_DTYPES, SCALE_BYTES, PoolClass
from kvbench.engines.kv.spec import KVSpec
from kvbench.engines.sequence import Sequence

MODALITIES = ("text", "image", "audio")


def held_counts(seq: Sequence, end: int) -> tuple[int, int, int]:
    """Text, image and audio positions among ``seq``'s first ``end`` positions."""
    image = audio = pos = 0
    for s in seq.request.segments:
        if pos >= end:
            break
        n = min(s.tokens, end - pos)
        if s.kind == "image":
            image += n
        elif s.kind == "audio":
            audio += n
        pos += s.tokens
    return end - image - audio, image, audio


def _storage(classes: tuple[PoolClass, ...] | None, spec: KVSpec, model_dtype: str
             ) -> dict[str, dict[str, Any]]:
    """Where each modality is stored: its class, dtype, bytes per element and per token."""
    out = {}
    for m in MODALITIES:
        if classes is None:
            dtype = spec.dtype or model_dtype
            out[m] = {"page_class": None, "dtype": dtype,
                      "element_bytes": KV_DTYPES.get(dtype),
                      "bytes_per_token": spec.bytes_per_token, "scale_bytes_per_token": 0.0}
            continue
        c = next(c for c in classes if m in c.holds)
        out[m] = {"page_class": c.name, "dtype": c.dtype, "element_bytes": KV_DTYPES[c.dtype],
                  "bytes_per_token": c.bytes_per_token,
                  "scale_bytes_per_token": (c.scale_units * SCALE_BYTES / c.scale_group
                                            if c.quantised else 0.0)}
    return out


def below_precision(storage: dict[str, dict[str, Any]], model_dtype: str) -> dict[str, str]:
    """The modalities ``storage`` keeps below ``model_dtype``'s precision (another dtype of
    no more bytes per element: int8, fp8, or a 16-bit float of a 16-bit model), with their
    dtype."""
    model_bytes = KV_DTYPES[model_dtype]
    return {m: f["dtype"] for m, f in storage.items()
            if f["dtype"] != model_dtype and f["element_bytes"] is not None
            and f["element_bytes"] <= model_bytes}


class ModalityAccount:
    """Per-modality KV of one KV manager's pool (see the module docstring)."""

    def __init__(self, classes: tuple[PoolClass, ...] | None, spec: KVSpec,
                 model_dtype: str) -> None:
        self.classes = classes
        self.storage = _storage(classes, spec, model_dtype)
        self._cumulative: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        # Per request id: whether its prompt has image or audio segments.
        self._media: dict[str, bool] = {}
        # Per live sequence with candidate shared blocks: what they were counted for and the
        # blocks; indexed by block id, how many of those sequences list the block and its
        # text, image and audio positions (as the first of them to list it counted them).
        self._candidates: dict[int, tuple[tuple[int, int, int], np.ndarray]] = {}
        self._listed = np.zeros(0, dtype=np.int64)
        self._positions = np.zeros((0, 3), dtype=np.int64)
        self._held: tuple[np.ndarray, list[int]] | None = None  # the listed blocks' ids

    def tokens(self, seqs: Iterable[Sequence]) -> tuple[int, int, int]:
        """Tokens of each modality the live ``seqs`` have written, summed (a text-only
        request's positions are all text: only requests with media are walked)."""
        held = image = audio = 0
        media = self._media
        for seq in seqs:
            end = seq.num_computed_tokens
            held += end
            request = seq.request
            has = media.get(request.id)
            if has is None:
                if len(media) > 4096:
                    media.clear()  # bounded: entries of finished requests go
                has = media[request.id] = any(s.kind != "text" for s in request.segments)
            if has:
                _, i, a = held_counts(seq, end)
                image += i
                audio += a
        return held - image - audio, image, audio

    def shared_tokens(self, seqs: list[Sequence], block_table: Callable[[Sequence], list[int]],
                      block_refs: Callable[[list[int]], list[int]], block_size: int
                      ) -> tuple[int, int, int]:
        """Tokens of each modality that :meth:`tokens` counts more than once: in every block
        held by ``r > 1`` live sequences, ``r - 1`` times. A block is shared only through a
        prefix-cache hit (a sequence's first ``num_cached_tokens``) or a fork (a sample after
        the first), so those blocks are the candidates, each looked up once."""
        live: dict[int, tuple[Sequence, int, tuple[int, int, int]]] = {}
        for seq in seqs:
            n = (-(-seq.num_computed_tokens // block_size) if seq.sample_index
                 else seq.num_cached_tokens // block_size)
            if n:
                # A hit's blocks are full and fixed until the sequence is preempted; a forked
                # sample's last one fills (and is copied on write).
                live[seq.seq_id] = (seq, n, (n, seq.num_computed_tokens if seq.sample_index
                                             else -1, seq.num_preemptions))
        cache, listed = self._candidates, self._listed
        for sid in [sid for sid, (key, _) in cache.items()
                    if sid not in live or live[sid][2] != key]:
            listed[cache.pop(sid)[1]] -= 1
            self._held = None
        for sid, (seq, n, key) in live.items():
            if sid in cache:
                continue
            ids, counts = self._block_counts(seq, block_table(seq)[:n], block_size)
            if len(ids) and int(ids.max()) >= len(listed):
                listed = self._room(int(ids.max()) + 1)
            # A table lists a block once: the fancy-indexed increment counts each.
            new = listed[ids] == 0
            self._positions[ids[new]] = counts[new]
            listed[ids] += 1
            cache[sid] = (key, ids)
            self._held = None
        if self._held is None:
            held = np.flatnonzero(listed)
            self._held = (held, held.tolist())
        held, ids_list = self._held
        if not ids_list:
            return 0, 0, 0
        refs = np.asarray(block_refs(ids_list), dtype=np.int64)
        over = (np.maximum(refs - 1, 0)[:, None] * self._positions[held]).sum(axis=0)
        return int(over[0]), int(over[1]), int(over[2])

    def _room(self, size: int) -> np.ndarray:
        """The per-block arrays grown to hold block ids below ``size`` (at least doubled)."""
        old = len(self._listed)
        size = max(size, 2 * old)
        listed = np.zeros(size, dtype=np.int64)
        listed[:old] = self._listed
        positions = np.zeros((size, 3), dtype=np.int64)
        positions[:old] = self._positions
        self._listed, self._positions = listed, positions
        return listed

    def _block_counts(self, seq: Sequence, blocks: list[int], block_size: int
                      ) -> tuple[np.ndarray, np.ndarray]:
        """``blocks`` (the first of ``seq``'s table) and their text, image and audio
        positions ``[len(blocks), 3]``."""
        image, audio = self._prompt_counts(seq)
        starts = np.arange(len(blocks), dtype=np.int64) * block_size
        stops = np.minimum(starts + block_size, seq.num_computed_tokens)
        last = len(image) - 1
        i = image[np.minimum(stops, last)] - image[np.minimum(starts, last)]
        a = audio[np.minimum(stops, last)] - audio[np.minimum(starts, last)]
        return (np.asarray(blocks, dtype=np.int64),
                np.stack([stops - starts - i - a, i, a], axis=1))

    def _prompt_counts(self, seq: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """Image and audio positions before each prompt position (``[n_prompt + 1]``),
        kept per request while its sequences live."""
        request = seq.request
        got = self._cumulative.get(request.id)
        if got is None:
            if len(self._cumulative) > 4096:
                self._cumulative.clear()  # bounded: entries of finished requests go
            kinds = np.repeat(np.array([s.kind for s in request.segments]),
                              [s.tokens for s in request.segments])
            got = tuple(np.concatenate(([0], np.cumsum(kinds == m))) for m in ("image", "audio"))
            self._cumulative[request.id] = got
        return got

    def exact(self, tokens: tuple[int, int, int], stats: KVStats) -> bool:
        """Whether ``tokens`` account for the manager's used KV exactly."""
        by = dict(zip(MODALITIES, tokens, strict=True))
        if self.classes is None:
            bpt = self.storage["text"]["bytes_per_token"]
            return stats.used_bytes is not None and sum(tokens) * bpt == stats.used_bytes
        if stats.classes is None:
            return False
        return all(sum(by[m] for m in c.holds) == stats.classes[c.name]["used_tokens"]
                   for c in self.classes)

    def figures(self, tokens: tuple[int, int, int], stats: KVStats
                ) -> dict[str, dict[str, Any]] | None:
        """``KVStats.modalities``: per modality its storage, tokens held and used bytes; None
        where the tokens do not account for the manager's used KV."""
        if not self.exact(tokens, stats):
            return None
        out = {}
        for m, n in zip(MODALITIES, tokens, strict=True):
            facts = self.storage[m]
            out[m] = {**facts, "tokens": n, "used_bytes": n * facts["bytes_per_token"]}
        return out
