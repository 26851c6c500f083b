"""Trust edges: everything that arrives from outside this host's own writes is checked here.

Archive imports, objects fetched from the remote bucket and ``ImportSandbox`` records are
input, whoever sends them.  The modules of this package check them (provenance, declared
references, bounded expansion) before the coordinator allocates, writes or restores anything
from them; the coordinator never parses a foreign manifest itself (docs/security.md).
"""
