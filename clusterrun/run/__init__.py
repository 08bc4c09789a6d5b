"""One attempt's nodes on their hosts: the plan, the probes and setup before it, the start, following each node."""
