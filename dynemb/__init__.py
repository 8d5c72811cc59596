"""dynemb: dynamic-embedding training for recommendation models."""

__version__ = "0.1.0"
