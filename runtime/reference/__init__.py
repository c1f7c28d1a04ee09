"""The NumPy reference backend: the oracle every kernel and the cuda engine are checked against."""
