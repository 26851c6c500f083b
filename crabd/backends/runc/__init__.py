"""crab's own container runtime layer: runc bundles, overlay root filesystems and CNI networking.

The pieces, bottom up (see docs/runc.md):

* :mod:`.rootfs`: an env image exported once into a read-only lower dir; overlay mounts.
* :mod:`.bundle`: a typed :class:`~.bundle.ContainerSpec` and the OCI ``config.json`` made from it.
* :mod:`.security`: the sandbox's security posture in OCI terms (mirrors the Docker backend).
* :mod:`.cli`: the :class:`~.cli.Runc` driver (its own state root) and its typed state.
* :mod:`.named_netns`: persistent network namespaces under ``/run/crab/netns``.
* :mod:`.cni`: networking through the standard CNI plugins, and the isolation rules.
* :mod:`.cleanup`: the layout of it all; what is left after a crash, and reaping it.
* :mod:`.launch`: one container made to run (fresh or restored) in the right order, or rolled back.
* :mod:`.reaper`: crabd as child subreaper; container inits' exit statuses, and reaping them.
* :mod:`.sandbox`: :class:`~.sandbox.RuncSandboxBackend`, the ``SandboxBackend`` over it all and a btrfs pool.
  Its read side (status, listing) is :mod:`.status`; how a container ends :mod:`.ending`;
  a restore's images and CRIU work dirs :mod:`.restore_dirs`.
"""
