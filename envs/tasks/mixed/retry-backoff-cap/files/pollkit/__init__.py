"""Retrying flaky calls and polling for a condition."""

from pollkit.backoff import delays
from pollkit.poll import TimedOut, wait_until
from pollkit.retry import call_with_retry

__all__ = ["TimedOut", "call_with_retry", "delays", "wait_until"]
