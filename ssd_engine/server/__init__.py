"""OpenAI-compatible serving: `async_engine.py` (one engine loop shared by every connection),
`openai_api.py` (the FastAPI app), `ssd_engine/serve.py` (the `python -m ssd_engine.serve` CLI)."""
