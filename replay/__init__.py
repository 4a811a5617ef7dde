"""router-replay: offline trace replay of SGLang's cache-aware prefill routing."""

__version__ = "0.1.0"
