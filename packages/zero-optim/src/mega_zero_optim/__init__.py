"""mega_zero_optim (not built yet; see README.md)."""

__all__: list[str] = []
