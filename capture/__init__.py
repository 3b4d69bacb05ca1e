"""``dmi.capture``: hooks on Hugging Face models, the ring of host slots and the drain thread."""

__all__: list[str] = []
