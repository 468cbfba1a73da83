"""The OpenAI-compatible server: `eaglespec serve`."""
