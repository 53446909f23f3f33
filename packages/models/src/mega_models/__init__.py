"""mega_models (not built yet; see README.md)."""

__all__: list[str] = []
