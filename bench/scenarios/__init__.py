"""One module per scenario; each exposes ``run(ctx) -> dict`` returning raw figures and a ``summary``."""
