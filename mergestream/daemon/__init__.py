"""The long-running service (sources, ledger, store, probes, gate, metrics, tracking)."""
