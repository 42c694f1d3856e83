"""The OpenAI-compatible HTTP front door (FastAPI on uvicorn), served by the router beside gRPC."""
