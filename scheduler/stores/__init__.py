"""What the scheduler keeps on disk, each in its own file of the state directory:
`deployments` (sqlite), `ops` (usage, logs, devices seen; sqlite), `kept_results` (spawned
calls' results and detached calls)."""
