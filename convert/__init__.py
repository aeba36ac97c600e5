"""The floor: checkpoint and adapter readers, architecture tables, merge, and one exporter per target.

Nothing here imports ``serve`` or ``toolkit``.
"""

__version__ = "0.1.0"
