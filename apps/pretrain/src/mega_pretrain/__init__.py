"""mega_pretrain (not built yet; see README.md)."""

__all__: list[str] = []
