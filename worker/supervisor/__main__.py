"""`python -m gpufn.worker.supervisor`: the per-host supervisor."""

from gpufn.worker.supervisor.daemon import main

main()
