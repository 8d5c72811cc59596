"""dynemb's version (also in pyproject.toml; tests/test_deploy.py checks they agree)."""

__version__ = "0.1.0"
