"""Why a job failed: the root cause from what the nodes printed, known failure signatures, ranks' stacks."""
