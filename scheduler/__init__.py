"""The periodic sweeps: the beat schedule (`schedule`), a beat that only sends while it leads
(`beat`), and the sweep tasks (`tasks`)."""
