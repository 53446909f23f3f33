"""mega_tp_layers (not built yet; see README.md)."""

__all__: list[str] = []
