"""Why a job failed or hangs: the root cause from what the nodes printed, known failure signatures,
ranks' stacks, a hung job's report."""
