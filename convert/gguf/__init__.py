"""GGUF for llama.cpp: model writer, LoRA writer, vocabulary, quantization, Ollama Modelfile."""
