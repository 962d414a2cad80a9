"""``kvguard load``: Locust load runs through the gateway that assert on content.

Layout: ``content`` (pure per-response checks), ``report`` (pure samples, percentiles, summary),
``plan`` (the typed set-up -> worker message), ``setup`` (tenants, limit, calibration over HTTP),
``runner`` (the run as a library, the bench hook), ``worker`` + ``locustfile`` (the only modules
that import Locust, in a child process of their own), ``cli`` (the command).
"""
