"""Reliability suite (GitHub issue 7): crashes, corruption, full disk, concurrency, hostile input,
isolation and leaks. Sizes scale with the environment variables in `budget.py`."""
