"""Measurements: `thorgen bench` and its sweeps, the HTTP load generator, roofline, peers, and the report."""
