"""The desks, each owning one family of messages over the small `surface` of the core:
`app_book` (apps), `ops` (drain, logs, usage), `streams` (items, attached callers),
`user_desk` (`gpufn token ...`), and `report` (the status report)."""
