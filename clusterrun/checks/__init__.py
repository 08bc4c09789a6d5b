"""``doctor`` and ``exec``: the hosts examined and commanded outside a job."""
