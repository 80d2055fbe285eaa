"""The ``openai`` engine: a live OpenAI-compatible server (vLLM, SGLang, ...) driven over HTTP,
its streamed chunks timed exactly and its Prometheus metrics scraped into the same KV curves
the built-in engines report."""

from kvbench.engines.external.openai.section import OpenAISection

__all__ = ["OpenAISection"]
