"""The OpenAI-compatible HTTP front of the gateway (docs/openai.md), a client of the gateway's own Omni port.

app.py assembles the routes (text_routes, media_routes, tokens_routes, transcriptions, extras_routes);
body.py reads request bodies; chat_body.py / bodies.py are their documented shapes (pydantic, rules in
schema.py); translate.py / media_requests.py turn them into Omni requests; omni_calls.py runs the calls;
answers.py / streams.py turn the events into OpenAI's objects and SSE; serve.py runs it under uvicorn.
"""
