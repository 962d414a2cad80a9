"""Grafana dashboards and Prometheus alert rules of kvguard, as code (see ``dashboards.build``)."""
