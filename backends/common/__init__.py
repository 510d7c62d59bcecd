"""Code shared by every backend; the integer rules of docs/semantics.md live in :mod:`.numerics`."""
