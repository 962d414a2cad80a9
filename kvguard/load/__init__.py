"""``kvguard load``: Locust load runs through the gateway that assert on content.

Layout: ``content`` (pure per-response checks), ``report`` (pure samples, percentiles, summary),
``plan`` (the typed set-up -> worker message), ``setup`` (tenants, limit, calibration over HTTP),
``runner`` (the run as a library, the bench hook), ``worker`` + ``locustfile`` + ``shape`` (the
only modules that import Locust, in a child process of their own or under the ``locust`` CLI;
``stage`` is what a shape tells the users), ``cli`` (the command).
"""
