"""ckray: train, index and serve neural long-document rankers on Ray."""

__version__ = "0.1.0"
