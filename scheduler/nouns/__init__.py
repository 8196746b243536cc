"""The scheduler's nouns: records, their state machines, execution shapes, the core's
events and sends, settings and counters. They import nothing else of the scheduler."""
