"""Engines kvbench drives but does not implement: vLLM in-process and OpenAI-compatible servers."""
