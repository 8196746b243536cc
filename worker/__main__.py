"""`python -m gpufn.worker`: one worker process (started by a supervisor, not by hand)."""

from gpufn.worker.process import main

main()
