"""klevict: stream long documents through an LLM, evicting the KV-cache entries whose loss changes the model least."""

__version__ = "0.1.0"
