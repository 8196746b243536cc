"""The HTTP gateway (`gpufn serve --http-port`): deployed apps over HTTP with JSON calls and
Server-Sent Events, an OpenAI-compatible chat route, and a read-only dashboard.

It is a client of the scheduler like any other: each request's Bearer token becomes the
token of a scheduler connection, and calls travel as JSON end to end (gpufn/wire/jsonwire.py),
so the gateway never unpickles anything. Needs `pip install 'gpufn[http]'`; nothing outside
this package imports it.
"""
