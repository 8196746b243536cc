"""What the processes of one host share: `proc_table` (/proc), `children` (processes a
call leaves behind), `memory_watch` (host memory per worker), `held` (what a worker keeps
for a restarted scheduler)."""
