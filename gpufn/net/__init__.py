"""Process plumbing every gpufn process shares (over `gpufn.wire`).

In reading order:
- `connection`: one peer's connection to the scheduler (handshake, re-hello, backoff);
- `sockets`: socket settings; `curve`: CURVE keys and who may connect;
- `interfaces`: which local interface reaches the scheduler (for gloo/NCCL);
- `discovery`: where every client finds its cluster (address, GPUFN_ADDRESS, the running
  `gpufn serve` of this GPUFN_HOME, else embedded), and who holds a port;
- `cluster_file`: where `gpufn serve` leaves its address and token for local clients;
  `address_file`: how a head tells worker hosts where it is, on a shared filesystem;
- `processes`: is a pid alive, follow a parent's exit.
- `private_files`: owner-only folders and files (state databases, worker logs).
"""
