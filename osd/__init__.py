"""The ``osd`` command line: the user's entry point (generate, bench, profile, workload, train-draft)."""
