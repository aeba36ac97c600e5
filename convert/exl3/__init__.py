"""EXL3 (ExLlamaV3): drive exllamav3's converter on CUDA hosts, and read and decode what it writes on any machine.

The format's facts live here once: the codebooks (``codebook``), the trellis bit layout of a 16x16 tile
(``trellis``), the 128-wide Hadamard rotations and ``suh``/``svh`` (``hadamard``), the directory layout
(``read``), the converter's command line (``converter``) and the export (``export``).
"""

# here, so that reading them needs no torch
CODEBOOKS = ("3inst", "mcg", "mul1")  # exllamav3's --codebook names
HALF_RATES = (1.5, 2.5, 3.5)  # the half-integer bits per weight exllamav3 1.6 writes (mul1 codebook only)
