"""crab's optional Ray cluster layer (the ``cluster`` extra): hosts, registry, placement, TLS.

Only this package imports ``ray`` (an import-linter contract keeps it so), and
only inside functions that need a running cluster: :mod:`crabd.cluster.tls`,
:mod:`crabd.cluster.registry`'s placement and :class:`crabd.cluster.hosts.HostAgent`
work without Ray installed.
"""
