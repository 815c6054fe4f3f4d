"""Operating the daemon: the stats snapshot, Prometheus metrics, log lines and systemd's notify protocol."""
