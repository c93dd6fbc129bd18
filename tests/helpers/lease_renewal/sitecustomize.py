"""Put on PYTHONPATH (with EAGLE3_TEST_LEASE_RENEW_S) for a process whose flow run holds a deployment
concurrency lease: Prefect renews that lease every 225 s (75 % of its fixed 300 s, prefect/concurrency/
_leases.py), and a test cannot wait that long for the renewal that finds the lease gone. This shortens only
the interval; the renewal, its retries and what a failed one does are Prefect's own."""

import os

if os.environ.get("EAGLE3_TEST_LEASE_RENEW_S"):
    import prefect.concurrency._leases as _leases

    _leases._RENEWAL_FRACTION = float(os.environ["EAGLE3_TEST_LEASE_RENEW_S"]) / 300.0
