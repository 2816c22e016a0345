"""Built-in patch families, one module per family; each exposes ``PATCHES``."""
