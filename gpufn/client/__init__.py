"""The caller's I/O (over `gpufn.net` and `gpufn.wire`): what a client process does to talk to a
cluster, below the user's SDK in `gpufn.api`.

In reading order:
- `client`: `Client`, one I/O thread owning the socket, futures for callers;
- `default`: this process's default client (`gpufn.connect()`, `get_client()`, exit);
- `embedded`: the local cluster started when no address is configured;
- `head`: `gpufn serve`'s processes, a scheduler it restarts and a supervisor that
  outlives it, adopted by the next `gpufn serve`;
- `items`: the values of a streamed call as the I/O thread receives them.
"""
