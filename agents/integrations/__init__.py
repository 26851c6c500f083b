"""Adapters that let other agent frameworks run their agents in crab sandboxes."""
