"""The HTTP server: one FastAPI app that serves the OpenAI-compatible /v1 API, the assistant's turn
stream, and mounts the Gradio web chat. Each concern is one module (see app.py for the list)."""
