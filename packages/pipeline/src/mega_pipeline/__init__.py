"""mega_pipeline (not built yet; see README.md)."""

__all__: list[str] = []
