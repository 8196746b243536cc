"""A call's life in the core: `intake` (accepted or not), `wire_checks` (what the codec
cannot judge), `transitions` (every move with all of its effects), `recovery` (what a
restarted scheduler knows and its hold)."""
