"""Jobs on this controller: their records, logs and owners, and jobs found again on their hosts."""
