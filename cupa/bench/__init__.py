"""`python -m cupa bench`: the harness (timers, problems), the peers, the feature rows, the
host-cost rows and the command itself (`main`)."""
