"""The simulated device: cost model, activations, device memory, the allocator model, vLLM's
KV budget, and the event replay."""
