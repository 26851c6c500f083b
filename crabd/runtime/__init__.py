"""What runs inside (or talks to) a sandbox: crab's init, its protocol, the session."""
