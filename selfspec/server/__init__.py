"""`selfspec serve`: an OpenAI-compatible HTTP server (protocol: wire format; scheduler: the
engine's worker thread and its bounded queue; app: the FastAPI routes; cli: the command)."""
