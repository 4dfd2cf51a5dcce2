"""Apps embedded in numaserve; ``demo`` is served when no app is configured."""
