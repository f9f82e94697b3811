"""Tally runtime: an OpenAI-compatible streaming server over an engine adapter."""

__version__ = "0.1.0"
