"""Estimates before launch: per-node costs (costs.py), the device model (device.py,
cpu_probe.py, profile.py for measured cost files), traffic and collectives
(traffic.py, collectives.py), per-rank memory and time (estimates.py, precision.py)
and the report a person reads (report.py)."""
