"""mega_moe (not built yet; see README.md)."""

__all__: list[str] = []
