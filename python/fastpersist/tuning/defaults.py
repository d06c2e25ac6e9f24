"""What an untuned ``"auto"`` chunk size and queue depth resolve to (no imports: config.py and
the tuning modules both read them)."""

__all__ = ["DEFAULT_CHUNK_BYTES", "DEFAULT_QUEUE_DEPTH"]

#: The chunk size an untuned ``"auto"`` resolves to: safe on every drive, rarely the fastest.
DEFAULT_CHUNK_BYTES = 8 << 20
#: The queue depth an untuned ``"auto"`` resolves to.
DEFAULT_QUEUE_DEPTH = 8
