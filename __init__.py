"""thorgen: an ahead-of-time compiled inference engine for Gemma-4-26B-A4B-it with DFlash speculative decoding."""

__version__ = "0.1.0"
