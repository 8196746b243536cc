"""Where calls run: `device_fit` (types, feasibility, ranking), `open_index` (the open
devices in the order a pass reads them), `gang_choice` (which devices form a gang), `affinity`
(session and prefix keys follow their device, under a load cap) and `placement_pass` (one pass over the queue, yielding decisions)."""
