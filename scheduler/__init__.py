"""The scheduler: a sans-I/O core composed of queues, books and a placement pass, and the
ZeroMQ process shell around it."""
