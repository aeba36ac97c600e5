"""The real model of the demo, tests and benchmarks: SmolLM2-135M-Instruct from the package index, its HF
base rebuilt on first use, and LoRA adapters trained on it on the spot (cached by content hash)."""
