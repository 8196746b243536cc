"""Who is connected: `handshake` (Hello checks, the role table), `membership` (hellos,
heartbeats, lost and exited workers, kills; decisions the core applies), `fencing`
(worker generations)."""
