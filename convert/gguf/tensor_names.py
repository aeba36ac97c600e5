"""gguf's HF -> GGUF tensor name map by llama.cpp's architecture name (torch-free: the serve policy reads GGUF files
with it)."""

from __future__ import annotations

from ..errors import UserError


def tensor_name_map(graph_name: str, n_layers: int):
    """The map for ``graph_name`` (llama.cpp's ``general.architecture``: "granitehybrid" is gguf's
    ``MODEL_ARCH.GRANITE_HYBRID``)."""
    import gguf

    model_arch = next((a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == graph_name), None)
    if model_arch is None:
        raise UserError(f"the installed gguf package does not know llama.cpp's architecture {graph_name!r}",
                        "install the gguf version tuneport pins (pip install -U tuneport)")
    return gguf.get_tensor_name_map(model_arch, n_layers)
