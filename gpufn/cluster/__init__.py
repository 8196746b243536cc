"""What starts gpufn's processes: `embedded` (a local scheduler and supervisor as child
processes, the default cluster and the one `gpufn serve` runs), `head` (`gpufn serve`'s
scheduler restarts and the supervisor a next serve adopts), `gateway` (the HTTP gateway
as a child process) and `serve` (the whole lifecycle of `gpufn serve`: options checked,
keys, ports, token, processes, files, signals)."""
