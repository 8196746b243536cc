"""The scheduler's books, each a small object with its own state that the core asks
questions of: `queues` and `batches`, `model_book`, `gang_book` and `gang_verdict`, `users`
(who a token is, caps and ceilings), `logs` and `usage`."""
