"""The Azure LMM inference trace 2025 (``TIMESTAMP,NumImages,ContextTokens,GeneratedTokens``).

About a million requests to a multimodal model in Azure over a week (2024-10-15 to -22),
published as ``data/AzureLMMInferenceTrace_multimodal.csv.gz`` in Azure/AzurePublicDataset
under CC-BY 4.0; cite Qiu et al., "ModServe: Modality- and Stage-Aware Resource
Disaggregation for Scalable Multimodal Model Serving", SoCC 2025. Timestamps are like
``2024-10-15T12:00:00.269Z``; decompress the file first (``gunzip -k``).

The trace counts images but does not size them, so one ``ImageChoice`` (``RULE[:HxW]``,
default ``llava-1.5``) gives every image its token count. Each request becomes its
``NumImages`` image segments, then one text segment; the output is ``GeneratedTokens``.

``ContextTokens`` counts the whole prompt, image tokens included (the dataset's schema), so
the text gets ``ContextTokens − NumImages × image tokens``. Where that leaves fewer than
``MIN_TEXT_TOKENS`` (the chosen rule spends more tokens per image than the traced model did),
the text is set to ``MIN_TEXT_TOKENS`` and the request's prompt exceeds ``ContextTokens``:
image counts are facts of the rule, and every request has some text (its question), so
neither is shrunk to fit. The spec's ``rows_text_clamped`` and ``tokens_added`` count those
rows and what they added, and a warning says so.
"""

from __future__ import annotations

from array import array
from pathlib import Path

from kvbench.workloads.azure_trace import AZURE_COLUMNS, NS_PER_S, CsvTable, azure_time_ns, show_ns
from kvbench.workloads.bulk import collector_paused, new_request, new_segment, text_segment
from kvbench.workloads.modalities import ImageChoice
from kvbench.workloads.textstream import TextStream
from kvbench.workloads.trace_rows import TraceRead, TraceTimes, check_lengths, int_field

AZURE_LMM_COLUMNS = ("TIMESTAMP", "NumImages", "ContextTokens", "GeneratedTokens")
DEFAULT_IMAGE_RULE = "llava-1.5"
MIN_TEXT_TOKENS = 1


def _llm_hint(header: list[str]) -> str:
    return "; with no NumImages this is the Azure LLM trace: import it as kind azure" if (
        set(AZURE_COLUMNS) <= set(header)) else ""


def read_azure_lmm(path: Path, limit: int | None, seed: int, image: ImageChoice) -> TraceRead:
    """The first ``limit`` rows (None: all), reading the file only that far."""
    times = TraceTimes(path, float(NS_PER_S), show_ns)
    # Compact columns rather than a tuple per row: the trace has a million rows.
    image_counts, texts, outputs = array("q"), array("q"), array("q")
    clamped = added = 0
    with TextStream(path, "trace") as stream:
        for line, (stamp, images, context, generated) in CsvTable(
            stream, AZURE_LMM_COLUMNS, _llm_hint
        ).rows(limit):
            times.add(azure_time_ns(stamp, path, line), line)
            n_images = int_field(images, "NumImages", 0, path, line)
            prompt = int_field(context, "ContextTokens", 1, path, line)
            output = int_field(generated, "GeneratedTokens", 0, path, line)
            image_tokens = n_images * image.tokens
            text = prompt - image_tokens
            if text < MIN_TEXT_TOKENS:
                clamped += 1
                added += MIN_TEXT_TOKENS - text
                text = MIN_TEXT_TOKENS
            check_lengths(image_tokens + text, output, path, line)
            image_counts.append(n_images)
            texts.append(text)
            outputs.append(output)
    with collector_paused():
        requests = []
        for i, (arrival, n_images, text, output) in enumerate(
            zip(times.arrivals_s(), image_counts, texts, outputs, strict=True)
        ):
            base = f"s{seed}/azure-lmm/{i}"
            segments = [
                new_segment("image", image.tokens, f"{base}/image/{j}", image.height,
                            image.width, None, image.rule)
                for j in range(n_images)
            ]
            segments.append(text_segment(text, f"{base}/text"))
            requests.append(new_request(f"r{i}", arrival, tuple(segments), output, None, None, 1))
    facts = {
        "image_rule": image.label,
        "image_tokens": image.tokens,
        "images": sum(image_counts),
        "min_text_tokens": MIN_TEXT_TOKENS,
        "rows_text_clamped": clamped,
        "tokens_added": added,
    }
    warnings = []
    if clamped:
        warnings.append(
            f"{clamped:,} of {len(texts):,} rows have fewer ContextTokens than their images "
            f"take under {image.label} ({image.tokens} tokens each); their text was set to "
            f"{MIN_TEXT_TOKENS} token, adding {added:,} prompt tokens in all"
        )
    return TraceRead(requests, facts, warnings)
