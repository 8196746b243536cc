"""The scheduler: queues, placement, gangs, the process shell and the deployment store."""
