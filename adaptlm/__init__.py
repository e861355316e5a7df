"""adaptlm: an inference server for adaptive language models. The CLI lives in `adaptlm.cli`."""

__version__ = "0.1.0"
__all__ = ["__version__"]
