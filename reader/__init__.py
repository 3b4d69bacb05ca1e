"""``dmi.reader``: fetch records from packs and reassemble them into torch tensors."""

__all__: list[str] = []
