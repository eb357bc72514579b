"""`runnerlab serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over an engine
stepped by a background thread."""
