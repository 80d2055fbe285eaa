"""Engines: the Engine protocol, the built-in engine (KV managers, scheduler, executors), vLLM."""

from kvbench.engines.base import BatchShape, Engine, Finished, KVStats, StepReport

__all__ = ["BatchShape", "Engine", "Finished", "KVStats", "StepReport"]
