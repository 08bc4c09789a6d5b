"""Slurm as the launcher: the allocation, the one ``srun`` step, and its job as a recorded job."""
