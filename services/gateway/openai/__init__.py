"""The OpenAI-compatible HTTP front of the gateway (docs/openai.md).

translate.py turns OpenAI request bodies into Omni GenerateRequests and Omni events back into OpenAI
responses (pure functions, no I/O); app.py is the Starlette application that calls the gateway's own
Omni port through a gRPC channel (so API keys, validation and admission are exactly the gRPC ones);
serve.py runs it under uvicorn inside the gateway process.
"""
