"""Talaria: session-aware serverless multi-model serving for tool-using LLM agents."""

__version__ = "0.1.0"
