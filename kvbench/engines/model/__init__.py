"""The model: presets of real shapes, Hugging Face configs, the Llama-style network, its
encoders and weights."""
