"""The fuzzers' parts: drawing cases, checking the answers, one module per surface (the
estimate, isolation, the policy loader, the Batch API). `python -m loadtest.fuzz` runs them."""
