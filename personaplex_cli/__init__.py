"""personaplex: run NVIDIA's PersonaPlex full-duplex speech model from the command line."""

__version__ = "0.1.0"
