"""The per-host supervisor process (`python -m gpufn.worker.supervisor`): `daemon`
starts one worker per device and restarts them; `joining` is its attempts to join the
scheduler."""
